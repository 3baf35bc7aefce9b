#!/usr/bin/env bash
# The worker engine's GPU run in one command, from a clean checkout on a CUDA
# machine with the project installed (`make venv` there, or PYTHON=python3
# where outrider is installed into the system's Python):
#
#   make bench-gpu                    # or: scripts/bench_gpu.sh [OUT]
#
# 1. the CUDA tests (greedy identity on a tiny model and the default model in
#    float32, CPU-vs-CUDA seeded equality);
# 2. `outrider bench --concurrency 1,8,32,64`, 8 MT-Bench prompts × 64 tokens,
#    EOS ignored, target-only and prompt lookup K=4 against Hugging Face
#    `generate` (padded batches) and `generate_batch`, in float32 (outputs
#    must equal Hugging Face's) and bfloat16;
# 3. the cost of one step by shape (`outrider bench steps`).
#
# Everything lands in OUT (default docs/gpu-<date>): tables, JSON, plots.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${1:-docs/gpu-$(date +%Y%m%d)}
PROMPTS=${PROMPTS:-mt-bench}
mkdir -p "$OUT"

"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: this run needs one")'
"$PYTHON" -m pytest -q -m cuda tests/cuda 2>&1 | tee "$OUT/cuda-tests.txt"
for dtype in float32 bfloat16; do
    "$PYTHON" -m outrider bench --prompts "$PROMPTS" --limit 8 --max-new-tokens 64 --ignore-eos \
        --device cuda --dtype "$dtype" --concurrency 1,8,32,64 --drafters prompt-lookup --k 4 --no-adaptive \
        --json "$OUT/bench-concurrency-$dtype.json" --plot "$OUT/bench-concurrency-$dtype.png" --no-progress \
        2>&1 | tee "$OUT/bench-concurrency-$dtype.txt"
done
"$PYTHON" -m outrider bench steps --device cuda --shapes 1x1,1x5,8x5,32x5,64x5 \
    --json "$OUT/engine-step-smollm2.json" --no-progress 2>&1 | tee "$OUT/engine-step-smollm2.txt"
echo "results in $OUT"
