"""MP4 files written with PyAV, with LeRobot's encoder settings (lerobot.datasets.video_utils
.encode_video_frames: libsvtav1, yuv420p, a key frame every 2 frames, crf 30), so that a
dataset's videos decode as LeRobot's own do; libx264 where this PyAV has no SVT-AV1.

SVT-AV1 run as root (a container, CI) switches the thread that opens an encoder to real-time
scheduling (SCHED_FIFO at priority 99), and its own worker threads inherit it. Left so, every
thread and subprocess this process starts afterwards runs real-time too: a spin-waiting one then
never yields its core (two jax.distributed processes started after a collection stalled for good).
`write` puts back the scheduling each thread had before the encoder was opened.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path

import numpy as np

CODECS = ("libsvtav1", "libx264")  # the first this PyAV can encode


def codec() -> str:
    import av

    return next(c for c in CODECS if c in av.codecs_available)


REALTIME = {getattr(os, "SCHED_FIFO", None), getattr(os, "SCHED_RR", None)} - {None}


def realtime_threads() -> set[int]:
    """The ids of this process's threads on a real-time scheduling policy (Linux; elsewhere none)."""
    if not hasattr(os, "sched_getscheduler") or not os.path.isdir("/proc/self/task"):
        return set()
    found = set()
    for tid in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            if os.sched_getscheduler(tid) in REALTIME:
                found.add(tid)
    return found


@contextlib.contextmanager
def no_realtime_scheduling():
    """Every thread of this process that a library moved to a real-time policy inside the block
    goes back to the policy and priority the calling thread had when it entered (Linux; elsewhere
    a no-op). Threads already real-time on entry, set so by the user, are left as they were."""
    if not hasattr(os, "sched_getscheduler"):
        yield
        return
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    before = realtime_threads()
    try:
        yield
    finally:
        for tid in realtime_threads() - before:
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                os.sched_setscheduler(tid, policy, param)


def write(path: Path, frames, fps: int, crf: int = 30, gop: int = 2) -> dict:
    """Encode RGB uint8 [h, w, 3] frames into `path`; the stream's facts as LeRobot's
    get_video_info writes them into meta/info.json."""
    import av

    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1's own banner (20 lines a file) off: errors only
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    name = codec()
    frames = iter(frames)
    first = np.ascontiguousarray(next(frames), np.uint8)
    with av.open(str(path), "w") as out:
        stream = out.add_stream(name, fps, options={"g": str(gop), "crf": str(crf)})
        stream.pix_fmt = "yuv420p"
        stream.height, stream.width = first.shape[:2]
        with no_realtime_scheduling():  # SVT-AV1 raises this thread, and starts its own, here
            stream.codec_context.open()
        for frame in itertools.chain([first], frames):
            frame = np.ascontiguousarray(frame, np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
        height, width = stream.height, stream.width
    with av.open(str(path)) as done:
        canonical = done.streams.video[0].codec_context.codec.canonical_name
    return {"video.height": height, "video.width": width, "video.codec": canonical, "video.pix_fmt": "yuv420p",
            "video.is_depth_map": False, "video.fps": fps, "video.channels": 3, "has_audio": False}
