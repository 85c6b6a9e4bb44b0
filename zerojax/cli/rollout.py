"""`zerojax rollout`: a policy run (π0, π0.5, SmolVLA; or Meta-World's scripted expert) in closed loop on simulated
tasks, scored per task. Needs the sim extra, checked after the arguments and before a model
is loaded."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from zerojax.cli.args import Parser, UsageError, positive_int

HELP = "a policy run (π0, π0.5, SmolVLA; or the scripted expert) in closed loop on simulated tasks: success rate per task (the sim extra: Meta-World)"
ENV_KINDS = ("metaworld",)


def arguments(rollout: Parser) -> None:
    rollout.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="a policy run (π0, π0.5, SmolVLA) trained on a dataset "
                         "`zerojax collect` wrote (or its export); none with --policy expert")
    rollout.add_argument("--env", required=True, metavar="KIND:TASKS", help="metaworld:TASK[,TASK...] (e.g. "
                         "metaworld:reach-v3,drawer-close-v3)")
    rollout.add_argument("--episodes", type=positive_int, default=50, metavar="N", help="seeded episodes per task "
                         "(default 50)")
    rollout.add_argument("--seed", type=int, default=100000, metavar="S", help="episode e starts from the env's "
                         "reset(S + e) (default 100000: past the seeds `zerojax collect` records from)")
    rollout.add_argument("--policy", choices=["run", "expert"], default="run", help="run: RUN_DIR's policy (default); "
                         "expert: Meta-World's scripted expert, through the same loop")
    rollout.add_argument("--n-action-steps", type=positive_int, metavar="N", help="actions executed from each chunk "
                         "before the next is sampled (LeRobot's n_action_steps; default: the chunk's length)")
    rollout.add_argument("--delay", type=int, default=0, metavar="D", help="a simulated inference time of D control "
                         "steps: the robot goes on with the current chunk's next D actions meanwhile (default 0)")
    rollout.add_argument("--rtc", action="store_true", help="real-time chunking: each request carries the actions "
                         "not yet executed and the delay, and the new chunk is inpainted to agree with them")
    rollout.add_argument("--rtc-jacobian", action="store_true", help="real-time chunking's correction pulled back "
                     "through the denoiser (the paper's, one vector-Jacobian product a step) instead of LeRobot's")
    rollout.add_argument("--num-steps", type=positive_int, default=10, metavar="N",
                         help="Euler steps of the flow from noise to actions (default 10, as π0's)")
    rollout.add_argument("--max-steps", type=positive_int, metavar="N", help="cut episodes at N steps (default: the "
                         "task's max_path_length, 500)")
    rollout.add_argument("--size", type=positive_int, default=64, metavar="S", help="--policy expert: the camera's "
                         "size for --video (a run uses its dataset's)")
    rollout.add_argument("--video", metavar="DIR", help="write MP4s of the first --videos episodes of each task here")
    rollout.add_argument("--videos", type=positive_int, default=2, metavar="K", help="episodes filmed per task "
                         "(default 2)")
    rollout.add_argument("--step", type=int, help="RUN_DIR: a checkpoint step (default: the newest)")
    rollout.add_argument("--dataset", metavar="NAME", help="a run trained on a mixture of datasets: the dataset "
                         "whose robot, camera and statistics the episodes are served with (as a request to "
                         "`zerojax serve` names it)")
    rollout.add_argument("--shift", action="append", default=[], metavar="KEY=VALUE", help="evaluate in a scene the "
                         "training data never showed (repeatable): brightness=F scales the lights, colour=R,G,B "
                         "multiplies the materials' colours, camera=DX,DY,DZ moves the camera (metres)")
    rollout.add_argument("--camera", default="corner2", help="--policy expert: the camera filmed for --video (a run "
                         "uses its dataset's)")
    rollout.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    rollout.add_argument("--json", action="store_true", help="stdout: one JSON document")


def run(args) -> int:
    names, video_dir, shift = _check(args)
    from zerojax import sim

    sim.require()
    from zerojax.sim import metaworld, rollout

    tasks = [t for t in names.split(",") if t]
    metaworld.check_tasks(tasks)
    policy, size, camera, n_action_steps, where = _policy(args)
    chunking = rollout.Chunking(n_action_steps, args.delay, args.rtc)
    print(f"zerojax: rollout of {where} on {', '.join(tasks)}: {args.episodes} episodes each from seed {args.seed}, "
          f"{n_action_steps} actions a chunk" + (f", an inference delay of {args.delay} steps" if args.delay else "")
          + (", real-time chunking" if args.rtc else "") + f"; camera {camera}, shift: {shift.describe()}",
          file=sys.stderr)
    start = time.perf_counter()
    results = rollout.run(policy, tasks, args.episodes, args.seed, chunking, size, video_dir, args.videos,
                          args.max_steps, progress=not args.no_progress, camera=camera, shift=shift)
    doc = {**rollout.summary(results), "shift": shift.describe()}
    if getattr(policy, "seconds", None):  # the median: the first requests of a run include compiling
        doc["request_ms"] = round(1000 * statistics.median(policy.seconds), 2)
    print(f"zerojax: {len(tasks) * args.episodes} episodes in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    _print(doc, args.json, video_dir)
    return 0


def _check(args) -> tuple[str, Path | None, object]:
    """The task names, the video directory and the scene's shift, once the arguments are known to
    be consistent (before the sim extra is looked for, so that bad input is named first)."""
    from zerojax.sim import metaworld  # numpy only: Meta-World itself is imported by its Env

    shift = metaworld.Shift.parse(args.shift)
    metaworld.check_camera(args.camera)
    kind, _, names = args.env.partition(":")
    if kind not in ENV_KINDS or not names:
        raise UsageError(f"--env {args.env!r}: give KIND:TASK[,TASK...] with KIND one of {', '.join(ENV_KINDS)} "
                         "(e.g. metaworld:reach-v3,drawer-close-v3)")
    if (args.policy == "run") != (args.run_dir is not None):
        raise UsageError("give RUN_DIR (a policy run) or --policy expert, not both" if args.run_dir else
                         "give RUN_DIR (a policy run), or --policy expert for Meta-World's scripted expert")
    if args.policy == "expert" and args.dataset:
        raise UsageError("--dataset names a dataset of a run trained on a mixture; the expert has none")
    if args.delay < 0 or (args.policy == "expert" and (args.delay or args.rtc)):
        raise UsageError(f"--delay {args.delay} must be >= 0" if args.delay < 0 else
                         "--delay and --rtc are for a run's chunks; the expert acts one step at a time")
    video_dir = Path(args.video) if args.video else None
    if video_dir is not None and video_dir.exists() and not video_dir.is_dir():
        raise UsageError(f"--video {args.video!r}: not a directory")
    return names, video_dir, shift


def _policy(args):
    """(policy, camera size, camera, actions executed per chunk, its description) of --policy."""
    from zerojax.sim import metaworld, rollout

    if args.policy == "expert":
        return rollout.expert, args.size, args.camera, 1, "Meta-World's scripted expert"
    from zerojax.serve import loaders
    from zerojax.serve.observation import DATASET, ObservationError

    served = loaders.load(Path(args.run_dir), args.step, args.num_steps, args.seed,
                             rtc_jacobian=args.rtc_jacobian)
    observations, asked = served.observations, {}
    if served.mixture != bool(args.dataset):  # a mixture's requests name their dataset; one dataset's none
        raise UsageError(f"{served.where} trained on a mixture of datasets (data.source=mixture): give --dataset, one "
                         f"of {observations.choices()}" if served.mixture else
                         f"--dataset {args.dataset!r}: {served.where} trained on one dataset, not a mixture")
    if served.mixture:
        try:
            observations = observations.member({DATASET: args.dataset})
        except ObservationError:
            raise UsageError(f"--dataset {args.dataset!r}: {served.where} trained on none of that name; give one of "
                             f"{observations.choices()}") from None
        asked = {DATASET: args.dataset}
    if args.rtc and served.train_delay and args.delay > served.train_delay:
        raise UsageError(f"--delay {args.delay} with --rtc: the run was trained to be given at most "
                         f"{served.train_delay} actions (model.action.train_delay={served.train_delay}); "
                         f"give --delay from 0 to {served.train_delay}")
    size, camera = metaworld.check_features(observations.features, served.where)
    n_action_steps = args.n_action_steps or served.horizon - args.delay
    if args.delay > n_action_steps:
        raise UsageError(f"--delay {args.delay} is more than --n-action-steps {n_action_steps}: the robot would run "
                         "out of the actions it committed to before the next chunk arrives")
    if n_action_steps + args.delay > served.horizon:
        raise UsageError(f"--n-action-steps {n_action_steps} and --delay {args.delay}: the run's chunks hold "
                         f"{served.horizon} actions (model.action.horizon), fewer than the two together")

    def policy(obs, request, env, leftover=None, delay=0):
        obs = {**{k: v for k, v in obs.items() if k in served.expected_keys}, **asked}
        if leftover is not None:  # real-time chunking: as a client of zerojax serve sends them
            obs.update({"prev_actions": leftover, "inference_delay": delay})
        start = time.perf_counter()
        actions = served.infer(obs, request)["actions"]
        policy.seconds.append(time.perf_counter() - start)
        return actions

    policy.seconds = []  # each request's time in the server's infer: its observation, sampling and actions

    return policy, size, camera, n_action_steps, served.where


def _print(doc: dict, as_json: bool, video_dir: Path | None) -> None:
    if as_json:
        print(json.dumps(doc))
        return
    for task, r in doc["tasks"].items():
        print(f"{task:32s} {r['successes']:4d}/{r['episodes']:<4d} {100 * r['success_rate']:6.1f}%")
    print(f"{'mean success rate':32s} {'':9s} {100 * doc['mean_success_rate']:6.1f}%")
    if video_dir is not None:
        print(f"videos: {video_dir}")
