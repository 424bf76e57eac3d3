"""A tensor-parallel group spanning two hosts (network namespaces of the lab, tests/integration/netlab.py):
rank 0 on host ``a`` (`tandem complete --tp 2 --group-local-ranks 1`) waits at its group address,
rank 1 on host ``b`` joins it with `tandem rank --join`, reads the engine config from rank 0's
store and loads its shard; their collectives cross the lab network (gloo over TCP, no shared memory).
Greedy text equal to one process's, both ranks exit 0; rank 1 SIGKILLed mid-generation ends rank 0
with an error and leaves no process on either host."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from netlab import Lab, available

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.long]

if (why := available()) is not None:
    pytest.skip(f"no network lab here: {why}", allow_module_level=True)

PORT = 29650
PROMPT = "A steam engine turns a wheel by"
TANDEM = [sys.executable, "-m", "services.cli"]
ENGINE = ["--dtype", "float32", "--temperature", "0", "--kv-cache-memory", "64MiB", "--num-threads", "1"]


@pytest.fixture(scope="module")
def heads_32(tmp_path_factory):
    """A 2-layer random model with 32 heads and 8 KV heads and SmolLM2's tokenizer (TP=2 splits it)."""
    path = tmp_path_factory.mktemp("heads-32")
    subprocess.run([sys.executable, "-m", "loadtest.tools.synth_model", "--shape", "heads-32", "--format", "hf",
                    "--out", str(path)], check=True, capture_output=True)
    return path


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
        deadline = time.monotonic() + 120
        while not any("KV cache:" in line for line in rank0.lines):  # the engine is up: it generates now
            assert rank0.poll() is None and time.monotonic() < deadline, rank0.lines[-20:]
            time.sleep(0.2)
        time.sleep(2.0)
        assert rank0.poll() is None  # 5,000 tokens take far longer than this
        rank1.send_signal(signal.SIGKILL)
        assert rank0.wait(120) != 0, rank0.lines[-20:]
        assert not a.pids() and not b.pids()
