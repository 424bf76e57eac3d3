"""Credentials stay out of logs, help texts and child command lines."""

import logging

from services.stack.children import service_argv, split_secret_flags
from shared.telemetry.logs import configure_logging
from shared.telemetry.redact import RedactSecrets, new_secret, redact_text, redact_url


def test_redact_url_hides_passwords_and_tokens_and_keeps_the_rest():
    assert redact_url("nats://tandem:s3cret@nats:4222") == "nats://tandem:***@nats:4222"
    assert redact_url("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact_url("nats://t0ken@host:4222") == "nats://***@host:4222"  # a token is the whole user-info
    assert redact_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
    assert redact_url("redis://:p%40ss@h:1/0") == "redis://:***@h:1/0"


def test_redact_text_finds_every_url_in_a_message():
    text = "cannot reach nats://u:pw1@a:1 nor redis://:pw2@b:2/0 (tried tls://tok@c:3)"
    assert redact_text(text) == "cannot reach nats://u:***@a:1 nor redis://:***@b:2/0 (tried tls://***@c:3)"
    assert redact_text("no url here: a@b and http://plain/path") == "no url here: a@b and http://plain/path"


def test_the_log_filter_redacts_messages_arguments_and_tracebacks():
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    handler = Keep()
    handler.addFilter(RedactSecrets())
    log = logging.getLogger("test_credentials")
    log.addHandler(handler)
    try:
        log.warning("connecting to %s", "nats://tandem:hunter2@h:4222")
        try:
            raise ConnectionError("refused by redis://:hunter3@h:6379/0")
        except ConnectionError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    assert records[0] == "connecting to nats://tandem:***@h:4222"
    assert "redis://:***@h:6379/0" in records[1]
    assert not any("hunter" in r for r in records), records


def test_secret_settings_go_to_the_environment_not_the_command_line():
    password = new_secret()
    flags = {"nats_url": f"nats://tandem:{password}@h:1", "redis_url": f"redis://:{password}@h:2/0",
             "api_keys": "k1:gold", "namespace": "ns", "port": 8000}
    argv_flags, env = split_secret_flags(flags)
    argv = service_argv("kv-index", argv_flags)
    assert not any(password in a or "k1:gold" in a for a in argv), argv
    assert argv[-4:] == ["--namespace", "ns", "--port", "8000"]
    assert env == {"TANDEM_NATS_URL": flags["nats_url"], "TANDEM_REDIS_URL": flags["redis_url"],
                   "TANDEM_API_KEYS": "k1:gold"}


def test_new_secrets_are_fresh_and_need_no_escaping_in_a_url():
    secrets = {new_secret() for _ in range(100)}
    assert len(secrets) == 100
    assert all(len(s) >= 32 and s.replace("-", "").replace("_", "").isalnum() for s in secrets)


def test_every_service_log_handler_redacts(capsys):
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    try:
        configure_logging("test", "INFO")
        logging.getLogger("nats.aio.client").warning("lost nats://tandem:hunter4@h:4222")
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    err = capsys.readouterr().err
    assert "nats://tandem:***@h:4222" in err and "hunter4" not in err
