"""The Helm chart's security: non-root read-only pods, minimal RBAC, API
tokens only where needed, mTLS on every hop, network policies."""

from __future__ import annotations

from tests.deploy.conftest import (
    NAMESPACE,
    RELEASE,
    by_kind,
    component,
    env_of,
    pod_spec,
    workers,
)


def test_every_container_is_non_root_read_only_and_drops_all_capabilities(objects):
    for name, deployment in by_kind(objects, "Deployment").items():
        spec = pod_spec(deployment)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in spec["containers"] + spec.get("initContainers", []):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, (name, container["name"])
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts["/var/cache/outrider"] == "cache" and mounts["/tmp"] == "tmp"
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes["cache"] and "emptyDir" in volumes["tmp"]


def test_rbac_grants_only_get_list_watch_on_endpointslices_in_the_namespace(objects):
    (role,) = by_kind(objects, "Role").values()
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")
    (binding,) = by_kind(objects, "RoleBinding").values()
    (account,) = by_kind(objects, "ServiceAccount").values()
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]


def test_only_the_coordinator_gets_an_api_token(objects):
    account = next(iter(by_kind(objects, "ServiceAccount").values()))
    assert account["automountServiceAccountToken"] is False
    coordinator = pod_spec(component(objects, "Deployment", "coordinator"))
    assert coordinator["serviceAccountName"] == account["metadata"]["name"]
    assert coordinator["automountServiceAccountToken"] is True
    for name in workers(objects):
        worker = pod_spec(component(objects, "Deployment", name))
        assert worker["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in worker


def test_mtls_secrets_are_wired_into_every_hop(full_objects):
    coordinator = pod_spec(component(full_objects, "Deployment", "coordinator"))
    env = env_of(coordinator["containers"][0])
    assert env["OUTRIDER_TLS_CERT"] == "/etc/outrider/tls/tls.crt"
    assert (
        "OUTRIDER_TLS_CLIENT_CA" not in env
    )  # clients are not asked for certificates in the full values
    assert env["OUTRIDER_WORKER_TLS_CA"] == "/etc/outrider/worker-tls/ca.crt"
    assert env["OUTRIDER_WORKER_TLS_CERT"] == "/etc/outrider/worker-tls/tls.crt"
    assert env["OUTRIDER_AUTH_TOKENS_FILE"] == "/etc/outrider/auth/tokens"
    secrets = {
        v["name"]: v["secret"]["secretName"] for v in coordinator["volumes"] if "secret" in v
    }
    assert secrets == {
        "tls": "outrider-coordinator-tls",
        "worker-tls": "outrider-coordinator-client-tls",
        "auth": "outrider-tokens",
    }
    for name in ("target", "draft"):
        worker = pod_spec(component(full_objects, "Deployment", name))
        env = env_of(worker["containers"][0])
        assert (
            env["OUTRIDER_TLS_CLIENT_CA"] == "/etc/outrider/tls/ca.crt"
        )  # mutual TLS: only the coordinator
        assert {
            v["name"]: v["secret"]["secretName"] for v in worker["volumes"] if "secret" in v
        } == {"tls": "outrider-workers-tls"}


def test_network_policies_let_only_the_coordinator_reach_the_workers(full_objects):
    policies = by_kind(full_objects, "NetworkPolicy")
    coordinator_pods = pod_spec(component(full_objects, "Deployment", "coordinator"))
    coordinator_labels = component(full_objects, "Deployment", "coordinator")["spec"]["template"][
        "metadata"
    ]["labels"]
    assert coordinator_pods  # the coordinator exists
    for name in ("target", "draft"):
        policy = policies[f"{RELEASE}-outrider-{name}"]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        grpc_rule, metrics_rule = policy["spec"]["ingress"]
        assert grpc_rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
        (peer,) = grpc_rule["from"]
        assert peer["podSelector"]["matchLabels"].items() <= coordinator_labels.items()
        assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "coordinator"
        assert metrics_rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
        assert metrics_rule["from"][0]["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": "monitoring"
        }
    clients = policies[f"{RELEASE}-outrider-coordinator"]["spec"]["ingress"][0]
    assert clients["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "gateway"
    }
