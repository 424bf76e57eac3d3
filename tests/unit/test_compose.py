"""compose/ cannot run here (no Docker engine), so check it against the real CLI: every Tandem
service is there, its command parses with `tandem`'s own parser, and every TANDEM_* variable it
sets is a setting of that service; and the credentials: NATS and Redis require the passwords of
compose/.env, every service gets them, and nothing puts them into the image."""

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
