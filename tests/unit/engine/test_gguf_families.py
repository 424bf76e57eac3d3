"""Families from GGUF files as llama.cpp's converter writes them (gguf-py's names and keys, q/k rows
as they are for Qwen): the same model as from their Hugging Face directory, equal to transformers."""

import pytest
import torch

from loadtest.tools.hf_gguf import write_gguf
from shared.model.loader import load_model
from tiny_hf_models import save_tiny


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_a_gguf_of_the_family_is_the_model_its_directory_is(kind, tmp_path):
    hf = save_tiny(kind, tmp_path / "hf").eval()
    gguf = write_gguf(tmp_path / "hf", tmp_path / f"{kind}.gguf")
    from_gguf = load_model(gguf, "gguf", torch.device("cpu"), torch.float32)
    from_dir = load_model(tmp_path / "hf", "hf", torch.device("cpu"), torch.float32)
    assert from_gguf.cfg.qk_norm == from_dir.cfg.qk_norm and from_gguf.cfg.head_dim == from_dir.cfg.head_dim
    prompt = [(13 * i + 5) % 256 for i in range(40)]
    got = from_gguf.prefill_logits(prompt)
    torch.testing.assert_close(got, from_dir.prefill_logits(prompt), rtol=0, atol=0)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
