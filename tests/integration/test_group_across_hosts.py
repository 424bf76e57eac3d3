"""A tensor-parallel group spanning two hosts (network namespaces of the lab, tests/integration/netlab.py):
rank 0 on host ``a`` (`tandem complete --tp 2 --group-local-ranks 1`) waits at its group address,
rank 1 on host ``b`` joins it with `tandem rank --join`, reads the engine config from rank 0's
store and loads its shard; their collectives cross the lab network (gloo over TCP, no shared memory).
Greedy text equal to one process's, both ranks exit 0; rank 1 SIGKILLed mid-generation ends rank 0
with an error and leaves no process on either host.

And the same group as a worker of a cluster: a control plane on ``cp`` (`tandem up`, one worker of
its own), host ``a`` joined with the group's rank 0 (`tandem join --decode-tp 2 --group-local-ranks
1`), host ``b`` with its rank 1 (`tandem join --group-join`). The group registers once, with its
address; rank 1 SIGKILLed mid-stream: the stream finishes on cp's worker, the broken group leaves the
registry, and both joins bring it back by themselves (rank 0 restarted, rank 1 rejoining)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from netlab import UCX_NETWORK_ONLY, Lab, UnixHTTPConnection, available, unix_request
from stack_helpers import wait_for

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.long]

if (why := available()) is not None:
    pytest.skip(f"no network lab here: {why}", allow_module_level=True)

PORT = 29650
PROMPT = "A steam engine turns a wheel by"
TANDEM = [sys.executable, "-m", "services.cli"]
ENGINE = ["--dtype", "float32", "--temperature", "0", "--kv-cache-memory", "64MiB", "--num-threads", "1"]


def complete(model, max_tokens: int, *extra: str) -> list[str]:
    return [*TANDEM, "complete", "--model", str(model), *ENGINE, "--max-tokens", str(max_tokens), *extra, PROMPT]


def test_a_group_across_two_hosts_gives_one_processs_text(heads_32):
    alone = subprocess.run(complete(heads_32, 16), capture_output=True, text=True, timeout=300, check=True).stdout
    with Lab() as lab:
        a, b = lab.add_host("a"), lab.add_host("b")
        rank0, _ = a.popen_ready(complete(heads_32, 16, "--tp", "2", "--group-local-ranks", "1", "--group-host",
                                          a.address, "--group-port", str(PORT)),
                                 "waiting for ranks 1-1 of the group", timeout_s=120)
        rank1, joined = b.popen_ready([*TANDEM, "rank", "--join", f"{a.address}:{PORT}", "--rank", "1", "--size", "2"],
                                      r"joins the group at \S+ from (\S+)", timeout_s=120)
        assert joined.group(1) == b.address  # its end of the collectives is on its own host's network
        assert rank0.wait(300) == 0 and rank1.wait(60) == 0, (rank0.lines[-20:], rank1.lines[-20:])
        assert len(alone.strip()) > 20 and alone.strip() in "".join(rank0.lines)  # its stdout, among its logs
        assert not a.pids() and not b.pids()


def test_a_rank_killed_on_the_other_host_ends_the_group(heads_32):
    with Lab() as lab:
        a, b = lab.add_host("a"), lab.add_host("b")
        rank0, _ = a.popen_ready(complete(heads_32, 5000, "--ignore-eos", "--tp", "2",
                                          "--group-local-ranks", "1", "--group-host", a.address,
                                          "--group-port", str(PORT)),
                                 "waiting for ranks 1-1 of the group", timeout_s=120)
        rank1, _ = b.popen_ready([*TANDEM, "rank", "--join", f"{a.address}:{PORT}", "--rank", "1", "--size", "2"],
                                 "KV shard of", timeout_s=120)
        wait_for(lambda: rank0.poll() is not None or any("KV cache:" in line for line in rank0.lines), 120,
                 "rank 0's engine up (it generates from there on)")
        assert rank0.poll() is None, rank0.lines[-20:]  # 5,000 tokens take far longer than the start
        rank1.send_signal(signal.SIGKILL)
        assert rank0.wait(120) != 0, rank0.lines[-20:]
        assert not a.pids() and not b.pids()


GATEWAY_PORT = 8000
SMOLLM2 = "smollm2-135m"  # the default model
TTL_S = 3.0
LONG = 400  # tokens of a stream that is still running when a rank dies
HOST_ENGINE = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--compile", "off", "--num-threads", "1"]


def _stream(socket_path: str, model: str, prompt: str, max_tokens: int) -> tuple[http.client.HTTPResponse, str]:
    conn = UnixHTTPConnection(socket_path, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    return resp, resp.getheader("X-Tandem-Worker")


def _events(resp, count: int | None = None) -> list[dict]:
    events = []
    while count is None or len(events) < count:
        line = resp.readline().decode()
        if not line:
            break
        if line.startswith("data: ") and line.strip() != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


def _stream_on(socket_path: str, model: str, worker_id: str, max_tokens: int, held: list):
    """A stream admitted to ``worker_id``, and its prompt. Each one admitted elsewhere stays open in
    ``held`` beside a long one sent after it, so that the other worker gets busier until admission
    picks ``worker_id`` (each prompt is new: a repeated one would follow its cached prefix)."""
    seen = []
    for attempt in range(12):
        prompt = f"{PROMPT} ({attempt} {uuid.uuid4().hex[:6]})"
        resp, worker = _stream(socket_path, model, prompt, max_tokens)
        if worker == worker_id:
            return resp, prompt
        seen.append(worker)
        held.append((resp, max_tokens))
        held.append((_stream(socket_path, model, f"{PROMPT} [{uuid.uuid4().hex[:6]}]", LONG)[0], LONG))
    raise AssertionError(f"no stream admitted to {worker_id} in 12 tries: {seen}; {_status(socket_path)}")


def _finished_whole(events: list[dict], max_tokens: int) -> bool:
    """No error, one finish (length) and ``max_tokens`` tokens: the stream lost nothing."""
    finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    return (not [e for e in events if "error" in e] and finish == ["length"]
            and events[-1].get("usage", {}).get("completion_tokens") == max_tokens)


def _text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))


def _status(socket_path: str) -> dict:
    return json.loads(unix_request(socket_path, "GET", "/status")[2])


def _entry(socket_path: str, worker_id: str) -> dict | None:
    return next((w["info"] for w in _status(socket_path)["workers"] if w["info"]["worker_id"] == worker_id), None)


def _rank_pids(host) -> list[int]:
    """The `tandem rank` processes in ``host``."""
    def is_rank(pid: int) -> bool:
        try:
            return b"\0rank\0--join" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # gone since it was listed
            return False

    return [pid for pid in host.pids() if is_rank(pid)]


@contextlib.contextmanager
def greedy_chat(model: str):
    """``text(prompt, n)``: ``model``'s greedy chat text in one process of this test."""
    from stack_helpers import greedy_text, reference_engine

    with reference_engine(model, 1024, 64 << 20) as engine:
        tok = engine.tokenizer

        def text(prompt: str, max_tokens: int) -> str:
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))
            return greedy_text(engine, ids, max_tokens, ignore_eos=True)

        yield text


