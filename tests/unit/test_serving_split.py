"""bench.serving_split's readings: metrics scraped from a Prometheus page, CPU time by process (named by
the service it runs) and by thread, and a process's tree; bench.attention's cases compute attention."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time

import torch

from loadtest.bench.attention import decode_cases, prefill_cases
from loadtest.bench.serving_split import cpu_seconds, process_tree, scrape, thread_cpu_seconds

PAGE = b"""# HELP tandem_engine_step_seconds one model step
# TYPE tandem_engine_step_seconds histogram
tandem_engine_step_seconds_bucket{le="0.01",service="decode"} 3.0
tandem_engine_step_seconds_sum{service="decode"} 0.5
tandem_engine_step_seconds_count{service="decode"} 20.0
tandem_worker_itl_seconds_sum 0.25
tandem_worker_itl_seconds_count 10.0
tandem_worker_ttft_seconds_sum 9.0
"""


def test_scrape_reads_the_step_and_itl_sums_and_counts():
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(PAGE)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        got = scrape(f"http://127.0.0.1:{server.server_address[1]}/metrics")
    finally:
        server.shutdown()
    assert got == {"tandem_engine_step_seconds_sum": 0.5, "tandem_engine_step_seconds_count": 20.0,
                   "tandem_worker_itl_seconds_sum": 0.25, "tandem_worker_itl_seconds_count": 10.0}


def test_cpu_time_by_process_and_by_thread():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in process_tree(os.getpid())
        deadline = time.process_time() + 0.2
        while time.process_time() < deadline:  # burn some CPU in this thread
            pass
        by_pid = cpu_seconds([os.getpid(), child.pid])
        assert set(by_pid) == {os.getpid(), child.pid}
        assert by_pid[os.getpid()][1] >= 0.2
        by_thread = thread_cpu_seconds(os.getpid())
        assert by_thread["main (event loop)"] >= 0.2
    finally:
        child.kill()
        child.wait()
    assert process_tree(child.pid) == [child.pid]  # gone: no children read


def test_bench_attention_cases_agree_with_their_baselines():
    torch.manual_seed(0)
    for calls in (prefill_cases(150, [128, 64, 32]), prefill_cases(20), decode_cases(3, 70)):
        base = calls.pop("baseline")()
        if base.dim() == 4:  # [B, H, q, D] from a plain SDPA call
            base = base[0].transpose(0, 1) if base.shape[0] == 1 and base.shape[2] > 1 else base[:, :, 0]
        assert calls
        for name, call in calls.items():  # every tile size; the C++ kernels where they build
            torch.testing.assert_close(call(), base, rtol=1e-5, atol=1e-5, msg=name)
