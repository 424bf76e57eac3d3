"""The model's kernels and the KV gather: for each op a plain-torch reference (``<op>_ref``, the CPU
path and the oracle) and a Triton kernel (``<op>_triton``, same signature, in ``<op>_triton.py``).

| op | reference | Triton |
|---|---|---|
| paged decode attention (split-K) | decode_attention.py | decode_attention_triton.py |
| paged prefill/extend attention | prefill_attention.py | prefill_attention_triton.py |
| KV write (slot_mapping scatter) | kv_write.py | kv_write_triton.py |
| KV block gather / scatter | kv_gather.py | kv_gather_triton.py |
| fused residual add + RMSNorm | rms_norm.py | rms_norm_triton.py |
| rotary embedding | rotary.py | rotary_triton.py |
| MoE grouped linear (experts' GEMMs) | moe_grouped.py | moe_grouped_triton.py |

Reference modules import only torch (triton is absent on some platforms) and ``cast.py``, the
dtype conversion they share that skips no-op casts; a Triton module may
import its reference, never the other way round. The model runs the references through
``TorchAttentionBackend`` (shared/model/attention.py) and the Triton kernels through
``backend.py``'s ``TritonAttentionBackend``, which that module selects on CUDA; the experts of
``MoeBlock`` (shared/model/moe.py) pick the grouped linear themselves. ``dispatch.py``
serves callers outside the model (the KV transfer's gather). Tests: tests/kernels (interpreter on
CPU); ``python -m kernels.compile_check`` compiles everything for sm_90 without a GPU;
loadtest/bench/kernels.py benchmarks on a GPU.
"""

from kernels.reproducible import pin_mkl_branch

pin_mkl_branch()
