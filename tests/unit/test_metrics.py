from shared.telemetry.metrics import Counter, Gauge, Histogram, RecentMean, Registry


def test_prometheus_text():
    reg = Registry()
    c = reg.add(Counter("tandem_requests_total", "requests"))
    g = reg.add(Gauge("tandem_in_flight", "in flight"))
    h = reg.add(Histogram("tandem_ttft_seconds", "ttft", (0.1, 1.0)))
    c.inc(status="200")
    c.inc(2, status="429")
    g.inc()
    g.dec()
    for v in (0.05, 0.5, 5.0):
        h.observe(v)
    text = reg.render()
    assert 'tandem_requests_total{status="429"} 2' in text
    assert "tandem_in_flight 0" in text
    assert 'tandem_ttft_seconds_bucket{le="1"} 2' in text
    assert 'tandem_ttft_seconds_bucket{le="+Inf"} 3' in text
    assert "tandem_ttft_seconds_count 3" in text
    assert "# TYPE tandem_ttft_seconds histogram" in text


def test_recent_mean_forgets_old_observations():
    m = RecentMean(window_s=10)
    assert m.mean(now=0) is None
    m.observe(1.0, now=0)
    m.observe(3.0, now=5)
    assert m.mean(now=6) == 2.0
    assert m.mean(now=11) == 3.0
