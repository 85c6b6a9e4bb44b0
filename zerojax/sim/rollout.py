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

`--delay D` simulates an inference that takes D control steps: the robot goes on with the
current chunk's next D actions while the next chunk is computed from the observation at the
request, and executes that chunk from its action D on (`Chunking`). Naive chunking then jumps at
the seam; `--rtc` sends the unexecuted actions and the delay with the request, so that the
policy's real-time chunking (zerojax/models/vla/rtc.py) inpaints the new chunk to agree. The summary
gives the mean action jump |a_t - a_t-1| at the seams and inside the chunks.

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
    seam_jumps: list = field(default_factory=list)  # |a_t - a_t-1| where a_t is a new chunk's first executed action
    inner_jumps: list = field(default_factory=list)  # the same between two actions of one chunk

    def as_json(self) -> dict:
        mean = lambda x: round(float(np.mean(x)), 5) if x else None  # noqa: E731
        return {"episodes": self.episodes, "successes": self.successes,
                "success_rate": self.successes / self.episodes if self.episodes else 0.0,
                "seam_jump": mean(self.seam_jumps), "inner_jump": mean(self.inner_jumps)}


@dataclass(frozen=True)
class Chunking:
    """How chunks are executed: `n_action_steps` of each from the observation it was sampled at,
    then the next is asked for; while it is computed (`delay` control steps, a simulated inference
    time) the robot goes on with the current chunk's next `delay` actions, and the new chunk is
    executed from its action `delay` on. `rtc`: the request carries those unexecuted actions
    (`leftover`) and the delay, so a real-time-chunking policy inpaints the new chunk to agree."""

    n_action_steps: int
    delay: int = 0
    rtc: bool = False


class Episode:
    """One episode's loop state: the environment, the camera, the actions executed and where a
    new chunk's actions began (for the smoothness figures)."""

    def __init__(self, env, frames, max_steps: int, reads: bool, obs):
        self.env, self.frames, self.max_steps, self.reads, self.obs = env, frames, max_steps, reads, obs
        self.image = env.image() if reads or frames is not None else None
        if frames is not None:
            frames.append(self.image)
        self.steps, self.success, self.actions, self.seams, self.chunk = 0, False, [], [], None

    @property
    def over(self) -> bool:
        return self.success or self.steps >= self.max_steps

    def observation(self) -> dict:
        if self.image is None and self.reads:
            self.image = self.env.image()
        return {**self.obs, self.env.image_key: self.image} if self.reads else self.obs

    def execute(self, actions, chunk: int) -> None:
        """Step through `actions`, of chunk number `chunk`: the first action of a chunk other than
        the last one executed is a seam."""
        for action in actions:
            if self.over:
                return
            if chunk != self.chunk and self.actions:
                self.seams.append(len(self.actions))
            self.chunk = chunk
            self.actions.append(np.asarray(action, np.float32))
            self.obs, self.success = self.env.step(action)
            self.steps += 1
            self.image = self.env.image() if self.frames is not None else None
            if self.frames is not None:
                self.frames.append(self.image)

    def jumps(self) -> tuple[list, list]:
        """(the seams' jumps, the others'): |a_t - a_t-1| over the executed actions."""
        a = np.stack(self.actions) if len(self.actions) > 1 else np.zeros((0, 1))
        steps = np.linalg.norm(np.diff(a, axis=0), axis=1) if len(a) > 1 else np.zeros(0)
        seam = np.zeros(len(steps), bool)
        seam[[t - 1 for t in self.seams if 0 < t <= len(steps)]] = True
        return steps[seam].tolist(), steps[~seam].tolist()


def episode(env: metaworld.Env, policy, seed: int, index: int, chunking: Chunking | int, frames: list | None,
            max_steps: int) -> Episode:
    """One episode (its success, steps and executed actions); `frames` (a list) collects the
    camera at every step. The camera is rendered for a policy that reads it
    (`policy.reads_camera`, default True) or a video."""
    c = chunking if isinstance(chunking, Chunking) else Chunking(chunking)
    ep = Episode(env, frames, max_steps, getattr(policy, "reads_camera", True), env.reset(seed + index))
    request = index * REQUESTS_PER_EPISODE
    chunk, start = policy(ep.observation(), request, env), 0  # the first chunk: before the robot moves
    while not ep.over:
        ep.execute(chunk[start:c.n_action_steps], request)
        if ep.over:
            break
        leftover = chunk[c.n_action_steps:]
        asked = {"leftover": leftover, "delay": c.delay} if c.rtc else {}
        new = policy(ep.observation(), request + 1, env, **asked)  # from the state the robot is in now
        ep.execute(chunk[c.n_action_steps:c.n_action_steps + c.delay], request)  # meanwhile
        chunk, start, request = new, c.delay, request + 1
    # the result keeps no environment: a closed task's env freed later, once the next task's has
    # rendered, takes MuJoCo's OSMesa context with it and every later frame is black
    ep.env = ep.frames = None
    return ep


def run(policy, tasks: list[str], episodes: int, seed: int, n_action_steps: "Chunking | int", size: int,
        video_dir: Path | None = None, videos_per_task: int = 2, max_steps: int | None = None,
        progress: bool = True, camera: str = metaworld.CAMERA, shift: metaworld.Shift | None = None) -> dict:
    """{task: TaskResult} over `episodes` seeded episodes per task, seen through `camera` in a
    scene changed by `shift`; MP4s of the first `videos_per_task` episodes of each task into
    video_dir/<task>-<e>.mp4."""
    results = {}
    total, done = len(tasks) * episodes, 0
    for task in tasks:
        env = metaworld.Env(task, size, camera, shift)
        result = results[task] = TaskResult()
        for e in range(episodes):
            frames = [] if video_dir is not None and e < videos_per_task else None
            ep = episode(env, policy, seed, e, n_action_steps, frames, max_steps or env.max_steps)
            success, steps = ep.success, ep.steps
            result.episodes += 1
            result.successes += int(success)
            result.steps.append(steps)
            seams, inner = ep.jumps()
            result.seam_jumps += seams
            result.inner_jumps += inner
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


def expert(obs, request, env, **_) -> np.ndarray:
    """Meta-World's scripted expert as a policy: one action a chunk, from the true state."""
    return env.expert_action()[None]


expert.reads_camera = False


def summary(results: dict) -> dict:
    """Per task and over all: the success rate, and the mean action jump at the chunks' seams and
    inside them (|a_t - a_t-1|, the robot's units: how smooth the executed motion is)."""
    tasks = {t: r.as_json() for t, r in results.items()}
    seams = [j for r in results.values() for j in r.seam_jumps]
    inner = [j for r in results.values() for j in r.inner_jumps]
    return {"tasks": tasks, "mean_success_rate": float(np.mean([t["success_rate"] for t in tasks.values()])),
            "seam_jump": round(float(np.mean(seams)), 5) if seams else None,
            "inner_jump": round(float(np.mean(inner)), 5) if inner else None}
