"""A plan written by hand (no search): prefill on H100s, decode on one big and one small group."""

from shared.planner.config import MODEL_PRESETS, ClusterSpec, GpuType, Node, Slo
from shared.planner.plan import Plan, WorkerPlan

TYPES = {"h100": GpuType(tflops_bf16=989, hbm_gib=80, hbm_gbps=3350, price_per_hour=3.5),
         "a100": GpuType(tflops_bf16=312, hbm_gib=80, hbm_gbps=2039, price_per_hour=2.0),
         "a6000": GpuType(tflops_bf16=155, hbm_gib=48, hbm_gbps=768, price_per_hour=0.8)}


def hand_plan():
    spec = ClusterSpec(gpu_types=TYPES, inter_node_gbps=25, nodes=[
        Node(name="h", gpu_type="h100", num_gpus=8, intra_gbps=450),
        Node(name="a", gpu_type="a100", num_gpus=8, intra_gbps=300),
        Node(name="s", gpu_type="a6000", num_gpus=4, intra_gbps=25)])

    def worker(name, role, node, n, gpu):
        return WorkerPlan(worker_id=name, role=role, gpu_type=gpu, gpus=[f"{node}/gpu{i}" for i in range(n)],
                          tp=n, pp=1, capacity_rps=0, assigned_rps=0, latency_s=0, price_per_hour=0)
    workers = [worker("decode-0", "decode", "a", 8, "a100"), worker("decode-1", "decode", "s", 4, "a6000"),
               worker("prefill-0", "prefill", "h", 8, "h100")]
    plan = Plan(model="llama-2-70b", num_gpus=20, request_rate=1, mean_input_len=2048, mean_output_len=512,
                slo=Slo(ttft_s=3, tpot_s=0.1), workers=workers, routes=[], capacity_rps=1, throughput_rps=1,
                output_tokens_per_s=1, predicted_ttft_s=1, predicted_tpot_s=0.05, cost_per_hour=1,
                cost_per_million_output_tokens=1, planning_time_s=0, search_history=[])
    return spec, plan, MODEL_PRESETS["llama-2-70b"]
