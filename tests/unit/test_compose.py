"""compose/ cannot run here (no Docker engine), so check it against the real CLI: every Tandem
service is there, its command parses with `tandem`'s own parser, and every TANDEM_* variable it
sets is a setting of that service."""

from pathlib import Path

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
    settings = args.settings_class(**{k[len("TANDEM_"):].lower(): v for k, v in svc["environment"].items()
                                      if k not in SHARED_ENV})
    assert settings.nats_url == "nats://nats:4222"
    assert set(svc["depends_on"]) == {"nats", "redis"}


def test_servers_health_and_scale():
    assert "-js" in SERVICES["nats"]["command"] and SERVICES["nats"]["volumes"]
    for name in ("nats", "redis", "gateway"):
        assert SERVICES[name]["healthcheck"]["test"]
    assert SERVICES["decode"]["deploy"]["replicas"] >= 2
    assert "8000:8000" in SERVICES["gateway"]["ports"]
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tandem"]' in dockerfile
    assert TANDEM["gateway"]["build"]["dockerfile"] == "compose/Dockerfile"
