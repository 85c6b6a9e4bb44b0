"""π0.5's training step, zerojax against LeRobot 0.6.1's own, side by side in one run
(BENCHMARKS.md, "π0.5's training step against LeRobot 0.6.1").

    python scripts/bench/pi05_step.py [--sizes tiny,mid] [--rounds 5] [--steps 3] [--warmup 2]
                                     [--lerobot-python /work/lr06venv/bin/python] [--lerobot-device cpu] [--json]

zerojax's venv runs it. It starts two workers per size, each a long-lived process that builds
its model, optimizer and one fixed batch, warms up (zerojax compiles), then waits: zerojax's in
this process's interpreter, LeRobot's in LeRobot 0.6.1's venv (Python 3.12, transformers 5.x,
torch; LeRobot is never a zerojax dependency). The rounds alternate, zerojax's --steps then
LeRobot's --steps, so both sides see the same machine load; samples/s per round is batch x steps
/ seconds, and the table gives each side's median and the ratio of the medians.

- LeRobot: `PI05Policy(PI05Config(...))` in fp32 (its default dtype), built at the size's
  widths by the fixtures' patch (scripts/fixtures/make_lerobot06_fixtures.py: `get_gemma_config`
  and the SigLIP tower shrunk), in train mode, and `lerobot_train.update_policy`'s step without
  its accelerator: `loss, _ = policy.forward(batch)`, `loss.backward()`,
  `clip_grad_norm_(params, 1.0)`, `optimizer.step()`, `optimizer.zero_grad()`, the optimizer
  being its config's preset (AdamW, betas 0.9/0.95, weight decay 0.01). The batch is what its
  preprocessor hands `forward`: images in [0, 1] per camera, the prompt's tokens and mask (random
  ids, every position real), actions normalized [B, H, D_a]; its noise and time are drawn inside.
- zerojax: `model.family=pi05` at the same widths, one device, `zero.stage=0`, fp32 compute,
  `model.remat=none` (LeRobot's `gradient_checkpointing` is off), AdamW with the same betas,
  weight decay and clip; its jitted step (`zerojax.analysis.measure.compile_step`, the step
  `zerojax train` runs) on one fixed random batch of its shapes (noise and time in the batch).

`--threads 1` (the default) gives each side one compute thread (torch: OMP_NUM_THREADS=1 and
`torch.set_num_threads(1)`; XLA: `--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1`):
on this shared 2-core machine under load 15, torch's two OpenMP threads took 17 s for the mid
step that one thread ran in 1.2 s (spin-waiting threads descheduled), which would measure the
load, not the libraries. `--threads 0` leaves each library its default (every core).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEROBOT_PYTHON = "/work/lr06venv/bin/python"
# The sizes: "tiny" is tests/fixtures/lerobot06/pi05's (scripts/fixtures/make_lerobot06_fixtures.py);
# "mid" is chosen so that one LeRobot step takes about a second on this 2-core CPU. LeRobot's joint
# attention hard-codes 8 heads; both Gemmas have one KV head and the same depth and head_dim.
SIZES = {
    "tiny": dict(vocab=288, width=32, mlp=64, depth=2, head_dim=4, expert=16, expert_mlp=32, vision=24,
                 vision_mlp=48, vision_heads=2, vision_depth=2, image=28, patch=14, cameras=2, horizon=4,
                 prompt=24, state=5, action=3, batch=8),
    "mid": dict(vocab=288, width=256, mlp=1024, depth=3, head_dim=32, expert=128, expert_mlp=512, vision=128,
                vision_mlp=512, vision_heads=2, vision_depth=2, image=56, patch=14, cameras=1, horizon=10,
                prompt=32, state=8, action=7, batch=4),
}
HEADS, MAX_DIM = 8, 32


def zerojax_overrides(s: dict) -> list[str]:
    """The size as zerojax's config keys (one device, fp32, no remat, LeRobot's optimizer)."""
    return [
        "model.family=pi05", f"model.vocab_size={s['vocab']}", f"model.d_model={s['width']}",
        f"model.n_layers={s['depth']}", f"model.n_heads={HEADS}", "model.n_kv_heads=1", f"model.head_dim={s['head_dim']}",
        f"model.d_ff={s['mlp']}", "model.norm_eps=1e-6", "model.vision.norm_eps=1e-6", f"model.expert.d_model={s['expert']}", f"model.expert.d_ff={s['expert_mlp']}",
        f"model.vision.image_size={s['image']}", f"model.vision.patch_size={s['patch']}",
        f"model.vision.d_model={s['vision']}", f"model.vision.n_layers={s['vision_depth']}",
        f"model.vision.n_heads={s['vision_heads']}", f"model.vision.d_ff={s['vision_mlp']}",
        f"model.action.horizon={s['horizon']}", f"model.action.prompt_len={s['prompt']}",
        f"model.action.max_state_dim={MAX_DIM}", f"model.action.max_action_dim={MAX_DIM}",
        f"model.action.action_dim={s['action']}", f"model.action.cameras={s['cameras']}",
        f"data.image_size={s['image']}", f"data.action_horizon={s['horizon']}", f"data.prompt_len={s['prompt']}",
        f"train.global_batch={s['batch']}", "mesh.cpu_devices=1", "mesh.data=1", "zero.stage=0",
        "precision.compute=float32", "model.remat=none", "optim.b1=0.9", "optim.b2=0.95", "optim.weight_decay=0.01",
        "optim.clip_norm=1.0", "optim.lr=2.5e-5", "optim.warmup_steps=0", "optim.schedule=constant",
    ]


def zerojax_worker(s: dict):
    """(step(n) -> seconds of n steps, parameter count, the last loss): zerojax's side, compiled
    and warmed up by the caller's first call."""
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts" / "bench")]  # this checkout's zerojax, and benchlib
    import jax

    from zerojax import config as config_lib
    from zerojax.analysis import measure as measure_lib
    from zerojax.parallel import mesh as mesh_lib
    from zerojax.train import state as state_lib

    from benchlib.measure import random_batch  # the bench's batch of the config's shapes

    cfg = config_lib.load(None, zerojax_overrides(s))
    engine, compiled = measure_lib.compile_step(cfg)
    batch = random_batch(cfg, jax.random.key(0), mesh_lib.batch_sharding(engine.mesh))
    box = {"state": state_lib.init_state(engine), "loss": None}

    def step(n: int) -> float:
        jax.block_until_ready(box["state"])
        start = time.perf_counter()
        for _ in range(n):
            box["state"], metrics = compiled(box["state"], batch)
        box["loss"] = float(metrics["loss"])  # waits for the last step
        return time.perf_counter() - start

    return step, measure_lib.count_params(cfg), box


