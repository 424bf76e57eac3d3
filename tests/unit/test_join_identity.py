"""A joined host's identity (``services.join.identity``): the host id kept in its state directory,
passed to its workers and carried in their registry entries; a join refused when another host's
live workers hold its worker ids; readiness counted on its own workers' entries only; a worker whose
NATS login is refused is not restarted. (Against a real nats-server:
tests/integration/test_join_failures.py.)"""

from __future__ import annotations

import sys
import time

import pytest

import services.stack.stack as stack_module
from services.cli import build_parser
from services.join.cli import EXIT_CODES
from services.join.identity import (EXIT_HOST_NAME_TAKEN, HOST_ID_FILE, describe_conflict, is_ready_here,
                                    live_conflicts, load_host_id)
from services.join.service import EXIT_CREDENTIALS_REFUSED, refused_workers, spec_from_settings, worker_ids_of
from shared.bus.errors import NatsCredentialsRefused
from services.framework.errors import CliError
from shared.protocol.workers import WorkerInfo
from services.framework.command import settings_from_args
from services.stack.children import Child
from services.stack.stack import Stack, StackSpec
from services.stack.supervisor import Backoff, RestartPolicy

NOW = 1_700_000_000.0


def entry(worker_id: str, host_id: str | None, *, state: str = "ready", started_at: float = NOW - 60,
          heartbeat_at: float = NOW - 1.5) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="decode", state=state, model="m", block_size=16, max_model_len=64,
                      generate_subject=f"g.{worker_id}", host="twin", host_id=host_id, pid=4242,
                      started_at=started_at, heartbeat_at=heartbeat_at)


def join_settings(tmp_path, *flags: str):
    connect = tmp_path / "connect.env"
    connect.write_text("TANDEM_NATS_URL=nats://tandem:pw@10.0.0.1:4222\nTANDEM_NAMESPACE=prod\n")
    args = build_parser().parse_args(["join", "--connect", str(connect), "--host-name", "twin",
                                      "--state-dir", str(tmp_path / "state"), *flags])
    return settings_from_args(args.settings_class, args), {"TANDEM_NATS_URL": "nats://tandem:pw@10.0.0.1:4222",
                                                           "TANDEM_NAMESPACE": "prod"}


def test_the_host_id_is_made_once_and_kept_in_the_state_directory(tmp_path):
    first = load_host_id(tmp_path / "join-prod")
    assert (tmp_path / "join-prod" / HOST_ID_FILE).read_text().strip() == first
    assert load_host_id(tmp_path / "join-prod") == first  # a restarted join is the same host
    assert load_host_id(tmp_path / "other") != first  # a clone with a state directory of its own is not
    assert sorted(p.name for p in (tmp_path / "join-prod").iterdir()) == [HOST_ID_FILE]  # no leftovers
    (tmp_path / "join-prod" / HOST_ID_FILE).write_text("not an id!\n")
    with pytest.raises(CliError, match="holds no host id"):
        load_host_id(tmp_path / "join-prod")


def test_another_hosts_live_entries_under_our_worker_ids_conflict_and_ours_do_not():
    ours, theirs = "a1b2c3", "d4e5f6"
    entries = [entry("prod-twin-decode-1", theirs), entry("prod-twin-prefill-1", None),  # an older worker
               entry("prod-twin-decode-2", ours), entry("prod-other-decode-1", theirs)]
    ids = ["prod-twin-decode-1", "prod-twin-decode-2", "prod-twin-prefill-1"]
    assert [e.worker_id for e in live_conflicts(entries, ids, ours)] == ["prod-twin-decode-1", "prod-twin-prefill-1"]
    assert live_conflicts(entries, ["prod-twin-decode-2"], ours) == []  # restarted on the same host
    assert live_conflicts(entries, ["prod-new-decode-1"], ours) == []


def test_the_refusal_is_one_line_naming_the_host_the_workers_and_their_last_beat():
    line = describe_conflict("twin", [entry("prod-twin-decode-1", "d4e5f6"), entry("prod-twin-decode-2", None,
                                                                                   heartbeat_at=0.0)], NOW)
    assert "\n" not in line and "'twin'" in line and "--host-name" in line, line
    assert "prod-twin-decode-1 (pid 4242 on twin, host id d4e5f6, last beat 1.5s ago)" in line, line
    assert "prod-twin-decode-2 (pid 4242 on twin, host id none, last beat at an unknown time)" in line, line


