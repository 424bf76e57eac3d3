"""Session-wide fixtures shared by every test directory. Keep it small: fixtures that only one
area needs belong in that directory's own conftest.py.

The ``slow`` marker (declared in pyproject.toml) tags tests that load the real default model or
start processes; deselect them with ``-m "not slow"``. Every test that uses ``smollm2_gguf``
(directly or through another fixture) is marked ``slow`` automatically.

The ``long`` marker tags the long real-time runs: stacks of service processes, containers, hosts in
network namespaces, a cold compile. A plain ``pytest`` leaves them out (the summary says how many);
``pytest -m long`` runs only them, any other ``-m`` expression decides for itself, and naming a
test file or test runs what is named. ``.ci/run`` runs both steps.

A test that takes over a minute says why in its docstring, with the words "over a minute": the
summary lists those that do not.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

# transformers (the reference implementation in some tests) must not look for a model hub:
# every model here is a local file
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# workers compile their decode step on a background thread by default: minutes of CPU per cold
# process on a small machine, beside the test it would slow down. Tests run them eager unless they
# ask for the compiled step (tests/engine/test_compiled_smollm2.py, tests/unit/engine/test_compiled_decode.py)
os.environ.setdefault("TANDEM_COMPILE", "off")

from services.stack.servers import start_nats_server, start_redis_server
from shared.model.registry import DEFAULT_MODEL, resolve_model
from shared.planner.plan import Plan, WorkerPlan


# a real nats-server (JetStream) and redis-server per test session, on free loopback ports, ready when they
# print their readiness line: for the stacks of tests/integration and tests/models
@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    server = start_nats_server(tmp_path_factory.mktemp("nats"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = start_redis_server(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF, fetched once into the default cache
    (``TANDEM_CACHE_DIR`` or ``~/.cache/tandem``) and reused by later runs."""
    return resolve_model(DEFAULT_MODEL).path


LONG_TEST_S = 60.0  # a test slower than this alone says why in its docstring ("over a minute")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        # fixturenames is the transitive closure, so indirect users are caught too
        if "smollm2_gguf" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    if not (config.option.markexpr or _names_files(config)):
        long = [item for item in items if item.get_closest_marker("long")]
        if long:
            config.hook.pytest_deselected(items=long)
            items[:] = [item for item in items if not item.get_closest_marker("long")]
            config.stash[_num_long_left_out] = len(long)
    config.stash[_items] = items


def _names_files(config: pytest.Config) -> bool:
    """Whether the command line names test files or tests (not only directories)."""
    return any("::" in arg or arg.split("::")[0].endswith(".py") for arg in config.args)


_num_long_left_out = pytest.StashKey[int]()
_items = pytest.StashKey[list]()
_seconds: dict[str, float] = defaultdict(float)  # node id -> setup + call + teardown


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid] += report.duration  # a module fixture's start counts for its first test


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if num := config.stash.get(_num_long_left_out, 0):
        terminalreporter.write_line(f"{num} long real-time tests left out: `pytest -m long` runs them "
                                    "(.ci/run runs both steps)")
    unexplained = [f"{_seconds[item.nodeid]:.0f}s {item.nodeid}" for item in config.stash.get(_items, [])
                   if _seconds.get(item.nodeid, 0.0) > LONG_TEST_S and not _says_why(item)]
    if unexplained:
        terminalreporter.section("tests over a minute with no reason in their docstring")
        for line in unexplained:
            terminalreporter.write_line(line)


def _says_why(item: pytest.Item) -> bool:
    doc = getattr(getattr(item, "function", None), "__doc__", None) or ""
    return "over a minute" in " ".join(doc.split()).lower()


@pytest.fixture
def record_logits():
    """``record(engine)`` returns a dict that fills as the engine samples: the logits row of every
    output position, keyed by (the request id's last ``-`` part, output index). Of a speculative
    step, the rows up to its first rejected draft token (those after it had a wrong context)."""
    def record(engine) -> dict:
        sampler, seen = engine.runner.sampler, {}
        sample, verify = sampler.sample, sampler.verify

        def key(request, j: int) -> tuple[str, int]:
            return request.request_id.rsplit("-", 1)[1], len(request.output_token_ids) + j

        def record_sample(logits, requests):
            seen.update((key(r, 0), row.clone()) for r, row in zip(requests, logits))
            return sample(logits, requests)

        def record_verify(logits, request, draft):
            tokens = verify(logits, request, draft)
            seen.update((key(request, j), logits[j].clone()) for j in range(len(tokens)))
            return tokens

        sampler.sample, sampler.verify = record_sample, record_verify
        return seen
    return record


@pytest.fixture
def plan_file(tmp_path):
    """``write(workers, **fields)`` writes a planner ``Plan`` (``tandem up --plan``) to tmp_path/plan.json
    and returns its path. Each worker is ``(worker_id, role, gpus, tp, pp)`` on CPU cores; its load, the
    plan's workload and predictions are placeholders, which ``fields`` overrides."""
    def write(workers, **fields):
        planned = [WorkerPlan(worker_id=worker_id, role=role, gpu_type="cpu-core", gpus=gpus, tp=tp, pp=pp,
                              capacity_rps=1.0, assigned_rps=1.0, latency_s=0.1, price_per_hour=0.0)
                   for worker_id, role, gpus, tp, pp in workers]
        placeholders = dict(
            model="smollm2-135m", num_gpus=sum(len(w.gpus) for w in planned), request_rate=1.0, mean_input_len=100,
            mean_output_len=100, slo={"ttft_s": 5.0, "tpot_s": 0.1}, routes=[], capacity_rps=1.0,
            throughput_rps=1.0, output_tokens_per_s=100.0, predicted_ttft_s=0.1, predicted_tpot_s=0.05,
            cost_per_hour=0.0, cost_per_million_output_tokens=None, planning_time_s=0.0, search_history=[])
        path = tmp_path / "plan.json"
        path.write_text(Plan(**{**placeholders, **fields}, workers=planned).model_dump_json())
        return path
    return write
