"""k8s:// worker addresses, and what an EndpointSlice's endpoints mean for routing."""

import pytest

from outrider.coordinator.workers.discovery import EndpointSliceWatch, ServiceRef


def parse(address: str) -> ServiceRef:
    return ServiceRef.parse(address, default_namespace=lambda: "pod-ns")


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("k8s://target.llm:grpc", ServiceRef("target", "llm", "grpc")),
        ("k8s://target:grpc", ServiceRef("target", "pod-ns", "grpc")),
        ("k8s://draft-pool.prod:50053", ServiceRef("draft-pool", "prod", 50053)),
    ],
)
def test_a_service_address_names_service_namespace_and_port(address, expected):
    assert parse(address) == expected
    assert str(parse(address)) == f"k8s://{expected.service}.{expected.namespace}:{expected.port}"


@pytest.mark.parametrize(
    "address",
    [
        "k8s://target",
        "k8s://target.llm",
        "k8s://Target.llm:grpc",
        "k8s://target.llm:0",
        "k8s://:grpc",
        "k8s://a.b.c:p",
    ],
)
def test_a_malformed_service_address_says_the_form_to_use(address):
    with pytest.raises(ValueError, match=r"k8s://SERVICE\[\.NAMESPACE\]:PORT"):
        parse(address)


def endpoints_of(endpoint_slice: dict, port: str | int = "grpc") -> dict[str, bool]:
    watch = EndpointSliceWatch(
        ServiceRef("target", "llm", port), api=None, on_change=lambda _: None
    )
    return watch._endpoints_of({"metadata": {"name": "target-abc"}, **endpoint_slice})


def test_ready_and_not_terminating_takes_sessions_and_a_missing_ready_counts_as_ready():
    endpoints = [
        {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
        {"addresses": ["10.0.0.2"], "conditions": {}},
        {"addresses": ["10.0.0.3"]},
        {"addresses": ["10.0.0.4"], "conditions": {"ready": False}},
        {
            "addresses": ["10.0.0.5"],
            "conditions": {"ready": False, "serving": True, "terminating": True},
        },
        # A Service with publishNotReadyAddresses reports ready even while terminating.
        {
            "addresses": ["10.0.0.6"],
            "conditions": {"ready": True, "serving": True, "terminating": True},
        },
        {"addresses": []},
    ]
    endpoint_slice = {
        "addressType": "IPv4",
        "ports": [{"name": "grpc", "port": 50052}],
        "endpoints": endpoints,
    }
    assert endpoints_of(endpoint_slice) == {
        "10.0.0.1:50052": True,
        "10.0.0.2:50052": True,
        "10.0.0.3:50052": True,
        "10.0.0.4:50052": False,
        "10.0.0.5:50052": False,
        "10.0.0.6:50052": False,
    }


def test_ports_are_found_by_name_or_given_by_number_and_ipv6_is_bracketed():
    endpoint_slice = {
        "addressType": "IPv6",
        "ports": [{"name": "metrics", "port": 9090}, {"name": "grpc", "port": 50052}],
        "endpoints": [{"addresses": ["fd00::1", "fd00::2"]}],
    }
    assert endpoints_of(endpoint_slice) == {"[fd00::1]:50052": True}
    assert endpoints_of(endpoint_slice, port=7000) == {"[fd00::1]:7000": True}
    assert endpoints_of(endpoint_slice, port="http") == {}


def test_a_replica_that_keeps_failing_is_passed_over_longer_each_time():
    import time

    from outrider.coordinator.workers.replicas import Replica

    replica = Replica("127.0.0.1:1", channel=None, stub=None)
    downs = []
    for _ in range(6):
        replica.failed()
        downs.append(round(replica.down_until - time.monotonic()))
    assert downs == [5, 10, 20, 40, 60, 60]  # a frozen worker is not tried every 5 s
    replica.opened()
    replica.failed()
    assert round(replica.down_until - time.monotonic()) == 5
