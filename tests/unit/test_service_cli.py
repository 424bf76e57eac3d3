"""Every service starts alone as ``tandem <service>`` with ``--help``, flags mirroring its settings."""

import subprocess
import sys
from typing import Literal, get_args, get_origin

import pytest

from services.cli import build_parser, main
from services.framework.command import settings_from_args

SERVICES = ["gateway", "admission", "decode", "prefill", "kv-index", "autoscaler", "up"]


@pytest.mark.parametrize("service", SERVICES)
def test_every_settings_field_is_a_flag(service):
    args = build_parser().parse_args([service])
    for name, field in args.settings_class.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            assert getattr(build_parser().parse_args([service, flag]), name) is True, flag
            assert getattr(build_parser().parse_args([service, "--no-" + flag[2:]]), name) is False, flag
            continue
        literal = next((a for a in (field.annotation, *get_args(field.annotation)) if get_origin(a) is Literal), None)
        value = get_args(literal)[-1] if literal is not None else "1"  # an optional Literal keeps its choices
        parsed = build_parser().parse_args([service, flag, value])
        assert getattr(parsed, name) == value, flag


def test_flags_override_env_and_env_overrides_defaults(monkeypatch):
    monkeypatch.setenv("TANDEM_NAMESPACE", "fromenv")
    monkeypatch.setenv("TANDEM_MAX_WAITING_PER_WORKER", "7")
    args = build_parser().parse_args(["admission", "--namespace", "fromflag"])
    settings = settings_from_args(args.settings_class, args)
    assert (settings.namespace, settings.max_waiting_per_worker) == ("fromflag", 7)


def test_bad_setting_is_a_one_line_user_error(capsys):
    assert main(["admission", "--max-waiting-per-worker", "0"]) == 2
    assert "max_waiting_per_worker" in capsys.readouterr().err


def test_help_runs_without_heavy_imports():
    code = ("import sys; from services.cli import main\n"
            "for s in %r:\n"
            "    try: main([s, '--help'])\n"
            "    except SystemExit: pass\n"
            "assert 'torch' not in sys.modules and 'nats' not in sys.modules, 'heavy import at --help'\n"
            % SERVICES)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage: tandem decode" in out.stdout and "--worker-id" in out.stdout


def test_decode_num_threads_reaches_the_engine_config():
    from services.decode.config import DecodeSettings

    assert DecodeSettings(num_threads=1).engine_config().num_threads == 1
    assert DecodeSettings().engine_config().num_threads is None


def test_quantization_reaches_the_engine_config_and_the_stack_workers(monkeypatch):
    from services.decode.config import DecodeSettings
    from services.up.config import UpSettings
    from services.up.service import spec_from_settings

    assert DecodeSettings(quantization="int8").engine_config().quantization == "int8"
    assert DecodeSettings().engine_config().quantization is None  # the engine picks the device's fastest
    monkeypatch.setenv("TANDEM_QUANTIZATION", "int8")
    args = build_parser().parse_args(["prefill"])
    assert settings_from_args(args.settings_class, args).engine_config().quantization == "int8"
    spec = spec_from_settings(UpSettings(quantization="int8", prefill=1))
    assert spec.decode_flags["quantization"] == spec.prefill_flags["quantization"] == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--quantization", "int4"])


def test_up_passes_dtype_and_num_threads_to_every_worker_and_only_when_given():
    from services.up.config import UpSettings
    from services.up.service import spec_from_settings

    spec = spec_from_settings(UpSettings(dtype="float32", num_threads=1, prefill=1))
    for flags in (spec.decode_flags, spec.prefill_flags):
        assert flags["dtype"] == "float32" and flags["num_threads"] == 1 and "quantization" not in flags
    args = build_parser().parse_args(["up", "--dtype", "bfloat16", "--num-threads", "2"])
    up = settings_from_args(args.settings_class, args)
    assert (up.dtype, up.num_threads) == ("bfloat16", 2)
    assert not {"dtype", "num_threads", "quantization"} & set(spec_from_settings(UpSettings()).decode_flags)


