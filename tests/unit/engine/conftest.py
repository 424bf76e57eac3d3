import pytest
import torch

from tiny_hf_models import save_tiny


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama3", "qwen3", "phi3", "olmo2", "granite",
                                                "gemma2", "gemma3_text"])
def tiny_hf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, save_tiny(request.param, path)


@pytest.fixture(scope="module")
def tiny_engine_model(tmp_path_factory):
    """A tiny random-weight Llama, loaded as the engine loads a model."""
    from shared.model.loader import load_model

    path = tmp_path_factory.mktemp("tiny")
    save_tiny("llama", path)
    return load_model(path, "hf", torch.device("cpu"), torch.float32)
