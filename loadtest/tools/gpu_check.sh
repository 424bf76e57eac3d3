#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one pass of a few minutes, each step under its own time limit:
#
#   1. the kernel tests compiled for the GPU (TRITON_INTERPRET=0 pytest tests/kernels), against the
#      torch references and a float64 oracle, as the CPU runs them under the Triton interpreter;
#   2. python -m loadtest.bench.kernels: paged decode attention as a fraction of HBM bandwidth and
#      against SDPA / FlexAttention, causal prefill attention in TFLOP/s, KV gather/scatter;
#   3. the engine on the GPU: a random-weight Llama-3.2-1B-shaped model (bf16), decode tokens/s at
#      batch 1/8/32: decode steps replayed from CUDA graphs, then eager with the Triton attention
#      backend and eager with torch's (the baselines, in the same run);
#   4. python -m loadtest.bench.speculative on the GPU (n-gram drafts verified in the CUDA graphs,
#      against plain decoding, same run) at batch 1 and 4, on GPU_CHECK_SPEC_MODEL (default the 1B
#      model of step 3, whose random weights make its acceptance meaningless: give it a real model).
#   5. on a machine with two GPUs or more: python -m loadtest.bench.parallel on the model of step 3,
#      TP=2 and PP=2 against one GPU (the ranks' collectives over NCCL, the same code gloo and the
#      shared-memory collectives run on a CPU).
#
#   loadtest/tools/gpu_check.sh [OUT_DIR]      (default loadtest/results/gpu; run from the repo root)
#
# GPU_CHECK_SKIP="bench_kernels decode_torch" (say) leaves those steps out.
# Everything lands in OUT_DIR: gpu_check.log (every step's output), bench_kernels.json/.png,
# decode_graphs.json, decode_triton.json, decode_torch.json, speculative_b{1,4}/. Step 3 writes its vocabulary from a tokenizer GGUF:
# TANDEM_TOKENIZER_GGUF (default: the SmolLM2 alias, which `tandem model fetch` caches; any small
# GGUF with a tokenizer does, e.g. one written by `python -m loadtest.tools.synth_model --shape tiny`).
set -u
out=${1:-loadtest/results/gpu}
mkdir -p "$out"
log="$out/gpu_check.log"
: > "$log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python3}
model=${TMPDIR:-/tmp}/gpu-check-llama-1b-f16.gguf

step() {  # step NAME SECONDS COMMAND...: run it under a time limit, keep its output, go on whatever it returns
  local name=$1 limit=$2 started rc
  shift 2
  case " ${GPU_CHECK_SKIP:-} " in *" $name "*) echo "=== $name: skipped (GPU_CHECK_SKIP)" | tee -a "$log"; return;; esac
  started=$(date +%s)
  echo "=== $name (limit ${limit} s): $*" | tee -a "$log"
  timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  echo "=== $name: exit $rc after $(( $(date +%s) - started )) s" | tee -a "$log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee -a "$log"
"$python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$log"
step kernel_tests 150 env TRITON_INTERPRET=0 "$python" -m pytest tests/kernels -q -rfE -p no:cacheprovider
step bench_kernels 170 "$python" -m loadtest.bench.kernels --out "$out/bench_kernels.json"
step synth_model 50 "$python" -m loadtest.tools.synth_model --shape llama-1b --format gguf-f16 \
  --tokenizer-from "${TANDEM_TOKENIZER_GGUF:-smollm2-135m}" --out "$model"
for run in "graphs triton on" "triton triton off" "torch torch off"; do
  set -- $run
  step "decode_$1" 60 "$python" -m loadtest.bench.decode --model "$model" --device cuda --dtype bfloat16 \
    --attention-backend "$2" --compile "$3" --batch-sizes 1,8,32 --steps 32 --repeats 2 --out "$out/decode_$1.json"
done
for batch in 1 4; do
  step "speculative_b$batch" 150 "$python" -m loadtest.bench.speculative --model "${GPU_CHECK_SPEC_MODEL:-$model}" \
    --device cuda --compile on --batch "$batch" --repeats 2 --out "$out/speculative_b$batch"
done
if [ "$(nvidia-smi --list-gpus | wc -l)" -ge 2 ]; then
  step parallel 300 "$python" -m loadtest.bench.parallel --model "$model" --device cuda --dtype bfloat16 --tp 2 --pp 2 \
    --baseline-threads 1 --batch-sizes 1,8,32 --out "$out/parallel"
else
  echo "=== parallel: skipped (one GPU: tensor and pipeline parallelism need two)" | tee -a "$log"
fi
grep -E "^=== .*exit|passed|failed|batch +[0-9]+:|^(edit|chat):|^(TP|PP)=" "$log"
# 6. the MoE grouped GEMM (kernels/moe_grouped_triton.py, MoeBlock's kernel "auto") against MoeBlock's torch
#    loop over the experts (kernel "torch"), one Mixtral-8x7B-shaped layer in bf16 with random weights,
#    routing included, at decode and prefill token counts: timings only, lines "moe_grouped T=..." in the log.
step moe_grouped 120 "$python" - <<'PY'
import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

from shared.model.config import Moe
from shared.model.moe import MoeBlock

E, k, hidden, width = 8, 2, 4096, 14336
gen = torch.Generator(device="cuda").manual_seed(0)
weights = [torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
           for shape in ((E, hidden), (E, 2 * width, hidden), (E, hidden, width))]
moe = Moe(num_experts=E, top_k=k, intermediate_size=width, renormalize=True, round_weights=False, layers=(0,))
blocks = {kernel: MoeBlock(moe, *weights, F.silu, kernel=kernel) for kernel in ("triton", "torch")}
for T in (1, 8, 32, 256, 2048):
    x = torch.randn(T, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    torch.testing.assert_close(blocks["triton"].forward(x), blocks["torch"].forward(x), rtol=2e-2, atol=2e-2)
    us = {kernel: Timer("block.forward(x); torch.cuda.synchronize()", globals={"block": block, "x": x, "torch": torch})
          .blocked_autorange(min_run_time=1.0).median * 1e6 for kernel, block in blocks.items()}
    print(f"moe_grouped T={T}: triton {us['triton']:.0f} us, torch loop {us['torch']:.0f} us", flush=True)
PY
grep -E "^=== moe_grouped|^moe_grouped T=" "$log"
