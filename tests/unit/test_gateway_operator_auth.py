"""Who opens what on a gateway: API keys from a file (never a child's command line), the operator
key that closes /status, /metrics and /dashboard, and a strict ``Authorization: Bearer``.

The HTTP tests run the gateway's real app on loopback with a bus that only says the autoscaler is
not there (``/status`` then answers from the registry view it holds).
"""

from __future__ import annotations

import argparse
import base64
import os

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.framework.errors import CliError
from services.framework.command import settings_from_args
from services.gateway.config import GatewaySettings
from services.gateway.service import Gateway, build_app
from services.stack.children import service_argv, split_secret_flags
from shared.bus import ServiceError
from shared.openai_api.auth import ApiKeys, OperatorKey, bearer_key, operator_headers, path_is_operator
from shared.openai_api.errors import ApiError
from shared.planner.config import ConfigError
from shared.policy.qos import QosConfig, QosTier

OPERATOR_KEY = "op-7f3a9c"
QOS = QosConfig(default_tier="silver", tiers={"gold": QosTier(priority=0), "silver": QosTier(priority=1)})


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def error_of(call) -> ApiError:
    with pytest.raises(ApiError) as info:
        call()
    return info.value


# --- API keys from a file ---------------------------------------------------------------------------
def test_a_keys_file_has_the_flags_format_one_key_a_line(tmp_path):
    path = write(tmp_path, "keys", "# team A\nk1:gold\n\n  k2  \n")
    keys = ApiKeys.load(None, path, QOS)
    assert keys.key_tiers == {"k1": "gold", "k2": "silver"}
    assert keys.tier("Bearer k1") == "gold"


@pytest.mark.parametrize("text, match", [
    ("", "holds no key"),  # an empty table would turn authentication off
    ("# only a comment\n", "holds no key"),
    ("k1 gold\n", "line 1 is not KEY or KEY:TIER"),
    ("k1\nk2,k3\n", "line 2 is not KEY or KEY:TIER"),
    ("k1:platinum\n", "names tier 'platinum'"),
])
def test_a_keys_file_that_says_nothing_clear_is_refused_at_start(tmp_path, text, match):
    path = write(tmp_path, "keys", text)
    with pytest.raises(ConfigError, match=match):
        ApiKeys.load(None, path, QOS)


def test_keys_come_from_one_source_and_a_missing_file_is_named(tmp_path):
    path = write(tmp_path, "keys", "k1\n")
    with pytest.raises(ConfigError, match="api_keys and api_keys_file are both set"):
        ApiKeys.load("k2", path, QOS)
    with pytest.raises(ConfigError, match="cannot read .*nope"):
        ApiKeys.load(None, tmp_path / "nope", QOS)


def test_the_gateway_reads_its_key_files_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEYS_FILE", write(tmp_path, "keys", "k1\n"))
    monkeypatch.setenv("TANDEM_OPERATOR_KEY_FILE", write(tmp_path, "op", "bad key\n"))
    with pytest.raises(CliError, match="operator_key_file: .* holds no key"):  # checked before anything starts
        settings_from_args(GatewaySettings, argparse.Namespace())  # no flags: the environment alone
    monkeypatch.setenv("TANDEM_OPERATOR_KEY_FILE", write(tmp_path, "op", OPERATOR_KEY + "\n"))
    settings = settings_from_args(GatewaySettings, argparse.Namespace())
    assert settings.api_keys_file.endswith("keys") and settings.operator_key_file.endswith("op")


def test_a_stack_gives_gateways_their_keys_in_the_environment_never_on_the_command_line():
    """``tandem up`` starts each gateway with ``split_secret_flags`` + ``service_argv``: the keys
    travel as TANDEM_API_KEYS; a keys file travels as its path, which is no secret."""
    flags = {"api_keys": "sk-live-1:gold,sk-live-2", "api_keys_file": None, "port": 8000,
             "operator_key_file": "/etc/tandem/operator.key"}
    argv_flags, env = split_secret_flags(flags)
    argv = service_argv("gateway", argv_flags)
    assert not any("sk-live" in a for a in argv), argv
    assert "/etc/tandem/operator.key" in argv
    assert env == {"TANDEM_API_KEYS": "sk-live-1:gold,sk-live-2"}


# --- strict Authorization: Bearer ------------------------------------------------------------------
@pytest.mark.parametrize("header, says", [
    (None, "missing API key"),
    ("", "missing API key"),
    ("   ", "missing API key"),
    ("k1", "expected 'Bearer <key>'"),  # a bare key
    ("Bearerk1", "expected 'Bearer <key>'"),
    ("Basic k1", "expected 'Bearer <key>'"),
    ("Token k1", "expected 'Bearer <key>'"),
    ("Bearer\tk1", "expected 'Bearer <key>'"),  # 1*SP: spaces, not tabs
    ("Bearer", "takes one key, got 0 words"),
    ("Bearer    ", "takes one key, got 0 words"),
    ("Bearer k1 k2", "takes one key, got 2 words"),
    ("Bearer k1, Bearer k2", "takes one key, got 3 words"),
])
def test_a_malformed_authorization_is_401_saying_what_is_wrong_without_echoing_it(header, says):
    keys = ApiKeys.parse("k1", QOS)
    err = error_of(lambda: keys.tier(header))
    assert (err.status, err.code) == (401, "invalid_api_key")
    assert says in err.message and "k1" not in err.message.replace("'Bearer <key>'", "")


