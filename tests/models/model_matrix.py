"""The model test matrix: every family the loader builds (shared/model/config.py's ``FAMILIES``), each
as a tiny random-weight Hugging Face directory (tests/unit/engine/tiny_hf_models.py) and, where the
family has GGUF rules, a GGUF converted from one (loadtest/tools/hf_gguf.py); its greedy text in
float32 from transformers' ``generate`` and from the engine, alone and through each scheduling path."""

from __future__ import annotations

import dataclasses

import torch

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.model.config import FAMILIES
from shared.model.loader import load_model
from test_model_vs_transformers import assert_greedy_under_hf
from tiny_hf_models import save_tiny


@dataclasses.dataclass(frozen=True)
class Entry:
    family: str  # the key of FAMILIES it is a model of
    gguf_kind: str | None  # save_tiny's kind its GGUF is converted from (the family as a GGUF states it)
    no_gguf: str = ""  # why there is none, for a family with GGUF rules


# by save_tiny's kind (the test ids): a model of each family, and windowed variants of those whose window
# is optional (their requests give back the blocks that leave every layer's window as they go)
MATRIX = {
    "llama": Entry("llama", "llama"),
    "mistral": Entry("mistral", None, no_gguf="loadtest/tools/hf_gguf.py writes no Mistral (llama.cpp's "
                                              "converter writes its checkpoints as arch llama, without the window)"),
    "qwen2": Entry("qwen2", "qwen2"),
    "qwen3": Entry("qwen3", "qwen3"),
    "qwen3_window": Entry("qwen3", None, no_gguf="llama.cpp windows no Qwen3 layer (GgufRules.window_period)"),
    "phi3": Entry("phi3", "phi3"),
    "phi3_window": Entry("phi3", "phi3_window"),
    "olmo2": Entry("olmo2", "olmo2"),
    "granite": Entry("granite", "granite"),
    "gemma2": Entry("gemma2", "gemma2_gguf"),
    "gemma3_text": Entry("gemma3_text", "gemma3_gguf"),
    "smollm3": Entry("smollm3", "smollm3_gguf"),
    "smollm3_window": Entry("smollm3", None, no_gguf="the converter writes no window for SmolLM3"),
    "mixtral": Entry("mixtral", "mixtral"),
    "mixtral_window": Entry("mixtral", None, no_gguf="the converter writes no window for Mixtral"),
    "qwen3_moe": Entry("qwen3_moe", "qwen3_moe_gguf"),
    "gpt_oss": Entry("gpt_oss", None),
    "deepseek_v3": Entry("deepseek_v3", None),
}
# families of FAMILIES with no model in the matrix, each with the reason (none now)
NOT_IN_MATRIX: dict[str, str] = {}
WITH_GGUF = [kind for kind, entry in MATRIX.items() if entry.gguf_kind]

BLOCK_SIZE = 8
MAX_TOKENS = 12
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SHARED_PREFIX = 32  # tokens (4 blocks) the third prompt shares with the second


def _tokens(n: int, k: int) -> list[int]:
    return [(7 * i + 11 * k + 3) % 256 for i in range(n)]


# 7 tokens (under a block), 40 and 48 (past the tiny models' window of 12, split by a budget of 16 a step);
# the third begins with the second's first 32 tokens: run after it, it hits them in the prefix cache
PROMPTS = [_tokens(7, 1), _tokens(40, 2), _tokens(SHARED_PREFIX, 2) + _tokens(16, 3)]


def engine_config(**fields) -> EngineConfig:
    return EngineConfig(**({"kv_cache_memory": 4 << 20, "block_size": BLOCK_SIZE} | fields))


@dataclasses.dataclass
class Run:
    """What an engine generated for each request, the most cached tokens any of its outputs reported,
    and how many preemptions its scheduler counted."""

    tokens: list[list[int]]
    num_cached: list[int]
    num_preemptions: int