def test_ready_counts_only_entries_this_join_started():
    since = NOW - 10
    assert is_ready_here(entry("w", "ours", started_at=NOW - 5), "ours", since)
    assert not is_ready_here(entry("w", "theirs", started_at=NOW - 5), "ours", since)  # the other host's
    assert not is_ready_here(entry("w", "ours", started_at=NOW - 60), "ours", since)  # left by a crashed run
    assert not is_ready_here(entry("w", "ours", state="starting", started_at=NOW - 5), "ours", since)


def test_an_entry_without_a_host_id_still_parses_and_one_with_it_round_trips():
    old = entry("w", None).model_dump(mode="json")
    del old["host_id"]  # an older worker's, or a custom worker's
    assert WorkerInfo.model_validate(old).host_id is None
    info = entry("w", "a1b2c3")
    assert WorkerInfo.from_bytes(info.to_bytes()) == info and b'"host_id":"a1b2c3"' in info.to_bytes()


class RecordedChild:
    """Stands in for ``Child``: records the command line instead of starting a worker."""

    def __init__(self, name, argv, env, on_line):
        self.name, self.argv = name, argv


def test_the_join_passes_its_host_id_to_every_worker_and_tandem_up_passes_none(tmp_path, monkeypatch):
    monkeypatch.setattr(stack_module, "Child", RecordedChild)
    settings, connect = join_settings(tmp_path, "--decode", "1", "--prefill", "1")
    stack = Stack(spec_from_settings(settings, connect, "a1b2c3"))
    assert worker_ids_of(stack) == ["prod-twin-decode-1", "prod-twin-prefill-1"]
    for name, role in (("decode-1", "decode"), ("prefill-1", "prefill")):
        argv = stack._start_worker(name, role, {}).argv
        worker = build_parser().parse_args(argv[argv.index(role):])
        assert settings_from_args(worker.settings_class, worker).host_id == "a1b2c3", argv
    up = Stack(StackSpec(tmp_path / "up"))
    assert "--host-id" not in up._start_worker("decode-1", "decode", {}).argv


def test_the_exit_codes_are_the_errors_and_the_help_lists_7():
    assert EXIT_CREDENTIALS_REFUSED == NatsCredentialsRefused.exit_code
    assert EXIT_HOST_NAME_TAKEN == 7 and "; 7 another host's workers are live" in EXIT_CODES


def test_a_final_exit_is_not_restarted_whatever_its_code():
    policy = RestartPolicy(Backoff())
    policy.started("decode-1", 0.0)
    decision = policy.exited("decode-1", 5, 3.0, is_final=True)
    assert decision.restart_in_s is None and policy.due(1e9) == []
    assert decision.describe() == ("decode-1 exited (exit code 5) after 3.0s; not restarted (a restart cannot mend "
                                   "its cause)")


def exiting(name: str, code: int) -> Child:
    return Child(name, [sys.executable, "-c", f"raise SystemExit({code})"], {}, lambda *_: None)


def test_a_worker_refused_by_nats_stops_the_join_and_a_crashed_one_is_restarted(tmp_path):
    settings, connect = join_settings(tmp_path, "--decode", "2")  # restarts on (the default)
    stack = Stack(spec_from_settings(settings, connect, "a1b2c3"), on_line=lambda *_: None)
    assert stack.spec.restart_children and stack.spec.final_exit_codes == {EXIT_CREDENTIALS_REFUSED}
    now = time.monotonic()
    for name, code in (("decode-1", EXIT_CREDENTIALS_REFUSED), ("decode-2", 1)):
        stack._restarts.started(name, now)
        stack.children[name] = exiting(name, code)
        assert stack.children[name].wait(30)
    stack._supervise_once(now)  # records both exits; nothing is due yet (the crash waits its backoff)
    assert stack._restarts.due(now + 60) == ["decode-2"]
    assert refused_workers(stack) == ["decode-1"]


def test_releases_of_one_major_minor_line_mix_and_others_are_refused():
    from services.join.identity import release_mismatch

    assert release_mismatch("0.1.0", ["0.1.0", "0.1.9", "", "dev"]) is None  # patch releases, and services that do not say
    assert release_mismatch("0.1.0", []) is None
    why = release_mismatch("0.1.2", ["0.1.2", "0.2.0", "1.0.0"])
    assert "runs Tandem 0.2.0, 1.0.0 and this host 0.1.2" in why and "install the control plane's release" in why
