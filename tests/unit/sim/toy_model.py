"""A toy model with round figures, for tests whose expected values are worked out by hand.

1e9 parameters, 10 layers, hidden 1000, 10 KV heads of 100, 2-byte weights and KV:
weights 2e9 B, KV 2·10·10·100·2 = 40,000 B per token. On the nominal CPU "GPU" of
``loadtest.calibrate.sim.cpu_cluster_spec`` (1 TFLOP/s, 100 GB/s) at efficiency 0.5 each, with
0.1 s per prefill and 0.01 s per running sequence per decode step (``TOY_EFF``):

* prefill of T tokens: (2·1e9·T + 2·10·1000·T²) / 5e11 FLOP/s + 0.1 s
* decode step of B sequences at context C: max((2e9 + B·C·40,000) / 5e10 B/s, 2e9·B / 5e11 FLOP/s)
  + 0.01·B s
"""

from dataclasses import replace

from shared.planner.config import ModelSpec
from shared.planner.costmodel import Efficiency

TOY = ModelSpec(name="toy", num_layers=10, hidden_size=1000, num_heads=10, num_kv_heads=10, vocab_size=1000,
                num_params=1e9)
TOY_EFF = replace(Efficiency(), compute=0.5, hbm=0.5, prefill_overhead_s=0.1, decode_seq_s=0.01)
