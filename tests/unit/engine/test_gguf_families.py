"""Families from GGUF files as llama.cpp's converter writes them (gguf-py's names and keys, q/k rows
permuted where its LlamaModel permutes them, Gemma's norms as 1 + w, experts stacked): the same model
as from their Hugging Face directory, equal to transformers."""

import math

import pytest
import torch

from loadtest.tools.hf_gguf import write_gguf
from shared.model.loader import load_model
from tiny_hf_models import save_tiny

# the tiny models of tiny_hf_models; a "_gguf" one is its family as a GGUF states it (see there)
KINDS = ["llama", "qwen2", "qwen3", "phi3", "phi3_window", "olmo2", "granite", "gemma2_gguf", "gemma3_gguf",
         "smollm3_gguf", "mixtral", "qwen3_moe_gguf"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_gguf_of_the_family_is_the_model_its_directory_is(kind, tmp_path):
    hf = save_tiny(kind, tmp_path / "hf").eval()
    gguf = write_gguf(tmp_path / "hf", tmp_path / f"{kind}.gguf")
    from_gguf = load_model(gguf, "gguf", torch.device("cpu"), torch.float32)
    from_dir = load_model(tmp_path / "hf", "hf", torch.device("cpu"), torch.float32)
    assert not _differing(from_gguf.cfg, from_dir.cfg)
    prompt = [(13 * i + 5) % 256 for i in range(40)]
    got = from_gguf.prefill_logits(prompt)
    torch.testing.assert_close(got, from_dir.prefill_logits(prompt), rtol=0, atol=0)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def _differing(a, b) -> set[str]:
    """The fields of two ModelConfigs that differ (floats beyond float32's rounding: GGUF keeps float32)."""
    def same(x, y):
        return x == y or (isinstance(x, float) and isinstance(y, float) and math.isclose(x, y, rel_tol=1e-6))
    return {f for f in a.__dataclass_fields__ if not same(getattr(a, f), getattr(b, f))}


@pytest.mark.parametrize("kind", ["gemma2", "smollm3", "qwen3_moe"])
def test_a_model_its_gguf_would_misstate_is_refused(kind, tmp_path):
    save_tiny(kind, tmp_path / "hf")
    with pytest.raises(ValueError, match="does not state"):
        write_gguf(tmp_path / "hf", tmp_path / f"{kind}.gguf")
