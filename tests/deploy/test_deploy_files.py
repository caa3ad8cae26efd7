"""docker/ and deploy/ against the code: configs that validate, manifests that reference what exists, probe
paths the admin listener really serves, dashboards that query metrics the proxy and simulator really export."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import AffinityProxy
from proxy.cli import build_parser
from proxy.config import load_config, parse_config
from proxy.multiproc.supervisor import Supervisor
from tests.deploy.files import (
    DOCKER,
    DEPLOY,
    REPO,
    Dockerfile,
    configmap_configs,
    image_config_path,
    manifests,
    of_kind,
    promql_metric_names,
    proxy_config_files,
)
from tests.deploy.procs import AFFINITY_PROXY

# ------------------------------------------------------------------------------------------ configs


def _check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([AFFINITY_PROXY, "check-config", str(path)], capture_output=True, text=True, timeout=60)


def test_every_proxy_config_passes_check_config(tmp_path: Path) -> None:
    files = proxy_config_files()
    assert image_config_path()[1] in files
    embedded = configmap_configs()
    assert embedded, "deploy/ has no ConfigMap carrying a proxy configuration"
    for i, (where, text) in enumerate(embedded):
        path = tmp_path / f"configmap-{i}.yaml"
        path.write_text(text)
        files.append(path)
    for path in files:
        result = _check_config(path)
        assert result.returncode == 0, f"{path}: {result.stderr}"
        assert "valid" in result.stdout


def test_check_config_rejects_a_broken_config(tmp_path: Path) -> None:
    """The check above can fail: a typo in a copy of the image's config is reported with its line."""
    text = image_config_path()[1].read_text().replace("debug_headers:", "debug_header:")
    broken = tmp_path / "broken.yaml"
    broken.write_text(text)
    result = _check_config(broken)
    assert result.returncode == 2
    assert "debug_header" in result.stderr and "did you mean 'debug_headers'" in result.stderr


# ------------------------------------------------------------------------------------------ Dockerfile


def test_dockerfile_shape() -> None:
    df = Dockerfile.parse()
    first_from = next(i for i, (kw, _) in enumerate(df.instructions) if kw == "FROM")
    args = [rest for kw, rest in df.instructions[:first_from] if kw == "ARG"]
    assert any(a.startswith("BASE_IMAGE=") for a in args), "ARG BASE_IMAGE=... must precede the first FROM"
    assert all(rest.split()[0] == "${BASE_IMAGE}" for rest in df.all("FROM"))
    assert df.user().split(":")[0] not in ("root", "0")
    command = df.command()
    assert command[:2] == ["affinity-proxy", "run"]
    build_parser().parse_args(command[1:])  # the entry point is a valid command line of our CLI
    in_image, source = image_config_path()
    assert in_image == "/etc/affinity-proxy/config.yaml" and source.is_file()
    # Dependencies come from pyproject.toml, and everything COPYed from the build context exists.
    copied = [rest.split()[:-1] for kw, rest in df.instructions if kw == "COPY" and not rest.startswith("--from")]
    sources = [s for group in copied for s in group]
    assert "pyproject.toml" in sources
    for s in sources:
        assert (REPO / s).exists(), f"COPY source {s} does not exist"
    assert df.healthcheck()


def test_dockerignore_keeps_what_the_image_copies() -> None:
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for kw, rest in Dockerfile.parse().instructions:
        if kw == "COPY" and not rest.startswith("--from"):
            for source in rest.split()[:-1]:
                assert source.split("/")[0] not in ignored


# ------------------------------------------------------------------------------------------ Kubernetes


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _admin_paths(config_text: str) -> set[str]:
    """GET paths the admin listener of this configuration really serves (in a single process and as the
    --workers supervisor)."""
    paths: set[str] = set()
    for role in ("all", "control"):
        proxy = AffinityProxy(parse_config(config_text), role=role)
        for route in proxy.admin_app.router.routes():
            if route.method in ("GET", "*") and route.resource is not None:
                paths.add(route.resource.canonical)
    return paths


def test_manifests_parse_and_have_identity() -> None:
    docs = manifests()
    kinds = {doc["kind"] for _, doc in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    for path, doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), path
        if doc["kind"] != "Kustomization":
            assert doc["metadata"]["name"], path
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


