"""loadtest.tools.harness: sides take turns, each side's best repeat is compared, and the probes read
a live HTTP server."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loadtest.tools import harness
from loadtest.tools.harness import (Repeat, Side, alternate, best, comparison, is_healthy, log_to, ratio,
                                    report_comparison, status, take_turns, wait_healthy, warm_up)
from loadtest.tools.stats import RequestResult, summarize
from loadtest.tools.workload import RequestSpec
from services.stack.servers import free_port


def test_take_turns_runs_each_side_once_a_round_in_order():
    calls = []
    runs = take_turns({"on": lambda i: calls.append(("on", i)) or f"on{i}",
                       "off": lambda i: calls.append(("off", i)) or f"off{i}"}, 3)
    assert calls == [("on", 0), ("off", 0), ("on", 1), ("off", 1), ("on", 2), ("off", 2)]
    assert runs == {"on": ["on0", "on1", "on2"], "off": ["off0", "off1", "off2"]}


def results(tokens: int) -> list[RequestResult]:
    """One request that took 1 s and produced ``tokens`` tokens."""
    r = RequestResult(0, 0.0, 0.0, first_token_s=0.1, finished_s=1.0, num_output_tokens=tokens,
                      token_times_s=[0.1 + 0.9 * i / max(1, tokens - 1) for i in range(tokens)])
    return [r]


def test_warm_up_waits_for_each_side_before_its_load():
    calls = []
    sides = {name: Side(run=lambda specs, progress, n=name: calls.append((n, "run", len(specs), progress)) or [],
                        ready=lambda n=name: calls.append((n, "ready")))
             for name in ("stack", "engine")}
    warm_up(sides, [RequestSpec(0, 0.0, "hi", 4)] * 2)
    assert calls == [("stack", "ready"), ("stack", "run", 2, False), ("engine", "ready"), ("engine", "run", 2, False)]


def test_alternate_records_summary_results_and_load_before_each_repeat(monkeypatch):
    loads = iter(range(10))
    monkeypatch.setattr(harness.os, "getloadavg", lambda: (float(next(loads)), 0.0, 0.0))
    tokens = {"on": iter([10, 30]), "off": iter([20, 5])}
    order = []
    sides = {name: Side(run=lambda specs, progress, n=name: order.append((n, progress)) or results(next(tokens[n])))
             for name in ("on", "off")}
    runs = alternate(sides, [RequestSpec(0, 0.0, "hi", 4)], 2, {"slo_ttft_s": 1.0, "slo_tpot_s": 1.0}, progress=False)
    assert order == [("on", False), ("off", False), ("on", False), ("off", False)]
    assert [r.load_average_1m for r in runs["on"]] == [0.0, 2.0]
    assert [r.load_average_1m for r in runs["off"]] == [1.0, 3.0]
    assert [r.summary["output_token_throughput"] for r in runs["on"]] == pytest.approx([10.0, 30.0])
    assert best(runs)["on"] is runs["on"][1] and best(runs)["off"] is runs["off"][0]


def test_comparison_compares_the_best_repeats_and_keeps_the_report_fields_in_order(monkeypatch):
    monkeypatch.setattr(harness.os, "cpu_count", lambda: 2)

    def repeat(throughput: float, load: float) -> Repeat:
        return Repeat({"output_token_throughput": throughput}, [], load)

    runs = {"on": [repeat(9.0, 0.5), repeat(10.0, 0.7)], "off": [repeat(20.0, 0.6), repeat(16.0, 0.8)]}

    def compare(on: dict, off: dict) -> dict:
        return {"throughput_ratio": on["output_token_throughput"] / off["output_token_throughput"]}

    report = comparison(runs, "on", "off", compare, otlp_exports=3)
    assert list(report) == ["throughput_ratio", "cpu_count", "repeats", "otlp_exports", "load_average_1m_before",
                            "all_repeats"]
    assert report["throughput_ratio"] == 0.5  # 10 / 20: each side's best, not the same repeat's
    assert report["cpu_count"] == 2 and report["repeats"] == 2 and report["otlp_exports"] == 3
    assert report["load_average_1m_before"] == {"on": [0.5, 0.7], "off": [0.6, 0.8]}
    assert report["all_repeats"] == [{"throughput_ratio": 9.0 / 20.0}, {"throughput_ratio": 10.0 / 16.0}]


def test_report_comparison_prints_the_best_repeats_and_writes_them_under_their_titles(tmp_path, capsys):
    def repeat(tokens: int) -> Repeat:
        rs = results(tokens)
        return Repeat(summarize(rs, slo_ttft_s=1.0, slo_tpot_s=1.0), rs, 0.0)

    runs = {"on": [repeat(9), repeat(10)], "off": [repeat(20)]}

    def compare(on: dict, off: dict) -> dict:
        return {"throughput_ratio": on["output_token_throughput"] / off["output_token_throughput"],
                "added_ttft_p50_ms": 0.0, "meets_targets": False}

    result = report_comparison(tmp_path, "demo", {"model": "m"}, runs, compare,
                               {"on": ("feature on ", "on (title)"), "off": ("feature off", "off (title)")},
                               detail=lambda r: f" (ratio {r['throughput_ratio']:.1f})", exports=3)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("feature on : 1/1 ok") and lines[1].startswith("feature off: 1/1 ok")
    assert lines[2] == "throughput ratio 0.500, added TTFT p50 0.0 ms (ratio 0.5) -> misses the targets"
    assert lines[3] == f"wrote {tmp_path / 'demo.json'} {tmp_path / 'demo.png'}"
    written = json.loads((tmp_path / "demo.json").read_text())
    assert written["config"] == {"model": "m"} and written["comparison"] == result and result["exports"] == 3
    assert list(written["runs"]) == ["on (title)", "off (title)"]
    assert written["runs"]["on (title)"]["summary"] == runs["on"][1].summary


def test_ratio_is_none_without_both_values():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(3.0, None) is None and ratio(3.0, 0.0) is None


def test_log_to_writes_each_line_under_its_childs_name():
    lines = []

    class File:
        def write(self, text: str) -> None:
            lines.append(text)

    log_to(File())("gateway", "ready")
    log_to(File(), "on  ")("decode-1", "step")
    assert lines == [f"{'gateway':<12}| ready\n", f"on  {'decode-1':<12}| step\n"]


@pytest.fixture
def server():
    """A server whose /health answers 200 and /status a page; anything else 503."""
    page = {"workers": [{"info": {"worker_id": "w1"}, "load": {"num_running": 2}}]}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = json.dumps(page).encode() if self.path == "/status" else b""
            self.send_response(200 if self.path in ("/health", "/status") else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1], page
    httpd.shutdown()
    httpd.server_close()


def test_probes_read_a_live_server(server):
    port, page = server
    assert is_healthy(port) and is_healthy(f"http://127.0.0.1:{port}/")
    assert status(f"http://127.0.0.1:{port}") == page
    assert not is_healthy(free_port(), timeout_s=1.0)  # nothing listening


def test_waiting_for_a_started_server_ends_when_it_exits_or_its_time_is_up():
    port = free_port()  # nothing listens there
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match=r"peer exited with 3 before becoming healthy \(its log: p.log\)"):
        wait_healthy(exited, port, 30, "peer", poll_s=0.05, log="p.log")
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(TimeoutError, match="peer on port .* not healthy after 0s"):
        wait_healthy(hung, port, 0.2, "peer", poll_s=0.05)
    assert hung.wait(10) != 0  # killed, not left running
