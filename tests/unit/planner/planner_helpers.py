"""Small clusters built in code (GPU figures as in examples/clusters/)."""

from __future__ import annotations


from shared.planner.config import ClusterSpec, GpuType, Node

GPU_TYPES = {
    "h100": GpuType(tflops_bf16=989, hbm_gib=80, hbm_gbps=3350, price_per_hour=3.5),
    "a100": GpuType(tflops_bf16=312, hbm_gib=80, hbm_gbps=2039, price_per_hour=2.0),
    "l40": GpuType(tflops_bf16=181, hbm_gib=48, hbm_gbps=864, price_per_hour=1.1),
    "a6000": GpuType(tflops_bf16=155, hbm_gib=48, hbm_gbps=768, price_per_hour=0.8),
}
INTRA = {"h100": 450, "a100": 300, "l40": 25, "a6000": 25}


def make_cluster(*nodes: tuple[str, int], inter_gbps: float = 12.5) -> ClusterSpec:
    return ClusterSpec(gpu_types=GPU_TYPES, inter_node_gbps=inter_gbps,
                       nodes=[Node(name=f"n{i}-{t}", gpu_type=t, num_gpus=c, intra_gbps=INTRA[t])
                              for i, (t, c) in enumerate(nodes)])


