"""loadtest.bench.quality's measures on a tiny random-weight model: a model agrees fully with itself, and
a perturbed one measurably less, so the measures can fail."""

import pytest
import torch

from loadtest.bench.quality import first_divergence, greedy, greedy_equality, teacher_forced, windows
from shared.engine import EngineConfig, LLMEngine
from shared.model.config import ModelConfig
from shared.model.loader import build_model


CFG = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                  max_position_embeddings=512, tie_word_embeddings=False)


def tiny_model(noise: float = 0.0):
    """A tiny random-weight Llama built as the loaders build one (always the same weights), with
    ``noise`` times each linear weight's std of Gaussian noise added to every decoder linear layer."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"embed": (256, 64), "norm": (64,), "lm_head": (256, 64)}
    for i in range(CFG.num_layers):
        shapes |= {f"layers.{i}.{n}": s for n, s in [("attn_norm", (64,)), ("q", (64, 64)), ("k", (32, 64)),
                                                      ("v", (32, 64)), ("o_proj", (64, 64)), ("mlp_norm", (64,)),
                                                      ("gate", (128, 64)), ("up", (128, 64)), ("down", (64, 128))]}
    tensors = {name: 1 + 0.1 * torch.randn(s, generator=gen) if len(s) == 1 else 0.2 * torch.randn(s, generator=gen)
               for name, s in shapes.items()}
    noise_gen = torch.Generator().manual_seed(1)
    for name, w in tensors.items():
        if name.startswith("layers.") and w.dim() == 2:
            w += noise * w.std() * torch.randn(w.shape, generator=noise_gen)
    return build_model(CFG, tensors, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def tiny_trio():
    """The tiny model three times: the reference, the same weights again, and a perturbed copy."""
    return tiny_model(), tiny_model(), tiny_model(noise=0.05)


def test_teacher_forced_is_exact_against_itself_and_drops_with_noise(tiny_trio):
    reference, same, noisy = tiny_trio
    ids = [(7 * i + 3) % 256 for i in range(100)]
    got = teacher_forced(reference, {"same": same, "noisy": noisy}, ids, window=32)
    assert got["same"] == {"positions": 100, "top1_agreement": 1.0, "kl": 0.0}
    assert got["noisy"]["positions"] == 100
    assert got["noisy"]["top1_agreement"] < 0.95 and got["noisy"]["kl"] > 1e-3, got["noisy"]


def test_greedy_equality_against_itself_and_with_noise(tiny_trio):
    reference, same, noisy = tiny_trio
    prompts = [[(5 * i + k) % 256 for i in range(4 + 3 * k)] for k in range(6)]

    def answers(model):
        engine = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=8))
        return greedy(engine, prompts, 12)

    want = answers(reference)
    assert greedy_equality(want, answers(same)) == {"prompts": 6, "equal": 1.0, "mean_first_divergence": None,
                                                    "first_divergences": []}
    noisy_eq = greedy_equality(want, answers(noisy))
    assert noisy_eq["equal"] < 1.0 and 0 <= noisy_eq["mean_first_divergence"] < 12, noisy_eq


def test_first_divergence_and_windows():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one answer stopped early
    assert windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert greedy_equality([[1, 2], [3, 4]], [[1, 2], [3, 9]])["mean_first_divergence"] == 1
