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
