#!/usr/bin/env python3
"""The closed-loop benchmark of the authors' training features (BENCHMARKS.md "Meta-World: training
as the authors do"): each feature beside the plain recipe, on Meta-World, seeded, on the CPU.

    python scripts/bench/closed_loop.py --out DIR            # every step; one done before is skipped
    python scripts/bench/closed_loop.py --out DIR --table    # the tables, from DIR/rollouts/*.json
    python scripts/bench/closed_loop.py --out DIR --smoke    # the same steps, tiny (tests/test_closed_loop_bench.py)

Every step is a `zerojax` command, printed before it runs:
- data: `zerojax collect` of dataset A (reach-v3, button-press-topdown-v3, drawer-close-v3; camera
  corner2) and dataset B (button-press-v3, window-close-v3; camera topview, another robot's view);
- runs: the tiny π0 recipe (configs/pi0-metaworld-tiny.yaml, chunks of 16, one CPU device) trained on
  A as it is (plain), with openpi's augmentation (augment), with training-time real-time chunking
  (train_delay: model.action.train_delay=4), on B alone (only_b), and on the mixture of A and B,
  half each (mixture; mixture_x2 twice as long, so that it sees as many of A's frames as plain);
- rollouts, 8 actions a chunk:
  - plain and augment under each shift of the rendering the data never had: none, brightness x0.6, a
    colour cast (1.25, 0.9, 0.75), the camera moved 4 cm up;
  - delays d = 2 and 4: plain with naive chunks, plain with inference-time RTC (--rtc), and the
    train_delay run given its prefix (--rtc): success, seam jump and the server's time per request;
  - the mixture run on A's tasks and on B's (--dataset), beside plain on A's and a run on B alone.

Each rollout writes DIR/rollouts/NAME.json (`zerojax rollout --json`); a step whose output is there
is not run again, so a killed benchmark resumes; `--only GLOB` runs the steps whose name matches
(on two cores, a second process can roll out the plain run while the others train).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TASKS_A = "reach-v3,button-press-topdown-v3,drawer-close-v3"
TASKS_B = "button-press-v3,window-close-v3"
SHIFTS = {"none": [], "brightness": ["brightness=0.6"], "colour": ["colour=1.25,0.9,0.75"],
          "camera": ["camera=0,0,0.04"]}
DELAYS = (2, 4)
TRAIN_DELAY = 4
HORIZON, N_ACTION_STEPS = 16, 8
# --smoke: every kind of step once, tiny (2 demonstrations a task at 32 px, 2 training steps, one
# episode a task cut at 12 steps): the suite's check that the benchmark's commands run
SMOKE = {"augment", "train_delay", "mixture", "augment-shift-camera", "plain-delay2-rtc", "train_delay-delay2",
         "mixture-b"}


def zerojax(*args) -> list[str]:
    return [sys.executable, "-m", "zerojax", *map(str, args)]


class Plan:
    """The benchmark's commands at full size or as the smoke test's tiny version."""

    def __init__(self, out: Path, smoke: bool, episodes: int, steps: int):
        self.out, self.smoke = out, smoke
        self.episodes = 1 if smoke else episodes
        self.demos = 2 if smoke else 30
        self.steps = 2 if smoke else steps
        self.rollout_extra = ["--max-steps", "12"] if smoke else []
        self.collect_extra = ["--size", "32"] if smoke else []

    def data(self) -> list[tuple[Path, list[str]]]:
        return [(self.out / "data" / "a", zerojax("collect", "--tasks", TASKS_A, "--episodes", self.demos,
                                                  "--out", self.out / "data" / "a", *self.collect_extra)),
                (self.out / "data" / "b", zerojax("collect", "--tasks", TASKS_B, "--episodes", self.demos,
                                                  "--out", self.out / "data" / "b", "--camera", "topview",
                                                  *self.collect_extra))]

    def train(self, name: str, *keys: str, times: int = 1) -> tuple[Path, list[str]]:
        run = self.out / name
        small = ["train.global_batch=4", "train.ckpt_every=2"] if self.smoke else []
        return run, zerojax("train", "--config", ROOT / "configs" / "pi0-metaworld-tiny.yaml", "--no-progress",
                            f"train.out_dir={run}", f"train.steps={times * self.steps}", "mesh.cpu_devices=1",
                            f"model.action.horizon={HORIZON}", *small, *keys)

    def runs(self) -> list[tuple[Path, list[str]]]:
        a, b = self.out / "data" / "a", self.out / "data" / "b"
        return [self.train("plain", f"data.source=lerobot:{a}"),
                self.train("augment", f"data.source=lerobot:{a}", "data.augment=openpi"),
                self.train("train_delay", f"data.source=lerobot:{a}", f"model.action.train_delay={TRAIN_DELAY}"),
                self.train("only_b", f"data.source=lerobot:{b}"),
                self.train("mixture", "data.source=mixture", f"data.mixture={a}:0.5,{b}:0.5", "model.action.cameras=2"),
                # twice the steps: as many of A's frames as the plain run saw
                self.train("mixture_x2", "data.source=mixture", f"data.mixture={a}:0.5,{b}:0.5",
                           "model.action.cameras=2", times=2)]

    def rollout(self, name: str, run: str, tasks: str, *flags: str) -> tuple[Path, list[str]]:
        return (self.out / "rollouts" / f"{name}.json",
                zerojax("rollout", self.out / run, "--env", f"metaworld:{tasks}", "--episodes", self.episodes,
                        "--n-action-steps", N_ACTION_STEPS, "--no-progress", "--json", *self.rollout_extra, *flags))

    def rollouts(self) -> list[tuple[Path, list[str]]]:
        out = []
        for run in ("plain", "augment"):
            for shift, items in SHIFTS.items():
                out.append(self.rollout(f"{run}-shift-{shift}", run, TASKS_A, *[f"--shift={i}" for i in items]))
        out.append(self.rollout("train_delay-delay0", "train_delay", TASKS_A))  # the run itself, no delay
        for d in DELAYS:
            out += [self.rollout(f"plain-delay{d}-naive", "plain", TASKS_A, "--delay", d),
                    self.rollout(f"plain-delay{d}-rtc", "plain", TASKS_A, "--delay", d, "--rtc"),
                    self.rollout(f"train_delay-delay{d}", "train_delay", TASKS_A, "--delay", d, "--rtc")]
        a, b = self.out / "data" / "a", self.out / "data" / "b"
        out += [self.rollout("mixture-a", "mixture", TASKS_A, "--dataset", a),
                self.rollout("mixture-b", "mixture", TASKS_B, "--dataset", b),
                self.rollout("only_b-b", "only_b", TASKS_B),
                self.rollout("mixture_x2-a", "mixture_x2", TASKS_A, "--dataset", a),
                self.rollout("mixture_x2-b", "mixture_x2", TASKS_B, "--dataset", b)]
        return out

    def steps_in_order(self) -> list[tuple[Path, list[str]]]:
        steps = self.runs() + self.rollouts()
        if self.smoke:  # and the runs the smoke's rollouts need
            steps = [(t, c) for t, c in steps if t.stem in SMOKE or t.name == "plain"]
        return self.data() + steps


def done(target: Path) -> bool:
    """A rollout's JSON written, a dataset's info.json, or a run whose newest checkpoint is its last
    step (a killed run resumes when its command runs again)."""
    if target.suffix == ".json":
        return target.is_file()
    if (target / "meta" / "info.json").is_file():
        return True
    config, checkpoints = target / "config.yaml", target / "checkpoints"
    if not (config.is_file() and checkpoints.is_dir()):
        return False
    steps = [int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()]
    wanted = [line for line in config.read_text().splitlines() if line.strip().startswith("steps:")]
    return bool(steps and wanted) and max(steps) >= int(wanted[0].split(":")[1])


def execute(plan: Plan, only: str | None = None) -> None:
    (plan.out / "rollouts").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "osmesa")}
    for target, command in plan.steps_in_order():
        if only and not fnmatch.fnmatchcase(target.stem, only):
            continue
        if done(target):
            print(f"done before: {target}", file=sys.stderr)
            continue
        print("$ zerojax " + shlex.join(map(str, command[3:])), file=sys.stderr, flush=True)
        start = time.perf_counter()
        result = subprocess.run(command, env=env, capture_output=target.suffix == ".json", text=True, cwd=ROOT)
        if result.returncode:
            sys.stderr.write(result.stderr or "")
            raise SystemExit(f"failed ({result.returncode}): {shlex.join(map(str, command))}")
        if target.suffix == ".json":
            doc = {**json.loads(result.stdout), "wall_s": round(time.perf_counter() - start, 1)}
            target.write_text(json.dumps(doc, indent=1))
        print(f"  {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def markdown(head: list[str], rows: list[list]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|---" * len(head) + "|",
                      *("| " + " | ".join(map(str, row)) + " |" for row in rows)])


def tables(out: Path) -> str:
    """BENCHMARKS.md's tables from DIR/rollouts/*.json."""
    docs = {p.stem: json.loads(p.read_text()) for p in sorted((out / "rollouts").glob("*.json"))}
    a, b = TASKS_A.split(","), TASKS_B.split(",")

    def cells(name: str, tasks: list[str]) -> list[str]:
        """Each task's successes, and the mean rate."""
        doc = docs.get(name)
        if doc is None:
            return ["(not run)"] * (len(tasks) + 1)
        return [f"{doc['tasks'][t]['successes']}/{doc['tasks'][t]['episodes']}" for t in tasks] + \
            [f"{100 * doc['mean_success_rate']:.0f}%"]

    shifts = [[run, ", ".join(items) or "none", *cells(f"{run}-shift-{shift}", a)]
              for run in ("plain", "augment") for shift, items in SHIFTS.items()]
    named = [(0, "plain-shift-none", "naive"),
             (0, "train_delay-delay0", f"the training-time RTC run (D = {TRAIN_DELAY}), naive")]
    for d in DELAYS:
        named += [(d, f"plain-delay{d}-naive", "naive"), (d, f"plain-delay{d}-rtc", "inference-time RTC"),
                  (d, f"train_delay-delay{d}", f"training-time RTC (D = {TRAIN_DELAY})")]
    delays = [[d, what, *cells(name, a), *(docs.get(name, {}).get(k) for k in ("seam_jump", "inner_jump", "request_ms"))]
              for d, name, what in named]
    mixes = []
    for name, run, on in (("plain-shift-none", "plain (A only)", "A"), ("only_b-b", "B only", "B"),
                          ("mixture-a", "mixture A + B", "A"), ("mixture-b", "mixture A + B", "B"),
                          ("mixture_x2-a", "mixture A + B, twice the steps", "A"),
                          ("mixture_x2-b", "mixture A + B, twice the steps", "B")):
        *each, mean = cells(name, a if on == "A" else b)
        mixes.append([run, on, *(each + ["–"] * len(b) if on == "A" else ["–"] * len(a) + each), mean])
    return "\n\n".join([
        markdown(["run", "shift", *a, "mean"], shifts),
        markdown(["delay d", "chunking", *a, "mean", "seam jump", "inner jump", "ms a request (median)"], delays),
        markdown(["run", "evaluated on", *a, *b, "mean"], mixes)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--episodes", type=int, default=50, help="seeded episodes a task (default 50)")
    parser.add_argument("--steps", type=int, default=1500, help="training steps a run (default 1500)")
    parser.add_argument("--smoke", action="store_true", help="the same steps, tiny: for the suite")
    parser.add_argument("--table", action="store_true", help="print the tables only")
    parser.add_argument("--only", metavar="GLOB", help="only the steps whose name matches (plain-*: the rollouts of "
                        "the plain run), so that a second process can take some of them")
    args = parser.parse_args()
    if not args.table:
        execute(Plan(args.out, args.smoke, args.episodes, args.steps), args.only)
    print(tables(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
