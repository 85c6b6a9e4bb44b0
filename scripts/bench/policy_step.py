"""A policy's training step, zerojax against LeRobot 0.6.1's own, side by side in one run
(BENCHMARKS.md, "π0.5's training step against LeRobot 0.6.1" and "SmolVLA's training step").

    python scripts/bench/policy_step.py [--family pi05|smolvla] [--sizes tiny,mid] [--rounds 5] [--steps 3]
                                        [--warmup 2] [--lerobot-python /work/lr06venv/bin/python]
                                        [--lerobot-device cpu] [--json]

zerojax's venv runs it. It starts two workers per size, each a long-lived process that builds
its model, optimizer and one fixed batch, warms up (zerojax compiles), then waits: zerojax's in
this process's interpreter, LeRobot's in LeRobot 0.6.1's venv (Python 3.12, transformers 5.x,
torch; LeRobot is never a zerojax dependency). The rounds alternate, zerojax's --steps then
LeRobot's --steps, so both sides see the same machine load; samples/s per round is batch x steps
/ seconds, and the table gives each side's median and the ratio of the medians.

- LeRobot: the family's policy (`PI05Policy`, `SmolVLAPolicy`) in fp32, built at the size's
  widths with no hub (π0.5: the fixtures' patch of `get_gemma_config` and the SigLIP tower,
  scripts/fixtures/make_lerobot06_fixtures.py; SmolVLA: a local SmolVLM directory at the size's
  widths, written by scripts/fixtures/make_smolvla_fixtures.py's `write_vlm`), in train mode, and
  `lerobot_train.update_policy`'s step without its accelerator: `loss, _ = policy.forward(batch)`,
  `loss.backward()`, `clip_grad_norm_(params, clip)`, `optimizer.step()`, `optimizer.zero_grad()`,
  the optimizer being its config's preset (AdamW; π0.5: betas 0.9/0.95, weight decay 0.01, clip
  1; SmolVLA: betas 0.9/0.95, weight decay 1e-10, clip 10). The batch is what its preprocessor
  hands `forward`: images in [0, 1] per camera, the prompt's tokens and mask (random ids, every
  position real), actions normalized [B, H, D_a]; its noise and time are drawn inside.
- zerojax: the same family at the same widths, one device, `zero.stage=0`, fp32 compute,
  `model.remat=none` (LeRobot's `gradient_checkpointing` is off), AdamW with the same betas,
  weight decay and clip; its jitted step (`zerojax.analysis.measure.compile_step`, the step
  `zerojax train` runs) on one fixed random batch of its shapes (noise and time in the batch).
- The recipe: π0.5 trains everything (LeRobot's default). SmolVLA's sizes name theirs: LeRobot's
  default trains the expert only (`train_expert_only`, `freeze_vision_encoder`; zerojax's
  `optim.freeze=vlm`, its frozen weights kept in fp32, `precision.frozen=float32`, as LeRobot's
  are); the `_full` sizes train everything.

`--threads 1` (the default) gives each side one compute thread (torch: OMP_NUM_THREADS=1 and
`torch.set_num_threads(1)`; XLA: `--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1`):
on this shared 2-core machine under load 15, torch's two OpenMP threads took 17 s for the mid
step that one thread ran in 1.2 s (spin-waiting threads descheduled), which would measure the
load, not the libraries. `--threads 0` leaves each library its default (every core).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEROBOT_PYTHON = "/work/lr06venv/bin/python"
# π0.5's sizes: "tiny" is tests/fixtures/lerobot06/pi05's (scripts/fixtures/make_lerobot06_fixtures.py);
# "mid" is chosen so that one LeRobot step takes about a second on this 2-core CPU. LeRobot's joint
# attention hard-codes 8 heads; both Gemmas have one KV head and the same depth and head_dim.
PI05_SIZES = {
    "tiny": dict(vocab=288, width=32, mlp=64, depth=2, head_dim=4, expert=16, expert_mlp=32, vision=24,
                 vision_mlp=48, vision_heads=2, vision_depth=2, image=28, patch=14, cameras=2, horizon=4,
                 prompt=24, state=5, action=3, batch=8),
    "mid": dict(vocab=288, width=256, mlp=1024, depth=3, head_dim=32, expert=128, expert_mlp=512, vision=128,
                vision_mlp=512, vision_heads=2, vision_depth=2, image=56, patch=14, cameras=1, horizon=10,
                prompt=32, state=8, action=7, batch=4),
}
PI05_HEADS, MAX_DIM = 8, 32
# SmolVLA's sizes: "tiny" is tests/fixtures/lerobot06/smolvla's (scripts/fixtures/make_smolvla_fixtures.py;
# its vocabulary of 40 is the fixture tokenizer's); "mid" is 4x as wide. The expert is 0.75 of the
# width, its MLP LeRobot's `get_intermediate_size` of that (rounded up to 256). `expert_only`:
# LeRobot's default recipe (the VLM frozen), else everything trains.
_SMOLVLA_TINY = dict(vocab=40, width=64, mlp=128, depth=4, heads=4, kv_heads=2, head_dim=16, expert=48, expert_mlp=256,
                     vision=32, vision_mlp=64, vision_heads=2, vision_depth=1, image=64, patch=16, shuffle=2, cameras=2,
                     horizon=4, prompt=12, state=5, action=3, batch=8)
_SMOLVLA_MID = dict(_SMOLVLA_TINY, width=256, mlp=1024, head_dim=64, expert=192, expert_mlp=512, vision=128,
                    vision_mlp=512, vision_depth=2, image=128, cameras=1, horizon=10, prompt=32, state=8, action=7,
                    batch=4)
SMOLVLA_SIZES = {"tiny": dict(_SMOLVLA_TINY, expert_only=True), "tiny_full": dict(_SMOLVLA_TINY, expert_only=False),
                 "mid": dict(_SMOLVLA_MID, expert_only=True), "mid_full": dict(_SMOLVLA_MID, expert_only=False)}


def _common_overrides(s: dict) -> list[str]:
    """The keys every family's size sets alike: the vision tower, the action, the data, one fp32 device."""
    return [
        f"model.vocab_size={s['vocab']}", f"model.d_model={s['width']}", f"model.n_layers={s['depth']}",
        f"model.head_dim={s['head_dim']}", f"model.d_ff={s['mlp']}", "model.vision.norm_eps=1e-6",
        f"model.expert.d_model={s['expert']}", f"model.expert.d_ff={s['expert_mlp']}",
        f"model.vision.image_size={s['image']}", f"model.vision.patch_size={s['patch']}",
        f"model.vision.d_model={s['vision']}", f"model.vision.n_layers={s['vision_depth']}",
        f"model.vision.n_heads={s['vision_heads']}", f"model.vision.d_ff={s['vision_mlp']}",
        f"model.action.horizon={s['horizon']}", f"model.action.prompt_len={s['prompt']}",
        f"model.action.max_state_dim={MAX_DIM}", f"model.action.max_action_dim={MAX_DIM}",
        f"model.action.action_dim={s['action']}", f"model.action.cameras={s['cameras']}",
        f"data.image_size={s['image']}", f"data.action_horizon={s['horizon']}", f"data.prompt_len={s['prompt']}",
        f"train.global_batch={s['batch']}", "mesh.cpu_devices=1", "mesh.data=1", "zero.stage=0",
        "precision.compute=float32", "model.remat=none", "optim.b1=0.9", "optim.b2=0.95", "optim.warmup_steps=0",
        "optim.schedule=constant",
    ]