def shrink_lerobot(s: dict) -> None:
    """Patch LeRobot 0.6.1's π0.5 to build at the size's widths, as the fixtures do
    (scripts/fixtures/make_lerobot06_fixtures.py's `tiny_lerobot`): `get_gemma_config` knows only
    gemma_2b and gemma_300m, and PaliGemmaWithExpertModel hard-codes the vocabulary and So400m's
    SigLIP; the class it builds is wrapped so that its config is shrunk first."""
    import lerobot.policies.pi05.modeling_pi05 as modeling

    widths = {"gemma_2b": (s["width"], s["mlp"]), "gemma_300m": (s["expert"], s["expert_mlp"])}
    paligemma, expert = modeling.PaliGemmaForConditionalGenerationWithPiGemma, modeling.PiGemmaForCausalLM

    def gemma_config(variant):
        width, mlp = widths[variant]
        return modeling.GemmaConfig(width=width, depth=s["depth"], mlp_dim=mlp, num_heads=HEADS, num_kv_heads=1,
                                    head_dim=s["head_dim"])

    def small_paligemma(config):
        config._vocab_size = s["vocab"]  # noqa: SLF001 - as the fixtures do
        config.image_token_index = config.text_config.vocab_size = s["vocab"]
        v = config.vision_config
        v.hidden_size, v.intermediate_size, v.num_attention_heads = s["vision"], s["vision_mlp"], s["vision_heads"]
        v.num_hidden_layers, v.patch_size, v.projection_dim = s["vision_depth"], s["patch"], s["width"]
        config.projection_dim = s["width"]
        return paligemma(config=config)

    def small_expert(config):
        config.vocab_size = s["vocab"]
        return expert(config=config)

    modeling.get_gemma_config = gemma_config
    modeling.PaliGemmaForConditionalGenerationWithPiGemma = small_paligemma
    modeling.PiGemmaForCausalLM = small_expert