def test_remote_prefill_window_must_cover_a_kv_write(capsys):
    assert main(["decode", "--remote-prefill-timeout-s", "4", "--kv-write-timeout-s", "5"]) == 2
    assert "remote_prefill_timeout_s" in capsys.readouterr().err


def test_up_autoscale_bounds_reach_the_autoscaler_and_bad_ones_are_one_line(capsys):
    from services.up.config import UpSettings
    from services.up.service import spec_from_settings

    spec = spec_from_settings(UpSettings(autoscale=True, min_workers=1, max_workers=3))
    assert spec.autoscaler_flags == {"autoscale": True, "min_workers": 1, "max_workers": 3}
    assert spec.fleet_drain_timeout_s == 300.0
    fixed = spec_from_settings(UpSettings(autoscale=True, decode=2))  # flips only: no fleet manager
    assert fixed.autoscaler_flags == {"autoscale": True} and fixed.fleet_drain_timeout_s is None
    assert spec_from_settings(UpSettings()).autoscaler_flags == {}
    assert main(["up", "--max-workers", "3"]) == 2
    assert "min_workers and max_workers need autoscale" in capsys.readouterr().err
    assert main(["up", "--autoscale", "--decode", "4", "--max-workers", "3"]) == 2
    assert "must lie between min_workers (4) and max_workers (3)" in capsys.readouterr().err


def test_kv_tier_flags_reach_the_engine_and_each_decode_worker_gets_its_own_disk_dir(tmp_path, monkeypatch):
    from services.decode.config import DecodeSettings
    from services.stack.stack import Stack
    from services.up.config import UpSettings
    from services.up.service import spec_from_settings

    config = DecodeSettings(kv_host_memory="64MiB", kv_disk_dir=str(tmp_path), kv_disk_size="1GiB",
                            kv_disk_min_uses=3).engine_config()
    assert (config.kv_host_memory, config.kv_disk_dir, config.kv_disk_size, config.kv_disk_min_uses) == \
        (64 << 20, str(tmp_path), 1 << 30, 3)
    assert DecodeSettings().engine_config().kv_host_memory == 0 and DecodeSettings().engine_config().kv_disk_dir is None
    args = build_parser().parse_args(["up", "--kv-host-memory", "2GiB", "--kv-disk-dir", str(tmp_path)])
    spec = spec_from_settings(settings_from_args(args.settings_class, args))
    assert spec.decode_flags["kv_host_memory"] == 2 << 30 and spec.decode_flags["kv_disk_dir"] == str(tmp_path)
    assert "kv_disk_dir" not in spec.prefill_flags and "kv_disk_dir" not in spec_from_settings(UpSettings()).decode_flags

    started = {}
    stack = Stack(spec)
    monkeypatch.setattr(stack, "_start_child", lambda name, service, flags: started.setdefault(name, flags))
    stack.spawn_decode("decode-1")
    stack.spawn_decode("decode-2")
    assert started["decode-1"]["kv_disk_dir"] == str(tmp_path / "decode-1")
    assert started["decode-2"]["kv_disk_dir"] == str(tmp_path / "decode-2")


def test_speculative_decoding_flags_reach_the_engine_from_every_command():
    from services.commands.model_cmds import engine_config_from_args
    from services.decode.config import DecodeSettings
    from services.up.service import spec_from_settings
    from services.worker.settings import SPECULATIVE_TOKENS

    config = DecodeSettings(speculative_tokens=5, speculative_max_batch=2).engine_config()
    assert (config.speculative_tokens, config.speculative_max_batch) == (5, 2)
    # on by default on the CPU and on CUDA (measured on both); 0 turns it off
    assert DecodeSettings(device="cpu").engine_config().speculative_tokens == SPECULATIVE_TOKENS > 0
    assert DecodeSettings(device="cuda").engine_config().speculative_tokens == SPECULATIVE_TOKENS
    assert DecodeSettings(device="cpu", speculative_tokens=0).engine_config().speculative_tokens == 0
    args = build_parser().parse_args(["complete", "--speculative-tokens", "3", "hi"])
    assert engine_config_from_args(args).speculative_tokens == 3
    args = build_parser().parse_args(["up", "--speculative-tokens", "4"])
    assert spec_from_settings(settings_from_args(args.settings_class, args)).decode_flags["speculative_tokens"] == 4