def pi05_overrides(s: dict) -> list[str]:
    """A π0.5 size as zerojax's config keys (LeRobot's optimizer preset)."""
    return ["model.family=pi05", *_common_overrides(s), f"model.n_heads={PI05_HEADS}", "model.n_kv_heads=1",
            "model.norm_eps=1e-6", "optim.weight_decay=0.01", "optim.clip_norm=1.0", "optim.lr=2.5e-5"]


def smolvla_overrides(s: dict) -> list[str]:
    """A SmolVLA size as zerojax's config keys (LeRobot's optimizer preset and recipe)."""
    recipe = ["optim.freeze=vlm", "precision.frozen=float32"] if s["expert_only"] else []
    return ["model.family=smolvla", *_common_overrides(s), f"model.n_heads={s['heads']}",
            f"model.n_kv_heads={s['kv_heads']}", "model.norm_eps=1e-5", "model.rope_theta=10000",
            f"data.tokenizer={ROOT / 'tests' / 'fixtures' / 'lerobot06' / 'smolvla_vlm'}",  # its 40 ids
            f"model.smolvla.pixel_shuffle={s['shuffle']}", "optim.weight_decay=1e-10", "optim.clip_norm=10.0",
            "optim.lr=1e-4", *recipe]


def zerojax_worker(overrides: list[str]):
    """(step(n) -> seconds of n steps, parameter count, the last loss): zerojax's side, compiled
    and warmed up by the caller's first call."""
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts" / "bench")]  # this checkout's zerojax, and benchlib
    import jax

    from zerojax import config as config_lib
    from zerojax.analysis import measure as measure_lib
    from zerojax.parallel import mesh as mesh_lib
    from zerojax.train import state as state_lib

    from benchlib.measure import random_batch  # the bench's batch of the config's shapes

    cfg = config_lib.load(None, overrides)
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

    params, trained = measure_lib.param_counts(cfg)
    return step, {"params": params, "trained": trained}, box