@pytest.fixture(scope="module")
def one_process(heads_32):
    with greedy_chat(str(heads_32)) as text:
        yield text


@pytest.fixture(scope="module")
def smollm2_one_process():
    with greedy_chat(SMOLLM2) as text:
        yield text


def test_a_group_of_two_joined_hosts_serves_and_comes_back_after_a_rank_dies(heads_32, one_process, tmp_path):
    """About three minutes on 2 cores: a control plane, a worker, and the group's two ranks."""
    namespace = f"g{uuid.uuid4().hex[:8]}"
    env = {**os.environ, **UCX_NETWORK_ONLY, "TQDM_DISABLE": "1"}
    with Lab() as lab:
        cp, a, b = lab.add_host("cp"), lab.add_host("a"), lab.add_host("b")
        cp.popen_ready([*TANDEM, "up", "--model", heads_32, "--decode", "1", "--nats-host", cp.address,
                        "--host", cp.address, "--port", GATEWAY_PORT, "--state-dir", tmp_path / "cp",
                        "--namespace", namespace, "--registry-ttl-s", TTL_S, "--max-local-prefill-tokens", "0",
                        *HOST_ENGINE], r"\| ready: http", timeout_s=300, env=env)
        connect = tmp_path / "cp" / namespace / "connect.env"
        join = [*TANDEM, "join", "--connect", connect, "--model", heads_32, *HOST_ENGINE]
        leader, _ = a.popen_ready([*join, "--host-name", "a", "--state-dir", tmp_path / "a", "--decode-tp", "2",
                                   "--group-local-ranks", "1", "--group-host", a.address, "--group-port", PORT,
                                   "--restart-max-backoff-s", "2"],
                                  "waiting for ranks 1-1 of the group", timeout_s=300, env=env)
        ranks, _ = b.popen_ready([*join, "--host-name", "b", "--state-dir", tmp_path / "b",
                                  "--group-join", f"{a.address}:{PORT}", "--restart-max-backoff-s", "2"],
                                 "joins the group at", timeout_s=120, env=env)
        wait_for(lambda: any("| ready:" in line for line in leader.lines), 300, "host a's group registered")
        socket_path = cp.bridge(tmp_path / "gateway.sock", GATEWAY_PORT)

        group_id = f"{namespace}-a-decode-1"
        info = wait_for(lambda: _entry(socket_path, group_id), 30, "the group in the gateway's /status")
        assert info["tensor_parallel_size"] == 2 and info["rank_pids"] == []  # rank 1 is not on a's host
        assert info["group_address"] == f"{a.address}:{PORT}"
        model, held = str(heads_32), []
        resp, prompt = _stream_on(socket_path, model, group_id, 24, held)
        assert _text(_events(resp)) == one_process(prompt, 24)

        resp, _ = _stream_on(socket_path, model, group_id, LONG, held)
        events = _events(resp, 4)
        (rank1,) = _rank_pids(b)
        os.kill(rank1, signal.SIGKILL)  # the group breaks at its next step
        events += _events(resp)
        assert _finished_whole(events, LONG), events[-3:]  # finished on cp's worker
        wait_for(lambda: (_entry(socket_path, group_id) or {}).get("pid") != info["pid"], 4 * TTL_S + 10,
              "the broken group gone from the registry")
        # both joins bring it back: a restarts rank 0, b's restarted rank 1 joins it
        back = wait_for(lambda: (e := _entry(socket_path, group_id)) and e["pid"] != info["pid"]
                     and e["state"] == "ready" and e, 300, "the group back in the registry")
        assert back["num_restarts"] >= 1 and _rank_pids(b) and _rank_pids(b) != [rank1]
        resp, prompt = _stream_on(socket_path, model, group_id, 24, held)
        assert _text(_events(resp)) == one_process(prompt, 24)
        for other, max_tokens in held:  # every stream sent, wherever it ran: none lost
            assert _finished_whole(_events(other), max_tokens)
        for proc in (ranks, leader):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(90) == 0, proc.lines[-20:]
        wait_for(lambda: not a.pids() and not b.pids(), 30, "no process left on a or b")