def test_up_compile_reaches_every_worker_and_the_engine(monkeypatch):
    from services.commands.model_cmds import engine_config_from_args
    from services.decode.config import DecodeSettings
    from services.up.config import UpSettings
    from services.up.service import spec_from_settings

    monkeypatch.delenv("TANDEM_COMPILE", raising=False)  # tests/conftest.py pins it off
    spec = spec_from_settings(UpSettings(compile="on", prefill=1))
    assert spec.decode_flags["compile"] == "on" and spec.prefill_flags["compile"] == "on"
    assert "compile" not in spec_from_settings(UpSettings()).decode_flags  # the workers' own default
    args = build_parser().parse_args(["decode", "--compile", "on"])
    assert settings_from_args(args.settings_class, args).engine_config().compile == "on"
    # a worker compiles in the background unless told otherwise; the engine commands do not compile
    assert DecodeSettings().engine_config().compile == "background"
    assert DecodeSettings(compile="false").engine_config().compile == "off"  # an env var's boolean spelling
    assert engine_config_from_args(build_parser().parse_args(["complete", "hi"])).compile == "off"
    assert engine_config_from_args(build_parser().parse_args(["complete", "--compile", "on", "hi"])).compile == "on"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["complete", "--compile", "sometimes", "hi"])


def test_join_help_describes_a_host_without_the_control_plane(capsys):
    with pytest.raises(SystemExit):
        main(["join", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "PydanticUndefined" not in text and "(env TANDEM_CONNECT, required)" in text
    assert "number of decode workers on this host" in text and "the control plane alone" not in text
    assert "JetStream/Redis state" not in text and "Exit codes" in text
    assert "5 credentials refused (copy connect.env from the control plane again" in text


def test_up_gives_prefill_and_decode_workers_their_own_parallel_shapes():
    from services.up.config import UpSettings
    from services.up.service import spec_from_settings

    spec = spec_from_settings(UpSettings(prefill=1, prefill_tp=3, decode_pp=2))
    assert spec.prefill_flags["tensor_parallel_size"] == 3 and "pipeline_parallel_size" not in spec.prefill_flags
    assert spec.decode_flags["pipeline_parallel_size"] == 2 and "tensor_parallel_size" not in spec.decode_flags
    plain = spec_from_settings(UpSettings(prefill=1))
    assert not {"tensor_parallel_size", "pipeline_parallel_size"} & {*plain.prefill_flags, *plain.decode_flags}


def test_up_hands_its_key_files_to_the_gateways_and_keys_only_through_their_environment():
    from services.stack.children import split_secret_flags
    from services.up.config import UpSettings
    from services.up.service import spec_from_settings

    spec = spec_from_settings(UpSettings(api_keys_file="/etc/tandem/keys", operator_key_file="/etc/tandem/op"))
    assert spec.gateway_flags == {"api_keys_file": "/etc/tandem/keys", "operator_key_file": "/etc/tandem/op"}
    flags, env = split_secret_flags(spec_from_settings(UpSettings(api_keys="sk-1:premium")).gateway_flags)
    assert "api_keys" not in flags and env == {"TANDEM_API_KEYS": "sk-1:premium"}


@pytest.mark.parametrize("command", ["up", "gateway"])
def test_api_keys_on_the_command_line_are_refused_and_taken_from_the_environment(command, monkeypatch):
    """A flag's value is in /proc/PID/cmdline for every user of the machine: keys come from the
    environment or a file only."""
    from services.cli import build_parser
    from services.framework.command import settings_from_args
    from services.framework.errors import CliError

    args = build_parser().parse_args([command, "--api-keys", "sk-1"])
    with pytest.raises(CliError, match="seen by every user.*TANDEM_API_KEYS or in a file named by --api-keys-file"):
        settings_from_args(args.settings_class, args)
    monkeypatch.setenv("TANDEM_API_KEYS", "sk-1")
    args = build_parser().parse_args([command])
    assert settings_from_args(args.settings_class, args).api_keys == "sk-1"