def shrink_pi05(s: dict) -> None:
    """Patch LeRobot 0.6.1's π0.5 to build at the size's widths, as the fixtures do
    (scripts/fixtures/make_lerobot06_fixtures.py's `tiny_lerobot`): `get_gemma_config` knows only
    gemma_2b and gemma_300m, and PaliGemmaWithExpertModel hard-codes the vocabulary and So400m's
    SigLIP; the class it builds is wrapped so that its config is shrunk first."""
    import lerobot.policies.pi05.modeling_pi05 as modeling

    widths = {"gemma_2b": (s["width"], s["mlp"]), "gemma_300m": (s["expert"], s["expert_mlp"])}
    paligemma, expert = modeling.PaliGemmaForConditionalGenerationWithPiGemma, modeling.PiGemmaForCausalLM

    def gemma_config(variant):
        width, mlp = widths[variant]
        return modeling.GemmaConfig(width=width, depth=s["depth"], mlp_dim=mlp, num_heads=PI05_HEADS, num_kv_heads=1,
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


def _features(s: dict, cameras: list[str]) -> tuple[dict, dict]:
    from lerobot.configs.types import FeatureType, PolicyFeature

    inputs = {"observation.state": PolicyFeature(type=FeatureType.STATE, shape=(s["state"],)),
              **{k: PolicyFeature(type=FeatureType.VISUAL, shape=(3, s["image"], s["image"])) for k in cameras}}
    return inputs, {"action": PolicyFeature(type=FeatureType.ACTION, shape=(s["action"],))}


def pi05_policy(s: dict, device: str, cameras: list[str]):
    """LeRobot 0.6.1's π0.5 at the size (fp32, its default dtype)."""
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    shrink_pi05(s)
    cfg = PI05Config(chunk_size=s["horizon"], n_action_steps=s["horizon"], tokenizer_max_length=s["prompt"],
                     image_resolution=(s["image"], s["image"]), dtype="float32", device=device)
    cfg.input_features, cfg.output_features = _features(s, cameras)
    return cfg, PI05Policy(cfg)


def smolvla_policy(s: dict, device: str, cameras: list[str]):
    """LeRobot 0.6.1's SmolVLA at the size, from a SmolVLM directory written at its widths."""
    sys.path.insert(0, str(ROOT / "scripts" / "fixtures"))
    from make_smolvla_fixtures import write_vlm  # the fixtures' SmolVLM directory, at other widths

    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

    vlm = Path(tempfile.mkdtemp(prefix="smolvla_vlm_"))
    atexit.register(shutil.rmtree, vlm, ignore_errors=True)  # the worker's own: gone when it exits
    text = {"vocab_size": s["vocab"], "hidden_size": s["width"], "intermediate_size": s["mlp"],
            "num_hidden_layers": s["depth"], "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
            "head_dim": s["head_dim"]}
    vision = {"hidden_size": s["vision"], "intermediate_size": s["vision_mlp"], "num_hidden_layers": s["vision_depth"],
              "num_attention_heads": s["vision_heads"]}
    write_vlm(vlm, text=text, vision=vision, image=s["image"], patch=s["patch"], scale=s["shuffle"])
    cfg = SmolVLAConfig(chunk_size=s["horizon"], n_action_steps=s["horizon"], tokenizer_max_length=s["prompt"],
                        pad_language_to="max_length", resize_imgs_with_padding=(s["image"], s["image"]),
                        vlm_model_name=str(vlm), load_vlm_weights=False, num_vlm_layers=s["depth"], device=device,
                        train_expert_only=s["expert_only"], freeze_vision_encoder=s["expert_only"])
    cfg.input_features, cfg.output_features = _features(s, cameras)
    return cfg, SmolVLAPolicy(cfg)


def lerobot_worker(family: str, s: dict, device: str):
    """(step(n) -> seconds of n steps, parameter count, the last loss): LeRobot's side (module
    docstring), warmed up by the caller's first call."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing from the hub: the model is built here
    import torch

    if os.environ.get("OMP_NUM_THREADS") == "1":  # --threads 1
        torch.set_num_threads(1)
    from lerobot.utils.constants import OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS

    torch.manual_seed(0)
    cameras = [f"observation.images.cam{k}" for k in range(s["cameras"])]
    cfg, policy = FAMILIES[family]["lerobot"](s, device, cameras)
    policy = policy.float().to(device)
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

    trained = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    return step, {"params": sum(p.numel() for p in policy.parameters()), "trained": trained}, box


FAMILIES = {"pi05": {"sizes": PI05_SIZES, "overrides": pi05_overrides, "lerobot": pi05_policy},
            "smolvla": {"sizes": SMOLVLA_SIZES, "overrides": smolvla_overrides, "lerobot": smolvla_policy}}


def serve_worker(side: str, family: str, size: str, warmup: int, device: str) -> int:
    """A worker's loop: build, warm up, say so; then for each line "N" on stdin time N steps.
    Its stdout is the protocol's alone: what the libraries print goes to stderr (LeRobot's SmolVLA
    prints as it builds)."""
    start = time.perf_counter()
    protocol, sys.stdout = sys.stdout, sys.stderr
    s = FAMILIES[family]["sizes"][size]
    step, counts, box = (zerojax_worker(FAMILIES[family]["overrides"](s)) if side == "zerojax"
                         else lerobot_worker(family, s, device))
    step(warmup)  # zerojax: the first call compiles
    print(json.dumps({"ready": True, **counts, "setup_s": round(time.perf_counter() - start, 1),
                      "loss": box["loss"]}), file=protocol, flush=True)
    for line in sys.stdin:
        seconds = step(int(line))
        print(json.dumps({"seconds": seconds, "loss": box["loss"]}), file=protocol, flush=True)
    return 0


class Worker:
    """One side's worker process (`serve_worker`), spoken to one line at a time."""

    def __init__(self, python: str, side: str, size: str, opts):
        cmd = [python, __file__, "--worker", side, "--family", opts.family, "--sizes", size, "--warmup", str(opts.warmup),
               "--lerobot-device", opts.lerobot_device]
        self.side, self.ready = side, None
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=threads_env(opts.threads))

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"policy_step: the {self.side} worker died (exit {self.proc.wait()}); its stderr is above")
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
    s = FAMILIES[opts.family]["sizes"][size]
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
    return {"family": opts.family, "size": size, **s, "threads": opts.threads,
            "params": {w.side: w.ready["params"] for w in workers},
            "trained": {w.side: w.ready["trained"] for w in workers},
            "setup_s": {w.side: w.ready["setup_s"] for w in workers}, "samples_per_sec": rates,
            "median": median, "zerojax_over_lerobot": median["zerojax"] / median["lerobot"], "last_loss": losses}


