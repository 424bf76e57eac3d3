"""A CPU decode step as one compiled graph (``torch.compile``, inductor's C++ backend).

An eager decode step of SmolLM2-135M makes about 7,700 aten op calls: 30 layers of norms,
activation quantization, rotary, the KV write, the attention gather and SDPA, each one op through
torch's dispatcher from Python. At batch 1 on a CPU that dispatch costs about what the ops' work
does. ``CompiledDecode`` traces the whole forward of a decode-only step once, from the same
reference functions the eager model runs, so inductor fuses the small elementwise ops into a few
C++ loops and the step is one call.

Three things differ from the eager step, all so that the graph is the same at every step:

* the cache is only read inside the graph. Each layer attends over the cached past (the positions
  before the step's token, gathered by block table and masked past each sequence's length) plus the
  token's own K/V, which the graph returns; the runner writes all layers' new K/V into the cache
  with one indexed copy after the graph. Writing inside the graph would make inductor copy the
  whole pool;
* the past is always masked (the eager path cuts it instead when every length is equal), so the
  attention sums differ from eager in the last bits of float32;
* attention is a C++ kernel that reads the pool in place (kernels/attention_cpu.py), the step's
  own token joining the softmax beside the past. Where it cannot run, attention is written out as
  products and sums (``_decode_attention``, also the kernel's reference) so that inductor reads
  the gathered past inside its reduction loops: SDPA's CPU kernel cost about 50 µs a layer at
  batch 1, and matmuls over a concatenated K/V made inductor copy and transpose the gathered past
  first (about 125 µs a layer). At batch 32 those generated loops, over the longest sequence's
  length and masked, took about 40% of a served step.

The graph's caller is C++ (inductor's ``cpp_wrapper``), not generated Python. Measured on a 2-core
AVX-512 CPU (SmolLM2-135M, int8 layers, batch 1): eager 17.6 ms a step; compiled with a Python
caller and SDPA 12.9 ms; with a C++ caller, input guards and matmul attention 9.8 ms; this graph
8.4 ms.

The step is compiled ahead of time (``torch.compile(...).aot_compile``) into one function with
symbolic sizes: one graph serves every batch and every context length. A lone sequence runs with a
companion row (its results dropped), so that no second graph specialized for batch 1 exists: a
sequence's rows get the same bits alone as among any batch-mates. The function is called without
guards (every call passes inputs of the traced ranks and dtypes), and it is serialized with the
inductor cache it was built in (shared/engine/compiled/artifacts.py): a later process on a machine
like this one loads it in seconds instead of compiling for minutes, and a worker takes it from its
cluster when this machine has none. ``warm()`` loads or compiles it; a worker does that on a thread
of its own while eager steps serve (``shared/engine/compiled/background.py``), or before it takes
traffic. Prefill and chunked steps stay eager; a speculative entry's tokens run in the graph as
decode rows, each over the past it would have as a plain decode row (the K/V of the step's own
earlier tokens taken from those rows), so its verified drafts get the bits plain decoding gives.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.nn.functional as F

from kernels import attention_cpu
from kernels.cast import cast
from kernels.rms_norm import fused_add_rms_norm_ref
from kernels.rotary import rotary_embedding_ref
from shared.engine.compiled.artifacts import ArtifactStore, CompileArtifacts
from shared.model.attention import AttentionMetadata
from shared.model.quant import linear

log = logging.getLogger(__name__)

# The tensor-parallel group of this process's compiled step: the graph calls ``tandem::all_reduce``
# (an operator it cannot look into, so inductor calls it where it stands) with key 0, which each rank
# process resolves to its own group. One key in every process, so that the ranks' graphs are the same
# and a follower loads the one rank 0 compiled.
_GROUPS: dict[int, object] = {}


@torch.library.custom_op("tandem::all_reduce", mutates_args=())
def _all_reduce(x: torch.Tensor, key: int) -> torch.Tensor:
    return _GROUPS[key].all_reduce(x.clone())


@_all_reduce.register_fake
def _(x: torch.Tensor, key: int) -> torch.Tensor:
    return torch.empty_like(x)


def unsupported_reason(cfg) -> str | None:
    """Why the compiled decode step cannot run a model of ``cfg`` (None: it can). It runs the Llama
    layer, with Qwen3's per-head q/k norms; the families whose layers differ further (post-norms,
    OLMo 2's whole q/k norm, multipliers, soft-caps, non-default softmax scales, a second rope base,
    an activation other than SiLU, SmolLM3's layers without rotary, experts) decode eagerly. A step
    that called the eager layer's own methods for all of them sent the ahead-of-time compile of a
    default-precision SmolLM2 step into minutes of symbolic shape reasoning, so they are left out
    until it does not."""
    differs = [name for name, is_plain in (
        ("post-norms", not cfg.post_norms and cfg.pre_norms),
        ("a q/k norm over the whole projection", cfg.qk_norm in (None, "head")),
        ("embedding or residual multipliers", cfg.embedding_multiplier == 1.0 and cfg.residual_multiplier == 1.0),
        ("a softmax scale of its own", cfg.attention_scale is None),
        ("soft-capping", cfg.attn_softcap is None and cfg.final_softcap is None),
        ("logits scaling", cfg.logits_scaling == 1.0),
        ("local layers with their own rope base", not cfg.local_layers),
        (f"the {cfg.activation} activation", cfg.activation == "silu"),
        ("layers without rotary", not cfg.nope_layers),
        ("a mixture of experts", cfg.moe is None),
        ("latent attention", cfg.mla is None),
        # one window for every layer is a mask of the past (``CompiledDecode.forward``); windowed layers
        # beside global ones would need a mask per layer in the graph
        ("windowed layers beside global ones", len(cfg.window_layers) in (0, cfg.num_layers)),
    ) if not is_plain]
    if not differs:
        return None
    return f"the {cfg.architecture} layer has " + ", ".join(differs)


class CompiledDecode:
    def __init__(self, model, block_size: int, num_threads: int | None = None) -> None:
        """``model``: a whole model, or a tensor-parallel rank's shard (one pipeline stage only): its
        step's two all-reduces a layer and its vocabulary-parallel embedding run in the graph, through
        the rank's own collectives (``_GROUPS``)."""
        if model.device.type != "cpu":
            raise ValueError(f"the compiled decode step runs on the CPU, not on {model.device.type}")
        if reason := unsupported_reason(model.cfg):
            raise ValueError(f"no compiled decode step for this model yet: {reason}")
        if model.pipeline.num_stages > 1:
            raise ValueError("no compiled decode step on pipeline stages: a step hands its hidden states on "
                             "between the stages' layers")
        if model.group.size > 1:
            _GROUPS[0] = model.group
        self.model = model
        # what the graph needs of the rank's place in its group, read here: the traced step does not
        # look into the group's collectives (which cannot be serialized with the step)
        self.tp, self.num_heads, self.num_kv_heads = model.group.size, model.split.num_heads, model.split.num_kv_heads
        self.vocab_shard = model.split.vocab_shard
        # a tensor, so that the graph reads it rather than holding rank 0's number (ranks load one graph)
        self.vocab_start = torch.tensor(model.split.vocab_start, dtype=torch.long, device=model.device)
        self.block_size = block_size
        # the C++ loops' OpenMP team size is fixed when they are generated: the engine thread's, not
        # that of the thread that happens to compile them
        self.threads = num_threads or torch.get_num_threads()
        self.num_steps = 0  # decode steps run through the graph
        self.source: str | None = None  # after warm(): "compiled" here, or "loaded" (compile_artifacts)
        self.warm_s = 0.0  # how long warm() took
        self.artifacts: CompileArtifacts | None = None  # where warm() loaded or kept the step
        self._fn = None  # the step compiled ahead of time (torch's AOTCompiledFunction)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                 past_blocks: torch.Tensor, past_valid: torch.Tensor, step_src: torch.Tensor):
        model, cfg = self.model, self.model.cfg
        num_seqs, past_len = past_valid.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, cfg.head_dim  # this rank's
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        hidden = self._embed(input_ids)
        cos, sin = model.rope_cos_sin(positions)
        in_place = attention_cpu.usable(kv_cache, head_dim)
        mask = past_valid[:, :, None, None]  # [B, L, 1, 1]: the past positions each row has
        from_step = (step_src >= 0)[:, :, None, None]  # [B, L, 1, 1]: a past position this step computes
        src = step_src.clamp(min=0)  # [B, L]: the row of the step that computes it
        residual = None
        new_k, new_v = [], []
        for i, layer in enumerate(model.layers):
            x, residual = fused_add_rms_norm_ref(hidden, residual, layer.attn_norm, cfg.rms_norm_eps)
            q, k, v = linear(x, layer.qkv, layer.qkv_bias).split([q_size, kv_size, kv_size], dim=-1)
            q, k = layer.norm_qk(q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim))  # Qwen3's q/k norm
            q, k = rotary_embedding_ref(q, k, cos, sin)
            v = v.view(-1, kv_heads, head_dim)
            new_k.append(k)
            new_v.append(v)
            k, v = cast(k, kv_cache.dtype), cast(v, kv_cache.dtype)  # as the cache will hold them
            if in_place:  # the C++ kernel reads the pool where it is (kernels/attention_cpu.py)
                attn = attention_cpu.decode_attention(cast(q, torch.float32), cast(k, torch.float32),
                                                      cast(v, torch.float32), kv_cache, i, past_blocks,
                                                      past_valid, step_src)
            else:
                # the past: from the cache, except positions an earlier row of this step computes (a
                # speculative entry's tokens before a draft row), taken from that row's new K/V
                past_k = torch.where(from_step, k[src],
                                     kv_cache[past_blocks, i, 0].view(num_seqs, past_len, kv_heads, head_dim))
                past_v = torch.where(from_step, v[src],
                                     kv_cache[past_blocks, i, 1].view(num_seqs, past_len, kv_heads, head_dim))
                attn = _decode_attention(q, k, v, past_k, past_v, mask)
            hidden = self._reduce(linear(cast(attn, q.dtype).reshape(num_seqs, q_size), layer.o_proj))
            x, residual = fused_add_rms_norm_ref(hidden, residual, layer.mlp_norm, cfg.rms_norm_eps)
            gate, up = linear(x, layer.gate_up).chunk(2, dim=-1)
            hidden = self._reduce(linear(F.silu(gate) * up, layer.down))
        out = fused_add_rms_norm_ref(hidden, residual, model.norm, cfg.rms_norm_eps)[0]
        return out, torch.stack(new_k, dim=1), torch.stack(new_v, dim=1)  # [B, hidden], [B, layers, Hkv, D] x2

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel product summed over the group (as ``LlamaLayer.forward``'s all-reduce)."""
        return torch.ops.tandem.all_reduce(x, 0) if self.tp > 1 else x

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``LlamaModel.embed_tokens``: on a rank, the rows of its share of the vocabulary, summed."""
        if self.tp == 1:
            return F.embedding(input_ids, self.model.embed)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_shard)
        rows = F.embedding(torch.where(mine, local, 0), self.model.embed)
        return self._reduce(torch.where(mine[:, None], rows, 0.0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states [B, hidden] of a decode-only step; writes its K/V into ``kv_cache``.

        Rows are decode rows, one token each. Where ``meta.step_starts`` is given, a row's context
        from its step start to its own token is computed by the rows just before it in this step
        (a speculative entry: the last token and its draft, a row per token), and the graph takes
        those positions' K/V from them, not from the cache: each row gets the bits it would get
        as a plain decode row at its position."""
        bs = self.block_size
        num_seqs = input_ids.shape[0]
        past = meta.seq_lens.long() - 1
        # at least 2 blocks (the spare ones masked): with 1, the table's length would equal the batch
        # size, which the graph was traced with apart
        num_blocks = max(2, -(-(meta.max_seq_len - 1) // bs))
        table = meta.block_tables[:, :num_blocks].long()
        if table.shape[1] < num_blocks:
            table = F.pad(table, (0, num_blocks - table.shape[1]))
        starts = torch.arange(num_blocks, device=table.device) * bs
        table = torch.where(starts[None, :] < past[:, None], table, 0)  # blocks past a length: block 0, masked
        offsets = torch.arange(num_blocks * bs, device=table.device)[None, :]
        past_valid = offsets < past[:, None]
        if self.model.cfg.window_layers:  # every layer windowed (unsupported_reason): the token at p sees (p - w, p]
            past_valid &= offsets > past[:, None] - self.model.cfg.sliding_window
        if meta.step_starts is None:
            step_src = torch.full_like(past_valid, -1, dtype=torch.long)
        else:  # position l of row r, when this step computes it: row r - (its position - l)
            rows = torch.arange(num_seqs, device=table.device)[:, None]
            step_src = torch.where(past_valid & (offsets >= meta.step_starts[:, None]),
                                   rows - past[:, None] + offsets, -1)
        if num_seqs == 1:
            # one graph serves every batch, so a sequence gets the same bits alone as among others:
            # alone, it gets a companion row with no past (its results are dropped)
            input_ids, positions = F.pad(input_ids, (0, 1)), F.pad(positions, (0, 1))
            table, past_valid = F.pad(table, (0, 0, 0, 1)), F.pad(past_valid, (0, 0, 0, 1))
            step_src = F.pad(step_src, (0, 0, 0, 1), value=-1)
        with torch.inference_mode():
            hidden, new_k, new_v = self._fn(self, input_ids, positions, kv_cache, table.reshape(-1), past_valid,
                                            step_src)
        hidden, new_k, new_v = hidden[:num_seqs], new_k[:num_seqs], new_v[:num_seqs]
        block = torch.div(meta.slot_mapping, bs, rounding_mode="floor")
        offset = meta.slot_mapping - block * bs
        kv_cache[block, :, 0, offset] = cast(new_k, kv_cache.dtype)
        kv_cache[block, :, 1, offset] = cast(new_v, kv_cache.dtype)
        self.num_steps += 1
        return hidden

    def warm(self, kv_cache: torch.Tensor, artifacts: CompileArtifacts | None = None,
             store: ArtifactStore | None = None, run_once: bool = True) -> None:
        """Make the step ready before traffic comes: load it from ``artifacts`` (this machine's, or
        fetched from ``store``) or compile it ahead of time (and keep it there, and offer it to
        ``store``); then run it once over block 0, whose results are dropped (nothing is written).
        ``run_once=False`` leaves that run to ``run_once`` (a rank of a group runs it with the others:
        it makes the group's collectives)."""
        started = time.perf_counter()
        self.artifacts = artifacts
        attention_cpu.load()  # before tracing or loading a graph that calls it
        _mark_pool_static(kv_cache)
        _mark_model_static(self.model)
        example = self._example(kv_cache)
        if artifacts is not None:
            artifacts.activate()
            if artifacts.complete() is None and store is not None:
                artifacts.fetch(store)
            if artifacts.complete() is not None:
                try:
                    self._fn = _load(artifacts.function_path.read_bytes(), self._forward)
                    self.source = "loaded"
                except Exception as exc:  # noqa: BLE001 - compiling here is the fallback
                    log.warning("the compiled step in %s cannot be loaded (%s: %s): compiling it again",
                                artifacts.dir, type(exc).__name__, exc)
        if self._fn is None:
            # emulate_precision_casts: a K/V rounded to a float16 / bfloat16 pool's dtype and read back
            # in float32 keeps the rounding inside a fused loop too (inductor drops the round trip
            # otherwise), so a row attends to the values the pool holds, as an eager step does
            compiler = torch.compile(self._forward, dynamic=True, fullgraph=True,
                                     options={"cpp_wrapper": True, "cpp.threads": self.threads,
                                              "emulate_precision_casts": True})
            with torch.inference_mode():
                self._fn = compiler.aot_compile((example, {}))
            self.source = "compiled"
            if artifacts is not None:
                artifacts.save_function(_serialize(self._fn), "compiled")
            # as for a loaded step (``_load``): its guards would refuse, say, the inference-mode
            # tensors of a warm-up request, and every call passes the traced ranks and dtypes anyway
            self._fn.disable_guard_check()
        if run_once:
            self.run_once(kv_cache)
        self.warm_s = time.perf_counter() - started
        log.info("decode step of %d layers %s in %.1f s%s", self.model.cfg.num_layers,
                 "loaded, compiled ahead of time," if self.source == "loaded" else "compiled", self.warm_s,
                 f" ({artifacts.dir})" if artifacts is not None else "")
        if artifacts is not None and store is not None:
            artifacts.offer(store)

    def run_once(self, kv_cache: torch.Tensor) -> None:
        """The step over block 0, its results dropped: brings the C++ libraries in (compiling any the
        cache lacks)."""
        with torch.inference_mode():
            self._fn(self, *self._example(kv_cache))

    def _example(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Inputs to trace with: sizes unlike each other and unlike the model's (torch gives equal
        sizes one symbol when it traces, which would tie the batch to, say, the number of KV heads),
        and above 1 (a size of 1 would be fixed in the graph)."""
        dev = kv_cache.device
        num_seqs, num_blocks = 5, 7
        valid = torch.zeros(num_seqs, num_blocks * self.block_size, dtype=torch.bool, device=dev)
        valid[:, 0] = True
        return (torch.zeros(num_seqs, dtype=torch.long, device=dev), torch.ones(num_seqs, dtype=torch.long, device=dev),
                kv_cache, torch.zeros(num_seqs * num_blocks, dtype=torch.long, device=dev), valid,
                torch.full((num_seqs, num_blocks * self.block_size), -1, dtype=torch.long, device=dev))


def _serialize(fn) -> bytes:
    return type(fn).serialize(fn).serialized_data


def _load(data: bytes, forward):
    """A step serialized by ``_serialize``, callable as ``fn(self, *inputs)``. Its guards are not
    checked: every call passes inputs of the traced ranks and dtypes (``forward``), and the model it
    reads from ``self`` has the structure the artifacts' key names."""
    import io

    fn = torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=forward.__func__.__globals__)
    fn.disable_guard_check()
    return fn


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor,
                      past_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query per sequence over its cached past and its own new key/value, in float32.

    q [B, H, D]; k, v [B, Hkv, D] (the step's token); past_k, past_v [B, L, Hkv, D] gathered from the
    pool; mask [B, L, 1, 1] true where a past position exists. Written as products and sums, not as
    matmuls over a concatenated K/V: inductor then reads the pool inside its reduction loops instead
    of copying the gathered K/V out first. The new token's score joins the softmax separately.
    Returns [B, H, D]."""
    num_seqs, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    scale = head_dim ** -0.5
    qg = cast(q, torch.float32).view(num_seqs, 1, kv_heads, heads // kv_heads, head_dim)  # [B, 1, Hkv, G, D]
    past = (qg * cast(past_k, torch.float32)[:, :, :, None, :]).sum(-1) * scale  # [B, L, Hkv, G]
    past = torch.where(mask, past, float("-inf"))  # also drops whatever an unused slot holds (NaN included)
    own = (qg[:, 0] * cast(k, torch.float32)[:, :, None, :]).sum(-1) * scale  # [B, Hkv, G]
    top = torch.maximum(past.amax(dim=1), own)
    p_past = torch.exp(past - top[:, None])
    p_own = torch.exp(own - top)
    values = torch.where(mask, cast(past_v, torch.float32), 0.0)[:, :, :, None, :]  # [B, L, Hkv, 1, D]
    out = (p_past[..., None] * values).sum(1) + p_own[..., None] * cast(v, torch.float32)[:, :, None, :]
    out = out / (p_past.sum(1) + p_own)[..., None]  # [B, Hkv, G, D]
    return out.reshape(num_seqs, heads, head_dim)


def _mark_model_static(value, seen: set[int] | None = None) -> None:
    """Every tensor the model holds (weights, their scales and panels, rotary tables) gets fixed
    sizes in the graph: the model's structure is part of the artifacts' key anyway. Left symbolic,
    a weight's size that happens to equal the traced pool's number of blocks would share its symbol
    (torch gives equal sizes one symbol), and the graph would refuse that weight once the pool had
    another size (a 1B model's o_proj panels, 128, against the compile process's 128-block pool)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        torch._dynamo.mark_static(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _mark_model_static(item, seen)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _mark_model_static(getattr(value, field.name), seen)
    elif type(value).__module__.startswith("shared.") and hasattr(value, "__dict__"):
        for item in vars(value).values():
            _mark_model_static(item, seen)


def _mark_pool_static(kv_cache: torch.Tensor) -> None:
    """Every dimension of the KV pool but the number of blocks is fixed by the model: no symbols for
    them (one of size 2 or 3 would otherwise share a symbol with a batch of that size). The number of
    blocks stays symbolic, so that a graph cached on disk serves any pool size."""
    for dim in range(1, kv_cache.dim()):
        torch._dynamo.mark_static(kv_cache, dim)
