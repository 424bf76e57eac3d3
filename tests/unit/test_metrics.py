"""The metric objects of every service, read back through the Prometheus text parser (what a scraper
sees), and the dashboard's recent history."""

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.metrics import GatewayMetrics
from shared.engine.engine import EngineStats
from shared.protocol.workers import ScalingAction, ScalingDecisionRecord, WorkerInfo, WorkerLoad, WorkerStatus
from services.worker.metrics import WorkerMetrics
from shared.telemetry.families import AdmissionMetrics, AutoscalerMetrics, KvIndexMetrics
from shared.telemetry.measure import percentile
from shared.telemetry.metrics import RecentMean, exposition, sample_total, service_registry
from shared.telemetry.series import MAX_SAMPLES_PER_SECOND, RecentSeries
from shared.transfer.base import TransferStats


def scrape(registry) -> tuple[str, dict[str, str]]:
    """The exposition text and family name → type, as the library's parser reads them."""
    text = exposition(registry)[0].decode()
    return text, {f.name: f.type for f in text_string_to_metric_families(text)}


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_gateway_metrics_parse_with_conventional_names_and_values():
    clock = Clock()
    m = GatewayMetrics(clock=clock)
    m.observe_response(200)
    m.observe_response(429)
    m.observe_response(429)
    m.observe_ttft(0.2, "gold")
    for _ in range(3):
        m.observe_itl(0.02)
    m.observe_finished(0.3, "gold", 4)
    m.observe_rejected("bulk", "shedding")
    m.observe_admitted("gold")
    m.observe_migration()
    m.observe_phases({"admission": 0.004, "queue": 0.05, "prefill": 0.12})
    m.observe_phases({"queue": 0.5})
    text, types = scrape(m.registry)
    assert types["tandem_gateway_requests"] == "counter"
    assert types["tandem_gateway_ttft_seconds"] == types["tandem_request_phase_seconds"] == "histogram"
    assert sample_total(text, "tandem_gateway_requests_total", status="429") == 2
    assert sample_total(text, "tandem_gateway_ttft_seconds_count", tier="gold") == 1
    assert sample_total(text, "tandem_gateway_ttft_seconds_bucket", tier="gold", le="0.25") == 1
    assert sample_total(text, "tandem_gateway_ttft_seconds_bucket", tier="gold", le="0.1") == 0
    assert sample_total(text, "tandem_gateway_itl_seconds_count") == 3
    assert sample_total(text, "tandem_gateway_e2e_seconds_sum", tier="gold") == 0.3
    assert sample_total(text, "tandem_gateway_generated_tokens_total") == 4
    assert sample_total(text, "tandem_gateway_rejected_total", reason="shedding", tier="bulk") == 1
    assert sample_total(text, "tandem_gateway_admitted_total", tier="gold") == 1
    assert sample_total(text, "tandem_gateway_migrations_total") == 1
    assert sample_total(text, "tandem_request_phase_seconds_count", phase="queue") == 2
    assert sample_total(text, "tandem_request_phase_seconds_sum", phase="queue") == 0.55
    assert sample_total(text, "tandem_request_phase_seconds_count", phase="prefill") == 1
    assert sample_total(text, "tandem_request_phase_seconds_count", phase="transfer") is None
    assert "_created" not in text  # switched off: noise on every scrape
    # the same observations feed the dashboard's history
    point = m.series.points(clock.now, 5)[-1]
    assert (point.ttft_p50, point.itl_p99, point.rejected) == (0.2, 0.02, {"bulk": 1})


def test_in_flight_goes_up_and_down():
    m = GatewayMetrics()
    m.observe_started()
    m.observe_started()
    m.observe_ended()
    text, _ = scrape(m.registry)
    assert m.num_in_flight == 1 and sample_total(text, "tandem_gateway_in_flight") == 1
    m.observe_batch_lines(3)
    text, _ = scrape(m.registry)
    assert m.num_batch_lines == 3 and sample_total(text, "tandem_gateway_batch_lines_in_flight") == 3
    assert m.num_in_flight == 1  # batch lines are not online requests


def test_every_service_registry_has_process_and_restart_families():
    text, types = scrape(service_registry("admission", "admission-h-1", num_restarts=3))
    assert sample_total(text, "tandem_service_restarts_total") == 3
    assert sample_total(text, "tandem_service_info", service="admission", instance="admission-h-1") == 1
    assert "process_resident_memory_bytes" in types


def engine_stats(**overrides) -> EngineStats:
    fields = dict(num_running=3, num_waiting=2, num_blocks_total=100, num_blocks_used=25, num_cached_blocks=10,
                  max_num_seqs=8, num_preemptions=1, num_steps=40, num_prompt_tokens=400,
                  num_cached_prompt_tokens=100, num_generated_tokens=60)
    return EngineStats(**{**fields, **overrides})