def markdown(rows: list[dict]) -> str:
    out = ["| size | parameters (zerojax / LeRobot) | trained (zerojax / LeRobot) | batch | zerojax samples/s, per round "
           "| LeRobot samples/s, per round | **zerojax / LeRobot** (medians) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        per = {side: ", ".join(f"{x:.2f}" for x in r["samples_per_sec"][side]) for side in ("zerojax", "lerobot")}
        out.append(f"| {r['size']} | {r['params']['zerojax']:,} / {r['params']['lerobot']:,} | "
                   f"{r['trained']['zerojax']:,} / {r['trained']['lerobot']:,} | {r['batch']} | "
                   f"{per['zerojax']} (median {r['median']['zerojax']:.2f}) | {per['lerobot']} (median "
                   f"{r['median']['lerobot']:.2f}) | **{r['zerojax_over_lerobot']:.2f}x** |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="pi05")
    parser.add_argument("--sizes", default="tiny,mid", help="π0.5: " + ", ".join(PI05_SIZES) + "; SmolVLA: "
                        + ", ".join(SMOLVLA_SIZES))
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
    known = FAMILIES[opts.family]["sizes"]
    unknown = [x for x in sizes if x not in known]
    if unknown:
        parser.error(f"--sizes {','.join(unknown)}: {opts.family}'s sizes are {', '.join(known)}")
    if opts.worker:
        return serve_worker(opts.worker, opts.family, sizes[0], opts.warmup, opts.lerobot_device)
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
