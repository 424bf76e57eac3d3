"""The NATS login's rotation without a server: the kept logins and their overlap, the files through
which ``tandem credentials`` asks ``tandem up``, the rolling restart's pace, the server's config."""

import json

import pytest

from services.stack.nats_login import KeptLogin
from services.stack.rotate import (CredentialsAnswer, CredentialsRequest, GatewayView, RollingRestart, send_request,
                                 take_request, wait_answer, withdraw_request, write_answer)
from services.stack.servers import Login, nats_config, with_login


def test_a_rotation_alternates_user_names_and_keeps_the_old_login_for_the_overlap():
    kept = KeptLogin.new("pw-1", [4222])
    rotated = kept.rotated("pw-2", now_s=100.0, overlap_s=60.0)
    assert rotated.logins == (Login("tandem-2", "pw-2"), Login("tandem", "pw-1")) and rotated.old_until_s == 160.0
    assert rotated.is_overlapping and not rotated.is_due(159.9) and rotated.is_due(160.0)
    finished = rotated.finished()
    assert finished.logins == (Login("tandem-2", "pw-2"),) and finished.old_until_s is None
    assert not finished.is_due(1e12)
    assert finished.rotated("pw-3", 200.0, 1.0).current == Login("tandem", "pw-3")  # back to the first name
    with pytest.raises(AssertionError, match="finish it first"):
        rotated.rotated("pw-3", 120.0, 60.0)


def test_the_kept_login_round_trips_and_reads_the_file_written_before_rotation(tmp_path):
    rotated = KeptLogin.new("pw-1", [4222, 4223]).rotated("pw-2", 100.0, 60.0)
    rotated.save(tmp_path)
    assert (tmp_path / KeptLogin.FILE).stat().st_mode & 0o777 == 0o600
    assert KeptLogin.load(tmp_path, 2) == rotated
    assert KeptLogin.load(tmp_path, 3) is None  # another number of members
    (tmp_path / KeptLogin.FILE).write_text(json.dumps({"password": "pw-0", "ports": [4222]}))
    assert KeptLogin.load(tmp_path, 1) == KeptLogin((Login("tandem", "pw-0"),), (4222,))
    (tmp_path / KeptLogin.FILE).write_text("{not json")
    assert KeptLogin.load(tmp_path, 1) is None


def test_a_request_is_taken_once_and_answered_by_its_id(tmp_path):
    request = send_request(tmp_path, CredentialsRequest("rotate", overlap_s=30.0))
    taken = take_request(tmp_path)
    assert taken == request and request.request_id and take_request(tmp_path) is None
    write_answer(tmp_path, CredentialsAnswer("another-request", True, "not this one"))
    assert wait_answer(tmp_path, request, timeout_s=0.2) is None
    write_answer(tmp_path, CredentialsAnswer(request.request_id, False, "refused"))
    assert wait_answer(tmp_path, request, timeout_s=1.0) == CredentialsAnswer(request.request_id, False, "refused")


def test_an_unanswered_request_is_withdrawn_and_a_garbled_one_dropped(tmp_path):
    request = send_request(tmp_path, CredentialsRequest("finish"))
    assert wait_answer(tmp_path, request, timeout_s=0.2) is None
    assert take_request(tmp_path) is None  # a tandem up started later does not act on it unasked
    other = send_request(tmp_path, CredentialsRequest("finish"))
    withdraw_request(tmp_path, request)  # not ours any more: left alone
    assert take_request(tmp_path) == other
    (tmp_path / "credentials-request.json").write_text("{")
    assert take_request(tmp_path) is None and not (tmp_path / "credentials-request.json").exists()


def test_a_rolling_restart_waits_until_the_process_is_listed_and_the_workers_are_back():
    before = GatewayView(num_ready_decode=2, num_ready_prefill=1, pids=frozenset({10, 11}))
    roll = RollingRestart(["kv-index"], step_timeout_s=10.0, last_pid=12, before=before, step_deadline_s=10.0)
    assert roll.is_waiting(None, now_s=5.0)  # the gateway itself restarting
    assert roll.is_waiting(GatewayView(2, 1, frozenset({10, 11})), now_s=5.0)  # 12 not listed yet
    assert roll.is_waiting(GatewayView(1, 1, frozenset({10, 12})), now_s=5.0)  # a decode worker still away
    assert not roll.is_waiting(GatewayView(2, 1, frozenset({10, 12})), now_s=5.0)
    assert not roll.is_waiting(None, now_s=10.0)  # the step timed out: on with the next
    assert not RollingRestart(["gateway"]).is_waiting(None, now_s=0.0)  # no gateway answered before it


def test_the_config_lists_both_logins_in_the_overlap_and_the_url_carries_the_current_one(tmp_path):
    text = nats_config(server_name="tandem", host="127.0.0.1", port=4222, store_dir=tmp_path, user="tandem-2",
                       password="new", also_accepted=[Login("tandem", "old")])
    assert ('authorization { users = [{user: "tandem-2", password: "new"}, {user: "tandem", password: "old"}] }'
            in text)
    alone = nats_config(server_name="tandem", host="127.0.0.1", port=4222, store_dir=tmp_path, user="tandem-2",
                        password="new", listed=True)
    assert 'authorization { users = [{user: "tandem-2", password: "new"}] }' in alone
    assert (with_login("tls://tandem:old@10.0.0.1:4222", Login("tandem-2", "n/w"))
            == "tls://tandem-2:n%2Fw@10.0.0.1:4222")
    assert with_login("nats://127.0.0.1:4222", None) == "nats://127.0.0.1:4222"
