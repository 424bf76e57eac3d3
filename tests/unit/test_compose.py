"""compose/ cannot run here (no Docker engine), so check it against the real CLI: every Tandem
service is there, its command parses with `tandem`'s own parser, and every TANDEM_* variable it
sets is a setting of that service; and the credentials: NATS and Redis require the passwords of
compose/.env, every service gets them, and nothing puts them into the image."""

import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from shared.cli.main import build_parser
from shared.runtime.settings import settings_env_names

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
TANDEM = {name: svc for name, svc in SERVICES.items() if svc.get("image", "").startswith("tandem")}
# Read by code every command shares (the model cache), not by a settings class.
SHARED_ENV = {"TANDEM_CACHE_DIR"}
ENV_EXAMPLE = dict(line.split("=", 1) for line in (ROOT / "compose" / ".env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
_REQUIRED_VAR = re.compile(r"\$\{(\w+):\?[^}]*\}")


def interpolate(value: str, env: dict[str, str]) -> str:
    """What compose makes of ``${VAR:?message}``: the variable's value (compose refuses to start
    when it is unset); the test fails on any other form, which it does not model."""
    value = _REQUIRED_VAR.sub(lambda m: env[m.group(1)], str(value))
    assert "${" not in value, f"unexpected interpolation in {value!r}"
    return value


def test_every_service_is_in_compose():
    assert set(TANDEM) == {"gateway", "admission", "decode", "prefill", "kv-index", "autoscaler"}
    assert {"nats", "redis"} <= set(SERVICES)


@pytest.mark.parametrize("name", sorted(TANDEM))
def test_command_parses_and_env_names_settings(name):
    svc = TANDEM[name]
    args = build_parser().parse_args(svc["command"])
    assert args.command == name and callable(args.func)
    allowed = settings_env_names(args.settings_class) | SHARED_ENV
    env = set(svc.get("environment", {}))
    assert env <= allowed, f"{name}: unknown settings {sorted(env - allowed)}"
    settings = args.settings_class(**{k[len("TANDEM_"):].lower(): interpolate(v, ENV_EXAMPLE)
                                      for k, v in svc["environment"].items() if k not in SHARED_ENV})
    nats = urlsplit(settings.nats_url)
    assert (nats.hostname, nats.port, nats.username, nats.password) == (
        "nats", 4222, "tandem", ENV_EXAMPLE["NATS_PASSWORD"])
    if hasattr(settings, "redis_url"):
        redis = urlsplit(settings.redis_url)
        assert (redis.hostname, redis.password) == ("redis", ENV_EXAMPLE["REDIS_PASSWORD"])
    assert set(svc["depends_on"]) == {"nats", "redis"}


def test_nats_and_redis_require_the_passwords_of_the_env_file():
    nats, redis = SERVICES["nats"], SERVICES["redis"]
    conf = nats["command"][nats["command"].index("-c") + 1]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in nats["volumes"] if v.startswith("./")}
    auth = (ROOT / "compose" / mounted[conf]).read_text()
    assert re.search(r"user: tandem\s+password: \$NATS_PASSWORD", auth), auth
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


def test_servers_health_and_scale():
    assert "-js" in SERVICES["nats"]["command"] and SERVICES["nats"]["volumes"]
    for name in ("nats", "redis", "gateway"):
        assert SERVICES[name]["healthcheck"]["test"]
    assert SERVICES["decode"]["deploy"]["replicas"] >= 2
    assert "8000:8000" in SERVICES["gateway"]["ports"]
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tandem"]' in dockerfile
    assert TANDEM["gateway"]["build"]["dockerfile"] == "compose/Dockerfile"


# --- observability: Prometheus scrapes every service, Grafana reads only families that exist -----

def exported_families() -> set[str]:
    """Every family name the services export, from their metric objects (fed once, so that the
    families built at scrape time from reports show up too)."""
    from prometheus_client.parser import text_string_to_metric_families

    from services.gateway.metrics import GatewayMetrics
    from shared.engine.engine import EngineStats
    from shared.protocol.workers import WorkerLoad
    from shared.runtime.worker_metrics import WorkerMetrics
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
    assert set(jobs) == set(TANDEM)
    for name, svc in TANDEM.items():
        env = svc["environment"]
        assert env["TANDEM_METRICS_HOST"] == "0.0.0.0", name  # reachable from the Prometheus container
        assert jobs[name]["names"] == [name] and jobs[name]["port"] == int(env["TANDEM_METRICS_PORT"]), name
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
