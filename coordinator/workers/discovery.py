"""Worker discovery through the Kubernetes API.

A session holds KV on one worker pod, so worker traffic cannot go through a
load-balanced Service address: the coordinator finds the pods itself. A
worker address ``k8s://SERVICE[.NAMESPACE]:PORT`` stands for the endpoints
of the EndpointSlices labelled ``kubernetes.io/service-name=SERVICE``;
:class:`EndpointSliceWatch` follows them the way client-go's reflector does
(list, then watch from the list's resourceVersion; list again when the watch
expires with 410 Gone or fails; back off on API errors) and reports every
change of the endpoint set to the routing table (``outrider.coordinator.workers.replicas``).

What an endpoint's conditions (discovery.k8s.io/v1) mean for routing:

* ``ready`` (absent counts as ready, as the API documents) and not
  ``terminating`` — takes new sessions;
* listed but not ready — starting, failing its readiness probe, or
  terminating while it drains (``serving``): keeps the sessions it has, gets
  no new ones;
* gone from every slice (the pod is deleted) — its sessions fail over.

The coordinator needs exactly get, list and watch on ``endpointslices`` in
the ``discovery.k8s.io`` group.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.watch.watch import iter_resp_lines

from outrider.logging import get_logger

if TYPE_CHECKING:
    import urllib3

log = get_logger(__name__)

SCHEME = "k8s://"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")

LIST_TIMEOUT = (5.0, 30.0)
"""(connect, read) seconds of a list call."""
WATCH_TIMEOUT_S = 300
"""The API server ends a watch after this long; it is then resumed."""
WATCH_READ_TIMEOUT = (5.0, WATCH_TIMEOUT_S + 30.0)


def is_service_address(address: str) -> bool:
    return address.startswith(SCHEME)


def pod_namespace() -> str:
    """The namespace this pod runs in, from its service account; else "default"."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


@dataclass(frozen=True)
class ServiceRef:
    """``k8s://SERVICE.NAMESPACE:PORT``: PORT is the name of a port of the
    EndpointSlices (``grpc``), or the pods' port number."""

    service: str
    namespace: str
    port: str | int

    @classmethod
    def parse(
        cls, address: str, *, default_namespace: Callable[[], str] = pod_namespace
    ) -> ServiceRef:
        form = (
            f"use {SCHEME}SERVICE[.NAMESPACE]:PORT, PORT a port name or number"
            f" (e.g. {SCHEME}target.llm:grpc)"
        )
        host, _, port = address.removeprefix(SCHEME).rpartition(":")
        service, _, namespace = host.partition(".")
        if (
            not port
            or not _DNS_LABEL.fullmatch(service)
            or (namespace and not _DNS_LABEL.fullmatch(namespace))
        ):
            raise ValueError(f"worker address {address!r}: {form}")
        if port.isdigit():
            if not 0 < int(port) < 65536:
                raise ValueError(f"worker address {address!r}: port {port} is out of range; {form}")
            return cls(service, namespace or default_namespace(), int(port))
        return cls(service, namespace or default_namespace(), port)

    def __str__(self) -> str:
        return f"{SCHEME}{self.service}.{self.namespace}:{self.port}"


def api_client() -> k8s.ApiClient:
    """A client of the cluster's API: in-cluster config inside a pod, else
    the kubeconfig (``KUBECONFIG`` or ``~/.kube/config``)."""
    configuration = k8s.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)
    except k8s_config.ConfigException as in_cluster:
        try:
            k8s_config.load_kube_config(client_configuration=configuration)
        except (k8s_config.ConfigException, OSError) as kubeconfig:
            raise ValueError(
                f"{SCHEME} worker addresses need the Kubernetes API, but this is not a pod with a"
                f" service account ({in_cluster}) and no kubeconfig could be loaded ({kubeconfig}):"
                " run inside the cluster, set KUBECONFIG, or give the workers as HOST:PORT"
            ) from kubeconfig
    return k8s.ApiClient(configuration)


