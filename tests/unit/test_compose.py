"""A fast static check of compose/ against the real CLI (tests/integration/test_compose_stack.py
runs it under Docker): every Tandem service is there, its command parses with `tandem`'s own
parser, and every TANDEM_* variable it sets is a setting of that service; NATS is a three-member
cluster the services know all of; the credentials: NATS and Redis require the passwords of
compose/.env, every service gets them, and nothing puts them into the image; nothing is pulled from
a container registry outside the optional observability profile."""

import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from shared.bus.bus import server_urls
from services.cli import build_parser
from services.framework.settings import settings_env_names

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
# the Tandem services: the image's entry point `tandem` (NATS and Redis run the same image with
# another entry point)
TANDEM = {name: svc for name, svc in SERVICES.items()
          if svc.get("image", "").startswith("tandem") and "entrypoint" not in svc}
NATS = {name: svc for name, svc in SERVICES.items() if name.startswith("nats-")}
# Read by every command (the model cache: kernels/cache_dir.py's settings), not by the service's own settings class.
SHARED_ENV = {"TANDEM_CACHE_DIR"}
ENV_EXAMPLE = dict(line.split("=", 1) for line in (ROOT / "compose" / ".env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
_REQUIRED_VAR = re.compile(r"\$\{(\w+):\?[^}]*\}")
_DEFAULT_VAR = re.compile(r"\$\{(\w+):-([^}]*)\}")


def interpolate(value: str, env: dict[str, str]) -> str:
    """What compose makes of ``${VAR:?message}`` (the variable's value; compose refuses to start
    when it is unset) and ``${VAR:-default}``; the test fails on any other form, which it does not
    model."""
    value = _REQUIRED_VAR.sub(lambda m: env[m.group(1)], str(value))
    value = _DEFAULT_VAR.sub(lambda m: env.get(m.group(1)) or m.group(2), value)
    assert "${" not in value, f"unexpected interpolation in {value!r}"
    return value


def command_of(name: str) -> str:
    """The tandem command a service runs: its name without a replica number (decode-2: decode)."""
    return re.sub(r"-\d+$", "", name)


def test_every_service_is_in_compose():
    assert set(TANDEM) == {"gateway", "admission", "decode-1", "decode-2", "prefill", "kv-index", "autoscaler"}
    assert set(NATS) == {"nats-1", "nats-2", "nats-3"} and "redis" in SERVICES


@pytest.mark.parametrize("name", sorted(TANDEM))
def test_command_parses_and_env_names_settings(name):
    svc = TANDEM[name]
    args = build_parser().parse_args(svc["command"])
    assert args.command == command_of(name) and callable(args.func)
    allowed = settings_env_names(args.settings_class) | SHARED_ENV
    env = set(svc.get("environment", {}))
    assert env <= allowed, f"{name}: unknown settings {sorted(env - allowed)}"
    settings = args.settings_class(**{k[len("TANDEM_"):].lower(): interpolate(v, ENV_EXAMPLE)
                                      for k, v in svc["environment"].items() if k not in SHARED_ENV})
    members = [urlsplit(url) for url in server_urls(settings.nats_url)]
    assert [(u.hostname, u.port, u.username, u.password) for u in members] == [
        (member, 4222, "tandem", ENV_EXAMPLE["NATS_PASSWORD"]) for member in sorted(NATS)]
    if hasattr(settings, "redis_url"):
        redis = urlsplit(settings.redis_url)
        assert (redis.hostname, redis.password) == ("redis", ENV_EXAMPLE["REDIS_PASSWORD"])
    assert svc["depends_on"] == {dep: {"condition": "service_healthy"} for dep in [*NATS, "redis"]}


def test_nats_is_a_cluster_of_three_with_jetstream_on_a_volume_each():
    conf_path = {svc["command"][svc["command"].index("-c") + 1] for svc in NATS.values()}
    assert len(conf_path) == 1
    conf = None
    for name, svc in NATS.items():
        assert svc["entrypoint"] == ["nats-server"]
        mounted = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
        conf = (ROOT / "compose" / mounted[next(iter(conf_path))]).read_text()
        env = {k: interpolate(v, ENV_EXAMPLE) for k, v in svc["environment"].items()}
        assert env["NATS_SERVER_NAME"] == name and env["NATS_ADVERTISE"] == f"{name}:4222"
        routes = [urlsplit(env[f"NATS_ROUTE_{i}"]) for i in (1, 2, 3)]
        assert [(r.hostname, r.port, r.username, r.password) for r in routes] == [
            (member, 6222, "route", ENV_EXAMPLE["NATS_PASSWORD"]) for member in sorted(NATS)]
        data = [v for v in svc["volumes"] if v.endswith(":/data")]
        assert len(data) == 1 and data[0].split(":")[0] in COMPOSE["volumes"], name
    assert len({v for svc in NATS.values() for v in svc["volumes"] if v.endswith(":/data")}) == 3
    assert re.search(r'jetstream \{ store_dir: "/data" \}', conf)
    assert re.search(r"routes: \[\$NATS_ROUTE_1, \$NATS_ROUTE_2, \$NATS_ROUTE_3\]", conf)
    assert "server_name: $NATS_SERVER_NAME" in conf and "client_advertise: $NATS_ADVERTISE" in conf


def test_nats_and_redis_require_the_passwords_of_the_env_file():
    nats, redis = SERVICES["nats-1"], SERVICES["redis"]
    conf = nats["command"][nats["command"].index("-c") + 1]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in nats["volumes"] if v.startswith("./")}
    auth = (ROOT / "compose" / mounted[conf]).read_text()
    assert re.search(r"user: tandem\s+password: \$NATS_PASSWORD", auth), auth
    assert re.search(r"cluster \{[^}]*authorization \{\s+user: route\s+password: \$NATS_PASSWORD", auth), auth
    assert interpolate(nats["environment"]["NATS_PASSWORD"], ENV_EXAMPLE) == ENV_EXAMPLE["NATS_PASSWORD"]
    assert '--requirepass "$$REDIS_PASSWORD"' in redis["command"][-1]
    assert interpolate(redis["environment"]["REDIS_PASSWORD"], ENV_EXAMPLE) == ENV_EXAMPLE["REDIS_PASSWORD"]
    assert "REDISCLI_AUTH" in redis["healthcheck"]["test"][1]  # the health check logs in too


def test_credentials_stay_out_of_git_and_the_image():
    assert "compose/.env" in (ROOT / ".gitignore").read_text().splitlines()
    assert "**/.env" in (ROOT / ".dockerignore").read_text().splitlines()
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    assert "PASSWORD" not in dockerfile and "TANDEM_NATS_URL" not in dockerfile
    assert not any(line.startswith("COPY") and "compose" in line for line in dockerfile.splitlines())
    # the final image copies nothing from the build context (the pip CA bundle and the staged
    # files stay in the build stages): only from the stages
    final = dockerfile.rsplit("\nFROM ", 1)[1]
    assert all("--from=" in line for line in final.splitlines() if line.startswith("COPY"))


def test_servers_health_and_scale():
    for name in [*NATS, "redis", "gateway"]:
        assert SERVICES[name]["healthcheck"]["test"], name
    assert {TANDEM[n]["command"][0] for n in ("decode-1", "decode-2")} == {"decode"}
    assert TANDEM["decode-1"]["networks"]["default"]["aliases"] == ["decode"]
    assert interpolate(SERVICES["gateway"]["ports"][0], {}) == "8000:8000"
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tandem"]' in dockerfile
    # built by compose/build.sh: no `build:` (compose would build it once per service), and no
    # image a registry must serve outside the optional observability profile
    assert not any("build" in svc for svc in SERVICES.values())
    for name, svc in SERVICES.items():
        assert svc["image"] == "tandem:latest" or svc.get("profiles") == ["observability"], name


def test_docker_compose_accepts_the_file(tmp_path):
    """docker-compose's own validation (1.29 or the v2 plugin), where one is installed."""
    cli = ["docker-compose"] if shutil.which("docker-compose") else None
    if cli is None and shutil.which("docker") and subprocess.run(
            ["docker", "compose", "version"], capture_output=True).returncode == 0:
        cli = ["docker", "compose"]
    if cli is None:
        pytest.skip("no docker-compose and no `docker compose` installed")
    env = tmp_path / "env"
    env.write_text("".join(f"{k}={v}\n" for k, v in ENV_EXAMPLE.items()))
    out = subprocess.run([*cli, "-f", str(ROOT / "compose" / "docker-compose.yml"), "--env-file", str(env),
                          "config", "-q"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# --- observability: Prometheus scrapes every service, Grafana reads only families that exist -----

def exported_families() -> set[str]:
    """Every family name the services export, from their metric objects (fed once, so that the
    families built at scrape time from reports show up too)."""
    from prometheus_client.parser import text_string_to_metric_families

    from services.gateway.metrics import GatewayMetrics
    from shared.engine.engine import EngineStats
    from shared.protocol.workers import WorkerLoad
    from services.worker.metrics import WorkerMetrics
    from shared.telemetry.families import AdmissionMetrics, AutoscalerMetrics, KvIndexMetrics
    from shared.telemetry.metrics import exposition, service_registry
    from shared.transfer.base import TransferStats

    worker = WorkerMetrics(service_registry("decode", "w", 0))
    worker.bind(lambda: EngineStats(1, 0, 10, 1, 0, 4, 0, 1, 1, 0, 1), TransferStats, lambda: 0)
    worker.observe_load(WorkerLoad(worker_id="w", role="decode", seq=1, timestamp=0.0), "ready")
    autoscaler = AutoscalerMetrics()
    autoscaler.bind(list)
    registries = [GatewayMetrics().registry, worker.registry, AdmissionMetrics().registry, KvIndexMetrics().registry,
                  autoscaler.registry]
    return {f.name for r in registries for f in text_string_to_metric_families(exposition(r)[0].decode())}


def test_prometheus_scrapes_every_service_on_its_metrics_port():
    config = yaml.safe_load((ROOT / "compose" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job["dns_sd_configs"][0] for job in config["scrape_configs"]}
    assert set(jobs) == {command_of(name) for name in TANDEM}
    for name, svc in TANDEM.items():
        env, job = svc["environment"], command_of(name)
        assert env["TANDEM_METRICS_HOST"] == "0.0.0.0", name  # reachable from the Prometheus container
        # the job's DNS name: the service's, or the alias its replicas share (decode-1, decode-2: decode)
        dns_names = {name, *svc.get("networks", {}).get("default", {}).get("aliases", [])}
        assert jobs[job]["names"] == [job] and job in dns_names, name
        assert jobs[job]["port"] == int(env["TANDEM_METRICS_PORT"]), name
    assert SERVICES["prometheus"]["profiles"] == SERVICES["grafana"]["profiles"] == ["observability"]
    mounted = SERVICES["prometheus"]["volumes"][0].split(":")
    assert mounted[0] == "./prometheus.yml" and mounted[1] in SERVICES["prometheus"]["command"][0]


def test_grafana_dashboard_queries_only_exported_families():
    dashboard = json.loads((ROOT / "compose" / "grafana" / "dashboards" / "tandem.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {re.sub(r"_(total|bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"\btandem_\w+", e)}
    exported = exported_families()
    assert used - exported == set(), f"the dashboard queries families nobody exports: {sorted(used - exported)}"
    assert {"tandem_request_phase_seconds", "tandem_worker_kv_cache_usage_ratio",
            "tandem_admission_decisions", "tandem_prefill_queue_depth"} <= used
    datasource = yaml.safe_load((ROOT / "compose" / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
                                .read_text())["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {datasource["uid"]}
    assert any(v.startswith("./grafana/dashboards:") for v in SERVICES["grafana"]["volumes"])
