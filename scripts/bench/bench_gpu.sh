#!/usr/bin/env bash
# The first GPU's benchmark, under a hard 8-minute cap: `scripts/bench/bench.py plan` runs each
# measurement of its PLAN (listed with estimated H200 seconds in BENCHMARKS.md's GPU section)
# in its own process and rewrites one JSON document after each, so a cut-short run keeps what
# it measured; at the end it prints a Markdown summary for BENCHMARKS.md.
#
#   bash scripts/bench/bench_gpu.sh             one H200: $OUT/bench_gpu.json (+ .log), default OUT=runs/bench_gpu
#   bash scripts/bench/bench_gpu.sh --dry-run   the same plan on CPU, tiny shapes (tests/test_bench.py, CI)
#   bash scripts/bench/bench_gpu.sh [--dry-run] --only gpt1b_s3_shard_map,fit_s3   (more `bench.py plan` options)
#   bash scripts/bench/bench_gpu.sh --only llama1b_8k_blockwise,llama1b_8k_cudnn   long sequences: cuDNN's
#        attention against the pure-JAX blockwise one, llama-1b at seq 8192 (benchlib/plan.py's LONG)
#   bash scripts/bench/bench_gpu.sh --only pi05_full_s3,pi05_lora_s3   π0.5 (configs/pi05.yaml, 3.35B) at
#        stage 3, full and openpi's LoRA: samples/s, MFU, peak memory against analyze (zerojax's side of
#        BENCHMARKS.md's "π0.5's training step against LeRobot 0.6.1"). LeRobot's side needs LeRobot 0.6.1
#        with a CUDA torch, which the GPU image lacks; where a venv has them:
#        python scripts/bench/policy_step.py --threads 0 --lerobot-device cuda --lerobot-python VENV/bin/python
#   Issue 44's GPU rows, after the plan (each a few seconds; the image's python3 with PYTHONPATH=.):
#        JAX_PLATFORMS=cuda python scripts/bench/augment_step.py --rounds 5 --steps 3 --image-size 224 --batch 8: the step's
#        cost with data.augment=none|openpi|lerobot (BENCHMARKS.md "Image augmentation's cost")
#        python scripts/bench/rtc_cost.py --requests 200 --delay 4   the server's time per request of real-time
#        chunking's kinds (BENCHMARKS.md "Real-time chunking: the server's time per request")
#
# PYTHON picks the interpreter (GPU: the image's python3, with its jax; dry run: .venv's, else
# python3). Record the GPU run's summary in BENCHMARKS.md with the date and this command.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-runs/bench_gpu}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's zerojax, nothing installed

dry_run=false
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=true; shift; fi
if $dry_run; then
  py="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}"
  export JAX_PLATFORMS=cpu
  # The rehearsal checks the plan's plumbing, not CPU speed: LLVM's optimisations cost more
  # compile time than they save on its tiny shapes.
  export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_backend_optimization_level=0"
  # 218 s alone on this workplace's 2-core machine (2026-12-01); CI runs it beside another test
  # worker, where 300 s was not enough (fit_s0 was cut short), so the cap leaves room for that.
  cap=600
  args=(--dry-run --steps 2 --warmup 1 --peak-tflops 989 --xla-preset gpu --fit-budget-gb 0.003 --fit-max-steps 2)
else
  py="${PYTHON:-python3}"
  # Reuse the jax the GPU image brings (never reinstall it): fail at once if it sees no GPU.
  if ! "$py" -c 'import jax; assert jax.default_backend() == "gpu"' 2>/dev/null; then
    echo "bench_gpu: $py's jax has no GPU backend ($("$py" -c 'import jax; print("jax", jax.__version__, "backend", jax.default_backend())' 2>&1 | tail -1)); run it on the GPU image's python3, or pass --dry-run" >&2
    exit 2
  fi
  # Install only what is missing, next to that jax (the machine reaches no registry: carried
  # wheels in .whl/ if there are any).
  missing=$("$py" - <<'EOF'
import importlib.util
need = {"flax": "flax", "optax": "optax", "orbax.checkpoint": "orbax-checkpoint", "ml_dtypes": "ml_dtypes",
        "yaml": "pyyaml", "rich": "rich", "safetensors": "safetensors", "numpy": "numpy"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod.split(".")[0]) is None
               or (mod == "orbax.checkpoint" and importlib.util.find_spec(mod) is None)))
EOF
)
  if [[ -n "$missing" ]]; then
    echo "bench_gpu: installing what the image lacks: $missing" >&2
    where=(); [[ -d .whl ]] && where=(--no-index --find-links .whl)
    "$py" -m pip install --quiet --retries 0 --timeout 5 "${where[@]}" $missing "jax==$("$py" -c 'import jax; print(jax.__version__)')" \
      || { echo "bench_gpu: could not install $missing (carry them as wheels in .whl/)" >&2; exit 2; }
  fi
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  # The fit search's budget is the allocator's limit: let it have most of the card, not JAX's 75%.
  export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}"
  cap=480
  args=(--steps 5 --warmup 2 --peak-tflops 989 --xla-preset gpu)
fi

mkdir -p "$out"
# The hard cap: SIGTERM at $cap s (the plan then records the rest as cut short), SIGKILL 15 s
# later. The plan's own deadline starts nothing it cannot finish before the cap.
timeout -k 15 "$cap" "$py" scripts/bench/bench.py plan --out "$out/bench_gpu.json" --deadline-s $((cap - 10)) "${args[@]}" "$@"
