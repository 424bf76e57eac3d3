"""Attention and KV-movement kernels: for each op a plain-torch reference (``<op>_ref``, the CPU
path and the oracle) and a Triton kernel (``<op>_triton``, same signature, in ``<op>_triton.py``).

| op | reference | Triton |
|---|---|---|
| paged decode attention (split-K) | decode_attention.py | decode_attention_triton.py |
| paged prefill/extend attention | prefill_attention.py | prefill_attention_triton.py |
| KV write (slot_mapping scatter) | kv_write.py | kv_write_triton.py |
| KV block gather / scatter | kv_gather.py | kv_gather_triton.py |
| FP8 e4m3 KV quantize / dequantize | kv_fp8.py | kv_fp8_triton.py |
| fused residual add + RMSNorm | rms_norm.py | rms_norm_triton.py |
| rotary embedding | rotary.py | rotary_triton.py |

Reference modules import only torch (triton is absent on some platforms); ``backend.py`` is the
Triton attention backend that shared/model/attention.py selects on CUDA. ``gather_kv_blocks``,
``scatter_kv_blocks``, ``quantize_kv_fp8`` and ``dequantize_kv_fp8`` pick Triton on CUDA and the
reference elsewhere. Tests: tests/kernels (interpreter on CPU); ``python -m kernels.compile_check``
compiles everything for sm_90 without a GPU; loadtest/bench_kernels.py benchmarks on a GPU.
"""