def run_engine(engine: LLMEngine, prompts: list[list[int]], *, together: bool = True) -> Run:
    """Greedy ``MAX_TOKENS`` for each prompt: all added before the first step (``together``), or each
    run to its end before the next is added."""
    waves = [list(range(len(prompts)))] if together else [[i] for i in range(len(prompts))]
    tokens: list[list[int]] = [[] for _ in prompts]
    cached = [0] * len(prompts)
    for wave in waves:
        for i in wave:
            engine.add_request(f"p-{i}", prompts[i], PARAMS)
        while engine.has_unfinished_requests():
            for out in engine.step():
                i = int(out.request_id.rsplit("-", 1)[1])
                tokens[i] += out.new_token_ids
                cached[i] = max(cached[i], out.num_cached_tokens)
    assert engine.kv.pool.num_free_blocks == engine.num_blocks, "blocks held after every request finished"
    return Run(tokens, cached, engine.scheduler.num_preemptions)


def transformers_greedy(hf, prompt: list[int]) -> list[int]:
    """transformers' ``generate``, greedy, ``MAX_TOKENS`` new tokens with no end of sequence (as
    ``ignore_eos``: suppressing it, as ``min_new_tokens`` does, would pick the next best token instead)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert out.shape[1] == len(prompt) + MAX_TOKENS
    return out[0, len(prompt):].tolist()


def assert_same_greedy(hf, prompt: list[int], ours: list[int], theirs: list[int]) -> None:
    """Token for token equal; where they part, a near-tie of the random weights that float rounding broke
    the other way: every one of our tokens is transformers' argmax given ours before it (up to 1e-4)."""
    if ours == theirs:
        return
    first = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    try:
        assert_greedy_under_hf(hf, prompt, ours)
    except AssertionError as exc:
        raise AssertionError(f"token {first} differs from transformers' generate ({ours[first]} vs "
                             f"{theirs[first]}): not a near-tie: {exc}") from None


class TinyModel:
    """One entry's tiny model (made on first use): its directory, transformers' and the engine's
    models, transformers' greedy text and the engine's, each prompt alone on a fresh engine."""

    def __init__(self, kind: str, root) -> None:
        self.kind, self.entry, self.root = kind, MATRIX[kind], root
        self.hf_dir = root / kind
        self.hf = save_tiny(kind, self.hf_dir)
        self.model = load_model(self.hf_dir, "hf", torch.device("cpu"), torch.float32)
        self.alone = run_engine(self.engine(enable_prefix_caching=False), PROMPTS, together=False)
        self.reference = [transformers_greedy(self.hf, p) for p in PROMPTS]

    def engine(self, **fields) -> LLMEngine:
        return LLMEngine(self.model, engine_config(**fields))

    def blocks_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.engine(kv_cache_memory=1 << 20).kv_spec.bytes_per_block

    def gguf(self):
        """(transformers' model the GGUF was converted from, the GGUF's path)."""
        kind = self.entry.gguf_kind
        if kind == self.kind:
            hf, hf_dir = self.hf, self.hf_dir
        else:
            hf_dir = self.root / kind
            hf = save_tiny(kind, hf_dir)
        from loadtest.tools.hf_gguf import write_gguf

        return hf, write_gguf(hf_dir, self.root / f"{kind}.gguf")


def families_not_covered() -> dict[str, str]:
    """Families of FAMILIES with neither a model in MATRIX nor a reason in NOT_IN_MATRIX, and names there
    of no family."""
    covered = {entry.family for entry in MATRIX.values()}
    missing = {f: "no model in MATRIX, and no reason in NOT_IN_MATRIX" for f in FAMILIES
               if f not in covered and f not in NOT_IN_MATRIX}
    unknown = {f: "not a family of shared/model/config.py's FAMILIES" for f in {*covered, *NOT_IN_MATRIX}
               if f not in FAMILIES}
    return missing | unknown
