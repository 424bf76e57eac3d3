"""A GGUF file or a Hugging Face directory loaded layer by layer: each tensor read from its mapped file
when its layer is made, and with a method that needs no calibration run (gguf, int8-precise) each layer
quantized before the next one's tensors are read, so a load never holds the whole model in float (a Q4_0
8B model would take 32 GB as float32). The model is the same as one loaded whole and quantized after."""

import pytest
import torch

from loadtest.tools.hf_gguf import write_gguf
from shared.model import llama, loader
from shared.model.loader import build_model, load_gguf, load_model
from tiny_hf_models import save_tiny

PROMPT = [(13 * i + 5) % 256 for i in range(40)]


@pytest.fixture(scope="module", params=["llama", "qwen3_moe_gguf"])
def gguf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, path / "hf")  # qwen3_moe_gguf's experts are 32 wide: whole blocks
    return write_gguf(path / "hf", path / "model.gguf")


@pytest.mark.parametrize("method", ["gguf", "int8-precise"])
def test_layer_by_layer_is_the_model_quantized_afterwards(gguf, method):
    cpu = torch.device("cpu")
    whole = build_model(*_eager(gguf), cpu, torch.float32)
    whole.quantize(method)
    layerwise = load_model(gguf, "gguf", cpu, torch.float32, quantization=method)
    assert layerwise.layers_quantized == method
    layerwise.quantize(method)  # the LM head: the layers are left as they are
    assert layerwise.quantization == whole.quantization == method
    torch.testing.assert_close(layerwise.prefill_logits(PROMPT), whole.prefill_logits(PROMPT), rtol=0, atol=0)


def test_each_layer_is_quantized_before_the_next_is_read(gguf, monkeypatch):
    events = record_load(monkeypatch, "_read_gguf_tensor",
                         lambda tensor, *_: int(tensor.name.split(".")[1]) if tensor.name.startswith("blk.") else None)
    model = load_model(gguf, "gguf", torch.device("cpu"), torch.float32, quantization="gguf")
    layer_reads = [(i, n) for n, (kind, i) in enumerate(events) if kind == "read" and i is not None]
    done = {i: n for n, (kind, i) in enumerate(events) if kind == "quantized"}
    assert sorted(done) == list(range(len(model.layers)))
    assert all(n > done[i - 1] for i, n in layer_reads if i > 0), events  # layer i read after i - 1 was quantized
    assert len(layer_reads) == len({t.name for t in _gguf_tensors(gguf) if t.name.startswith("blk.")})  # once each
    with pytest.raises(ValueError, match="loaded as gguf, not int8"):
        model.quantize("int8")


def test_a_directory_is_read_layer_by_layer_too(gguf, monkeypatch):
    """A Hugging Face directory's tensors are read from its safetensors when their layer is made."""
    hf_dir = gguf.parent / "hf"
    events = record_load(monkeypatch, "_read_hf_tensor",
                         lambda _, name, *__: int(name.split(".")[2]) if name.startswith("model.layers.") else None)
    model = load_model(hf_dir, "hf", torch.device("cpu"), torch.float32, quantization="int8-precise")
    done = {i: n for n, (kind, i) in enumerate(events) if kind == "quantized"}
    assert sorted(done) == list(range(len(model.layers)))
    assert all(n > done[i - 1] for n, (kind, i) in enumerate(events) if kind == "read" and i), events
    whole = load_model(hf_dir, "hf", torch.device("cpu"), torch.float32)
    whole.quantize("int8-precise")
    model.quantize("int8-precise")
    torch.testing.assert_close(model.prefill_logits(PROMPT), whole.prefill_logits(PROMPT), rtol=0, atol=0)


def record_load(monkeypatch, reader: str, layer_of) -> list[tuple[str, int | None]]:
    """The load's events in order: ("read", the layer ``layer_of(*reader's args)`` names, or None) for each
    call of the loader's ``reader``, ("quantized", i) as layer i is quantized."""
    events = []
    read, quantize = getattr(loader, reader), llama.quantize_layer

    def reading(*args):
        events.append(("read", layer_of(*args)))
        return read(*args)

    def quantizing(layer, method, index, *args):
        events.append(("quantized", index))
        return quantize(layer, method, index, *args)

    monkeypatch.setattr(loader, reader, reading)
    monkeypatch.setattr(llama, "quantize_layer", quantizing)
    return events


def _eager(path):
    """``load_gguf``'s tensors read at once, as a load held them before layers were made one by one."""
    cfg, lazy = load_gguf(path)
    return cfg, {name: read() for name, read in lazy.items()}


def _gguf_tensors(path):
    from shared.model.gguf_file import read_gguf

    return read_gguf(path).tensors