def test_bearer_takes_any_case_and_spaces_as_rfc_6750_allows():
    # credentials = "Bearer" 1*SP b64token; the header value's own whitespace is not part of it
    for header in ("Bearer k1", "bearer k1", "BEARER k1", "Bearer   k1", " Bearer k1 "):
        assert bearer_key(header) == "k1", header
    assert error_of(lambda: ApiKeys.parse("k1", QOS).tier("Bearer k9")).message == "invalid API key"


# --- the operator key ------------------------------------------------------------------------------
def test_the_operator_pages_are_status_metrics_and_the_dashboard():
    for path in ("/status", "/metrics", "/dashboard", "/dashboard/data", "/dashboard/static/dashboard.js"):
        assert path_is_operator(path), path
    for path in ("/health", "/ready", "/v1/models", "/statusx", "/v1/status", "/tokenize"):
        assert not path_is_operator(path), path


def test_the_operator_key_takes_bearer_or_a_basic_password(tmp_path):
    key = OperatorKey.load(write(tmp_path, "op", "# the stack's operator key\n" + OPERATOR_KEY + "\n"))
    key.check(f"Bearer {OPERATOR_KEY}")
    key.check("Basic " + base64.b64encode(f"admin:{OPERATOR_KEY}".encode()).decode())
    key.check("Basic " + base64.b64encode(f":{OPERATOR_KEY}".encode()).decode())
    for header in (None, "", OPERATOR_KEY, f"Token {OPERATOR_KEY}", "Bearer wrong", f"Bearer {OPERATOR_KEY}x",
                   "Basic !!!", "Basic " + base64.b64encode(f"{OPERATOR_KEY}:".encode()).decode()):
        err = error_of(lambda: key.check(header))
        assert (err.status, err.code) == (401, "invalid_operator_key"), header
    OperatorKey.load(None).check(None)  # none configured: open, as before
    assert operator_headers(tmp_path / "op") == {"Authorization": f"Bearer {OPERATOR_KEY}"}
    assert operator_headers(None) == {}


class _NoAutoscaler:
    async def request(self, *args, **kwargs):
        raise ServiceError("timeout", "no autoscaler in this test")


@pytest.fixture
async def client_for(tmp_path):
    clients: list[TestClient] = []

    async def start(**settings) -> TestClient:
        gateway = Gateway(GatewaySettings(**settings), _NoAutoscaler(), registry=None, tokenizer=None)
        client = TestClient(TestServer(build_app(gateway)))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


async def test_with_an_operator_key_its_pages_need_it_and_an_api_key_does_not_open_them(client_for, tmp_path):
    client = await client_for(api_keys="user-key", operator_key_file=write(tmp_path, "op", OPERATOR_KEY))
    operator = {"Authorization": f"Bearer {OPERATOR_KEY}"}
    for path in ("/status", "/metrics", "/dashboard", "/dashboard/data", "/dashboard/static/dashboard.js"):
        for headers in ({}, {"Authorization": "Bearer user-key"}, {"Authorization": "Bearer nope"}):
            resp = await client.get(path, headers=headers)
            body = await resp.json()
            assert resp.status == 401, (path, headers)
            assert body["error"]["code"] == "invalid_operator_key" and body["error"]["type"] == "authentication_error"
            assert resp.headers["WWW-Authenticate"].startswith("Basic ")  # a browser asks for the key
        assert (await client.get(path, headers=operator)).status == 200, path
    basic = "Basic " + base64.b64encode(f"ops:{OPERATOR_KEY}".encode()).decode()
    assert (await client.get("/dashboard/data", headers={"Authorization": basic})).status == 200
    # the rest is as before: probes open, the API behind its own key (which the operator key is not)
    assert (await client.get("/health")).status == 200
    assert (await client.get("/v1/models", headers={"Authorization": "Bearer user-key"})).status == 200
    resp = await client.get("/v1/models", headers=operator)
    assert resp.status == 200  # /v1/models needs no key, as before


async def test_without_an_operator_key_the_pages_stay_open(client_for):
    client = await client_for(api_keys="user-key")
    for path in ("/status", "/metrics", "/dashboard"):
        assert (await client.get(path)).status == 200, path


async def test_an_api_401_names_bearer_and_says_what_is_wrong(client_for, tmp_path):
    client = await client_for(api_keys_file=write(tmp_path, "keys", "user-key\n"))
    resp = await client.post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer user-key extra"})
    assert resp.status == 401 and resp.headers["WWW-Authenticate"].startswith("Bearer ")
    assert "takes one key, got 2 words" in (await resp.json())["error"]["message"]


def test_key_files_are_read_once_at_start_and_their_mode_is_checked(tmp_path, caplog):
    from services.gateway.service import _log_access  # noqa: PLC0415

    keys = write(tmp_path, "keys", "k1\n")
    os.chmod(keys, 0o644)
    settings = GatewaySettings(api_keys_file=keys)
    with caplog.at_level("INFO", logger="services.gateway.service"):
        _log_access(Gateway(settings, _NoAutoscaler(), registry=None, tokenizer=None), settings)
    assert "1 API keys; /status, /metrics and /dashboard open to anyone" in caplog.text
    assert "readable by other users" in caplog.text
