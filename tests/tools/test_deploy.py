"""deploy/kubernetes/ checked offline: every built-in resource against Kubernetes' own OpenAPI schemas
(kubernetes-validate ships them; strict, so a misspelt field fails), and the wiring between files
that no schema sees: selectors and named ports, the frontend's and Triton's command lines against
their real parsers, the autoscaler's metric against the adapter rule and the engine's metric names,
the multi-node pods' rendezvous flags."""

from __future__ import annotations

import argparse
import copy
import json
import re
import shlex

import kubernetes_validate
import pytest
import yaml

from backend.engine.metrics import EngineMetrics
from openai_frontend.main import parse_settings
from tests.utils import ROOT

KUBERNETES = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.29.0"  # the oldest release these manifests are meant for
# Custom resources have no bundled schema: checked by hand below (ServiceMonitor's wiring).
CUSTOM_KINDS = {"ServiceMonitor"}
MULTI_NODE_FLAGS = ("--nnodes", "--node-rank", "--master-addr", "--master-port")


def manifests() -> dict[str, list[dict]]:
    files = sorted(KUBERNETES.glob("*.yaml"))
    documents = {path.name: [d for d in yaml.safe_load_all(path.read_text()) if d] for path in files}
    return {name: docs for name, docs in documents.items() if all("kind" in d and "apiVersion" in d for d in docs)
            and name != "kustomization.yaml"}


def resources(kind: str | None = None) -> list[dict]:
    return [doc for docs in manifests().values() for doc in docs if kind is None or doc["kind"] == kind]


def named(kind: str, name: str) -> dict:
    return next(doc for doc in resources(kind) if doc["metadata"]["name"] == name)


def containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("resource", [r for r in resources() if r["kind"] not in CUSTOM_KINDS],
                         ids=lambda r: f"{r['kind']}/{r['metadata']['name']}")
def test_resource_matches_the_kubernetes_schema(resource):
    kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def test_the_validator_rejects_what_kubectl_would():
    broken = copy.deepcopy(named("Deployment", "tritonllm-triton"))
    container = containers(broken)[0]
    container["readinesProbe"] = container.pop("readinessProbe")  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_existing_built_in_resources():
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        assert name in manifests() and not any(d["kind"] in CUSTOM_KINDS for d in manifests()[name])


def test_services_select_pods_and_name_their_ports():
    workloads = resources("Deployment") + resources("StatefulSet")
    for service in resources("Service"):
        pods = [w for w in workloads if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(pods) == 1, f"Service {service['metadata']['name']} selects {len(pods)} workloads"
        container_ports = {p["name"] for c in containers(pods[0]) for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port.get("targetPort", port["name"]) in container_ports
    for monitor in resources("ServiceMonitor"):  # custom resource: its wiring, by hand
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        service = next(s for s in resources("Service")
                       if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items())
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}


def test_triton_replicas_ask_for_a_gpu_and_probe_tritons_health():
    for workload in (named("Deployment", "tritonllm-triton"), named("StatefulSet", "tritonllm-tp")):
        container = containers(workload)[0]
        assert container["resources"]["requests"]["nvidia.com/gpu"] == container["resources"]["limits"]["nvidia.com/gpu"] == 1
        probes = json.dumps([container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe")])
        assert "/v2/health/ready" in probes and "/v2/health/live" in probes and "8000" in probes + json.dumps(container["ports"])
        assert workload["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8002"


def serve_parser() -> argparse.ArgumentParser:
    from tools.cli import add_engine_arguments
    from tools.serve import add_serve_arguments
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(parser)
    add_engine_arguments(parser)
    return parser


def test_triton_command_line_parses_with_the_images_entrypoint():
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (.+)$", (ROOT / "Dockerfile").read_text(), re.M).group(1))
    assert entrypoint[:2] == ["tritonllm", "serve"]
    args = serve_parser().parse_args(entrypoint[2:] + containers(named("Deployment", "tritonllm-triton"))[0]["args"])
    assert args.host == "0.0.0.0" and args.grpc_port == 8001 and args.metrics_port == 8002


def test_frontend_finds_every_triton_replica_through_the_headless_service():
    container = containers(named("Deployment", "tritonllm-frontend"))[0]
    assert container["command"] == ["python3", "-m", "openai_frontend"]
    settings, _ = parse_settings(container["args"])
    service = named("Service", "tritonllm-triton")
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert service["spec"]["clusterIP"] == "None"
    assert settings.triton_urls() == [f"dns:///{service['metadata']['name']}:{grpc_port}"]
    assert settings.routing == "prefix" and settings.host == "0.0.0.0"


def test_autoscaler_metric_is_the_adapters_rule_for_the_engines_queue():
    hpa = named("HorizontalPodAutoscaler", "tritonllm-triton")
    assert hpa["spec"]["scaleTargetRef"]["name"] == named("Deployment", "tritonllm-triton")["metadata"]["name"]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    rules = yaml.safe_load((KUBERNETES / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]
    rule = next(r for r in rules if r["name"]["as"] == metric)
    series = rule["seriesQuery"].split("{")[0]
    assert re.fullmatch(rule["name"]["matches"], series)
    assert series == "vllm:num_requests_waiting" in {m.name for m in EngineMetrics().registry.snapshot()}


def test_multi_node_pods_meet_at_pod_zero():
    statefulset = named("StatefulSet", "tritonllm-tp")
    service = named("Service", statefulset["spec"]["serviceName"])
    assert statefulset["spec"]["replicas"] == 2 and statefulset["spec"]["podManagementPolicy"] == "Parallel"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    container = containers(statefulset)[0]
    env = {e["name"]: e["value"] for e in container["env"]}
    pod_zero = f"{statefulset['metadata']['name']}-0.{service['metadata']['name']}"
    assert env["MASTER_ADDR"] == pod_zero and env["MASTER_PORT"] == "29500"
    script = container["args"][0]
    commands = [shlex.split(line.strip().removeprefix("exec "))
                for line in script.splitlines() if line.strip().startswith("exec ")]
    assert [command[:2] for command in commands] == [["tritonllm", "serve"], ["tritonllm", "worker"]]
    for rank, command in enumerate(commands):
        flags = {token: command[i + 1] for i, token in enumerate(command) if token.startswith("--")}
        assert flags["--tensor-parallel-size"] == "2" and flags["--nnodes"] == "2"
        assert flags["--node-rank"] == str(rank)
        assert flags["--master-addr"] == pod_zero and flags["--master-port"] == "29500"
    # `serve`'s other flags parse now; the rendezvous flags are the multi-node work's to add.
    _, unknown = serve_parser().parse_known_args(commands[0][2:])
    assert set(unknown[::2]) <= set(MULTI_NODE_FLAGS), unknown


def test_deploy_doc_names_only_files_that_exist():
    text = (ROOT / "docs" / "deploy.md").read_text()
    mentioned = set(re.findall(r"deploy/kubernetes/[\w.-]+", text))
    assert mentioned and all((ROOT / path).exists() for path in mentioned)
    assert {f"deploy/kubernetes/{name}" for name in manifests()} <= mentioned