def test_worker_metrics_read_engine_role_and_transfer_at_scrape_time():
    m = WorkerMetrics()
    stats, flips = [engine_stats()], [0]
    transfer = TransferStats(num_bytes_sent=0, num_bytes_received=4096, num_transfers=0)
    m.bind(lambda: stats[0], lambda: transfer, lambda: flips[0])
    m.observe_step(4, 130, 0.02)
    m.observe_step(1, 1, 0.004)
    text, types = scrape(m.registry)
    assert sample_total(text, "tandem_worker_kv_cache_usage_ratio") == 0.25
    assert sample_total(text, "tandem_worker_prefix_hit_ratio") == 0.25
    assert sample_total(text, "tandem_worker_running_requests") == 3
    assert sample_total(text, "tandem_worker_waiting_requests") == 2
    assert sample_total(text, "tandem_engine_batch_size_sum") == 5
    assert sample_total(text, "tandem_engine_step_seconds_count") == 2
    assert sample_total(text, "tandem_kv_transfer_bytes_total", direction="received") == 4096
    assert types["tandem_worker_prompt_tokens"] == "counter"
    assert "tandem_worker_requests" not in types  # no load report yet: no role counters
    m.observe_load(WorkerLoad(worker_id="w", role="decode", seq=1, timestamp=0.0, num_requests_total=7,
                              num_remote_prefills=2, num_local_prefills=5,
                              kv_fetch={"num_fetches": 3, "num_failed": 1, "num_blocks_lent": 40}), "draining")
    assert "tandem_worker_spec_draft_tokens" not in types  # no speculation: no such counters
    stats[0], flips[0] = engine_stats(num_blocks_used=50, num_draft_tokens=30, num_accepted_tokens=12), 1
    text, _ = scrape(m.registry)  # scraped again: read again
    assert sample_total(text, "tandem_worker_spec_accepted_tokens_total") == 12
    assert sample_total(text, "tandem_worker_kv_cache_usage_ratio") == 0.5
    assert sample_total(text, "tandem_worker_requests_total", role="decode") == 7
    assert sample_total(text, "tandem_worker_prefills_total", kind="local") == 5
    assert sample_total(text, "tandem_worker_kv_peer_fetches_total", result="failed") == 1
    assert sample_total(text, "tandem_worker_kv_peer_blocks_total", direction="lent") == 40
    assert sample_total(text, "tandem_worker_info", role="decode", state="draining") == 1
    assert sample_total(text, "tandem_worker_role_flips_total") == 1


def test_worker_metrics_without_transfer_or_requests():
    m = WorkerMetrics()
    m.bind(lambda: engine_stats(num_blocks_total=0, num_blocks_used=0, num_prompt_tokens=0,
                                num_cached_prompt_tokens=0), lambda: None, lambda: 0)
    text, types = scrape(m.registry)
    assert sample_total(text, "tandem_worker_kv_cache_usage_ratio") == 0
    assert sample_total(text, "tandem_worker_prefix_hit_ratio") == 0
    assert "tandem_kv_transfer_bytes" not in types


def test_admission_decisions_by_tier_and_reason():
    m = AdmissionMetrics()
    m.observe_decision("gold", None, 0.001, predicted_ttft_s=0.3)
    m.observe_decision("bulk", "shedding", 0.002)
    m.observe_decision("bulk", "shedding", 0.002, predicted_ttft_s=9.0)  # not an admission: no TTFT
    text, _ = scrape(m.registry)
    assert sample_total(text, "tandem_admission_decisions_total", tier="gold", decision="admitted") == 1
    assert sample_total(text, "tandem_admission_decisions_total", tier="bulk", reason="shedding") == 2
    assert sample_total(text, "tandem_admission_decision_seconds_count") == 3
    assert sample_total(text, "tandem_admission_predicted_ttft_seconds_count") == 1


def test_kvindex_and_autoscaler_families():
    kv = KvIndexMetrics()
    kv.events.inc(3)
    assert sample_total(scrape(kv.registry)[0], "tandem_kvindex_events_total") == 3
    m = AutoscalerMetrics()

    def worker(i: int, role: str, state: str) -> WorkerStatus:
        return WorkerStatus(info=WorkerInfo(worker_id=f"w{i}", role=role, state=state, model="m", block_size=16,
                                            max_model_len=64, generate_subject="s"))

    m.bind(lambda: [worker(1, "decode", "ready"), worker(2, "decode", "ready"), worker(3, "prefill", "draining")])
    m.observe_queue([4, 0, 1], num_in_progress=2, num_redelivered=0)
    decision = ScalingDecisionRecord(timestamp=0, reason="r", num_prefill=1, num_decode=2, target_prefill=2,
                                     target_decode=1)
    m.observe_decision(decision, [ScalingAction(kind="flip", worker_id="w1", role="prefill", ok=True)])
    text, _ = scrape(m.registry)
    assert sample_total(text, "tandem_cluster_workers", role="decode", state="ready") == 2
    assert sample_total(text, "tandem_cluster_workers", role="prefill") == 1
    assert sample_total(text, "tandem_prefill_queue_depth") == 5
    assert sample_total(text, "tandem_prefill_queue_depth", level="0") == 4
    assert sample_total(text, "tandem_autoscaler_target_workers", role="prefill") == 2
    assert sample_total(text, "tandem_autoscaler_actions_total", kind="flip", ok="true") == 1