class _WatchExpired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class EndpointSliceWatch:
    """Follows the EndpointSlices of one Service and calls ``on_change`` with
    the whole endpoint set — ``{"HOST:PORT": takes new sessions}`` — each time
    it changes. The blocking list/watch calls of the official client run in
    :meth:`run`'s thread; ``on_change`` is called there too (the caller hands
    it to its event loop)."""

    def __init__(
        self,
        ref: ServiceRef,
        api: k8s.ApiClient,
        on_change: Callable[[dict[str, bool]], None],
        *,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
    ) -> None:
        self.ref = ref
        self._api = k8s.DiscoveryV1Api(api)
        self._on_change = on_change
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._slices: dict[str, dict[str, bool]] = {}
        self._reported: dict[str, bool] | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._response: urllib3.BaseHTTPResponse | None = None
        self._log = log.bind(service=str(ref))

    def run(self) -> None:
        """Lists and watches until :meth:`stop`; never raises for API errors."""
        failures = 0
        version = None
        while not self._stopping.is_set():
            try:
                if version is None:
                    version = self._list()
                version = self._watch(version)
                failures = 0
            except _WatchExpired:
                self._log.info("endpointslice watch expired: listing again")
                version = None
            except Exception as exc:  # any API or network failure: back off, list again
                if self._stopping.is_set():
                    break
                failures += 1
                delay = min(self._max_backoff_s, self._backoff_s * 2 ** (failures - 1))
                self._log.warning(
                    "kubernetes API error: keeping the last known endpoints",
                    error=_describe(exc),
                    retry_in_s=delay,
                )
                version = None
                self._stopping.wait(delay)

    def stop(self) -> None:
        """Ends :meth:`run` soon, from any thread: an open watch is cut."""
        self._stopping.set()
        with self._lock:
            connection = getattr(self._response, "connection", None)
            sock = getattr(connection, "sock", None)
            if sock is not None:
                with contextlib.suppress(OSError):  # already closed
                    sock.shutdown(socket.SHUT_RDWR)

    def _request(self, **params: Any) -> urllib3.BaseHTTPResponse:
        """The service's EndpointSlices (a list, or with ``watch=True`` a
        watch), as the raw HTTP response."""
        # With _preload_content=False the client returns the urllib3 response
        # unread, though its annotation names the decoded V1EndpointSliceList.
        return self._api.list_namespaced_endpoint_slice(  # type: ignore[return-value]
            self.ref.namespace,
            label_selector=f"{SERVICE_NAME_LABEL}={self.ref.service}",
            _preload_content=False,
            **params,
        )

    def _list(self) -> str:
        response = self._request(_request_timeout=LIST_TIMEOUT)
        try:
            body = json.loads(response.data)
        finally:
            response.release_conn()
        self._slices = {
            item["metadata"]["name"]: self._endpoints_of(item) for item in body.get("items") or []
        }
        self._report()
        return body["metadata"]["resourceVersion"]

    def _watch(self, version: str) -> str:
        """Applies the watch's events until the server ends it; returns the
        last resourceVersion seen."""
        try:
            response = self._request(
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=WATCH_TIMEOUT_S,
                watch=True,
                _request_timeout=WATCH_READ_TIMEOUT,
            )
        except k8s.ApiException as exc:
            if exc.status == 410:
                raise _WatchExpired() from exc
            raise
        with self._lock:
            self._response = response
        try:
            if self._stopping.is_set():
                return version
            for line in iter_resp_lines(response):
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event["type"], event["object"]
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _WatchExpired()
                    raise k8s.ApiException(
                        status=obj.get("code"), reason=f"{obj.get('reason')}: {obj.get('message')}"
                    )
                version = obj.get("metadata", {}).get("resourceVersion") or version
                if kind == "BOOKMARK":
                    continue
                name = obj["metadata"]["name"]
                if kind == "DELETED":
                    self._slices.pop(name, None)
                else:  # ADDED, MODIFIED
                    self._slices[name] = self._endpoints_of(obj)
                self._report()
            return version
        finally:
            with self._lock:
                self._response = None
            response.release_conn()

    def _endpoints_of(self, endpoint_slice: Mapping) -> dict[str, bool]:
        port = self._port_of(endpoint_slice)
        if port is None:
            self._log.warning(
                "endpointslice has no port of this name: its endpoints are ignored",
                endpointslice=endpoint_slice["metadata"]["name"],
                port=self.ref.port,
                ports=[p.get("name", "") for p in endpoint_slice.get("ports") or []],
            )
            return {}
        ipv6 = endpoint_slice.get("addressType") == "IPv6"
        endpoints = {}
        for endpoint in endpoint_slice.get("endpoints") or []:
            if not endpoint.get("addresses"):
                continue
            host = endpoint["addresses"][0]
            conditions = endpoint.get("conditions") or {}
            takes_sessions = conditions.get("ready") is not False and not conditions.get(
                "terminating"
            )
            endpoints[f"[{host}]:{port}" if ipv6 else f"{host}:{port}"] = takes_sessions
        return endpoints

    def _port_of(self, endpoint_slice: Mapping) -> int | None:
        if isinstance(self.ref.port, int):
            return self.ref.port
        for port in endpoint_slice.get("ports") or []:
            if port.get("name", "") == self.ref.port and port.get("port"):
                return int(port["port"])
        return None

    def _report(self) -> None:
        # An address listed by several slices (while they are rebalanced)
        # takes new sessions if any of them says so.
        endpoints: dict[str, bool] = {}
        for slice_endpoints in self._slices.values():
            for address, takes_sessions in slice_endpoints.items():
                endpoints[address] = endpoints.get(address, False) or takes_sessions
        if endpoints != self._reported:
            self._reported = endpoints
            self._on_change(dict(endpoints))


def _describe(exc: Exception) -> str:
    if isinstance(exc, k8s.ApiException):
        return f"HTTP {exc.status} {exc.reason}".strip()
    return f"{type(exc).__name__}: {exc}"
