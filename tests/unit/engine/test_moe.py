"""The mixture-of-experts block (shared/model/moe.py) on its own: routing and its two paths."""

import pytest
import torch
import torch.nn.functional as F

from shared.model.config import Moe
from shared.model.moe import MoeBlock


def block(renormalize: bool, num_experts: int = 4, hidden: int = 8, width: int = 6) -> MoeBlock:
    gen = torch.Generator().manual_seed(0)
    moe = Moe(num_experts=num_experts, top_k=2, intermediate_size=width, renormalize=renormalize,
              round_weights=False, layers=(0,))
    return MoeBlock(moe, torch.randn(num_experts, hidden, generator=gen),
                    torch.randn(num_experts, 2 * width, hidden, generator=gen),
                    torch.randn(num_experts, hidden, width, generator=gen), F.silu)


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_top_two_probabilities_weight_their_experts(renormalize):
    """Logits 0, ln 2, ln 4, ln 1 over 4 experts: probabilities 1/8, 2/8, 4/8, 1/8; experts 2 and 1
    chosen, weighted 4/8 and 2/8, or 2/3 and 1/3 renormalised (Mixtral, Qwen3-MoE's norm_topk_prob)."""
    moe = block(renormalize)
    moe.router = torch.zeros(4, 8)
    moe.router[:, 0] = torch.tensor([1.0, 2.0, 4.0, 1.0]).log()
    experts, weights = moe.route(torch.eye(8)[:1])
    assert experts.tolist() == [[2, 1]]
    want = [2 / 3, 1 / 3] if renormalize else [0.5, 0.25]
    torch.testing.assert_close(weights, torch.tensor([want]))


def test_every_expert_over_every_token_is_the_grouped_path():
    """What a CUDA graph captures (no host sync) against what an eager step runs."""
    moe = block(True)
    x = torch.randn(13, 8, generator=torch.Generator().manual_seed(1))
    experts, weights = moe.route(x)
    assert len(experts.unique()) == 4  # every expert has tokens, and none has them all
    torch.testing.assert_close(moe.forward_every_expert(x, experts, weights), moe.forward(x), rtol=1e-5, atol=1e-5)


def test_each_expert_counts_the_tokens_routed_to_it():
    moe = block(True)
    x = torch.randn(13, 8, generator=torch.Generator().manual_seed(1))
    experts, _ = moe.route(x)
    moe.forward(x)
    moe.forward(x[:5])
    want = torch.bincount(experts.flatten(), minlength=4) + torch.bincount(experts[:5].flatten(), minlength=4)
    assert moe.expert_tokens.tolist() == want.tolist() and int(moe.expert_tokens.sum()) == 2 * (13 + 5)


def test_the_expert_load_sums_layers_and_names_the_worst_ones_imbalance():
    from types import SimpleNamespace

    from shared.model.moe import expert_load

    even, skewed = block(True), block(True)
    even.expert_tokens = torch.tensor([5, 5, 5, 5])
    skewed.expert_tokens = torch.tensor([14, 2, 2, 2])  # mean 5, busiest 14
    layers = [SimpleNamespace(moe=even), SimpleNamespace(moe=None), SimpleNamespace(moe=skewed)]
    load = expert_load(layers)
    assert load.tokens == (19, 7, 7, 7) and load.imbalance == pytest.approx(14 / 5)
    assert expert_load([SimpleNamespace(moe=None)]) is None
    assert expert_load([SimpleNamespace(moe=block(True))]) is None  # nothing routed yet


def test_a_worker_reports_its_experts_load(tmp_path):
    """A Mixtral engine's stats and the worker's Prometheus families carry the load after a request."""
    from prometheus_client.parser import text_string_to_metric_families

    from services.worker.metrics import WorkerMetrics
    from shared.engine import EngineConfig, LLMEngine, SamplingParams
    from shared.model.loader import load_model
    from shared.telemetry.metrics import exposition
    from tiny_hf_models import save_tiny

    save_tiny("mixtral", tmp_path)
    engine = LLMEngine(load_model(tmp_path, "hf", torch.device("cpu"), torch.float32),
                       EngineConfig(kv_cache_memory=4 << 20, block_size=8))
    engine.generate([[(7 * i + 3) % 256 for i in range(20)]], SamplingParams(max_tokens=4, temperature=0.0))
    stats = engine.stats()
    num_moe_layers = sum(layer.moe is not None for layer in engine.model.layers)
    # every token of the prompt and of three decode steps, top 2 of 4 experts, in each layer
    assert sum(stats.expert_tokens) == num_moe_layers * 2 * (20 + 3) and len(stats.expert_tokens) == 4
    assert stats.expert_imbalance >= 1.0
    metrics = WorkerMetrics()
    metrics.bind(lambda: stats, lambda: None, lambda: 0)
    text = exposition(metrics.registry)[0].decode()
    samples = {s.labels.get("expert"): s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "tandem_worker_expert_tokens_total"}
    assert samples == {str(e): t for e, t in enumerate(stats.expert_tokens)}
