"""``TANDEM_*`` variables are read by settings classes only: the library's in
``shared.process_settings``, the cache root in ``kernels.cache_dir``, the engine's in
``shared.engine_settings``. A static scan finds any other read in shared/ and kernels/; each
variable is checked to take effect through the code that uses it, and a bad value to fail with a
message naming it."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from kernels.cache_dir import CacheSettings, cache_dir
from shared.process_settings import InvalidSetting, ProcessSettings, process_settings
from shared.telemetry.logs import JsonFormatter, configure_logging

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_MODULES = {"shared/process_settings.py", "kernels/cache_dir.py", "shared/engine_settings.py"}
VARIABLES = sorted({f"TANDEM_{name.upper()}" for cls in (ProcessSettings, CacheSettings) for name in cls.model_fields})


def _is_environ(node: ast.expr) -> bool:
    """``os.environ`` or a bare ``environ`` (``from os import environ``)."""
    return ((isinstance(node, ast.Attribute) and node.attr == "environ"
             and isinstance(node.value, ast.Name) and node.value.id == "os")
            or (isinstance(node, ast.Name) and node.id == "environ"))


def _is_getenv(node: ast.expr) -> bool:
    return ((isinstance(node, ast.Attribute) and node.attr == "getenv"
             and isinstance(node.value, ast.Name) and node.value.id == "os")
            or (isinstance(node, ast.Name) and node.id == "getenv"))


def _tandem_key(node: ast.expr | None) -> str | None:
    """The variable a key names when it is ``"TANDEM_..."`` or an f-string starting so."""
    if isinstance(node, ast.JoinedStr) and node.values:
        node = node.values[0]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("TANDEM_"):
        return node.value
    return None


def tandem_env_reads(path: Path) -> list[tuple[int, str]]:
    """(line, variable) of each ``os.environ.get("TANDEM_…")``, ``os.environ["TANDEM_…"]`` (read)
    and ``os.getenv("TANDEM_…")`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        key = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if _is_getenv(func) or (isinstance(func, ast.Attribute) and func.attr == "get" and _is_environ(func.value)):
                key = _tandem_key(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            key = _tandem_key(node.slice)
        if key is not None:
            found.append((node.lineno, key))
    return sorted(found)


def test_library_code_reads_tandem_variables_only_through_settings_classes():
    reads = [f"{path.relative_to(ROOT)}:{line} reads {key}"
             for layer in ("shared", "kernels")
             for path in sorted((ROOT / layer).rglob("*.py"))
             if str(path.relative_to(ROOT)) not in SETTINGS_MODULES
             for line, key in tandem_env_reads(path)]
    assert reads == [], "read these through a settings class (shared/process_settings.py):\n" + "\n".join(reads)


def test_the_scan_sees_each_form_of_read(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom os import environ, getenv\n\n"
                      "def f(name):\n"
                      "    a = os.environ.get('TANDEM_A', '1')\n"
                      "    b = os.environ['TANDEM_B']\n"
                      "    c = os.getenv('TANDEM_C')\n"
                      "    d = environ.get(f'TANDEM_{name}')\n"
                      "    e = getenv('TANDEM_E')\n"
                      "    os.environ['TANDEM_WRITTEN'] = '1'\n"
                      "    return os.environ.get('HOME'), os.environ['PATH']\n")
    assert tandem_env_reads(module) == [(5, "TANDEM_A"), (6, "TANDEM_B"), (7, "TANDEM_C"), (8, "TANDEM_"),
                                        (9, "TANDEM_E")]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def root_logger():
    """The root logger as it was, put back after the test configures logging."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def test_the_defaults_are_what_the_code_had(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    settings = process_settings()
    assert (settings.log_level, settings.log_format, settings.nats_ca, settings.nats_replicas) == (
        "INFO", "text", None, None)
    assert (settings.compile_cache_dir, settings.compile_nice, settings.compile_process) == (None, 19, True)
    assert cache_dir() == tmp_path / ".cache" / "tandem"


def test_an_empty_variable_is_its_default(monkeypatch):
    for name in VARIABLES:
        monkeypatch.setenv(name, "")
    assert process_settings() == ProcessSettings() and CacheSettings().cache_dir is None


def test_logging_follows_its_variables(monkeypatch, root_logger):
    monkeypatch.setenv("TANDEM_LOG_LEVEL", "debug")
    monkeypatch.setenv("TANDEM_LOG_FORMAT", "JSON")
    configure_logging("test")
    assert root_logger.level == logging.DEBUG and isinstance(root_logger.handlers[0].formatter, JsonFormatter)
    configure_logging("test", "warning", "text")  # arguments (a service's flags) win
    assert root_logger.level == logging.WARNING and not isinstance(root_logger.handlers[0].formatter, JsonFormatter)


def test_the_nats_defaults_follow_their_variables(monkeypatch):
    monkeypatch.setenv("TANDEM_NATS_CA", "/etc/tandem/ca.pem")
    monkeypatch.setenv("TANDEM_NATS_REPLICAS", "3")
    assert (process_settings().nats_ca, process_settings().nats_replicas) == ("/etc/tandem/ca.pem", 3)


def test_the_cache_directories_follow_their_variables(tmp_path, monkeypatch):
    from shared.engine.compiled.artifacts import CompileArtifacts

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    assert CompileArtifacts.default_root() == tmp_path / "cache" / "compile"
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TANDEM_COMPILE_CACHE_DIR", "~/steps")
    assert CompileArtifacts.default_root() == tmp_path / "steps"


@pytest.mark.parametrize(("value", "nice"), [("5", 5), (" 0 ", 0), ("-3", 0), ("40", 19)])
def test_the_compile_nice_value_follows_its_variable(monkeypatch, value, nice):
    from shared.engine import cpu_threads

    monkeypatch.setenv("TANDEM_COMPILE_NICE", value)
    assert cpu_threads.background_nice() == nice


@pytest.mark.parametrize(("value", "wanted"), [(v, False) for v in ("0", "false", "no", "off", " Off ", "FALSE")]
                         + [(v, True) for v in ("1", "true", "yes", "on", "On")])
def test_the_compile_process_follows_its_variable(monkeypatch, value, wanted):
    from shared.engine.compiled.child import use_child_process

    monkeypatch.setenv("TANDEM_COMPILE_PROCESS", value)
    assert use_child_process() is wanted


@pytest.mark.parametrize(("name", "value"), [
    ("TANDEM_LOG_LEVEL", "loud"), ("TANDEM_LOG_FORMAT", "xml"), ("TANDEM_NATS_REPLICAS", "three"),
    ("TANDEM_NATS_REPLICAS", "0"), ("TANDEM_COMPILE_NICE", "high"), ("TANDEM_COMPILE_PROCESS", "maybe")])
def test_a_bad_value_fails_naming_its_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidSetting, match=f"^{name}={value!r}: "):
        process_settings()


def test_a_bad_value_stops_a_command_when_it_sets_up_logging(monkeypatch, root_logger):
    monkeypatch.setenv("TANDEM_COMPILE_NICE", "high")
    with pytest.raises(InvalidSetting, match="TANDEM_COMPILE_NICE"):
        configure_logging("test", "info", "text")


@pytest.mark.parametrize("name", VARIABLES)
def test_each_variable_is_described_and_documented(name):
    field = name.removeprefix("TANDEM_").lower()
    cls = CacheSettings if field in CacheSettings.model_fields else ProcessSettings
    assert cls.model_fields[field].description
    assert f"`{name}`" in (ROOT / "docs" / "running.md").read_text()
