"""Closed-loop episodes (`zerojax rollout`): a policy drives a simulated task, and the
environment says whether it succeeded.

A policy is a function (observation dict, request number) -> action chunk float32 [H, D] in the
robot's units. Each episode executes the first n_action_steps of a chunk, then asks for a new
one from the observation it reached (LeRobot's n_action_steps; the camera is rendered only
when the policy reads it). Episode e of a task starts from the environment's reset(seed + e);
a served policy draws its noise from its request count, which restarts at 0 for every episode
(request = e * 100000 + chunk number), so an episode's actions depend only on (seed, e): the
same seed gives the same result, whatever else ran before. An episode succeeds where the
environment's `info["success"]` is set at any step, and ends there or at the task's
max_path_length.

`--policy expert` runs Meta-World's scripted expert through the same loop (one step a chunk:
it is a feedback controller), for the rate to compare the policy with.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from zerojax.sim import metaworld, video

REQUESTS_PER_EPISODE = 100000


@dataclass
class TaskResult:
    episodes: int = 0
    successes: int = 0
    steps: list = field(default_factory=list)  # each episode's length

    def as_json(self) -> dict:
        return {"episodes": self.episodes, "successes": self.successes,
                "success_rate": self.successes / self.episodes if self.episodes else 0.0}


def episode(env: metaworld.Env, policy, seed: int, index: int, n_action_steps: int, frames: list | None,
            max_steps: int) -> tuple[bool, int]:
    """(success, steps) of one episode; `frames` (a list) collects the camera at every step. The
    camera is rendered for a policy that reads it (`policy.reads_camera`, default True) or a video."""
    reads = getattr(policy, "reads_camera", True)
    obs = env.reset(seed + index)
    image = env.image() if reads or frames is not None else None
    if frames is not None:
        frames.append(image)
    steps, request = 0, index * REQUESTS_PER_EPISODE
    while steps < max_steps:
        chunk = policy({**obs, metaworld.IMAGE_KEY: image} if reads else obs, request, env)
        request += 1
        for action in chunk[:n_action_steps]:
            obs, success = env.step(action)
            steps += 1
            image = env.image() if frames is not None else None
            if frames is not None:
                frames.append(image)
            if success or steps >= max_steps:
                return success, steps
        if image is None and reads:
            image = env.image()
    return False, steps


def run(policy, tasks: list[str], episodes: int, seed: int, n_action_steps: int, size: int,
        video_dir: Path | None = None, videos_per_task: int = 2, max_steps: int | None = None,
        progress: bool = True) -> dict:
    """{task: TaskResult} over `episodes` seeded episodes per task; MP4s of the first
    `videos_per_task` episodes of each task into video_dir/<task>-<e>.mp4."""
    results = {}
    total, done = len(tasks) * episodes, 0
    for task in tasks:
        env = metaworld.Env(task, size)
        result = results[task] = TaskResult()
        for e in range(episodes):
            frames = [] if video_dir is not None and e < videos_per_task else None
            success, steps = episode(env, policy, seed, e, n_action_steps, frames, max_steps or env.max_steps)
            result.episodes += 1
            result.successes += int(success)
            result.steps.append(steps)
            if frames is not None:
                video.write(Path(video_dir) / f"{task}-{e}.mp4", frames, metaworld.FPS, crf=23, gop=12)
            done += 1
            if progress and sys.stderr.isatty():  # one line, redrawn
                bar = "#" * (24 * done // total)
                print(f"\r\033[Krollout [{bar:<24}] {done}/{total} {task} episode {e}: "
                      f"{'success' if success else 'failure'} in {steps} steps, "
                      f"{result.successes}/{result.episodes} so far", end="", file=sys.stderr, flush=True)
        if progress:  # a log (not a terminal) gets a line a task
            print(("\n" if sys.stderr.isatty() else "") + f"rollout: {task}: {result.successes}/{result.episodes} "
                  f"successes, {np.mean(result.steps):.0f} steps an episode", file=sys.stderr, flush=True)
        env.close()
    return results


def expert(obs, request, env) -> np.ndarray:
    """Meta-World's scripted expert as a policy: one action a chunk, from the true state."""
    return env.expert_action()[None]


expert.reads_camera = False


def summary(results: dict) -> dict:
    tasks = {t: r.as_json() for t, r in results.items()}
    return {"tasks": tasks, "mean_success_rate": float(np.mean([t["success_rate"] for t in tasks.values()]))}