def lerobot_worker(s: dict, device: str):
    """(step(n) -> seconds of n steps, parameter count, the last loss): LeRobot's side (module
    docstring), warmed up by the caller's first call."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing from the hub: the model is built here
    import torch

    if os.environ.get("OMP_NUM_THREADS") == "1":  # --threads 1
        torch.set_num_threads(1)
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from lerobot.utils.constants import OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS

    shrink_lerobot(s)
    torch.manual_seed(0)
    cameras = [f"observation.images.cam{k}" for k in range(s["cameras"])]
    cfg = PI05Config(chunk_size=s["horizon"], n_action_steps=s["horizon"], tokenizer_max_length=s["prompt"],
                     image_resolution=(s["image"], s["image"]), dtype="float32", device=device)
    cfg.input_features = {"observation.state": PolicyFeature(type=FeatureType.STATE, shape=(s["state"],)),
                          **{k: PolicyFeature(type=FeatureType.VISUAL, shape=(3, s["image"], s["image"]))
                             for k in cameras}}
    cfg.output_features = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(s["action"],))}
    policy = PI05Policy(cfg).float().to(device)
    policy.train()
    preset = cfg.get_optimizer_preset()
    optimizer = preset.build(policy.get_optim_params())
    B, g = s["batch"], torch.Generator().manual_seed(1)
    batch = {k: torch.rand(B, 3, s["image"], s["image"], generator=g) for k in cameras}
    batch.update({"observation.state": torch.rand(B, s["state"], generator=g) * 2 - 1,
                  "action": torch.rand(B, s["horizon"], s["action"], generator=g) * 2 - 1,
                  OBS_LANGUAGE_TOKENS: torch.randint(0, s["vocab"], (B, s["prompt"]), generator=g),
                  OBS_LANGUAGE_ATTENTION_MASK: torch.ones(B, s["prompt"], dtype=torch.bool)})
    batch = {k: v.to(device) for k, v in batch.items()}
    box = {"loss": None}

    def step(n: int) -> float:
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(n):  # lerobot_train.update_policy, without its accelerator
            loss, _ = policy.forward(batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), preset.grad_clip_norm)
            optimizer.step()
            optimizer.zero_grad()
        box["loss"] = float(loss.detach())  # waits for the last step
        sync()
        return time.perf_counter() - start

    return step, sum(p.numel() for p in policy.parameters()), box


def serve_worker(side: str, size: str, warmup: int, device: str) -> int:
    """A worker's loop: build, warm up, say so; then for each line "N" on stdin time N steps."""
    start = time.perf_counter()
    step, params, box = zerojax_worker(SIZES[size]) if side == "zerojax" else lerobot_worker(SIZES[size], device)
    step(warmup)  # zerojax: the first call compiles
    print(json.dumps({"ready": True, "params": params, "setup_s": round(time.perf_counter() - start, 1),
                      "loss": box["loss"]}), flush=True)
    for line in sys.stdin:
        seconds = step(int(line))
        print(json.dumps({"seconds": seconds, "loss": box["loss"]}), flush=True)
    return 0