def test_series_percentiles_rates_and_horizon():
    s = RecentSeries(horizon_s=60)
    for i in range(10):
        s.observe_ttft(100.2, 0.1 * (i + 1))
    s.observe_finished(101.5, 30)
    s.observe_finished(103.0, 20)
    s.observe_rejected(104.0, "bulk")
    points = s.points(104.5, step_s=5)
    last = points[-1]
    assert last.t == 100 and points[-2].t == 95 and points[0].t == 45 and len(points) == 12
    assert (last.ttft_p50, last.ttft_p90, last.ttft_p99) == pytest.approx((0.55, 0.91, 0.991))
    assert last.itl_p50 is None
    assert last.tokens_per_s == 50 / 5 and last.requests_per_s == 2 / 5
    assert s.points(200.0, 5)[-1].ttft_p50 is None  # past the horizon: forgotten
    assert s.rejected_total == {"bulk": 1}


def test_series_keeps_a_bounded_sample_per_second():
    s = RecentSeries()
    for i in range(MAX_SAMPLES_PER_SECOND * 3):
        s.observe_itl(50.0, 0.01 if i % 2 else 0.03)
    point = s.points(50.0, 1)[-1]
    assert 0.01 <= point.itl_p50 <= 0.03 and point.itl_p99 == pytest.approx(0.03)
    assert len(s._seconds[-1].itl) == MAX_SAMPLES_PER_SECOND


def test_percentile_interpolates_and_skips_missing_values():
    assert percentile([], 50) is None and percentile([None, math.nan], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([4.0, None, 1.0, 2.0, 3.0], 50) == 2.5


def test_recent_mean_forgets_old_observations():
    m = RecentMean(window_s=10)
    assert m.mean(now=0) is None
    m.observe(1.0, now=0)
    m.observe(3.0, now=5)
    assert m.mean(now=6) == 2.0
    assert m.mean(now=11) == 3.0


async def test_dashboard_data_is_the_status_plus_the_history():
    from services.gateway.dashboard import HISTORY_STEP_S, dashboard_data
    from shared.protocol.status import GatewayState, StatusPage

    class Source:
        def __init__(self) -> None:
            self.metrics = GatewayMetrics(clock=Clock(1000.0))

        async def cluster_status(self) -> StatusPage:
            return StatusPage(timestamp=5.0, source="test", gateway=GatewayState(in_flight=2))

    source = Source()
    source.metrics.observe_ttft(0.25, "default")
    source.metrics.observe_rejected("bulk", "slo")
    data = await dashboard_data(source, 1000.0)
    assert data["status"] == StatusPage.model_validate(data["status"]).model_dump(mode="json")
    assert data["status"]["source"] == "test" and data["status"]["gateway"]["in_flight"] == 2
    assert data["step_s"] == HISTORY_STEP_S and data["rejected_total"] == {"bulk": 1}
    assert data["series"][-1]["ttft_p50"] == 0.25 and data["series"][-2]["ttft_p50"] is None
    assert len(data["series"]) == source.metrics.series.horizon_s // HISTORY_STEP_S


async def test_a_metrics_listener_with_a_key_answers_only_that_bearer_token():
    import aiohttp

    from shared.telemetry.metrics import metrics_site

    registry = service_registry("kv-index", "kv-index-1", 0)
    async with metrics_site(registry, "127.0.0.1", 0, key="s3cret") as url, aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}):
            async with http.get(url, headers=headers) as resp:
                assert resp.status == 401 and "Bearer" in resp.headers["WWW-Authenticate"]
                assert "tandem_" not in await resp.text()
        async with http.get(url, headers={"Authorization": "Bearer s3cret"}) as resp:
            assert resp.status == 200
            assert list(text_string_to_metric_families(await resp.text()))


def test_every_process_a_stack_starts_gets_its_metrics_key_file(tmp_path, monkeypatch):
    """``tandem up`` hands its operator key file to every child as metrics_key_file (absolute, as a
    child may run elsewhere); a settings file that holds no key is refused at startup, by name."""
    from pydantic import ValidationError

    from services.framework.settings import ServiceSettings
    from services.stack.stack import Stack, StackSpec

    key = tmp_path / "operator.key"
    key.write_text("# the operator's\nk3y\n")
    monkeypatch.chdir(tmp_path)
    flags = Stack(StackSpec(state_dir=tmp_path / "state", metrics_key_file="operator.key"))._metrics_flags()
    assert flags["metrics_key_file"] == str(key)
    assert "metrics_key_file" not in Stack(StackSpec(state_dir=tmp_path / "state"))._metrics_flags()
    assert ServiceSettings(metrics_key_file=str(key)).metrics_key_file == str(key)
    (tmp_path / "empty.key").write_text("\n")
    with pytest.raises(ValidationError, match="metrics_key_file: .*holds no key"):
        ServiceSettings(metrics_key_file=str(tmp_path / "empty.key"))
