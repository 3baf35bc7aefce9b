"""The Helm chart's Services and discovery: headless worker Services, the
OpenAI HTTP port, EndpointSlice discovery, disruption budgets, draining,
autoscaling and metrics scraping."""

from __future__ import annotations

from tests.deploy.conftest import (
    NAMESPACE,
    RELEASE,
    by_kind,
    component,
    components,
    env_of,
    pod_spec,
    workers,
)


def test_worker_services_are_headless_with_a_grpc_port_and_only_ready_pods(objects):
    for name in workers(objects):
        service = component(objects, "Service", name)
        deployment = component(objects, "Deployment", name)
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is False
        grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
        assert grpc_port["targetPort"] == "grpc"
        assert (
            service["spec"]["selector"].items()
            <= deployment["spec"]["template"]["metadata"]["labels"].items()
        )
    coordinator = component(objects, "Service", "coordinator")
    assert "clusterIP" not in coordinator["spec"]  # the one load-balanced address clients use


def test_the_coordinator_serves_the_openai_api_on_its_http_port(
    default_objects, full_objects, render
):
    for objects, (container_port, service_port, protocol) in (
        (default_objects, (8000, 8000, "http")),
        (full_objects, (8080, 443, "https")),  # TLS on
    ):
        container = pod_spec(component(objects, "Deployment", "coordinator"))["containers"][0]
        assert env_of(container)["OUTRIDER_HTTP_PORT"] == str(container_port)
        assert {"name": "http", "containerPort": container_port, "protocol": "TCP"} in container[
            "ports"
        ]
        ports = component(objects, "Service", "coordinator")["spec"]["ports"]
        http = next(p for p in ports if p["name"] == "http")
        assert (http["port"], http["targetPort"], http["appProtocol"]) == (
            service_port,
            "http",
            protocol,
        )
    clients = by_kind(full_objects, "NetworkPolicy")[f"{RELEASE}-outrider-coordinator"]
    assert {"port": "http", "protocol": "TCP"} in clients["spec"]["ingress"][0]["ports"]

    grpc_only = render(sets=("coordinator.httpPort=null",))
    container = pod_spec(component(grpc_only, "Deployment", "coordinator"))["containers"][0]
    assert "OUTRIDER_HTTP_PORT" not in env_of(container)
    assert "http" not in {p["name"] for p in container["ports"]}
    assert "http" not in {
        p["name"] for p in component(grpc_only, "Service", "coordinator")["spec"]["ports"]
    }


def test_the_coordinator_discovers_the_worker_pools_through_their_endpointslices(
    drafting_objects,
):
    env = env_of(
        pod_spec(component(drafting_objects, "Deployment", "coordinator"))["containers"][0]
    )
    assert env["OUTRIDER_TARGET"] == f"k8s://{RELEASE}-outrider-target.{NAMESPACE}:grpc"
    assert env["OUTRIDER_DRAFT"] == f"k8s://{RELEASE}-outrider-draft.{NAMESPACE}:grpc"
    assert env["OUTRIDER_HOST"] == "0.0.0.0"


def test_without_a_draft_pool_the_coordinator_decodes_with_the_target_alone(render):
    objects = render(sets=("draft.enabled=false",))
    assert {o["metadata"]["name"] for o in objects if "draft" in o["metadata"]["name"]} == set()
    env = env_of(pod_spec(component(objects, "Deployment", "coordinator"))["containers"][0])
    assert "OUTRIDER_DRAFT" not in env
    assert "OUTRIDER_PROMPT_LOOKUP" not in env and "OUTRIDER_MAX_NGRAM" not in env


def test_pod_disruption_budgets_cover_every_component(objects):
    budgets = by_kind(objects, "PodDisruptionBudget")
    assert len(budgets) == len(components(objects))
    for name in components(objects):
        budget = budgets[f"{RELEASE}-outrider-{name}"]
        labels = component(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert budget["spec"]["maxUnavailable"] == 1


def test_every_service_drains_within_its_pods_termination_grace_period(objects):
    for name in components(objects):
        spec = pod_spec(component(objects, "Deployment", name))
        grace = int(env_of(spec["containers"][0])["OUTRIDER_SHUTDOWN_GRACE_S"])
        assert 0 < grace < spec["terminationGracePeriodSeconds"]


def test_the_hpa_scales_the_coordinator_and_owns_its_replica_count(full_objects, default_objects):
    (hpa,) = by_kind(full_objects, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": f"{RELEASE}-outrider-coordinator",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert "replicas" not in component(full_objects, "Deployment", "coordinator")["spec"]
    assert component(default_objects, "Deployment", "coordinator")["spec"]["replicas"] == 2
    assert not by_kind(default_objects, "HorizontalPodAutoscaler")


def test_the_service_monitor_scrapes_the_metrics_port_of_every_component(full_objects):
    (monitor,) = by_kind(full_objects, "ServiceMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["endpoints"] == [
        {
            "port": "metrics",
            "path": "/metrics",
            "scheme": "http",
            "interval": "15s",
            "scrapeTimeout": "10s",
        }
    ]
    selector = monitor["spec"]["selector"]["matchLabels"]
    for name in ("coordinator", "target", "draft"):
        service = component(full_objects, "Service", name)
        assert selector.items() <= service["metadata"]["labels"].items()
        assert {
            "name": "metrics",
            "port": 9090,
            "targetPort": "metrics",
            "protocol": "TCP",
            "appProtocol": "http",
        } in service["spec"]["ports"]
        container = pod_spec(component(full_objects, "Deployment", name))["containers"][0]
        assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
        assert env_of(container)["OUTRIDER_METRICS_PORT"] == "9090"