def test_a_plan_over_two_nodes_starts_as_written(smollm2_one_process, tmp_path, plan_file):
    """A plan whose decode worker has one pipeline stage on each of two nodes: `tandem up --plan-node
    a` leads it, `tandem join --plan-node b` runs its second stage; the default model (SmolLM2, 15
    layers a stage) serves one process's float32 greedy text."""
    plan = plan_file([("d0", "decode", ["a/gpu0", "b/gpu0"], 1, 2)], model=SMOLLM2, output_tokens_per_s=10.0)
    namespace = f"p{uuid.uuid4().hex[:8]}"
    env = {**os.environ, **UCX_NETWORK_ONLY, "TQDM_DISABLE": "1"}
    with Lab() as lab:
        a, b = lab.add_host("a"), lab.add_host("b")
        plan_flags = ["--plan", plan, "--group-port", PORT, "--model", SMOLLM2, *HOST_ENGINE]
        up, _ = a.popen_ready([*TANDEM, "up", *plan_flags, "--plan-node", "a", "--group-host", a.address,
                               "--nats-host", a.address, "--host", a.address, "--port", GATEWAY_PORT,
                               "--state-dir", tmp_path / "a", "--namespace", namespace, "--registry-ttl-s", TTL_S],
                              "waiting for ranks 1-1 of the group", timeout_s=300, env=env)
        connect = tmp_path / "a" / namespace / "connect.env"
        b.popen_ready([*TANDEM, "join", "--connect", connect, *plan_flags, "--plan-node", "b", "--plan-leaders",
                       f"a={a.address}", "--host-name", "b", "--state-dir", tmp_path / "b"],
                      "joins the group at", timeout_s=120, env=env)
        wait_for(lambda: any("| ready: http" in line for line in up.lines), 300, "tandem up ready")
        socket_path = a.bridge(tmp_path / "gateway.sock", GATEWAY_PORT)
        worker_id = f"{namespace}-decode-1"
        info = wait_for(lambda: _entry(socket_path, worker_id), 30, "the planned worker in /status")
        assert info["pipeline_parallel_size"] == 2 and info["group_address"] == f"{a.address}:{PORT}"
        resp, prompt = _stream_on(socket_path, SMOLLM2, worker_id, 24, [])
        assert _text(_events(resp)) == smollm2_one_process(prompt, 24)