class Worker:
    """One side's worker process (`serve_worker`), spoken to one line at a time."""

    def __init__(self, python: str, side: str, size: str, opts):
        cmd = [python, __file__, "--worker", side, "--sizes", size, "--warmup", str(opts.warmup), "--lerobot-device",
               opts.lerobot_device]
        self.side, self.ready = side, None
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=threads_env(opts.threads))

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"pi05_step: the {self.side} worker died (exit {self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def steps(self, n: int) -> dict:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def threads_env(threads: int) -> dict:
    """The workers' environment: with --threads 1, one compute thread on each side (torch's
    OpenMP and MKL pools; XLA's Eigen pool off), else each library's default (every core)."""
    env = dict(os.environ)
    if threads == 1:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                            "intra_op_parallelism_threads=1").strip()
    return env


def compare(size: str, opts) -> dict:
    """One size: both workers up, then --rounds rounds of zerojax's --steps and LeRobot's, in turn."""
    s = SIZES[size]
    workers = [Worker(sys.executable, "zerojax", size, opts), Worker(opts.lerobot_python, "lerobot", size, opts)]
    for w in workers:  # both set up at once: zerojax compiles while LeRobot imports torch and transformers
        w.ready = w.read()
    rates = {w.side: [] for w in workers}
    losses = {}
    for _ in range(opts.rounds):
        for w in workers:
            got = w.steps(opts.steps)
            rates[w.side].append(s["batch"] * opts.steps / got["seconds"])
            losses[w.side] = got["loss"]
    for w in workers:
        w.close()
    median = {side: statistics.median(r) for side, r in rates.items()}
    return {"size": size, **s, "threads": opts.threads, "params": {w.side: w.ready["params"] for w in workers},
            "setup_s": {w.side: w.ready["setup_s"] for w in workers}, "samples_per_sec": rates,
            "median": median, "zerojax_over_lerobot": median["zerojax"] / median["lerobot"], "last_loss": losses}


def markdown(rows: list[dict]) -> str:
    out = ["| size | parameters (zerojax / LeRobot) | batch | zerojax samples/s, per round | LeRobot samples/s, per "
           "round | **zerojax / LeRobot** (medians) |", "|---|---|---|---|---|---|"]
    for r in rows:
        per = {side: ", ".join(f"{x:.2f}" for x in r["samples_per_sec"][side]) for side in ("zerojax", "lerobot")}
        out.append(f"| {r['size']} | {r['params']['zerojax']:,} / {r['params']['lerobot']:,} | {r['batch']} | "
                   f"{per['zerojax']} (median {r['median']['zerojax']:.2f}) | {per['lerobot']} (median "
                   f"{r['median']['lerobot']:.2f}) | **{r['zerojax_over_lerobot']:.2f}x** |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,mid", help="of " + ", ".join(SIZES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per side per round")
    parser.add_argument("--warmup", type=int, default=2, help="steps each side runs before the rounds")
    parser.add_argument("--lerobot-python", default=LEROBOT_PYTHON)
    parser.add_argument("--lerobot-device", default="cpu", help="torch's device for LeRobot's side (cuda on a GPU)")
    parser.add_argument("--threads", type=int, choices=(0, 1), default=1,
                        help="1: one compute thread per side (a shared, loaded machine); 0: each library's default")
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    parser.add_argument("--worker", choices=("zerojax", "lerobot"), help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    sizes = opts.sizes.split(",")
    unknown = [x for x in sizes if x not in SIZES]
    if unknown:
        parser.error(f"--sizes {','.join(unknown)}: choose of {', '.join(SIZES)}")
    if opts.worker:
        return serve_worker(opts.worker, sizes[0], opts.warmup, opts.lerobot_device)
    if not Path(opts.lerobot_python).is_file():
        parser.error(f"--lerobot-python {opts.lerobot_python}: no such interpreter (LeRobot 0.6.1's venv)")
    rows = [compare(size, opts) for size in sizes]
    print(f"{platform.node()}, {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}", file=sys.stderr)
    if opts.json:
        print(json.dumps(rows, indent=1))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
