"""``deploy/k8s/``: the manifests against Kubernetes' own schemas, and against the server.

kubernetes-validate ships the schemas of every Kubernetes release it knows, so the check
runs offline; strict mode also refuses fields the schema does not have (a typo in a probe
would otherwise be dropped silently by the API server). The rest checks that the manifests
agree with the code: the container's flags parse, the probes hit the routes that exist, the
grace period covers preStop, the drain and the shutdown, the resources cover the memory the
capacity bench measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from server.config import ServerConfig
from server.serve.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30"  # the oldest release still supported upstream when written
BENCH_RESULTS = REPO / "bench" / "results"


def documents() -> list[tuple[str, dict[str, Any]]]:
    """(file name, resource) for every YAML document under deploy/k8s."""
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((path.name, doc))
    return found


def resource(kind: str, name: str = "whisperwire") -> dict[str, Any]:
    (found,) = [d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def container() -> dict[str, Any]:
    (only,) = resource("Deployment")["spec"]["template"]["spec"]["containers"]
    return only


def server_config() -> ServerConfig:
    """The ServerConfig the container's flags make (as ``server.serve.cli.main`` builds it)."""
    args = build_parser().parse_args(container()["args"])
    return ServerConfig(
        port=args.port,
        max_sessions=args.max_sessions,
        drain_s=args.drain_s,
        max_session_s=args.max_session_s,
        idle_timeout_s=args.idle_timeout_s,
    )


def mebibytes(quantity: str) -> float:
    units = {"Ki": 2**-10, "Mi": 1, "Gi": 2**10}
    return float(quantity[:-2]) * units[quantity[-2:]]


def test_every_manifest_is_valid_for_kubernetes() -> None:
    docs = documents()
    assert {d["kind"] for _, d in docs} == {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
    }
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{name}: {doc['kind']} {path}: {exc.message}")


def test_the_validator_catches_a_misspelt_field() -> None:
    broken = json.loads(json.dumps(resource("Deployment")))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_container_flags_are_the_servers() -> None:
    config = server_config()
    port = config.port
    (declared,) = container()["ports"]
    assert declared == {"name": "http", "containerPort": port}
    assert config.drain_s > 0  # behind a Service, SIGTERM drains


def test_probes_hit_readyz_and_healthz() -> None:
    c = container()
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    # One 503 (full, draining) takes the pod out of the endpoints at once.
    assert c["readinessProbe"]["failureThreshold"] == 1


def test_the_grace_period_covers_prestop_drain_and_shutdown() -> None:
    spec = resource("Deployment")["spec"]["template"]["spec"]
    command = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    prestop_s = float(command[1])
    config = server_config()
    closing_s = 2 * config.close_timeout_s  # close_quietly: drain the buffer, then the close
    needed_s = prestop_s + config.drain_s + config.shutdown_timeout_s + closing_s
    assert spec["terminationGracePeriodSeconds"] >= needed_s
    assert spec["terminationGracePeriodSeconds"] <= needed_s + 30  # and no needless wait


def test_resources_cover_the_memory_the_capacity_bench_measured() -> None:
    c = container()
    requests, limits = c["resources"]["requests"], c["resources"]["limits"]
    lanes = build_parser().parse_args(c["args"]).decode_lanes
    assert requests["cpu"] == str(lanes)  # a lane per requested core
    assert "cpu" not in limits
    rss_mib = [
        run["rss_mb_max"]
        for path in BENCH_RESULTS.glob("capacity*.json")
        for run in json.loads(path.read_text())["servers"]["ours"]["runs"]
        if run.get("decode_lanes") == lanes and run["rss_mb_max"] is not None
    ]
    assert rss_mib, "no capacity bench result with this many lanes"
    assert mebibytes(requests["memory"]) >= max(rss_mib)
    assert mebibytes(limits["memory"]) >= mebibytes(requests["memory"])


def test_services_have_no_session_affinity_and_reach_the_container_port() -> None:
    labels = resource("Deployment")["spec"]["template"]["metadata"]["labels"]
    for name in ("whisperwire", "whisperwire-pods"):
        spec = resource("Service", name)["spec"]
        assert spec.get("sessionAffinity", "None") == "None"
        assert spec["selector"] == labels
        assert [p["targetPort"] for p in spec["ports"]] == ["http"]
    assert resource("Service", "whisperwire-pods")["spec"]["clusterIP"] == "None"


def test_the_autoscaler_scales_the_deployment_on_a_recorded_metric() -> None:
    hpa = resource("HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"]["name"] == resource("Deployment")["metadata"]["name"]
    (metric,) = hpa["metrics"]
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    # prometheus-adapter serves a recording rule with its colons made underscores.
    assert metric["pods"]["metric"]["name"] in {r.replace(":", "_") for r in recorded}
