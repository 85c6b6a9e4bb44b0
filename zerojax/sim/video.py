"""MP4 files written with PyAV, with LeRobot's encoder settings (lerobot.datasets.video_utils
.encode_video_frames: libsvtav1, yuv420p, a key frame every 2 frames, crf 30), so that a
dataset's videos decode as LeRobot's own do; libx264 where this PyAV has no SVT-AV1."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

CODECS = ("libsvtav1", "libx264")  # the first this PyAV can encode


def codec() -> str:
    import av

    return next(c for c in CODECS if c in av.codecs_available)


def write(path: Path, frames, fps: int, crf: int = 30, gop: int = 2) -> dict:
    """Encode RGB uint8 [h, w, 3] frames into `path`; the stream's facts as LeRobot's
    get_video_info writes them into meta/info.json."""
    import av

    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1's own banner (20 lines a file) off: errors only
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    name = codec()
    with av.open(str(path), "w") as out:
        stream = out.add_stream(name, fps, options={"g": str(gop), "crf": str(crf)})
        stream.pix_fmt = "yuv420p"
        first = True
        for frame in frames:
            frame = np.ascontiguousarray(frame, np.uint8)
            if first:
                stream.height, stream.width = frame.shape[:2]
                first = False
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
        height, width = stream.height, stream.width
    with av.open(str(path)) as done:
        canonical = done.streams.video[0].codec_context.codec.canonical_name
    return {"video.height": height, "video.width": width, "video.codec": canonical, "video.pix_fmt": "yuv420p",
            "video.is_depth_map": False, "video.fps": fps, "video.channels": 3, "has_audio": False}
