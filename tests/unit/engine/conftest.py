import pytest

from tiny_hf_models import save_tiny


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama3"])
def tiny_hf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, save_tiny(request.param, path)
