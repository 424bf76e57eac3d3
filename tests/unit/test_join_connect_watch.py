"""``tandem join`` takes over a connect file copied over its own while it runs
(``services.join.watch.ConnectWatch``): a new NATS login that works restarts the workers with it one
at a time, each after the one before registered again; a file that cannot be used, or a login that
is refused, leaves the workers as they are."""

import threading

import pytest

from services.framework.errors import CliError
from services.join.service import read_connect_file
from services.join.watch import ConnectWatch

OLD = "nats://tandem:old@10.0.0.1:4222"
NEW = "nats://tandem-2:new@10.0.0.1:4222"


class FakeStack:
    def __init__(self, names):
        self.names, self.restarted, self.nats = list(names), [], None

    def rolling_order(self):
        return list(self.names)

    def use_nats(self, url, ca):
        self.nats = (url, ca)

    def restart_child(self, name, drain_timeout_s):
        self.restarted.append(name)
        return object()

    def worker_id(self, name):
        return f"ns-host-{name}"


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setattr("services.join.watch.CHECK_INTERVAL_S", 0.0)
    path = tmp_path / "connect.env"
    path.write_text(f"TANDEM_NATS_URL={OLD}\nTANDEM_NAMESPACE=ns\n")
    stack, logins, waits = FakeStack(["decode-1", "prefill-1"]), [], []
    gate = threading.Event()

    def check_login(url, ca):
        logins.append(url)
        if "refused" in url:
            raise CliError("NATS refused the credentials", 5)

    def wait_registered(worker_id, since):
        waits.append(worker_id)
        assert gate.wait(10)

    watch = ConnectWatch(stack, path, read_connect_file(path), read_connect_file, check_login, wait_registered, 5.0)
    return watch, path, stack, logins, waits, gate


def poll_until(watch, cond, n=200):
    for i in range(n):
        watch.poll(float(i))
        if cond():
            return
        threading.Event().wait(0.01)
    raise AssertionError("condition not reached")


def test_a_new_login_restarts_the_workers_one_at_a_time(setup, capsys):
    watch, path, stack, logins, waits, gate = setup
    watch.poll(0.0)
    assert stack.restarted == [] and logins == []  # the same file: nothing to do
    path.write_text(f"TANDEM_NATS_URL={NEW}\nTANDEM_NAMESPACE=ns\n")
    poll_until(watch, lambda: waits == ["ns-host-decode-1"])
    assert logins == [NEW] and stack.nats == (NEW, None) and stack.restarted == ["decode-1"]
    for i in range(5):  # decode-1 has not registered again: prefill-1 waits
        watch.poll(100.0 + i)
    assert stack.restarted == ["decode-1"]
    gate.set()
    poll_until(watch, lambda: stack.restarted == ["decode-1", "prefill-1"] and len(waits) == 2)
    poll_until(watch, lambda: "every worker of this host runs with the new NATS login" in capsys.readouterr().out)
    assert watch.num_applied == 1


def test_a_refused_login_or_an_unusable_file_leaves_the_workers_alone(setup, capsys):
    watch, path, stack, logins, _, _ = setup
    path.write_text("TANDEM_NATS_URL=nats://tandem:refused@10.0.0.1:4222\n")
    watch.poll(0.0)
    assert logins and stack.restarted == [] and stack.nats is None
    assert "its NATS login does not work" in capsys.readouterr().out
    path.write_text("garbage\n")
    watch.poll(1.0)
    assert "cannot be used" in capsys.readouterr().out and stack.restarted == []


def test_a_changed_namespace_says_to_restart_the_join(setup, capsys):
    watch, path, stack, logins, _, _ = setup
    path.write_text(f"TANDEM_NATS_URL={OLD}\nTANDEM_NAMESPACE=other\n")
    watch.poll(0.0)
    assert "TANDEM_NAMESPACE changed: restart tandem join to apply it" in capsys.readouterr().out
    assert logins == [] and stack.restarted == []
