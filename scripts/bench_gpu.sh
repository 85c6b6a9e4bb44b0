#!/usr/bin/env bash
# One H200 (about 4 minutes): MFU of the 1.3B GPT (configs/gpt-1b.yaml, bf16, remat) per ZeRO
# stage and schedule on one GPU, and the compile time of the same shapes at 2 and 16 layers.
# On one device the stages move no bytes; this measures what each schedule costs in compute.
#   device tool:  bash scripts/bench_gpu.sh    (results in $OUT/bench_gpu.json, or ./bench_gpu.json)
# Record the summary in BENCHMARKS.md with the date and this command.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
# The GPU image brings jax with CUDA; install only zerojax and what jax does not bring.
python -m pip install --quiet --no-deps -e . 2>/dev/null || true
python -c "import flax, optax, orbax.checkpoint, ml_dtypes, yaml, rich" 2>/dev/null \
  || python -m pip install --quiet flax optax orbax-checkpoint ml_dtypes pyyaml rich
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 280 python scripts/bench.py --config configs/gpt-1b.yaml --steps 5 --stages 0,3 \
  --schedules shard_map,gspmd --peak-tflops 989 --xla-preset gpu --out "$out/bench_gpu.json" \
  train.global_batch=8 train.grad_accum=1 mesh.replica=1 mesh.data=1