def test_deployment_references_what_exists() -> None:
    (deployment,) = of_kind("Deployment")
    pod = deployment["spec"]["template"]
    assert _labels_match(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    configmaps = {cm["metadata"]["name"]: cm for cm in of_kind("ConfigMap")}

    # The config volume is a ConfigMap that exists, with the key it projects, mounted where the image's
    # entry point reads its config.
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    in_image, _ = image_config_path()
    mounted = None
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            cm = configmaps[volume["configMap"]["name"]]
            for item in volume["configMap"]["items"]:
                assert item["key"] in cm["data"]
                if f"{mount['mountPath'].rstrip('/')}/{item['path']}" == in_image:
                    mounted = cm["data"][item["key"]]
    assert mounted is not None, f"no ConfigMap item is mounted at {in_image}"
    config = parse_config(mounted)

    # Container ports are the ports that config listens on.
    assert ports["http"] == config.listen.port
    assert config.grpc_listen is not None and ports["grpc"] == config.grpc_listen.port
    assert ports["admin"] == config.admin.port

    # The args extend the image's entry point into a valid command line.
    command = Dockerfile.parse().command() + list(container.get("args", []))
    parsed = build_parser().parse_args(command[1:])
    assert parsed.workers is None or parsed.workers >= 1

    # Probes hit paths the admin listener serves, on a declared port.
    served = _admin_paths(mounted)
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        get = container[probe]["httpGet"]
        port = get["port"]
        assert (ports[port] if isinstance(port, str) else port) == config.admin.port, probe
        assert get["path"] in served, f"{probe} path {get['path']} is not served ({sorted(served)})"
    assert "/healthz" in served and "/readyz" in served

    # Draining finishes before the kubelet's SIGKILL; the pod runs as the image's unprivileged user.
    assert pod["spec"]["terminationGracePeriodSeconds"] > config.timeouts.drain_s
    assert str(pod["spec"]["securityContext"]["runAsUser"]) == Dockerfile.parse().user().split(":")[0]
    annotations = pod["metadata"].get("annotations", {})
    assert int(annotations["prometheus.io/port"]) == config.admin.port
    assert annotations["prometheus.io/path"] in served


def test_services_and_pdb_select_the_pods() -> None:
    (deployment,) = of_kind("Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    port_names = {p["name"] for p in container["ports"]}
    services = {s["metadata"]["name"]: s for s in of_kind("Service")}
    proxy_services = [s for s in services.values() if s["spec"].get("clusterIP") != "None"]
    assert proxy_services
    for svc in proxy_services:
        assert _labels_match(svc["spec"]["selector"], pod_labels)
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names
    (pdb,) = of_kind("PodDisruptionBudget")
    assert _labels_match(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    assert deployment["spec"]["replicas"] > 1  # a PDB over a single replica would block every node drain


def test_headless_service_is_what_discovery_resolves() -> None:
    namespace = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["namespace"]
    headless = [s for s in of_kind("Service") if s["spec"].get("clusterIP") == "None"]
    assert len(headless) == 1
    svc = headless[0]
    ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    (deployment,) = of_kind("Deployment")
    # The model-server selector must not catch the proxy pods themselves.
    assert not _labels_match(svc["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    fqdn = f"{svc['metadata']['name']}.{namespace}.svc.cluster.local"
    for _, text in configmap_configs():
        config = parse_config(text)
        assert config.discovery.enabled
        (backend,) = config.backends
        assert backend.url == f"http://{fqdn}:{ports['http']}"
        assert backend.grpc == f"{fqdn}:{ports['grpc']}"


# ------------------------------------------------------------------------------------------ compose


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_references_files_that_exist() -> None:
    compose = _compose()
    local_images = {svc["image"] for svc in compose["services"].values() if svc.get("build")}
    for name, svc in compose["services"].items():
        # A locally built tag is never pulled: every service running it carries the build section.
        assert svc.get("image") not in local_images or svc.get("build"), name
        build = svc.get("build")
        if build:
            context = (DOCKER / build["context"]).resolve()
            assert context == REPO
            assert (context / build["dockerfile"]).resolve() == (DOCKER / "Dockerfile").resolve()
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{name}: {source} does not exist"


def _sim_port(svc: dict[str, Any]) -> int:
    args = svc["command"]
    assert args[args.index("--servers") + 1] == "1"
    return int(args[args.index("--port") + 1])


def test_compose_wiring_matches_the_proxy_config() -> None:
    compose = _compose()
    services = compose["services"]
    proxy = services["proxy"]
    in_image, source = image_config_path()
    mounts = {v.split(":")[1]: (DOCKER / v.split(":")[0]).resolve() for v in proxy["volumes"]}
    assert mounts[in_image] == source.resolve()
    config = load_config(str(source))
    # Every backend is a simulator service on the port it listens on; every simulator is a backend.
    sims = {name: svc for name, svc in services.items() if svc.get("entrypoint", [])[-1:] == ["sim"]}
    assert len(sims) == 4
    for b in config.backends:
        host, port = b.url.removeprefix("http://").split(":")
        assert host in sims and int(port) == _sim_port(sims[host])
        if b.grpc:
            ghost, gport = b.grpc.split(":")
            args = sims[ghost]["command"]
            assert ghost == host and int(gport) == int(args[args.index("--grpc-port") + 1])
    assert {b.url.removeprefix("http://").split(":")[0] for b in config.backends} == set(sims)
    # The simulator command line is one the simulator accepts.
    from sim.__main__ import build_parser as sim_parser

    for svc in sims.values():
        sim_parser().parse_args(svc["command"])
    # Published ports are the config's listeners.
    published = {int(p.split(":")[-1]) for p in proxy["ports"]}
    assert published == {config.listen.port, config.grpc_listen.port, config.admin.port}

    # Prometheus scrapes the proxy's admin port and every simulator.
    prom = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert f"proxy:{config.admin.port}" in targets
    for name, svc in sims.items():
        assert f"{name}:{_sim_port(svc)}" in targets
    for job in prom["scrape_configs"]:
        assert job["metrics_path"] == "/metrics"


def test_grafana_provisioning_points_at_the_dashboard() -> None:
    compose = _compose()
    grafana = compose["services"]["grafana"]
    mounts = {v.split(":")[1]: (DOCKER / v.split(":")[0]).resolve() for v in grafana["volumes"]}
    provisioning = mounts["/etc/grafana/provisioning"]
    (ds_file,) = (provisioning / "datasources").glob("*.yaml")
    datasources = yaml.safe_load(ds_file.read_text())["datasources"]
    prom_uid = {d["uid"] for d in datasources if d["type"] == "prometheus"}
    assert datasources[0]["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
    (dash_file,) = (provisioning / "dashboards").glob("*.yaml")
    provider = yaml.safe_load(dash_file.read_text())["providers"][0]
    dash_dir = mounts[provider["options"]["path"]]
    dashboards = list(dash_dir.glob("*.json"))
    assert dashboards
    for path in dashboards:
        dash = json.loads(path.read_text())
        for panel in dash["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] in prom_uid
            for target in panel["targets"]:
                assert target["datasource"]["uid"] in prom_uid


def _sample_names(text: str) -> set[str]:
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}
        names.update(family.name + s for s in suffixes.get(family.type, ()))
        names.update(s.name for s in family.samples)
    return names


async def test_dashboard_queries_metrics_that_exist() -> None:
    from sim.fleet import start_fleet
    from prometheus_client import generate_latest

    proxy = AffinityProxy(load_config(str(image_config_path()[1])))
    supervisor = Supervisor(proxy.config, proxy.store, 2, {}, drain_s=1.0)
    proxy.metrics.register_collector(supervisor.collect_own)
    exported = _sample_names(generate_latest(proxy.metrics.registry).decode())
    fleet = await start_fleet(1, flavor="vllm")
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{fleet.servers[0].url}/metrics") as resp:
                exported |= _sample_names(await resp.text())
    finally:
        await fleet.stop()
    queried: set[str] = set()
    for path in (DOCKER / "grafana" / "dashboards").glob("*.json"):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                queried |= promql_metric_names(target["expr"])
    assert queried, "no queries found"
    missing = queried - exported
    assert not missing, f"dashboard queries metrics nobody exports: {sorted(missing)}"


@pytest.mark.parametrize(
    "expr,names",
    [
        ('sum by (backend) (rate(affinity_proxy_requests_total{status="200"}[5m]))', {"affinity_proxy_requests_total"}),
        ("histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[$__rate_interval])))",
         {"vllm:time_to_first_token_seconds_bucket"}),
        ("a_total / b_total", {"a_total", "b_total"}),
    ],
)
def test_promql_metric_names(expr: str, names: set[str]) -> None:
    assert promql_metric_names(expr) == names
