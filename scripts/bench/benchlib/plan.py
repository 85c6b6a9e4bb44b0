"""`plan`: what the first GPU measures, and the runner that measures it, one fresh process per
measurement, under a deadline, rewriting one JSON document after each.

Each measurement has an estimate of its seconds on one H200 (process start ~8 s, compile of a
1B step ~25 s, the timed steps a few seconds). The estimates are guesses until the first run;
its JSON has each measurement's wall_s.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zerojax import config as config_lib

from benchlib import ENTRY, ROOT, write_json
from benchlib.summary import markdown, summary

GPT_1B, LLAMA_1B, S3 = "configs/gpt-1b.yaml", "configs/llama-1b.yaml", "gpt1b_s3_shard_map"
SETUP_S = 10  # bench_gpu.sh before the plan: the GPU check, nvidia-smi
BASE = ("train.global_batch=8", "train.grad_accum=1")  # 16k tokens per step
DRY = ("model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=2",
       "model.d_ff=256", "model.seq_len=32", "train.global_batch=16",
       "zero.min_shard_size=1024")  # so that the tiny blocks are still sharded and gathered


@dataclasses.dataclass(frozen=True)
class Measurement:
    name: str
    what: str  # one line, for BENCHMARKS.md
    h200_s: int  # estimated seconds on one H200, process start and compile included
    overrides: tuple[str, ...] = ()
    config: str = GPT_1B
    feature: str | None = None  # a feature that may not have landed yet: skipped (named) if so
    baseline: str | None = None  # its step time is compared with this measurement's
    fit_stage: int | None = None  # instead of throughput: the largest scaling that fits
    quant_overhead: bool = False  # also time the quantized gathers' own work (no network)
    dry: tuple[str, ...] = ()  # more overrides for the CPU rehearsal
    plan_check: bool = False  # instead of throughput: `zerojax plan` (on the CPU), then its winner run here


PLAN = (
    Measurement("gpt1b_s0_shard_map", "gpt-1b, stage 0, shard_map: MFU, tokens/s, peak memory", 40,
                ("zero.stage=0", "zero.schedule=shard_map")),
    Measurement(S3, "gpt-1b, stage 3, shard_map", 40, ("zero.stage=3", "zero.schedule=shard_map")),
    Measurement("gpt1b_s0_gspmd", "gpt-1b, stage 0, gspmd", 40, ("zero.stage=0", "zero.schedule=gspmd")),
    Measurement("gpt1b_s3_gspmd", "gpt-1b, stage 3, gspmd", 40, ("zero.stage=3", "zero.schedule=gspmd")),
    Measurement("llama1b_s3", "llama-1b, stage 3, shard_map", 40, ("zero.stage=3",), config=LLAMA_1B,
                feature="model.family=llama (configs/llama-1b.yaml)", dry=("model.n_kv_heads=1",)),
    Measurement("offload_optimizer_s3", "gpt-1b, stage 3, zero.offload=optimizer: step time vs none", 45,
                ("zero.stage=3", "zero.offload=optimizer"), feature="zero.offload=optimizer", baseline=S3),
    Measurement("offload_optimizer_master_s3", "gpt-1b, stage 3, zero.offload=optimizer+master", 50,
                ("zero.stage=3", "zero.offload=optimizer+master"), feature="zero.offload=optimizer+master",
                baseline=S3),
    Measurement("gather_int8_s3", "gpt-1b, stage 3, precision.gather=int8: step time vs bf16 gathers, and the "
                "quantize + dequantize time of every unit's two gathers per step vs a plain cast (one device "
                "shards nothing: its step gathers nothing)", 45, ("zero.stage=3", "precision.gather=int8"),
                baseline=S3, quant_overhead=True),
    Measurement("fit_s3", "largest depth x width scaling of gpt-1b that fits, stage 3 (compile only), "
                "then one real step of it", 95, ("zero.stage=3",), fit_stage=3),
    Measurement("fit_s0", "the same for stage 0 (on one device, N = 1, stages shard nothing: "
                "skipped, named)", 10, ("zero.stage=0",), fit_stage=0),
)
# Not in the 8-minute plan (they would not fit): run with `--only fit_s3_offload,plan_check` on a
# later lease.
EXTRA = (
    Measurement("plan_check", "`zerojax plan` of gpt-1b for this GPU (compiled on the CPU, as users run it), "
                "then its winner run here: measured peak vs the plan's compiled peak and budget, measured "
                "step time vs its estimate", 150, (), plan_check=True),
    Measurement("fit_s3_offload", "largest scaling of gpt-1b that fits at stage 3 with zero.offload="
                "optimizer+master (host bytes not counted against the device), then one real step of it", 95,
                ("zero.stage=3", "zero.offload=optimizer+master"), fit_stage=3, feature="zero.offload=optimizer+master"),
)
# π0 (configs/pi0.yaml, 3.24B; issue 24): batch 32, one 224² camera, H = 50, remat full, on one
# H200 (the tiny LeRobot dataset only names the batch's keys; the bench feeds random batches).
# Not in the 8-minute plan either (two ~3B compiles): `--only pi0_full_s3,pi0_lora_s3`.
PI0 = "configs/pi0.yaml"
PI0_BASE = ("train.global_batch=32", "data.source=lerobot:tests/fixtures/lerobot/tiny",
            "data.cameras=observation.images.front", "zero.stage=3")
PI0_DRY = ("model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.head_dim=8",
           "model.d_ff=64", "model.expert.d_model=16", "model.expert.d_ff=48", "model.action.horizon=4",
           "data.action_horizon=4", "model.action.prompt_len=6", "data.prompt_len=6", "model.vision.image_size=28",
           "data.image_size=28", "model.vision.d_model=24", "model.vision.n_layers=2", "model.vision.n_heads=2",
           "model.vision.d_ff=48", "train.global_batch=16")  # 28² at patch 14: 4 image tokens
EXTRA += (
    Measurement("pi0_full_s3", "π0 (3.24B), stage 3, full fine-tuning: step time, samples/s, MFU, peak memory "
                "(openpi: more than 70 GB on one card)", 120, PI0_BASE, config=PI0, dry=PI0_DRY),
    Measurement("pi0_lora_s3", "π0, stage 3, openpi's low-memory recipe: LoRA r16 on the VLM's Gemma and r32 on "
                "the expert's, their bases frozen, tower and projections trained (openpi: more than 22.5 GB)", 100,
                (*PI0_BASE, "optim.lora.rank=16", "optim.lora.alpha=16", "optim.lora.rank_pattern=expert:32",
                 "optim.lora.alpha_pattern=expert:32", "optim.lora.targets=language,expert", "optim.lora.base=targets"),
                config=PI0, dry=(*PI0_DRY, "optim.lora.rank=4", "optim.lora.rank_pattern=expert:8")),
)
# π0.5 (configs/pi05.yaml, 3.35B; issue 33): the same, with no dataset named (the model's widest
# batch: one 224² camera, H = 50, prompts of 200 tokens). `--only pi05_full_s3,pi05_lora_s3`.
PI05 = "configs/pi05.yaml"
PI05_DRY = (*(o for o in PI0_DRY if not o.startswith(("model.action.prompt_len", "data.prompt_len", "model.vocab"))),
            "model.vocab_size=256", "model.n_heads=8", "model.n_kv_heads=1", "model.head_dim=4", "model.action.prompt_len=24",
            "data.prompt_len=24")  # prompts hold the state's bins
EXTRA += (
    Measurement("pi05_full_s3", "π0.5 (3.35B), stage 3, full fine-tuning: step time, samples/s, MFU, peak memory "
                "(openpi #667: fsdp_devices=2 on 2 x A100-80 runs out of memory)", 120,
                ("train.global_batch=32", "zero.stage=3"), config=PI05, dry=PI05_DRY),
    Measurement("pi05_lora_s3", "π0.5, stage 3, openpi's LoRA: r16 on the VLM's Gemma and r32 on the expert's, "
                "their bases frozen", 100,
                ("train.global_batch=32", "zero.stage=3", "optim.lora.rank=16", "optim.lora.alpha=16",
                 "optim.lora.rank_pattern=expert:32", "optim.lora.alpha_pattern=expert:32",
                 "optim.lora.targets=language,expert", "optim.lora.base=targets"),
                config=PI05, dry=(*PI05_DRY, "optim.lora.rank=4", "optim.lora.rank_pattern=expert:8")),
)
# Long sequences (issue 34): llama-1b at seq 8192, the flash-style pure-JAX attention against
# cuDNN's fused one (bf16: configs/llama-1b.yaml's compute dtype), the chunked loss in both.
# Not in the 8-minute plan: `--only llama1b_8k_blockwise,llama1b_8k_cudnn`. The CPU rehearsal
# runs both blockwise (cuDNN is refused off a GPU) with blocks of 16 keys on its 32 tokens.
LONG = ("zero.stage=3", "model.seq_len=8192", "train.global_batch=2")
LONG_DRY = ("model.n_kv_heads=1", "model.attention=blockwise", "model.attention_block=16")
EXTRA += (
    Measurement("llama1b_8k_blockwise", "llama-1b, stage 3, seq 8192, model.attention=blockwise (pure JAX, "
                "flash-style): step time, tokens/s, peak memory", 70, (*LONG, "model.attention=blockwise"),
                config=LLAMA_1B, feature="model.attention", dry=LONG_DRY),
    Measurement("llama1b_8k_cudnn", "the same with model.attention=cudnn (jax.nn.dot_product_attention's cuDNN "
                "kernel): step time vs blockwise", 70, (*LONG, "model.attention=cudnn"), config=LLAMA_1B,
                feature="model.attention", baseline="llama1b_8k_blockwise", dry=LONG_DRY),
)
BY_NAME = {m.name: m for m in PLAN + EXTRA}


def overrides(m: Measurement, dry_run: bool) -> list[str]:
    return [*BASE, *m.overrides, *((*DRY, *m.dry) if dry_run else ())]


def unavailable(m: Measurement, dry_run: bool) -> str | None:
    """Why `m` cannot run with this zerojax (None: it can). Only a measurement of a feature may
    be skipped; for the others a config that does not load is an error (ValueError)."""
    try:
        if not (ROOT / m.config).is_file():
            raise ValueError(f"{m.config} does not exist")
        config_lib.load(ROOT / m.config, overrides(m, dry_run))
    except ValueError as err:
        if m.feature is None:
            raise
        return f"{m.feature}: not in zerojax yet ({err})"
    return None


# ---------------------------------------------------------------------------------------------
# The plan, run measurement by measurement.

MIN_START_S = 15  # a measurement is not started with less time left before the deadline


class CutShort(Exception):
    """SIGTERM (the shell's hard timeout): record what is left as skipped, and stop."""


def cut_short(signum, frame):
    raise CutShort()


def child_flags(opts) -> list[str]:
    flags = ["--steps", str(opts.steps), "--warmup", str(opts.warmup)]
    for name in ("peak_tflops", "xla_preset", "fit_budget_gb", "fit_max_steps"):
        if getattr(opts, name):
            flags += [f"--{name.replace('_', '-')}", str(getattr(opts, name))]
    return flags + (["--dry-run"] if opts.dry_run else [])


def run_child(m: Measurement, opts, limit_s: float, workdir: Path, log) -> dict:
    result = workdir / f"{m.name}.json"
    cmd = [sys.executable, str(ENTRY), "measure", m.name, "--result", str(result), *child_flags(opts)]
    print(f"== {m.name}: {' '.join(cmd[1:])}", file=log, flush=True)
    child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        child.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": f"killed after {limit_s:.0f} s"}
    finally:
        if child.poll() is None:  # timed out, or SIGTERM reached us: end its process group
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    if result.is_file():
        return json.loads(result.read_text())
    return {"status": "error", "error": f"exited {child.returncode} without a result (see the log)"}


def run_one(m: Measurement, opts, deadline: float, workdir: Path, log) -> dict:
    try:
        reason = unavailable(m, opts.dry_run)
    except ValueError as err:
        return {"status": "error", "error": str(err)}
    if reason:
        return {"status": "skipped", "reason": reason}
    left = deadline - time.monotonic()
    if left < MIN_START_S:
        return {"status": "skipped", "reason": f"no time left ({left:.0f} s before the deadline)"}
    start = time.monotonic()
    entry = run_child(m, opts, min(left, max(3 * m.h200_s, 120)), workdir, log)
    return {**entry, "wall_s": round(time.monotonic() - start, 1)}


def plan_main(opts) -> int:
    chosen = [m for m in PLAN + EXTRA if m.name in opts.only.split(",")] if opts.only else list(PLAN)
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta(opts), "plan": [plan_row(m) for m in chosen], "results": {}}
    write_json(out, doc)
    started, deadline = time.monotonic(), time.monotonic() + opts.deadline_s
    signal.signal(signal.SIGTERM, cut_short)
    with tempfile.TemporaryDirectory(prefix="zerojax-bench-") as workdir, open(out.with_suffix(".log"), "a") as log:
        # One compilation cache for the plan: the fit search and its real step share programs.
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(workdir) / "jax-cache"))
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        cut = False
        try:
            for m in chosen:
                doc["results"][m.name] = run_one(m, opts, deadline, Path(workdir), log)
                record(out, doc, m.name, started)
        except CutShort:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup
            cut = True
            for m in chosen:
                doc["results"].setdefault(m.name, {"status": "skipped", "reason": "cut short by the hard time limit"})
    doc["meta"].update(elapsed_s=round(time.monotonic() - started, 1), finished=True, cut_short=cut)
    doc["summary"] = summary(doc, PLAN + EXTRA)
    write_json(out, doc)
    print(markdown(doc))
    return 124 if cut else 0  # as timeout(1) says it


def record(out: Path, doc: dict, name: str, started: float) -> None:
    doc["meta"]["elapsed_s"] = round(time.monotonic() - started, 1)
    doc["summary"] = summary(doc, PLAN + EXTRA)
    write_json(out, doc)
    entry = doc["results"][name]
    said = entry.get("reason") or entry.get("error") or (f"{entry['tokens_per_sec']:,.0f} tokens/s"
                                                          if "tokens_per_sec" in entry else "")
    print(f"[{doc['meta']['elapsed_s']:6.1f} s] {name}: {entry['status']} {said}", flush=True)


def meta(opts) -> dict:
    try:  # the GPU machine gets a copy of the working tree, maybe without git
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "dry_run": opts.dry_run, "deadline_s": opts.deadline_s,
            "commit": commit or None, "python": sys.version.split()[0],
            "finished": False, "estimated_h200_s": SETUP_S + sum(m.h200_s for m in PLAN)}


def plan_row(m: Measurement) -> dict:
    return {"name": m.name, "what": m.what, "h200_s": m.h200_s, "config": m.config,
            "overrides": list(m.overrides), "feature": m.feature, "baseline": m.baseline}
