"""Camera frames of a LeRobot dataset: MP4 frames decoded with PyAV at a timestamp, PNG/JPEG
images embedded in the Parquet decoded with Pillow, and pi0's resize with padding.

Pixels come out as LeRobot's `__getitem__` gives them: float32 [3, h, w] in [0, 1] (uint8 / 255).
A video frame is the decoded frame nearest the requested time, which must lie within
`TOLERANCE_S` of it (LeRobot's `decode_video_frames`, pyav backend: seek to the key frame
before, decode forward).
"""

from __future__ import annotations

import io
import threading

import numpy as np

from zerojax.errors import ConfigError

TOLERANCE_S = 1e-4  # LeRobotDataset's default tolerance_s: how far a decoded frame may be from the requested time


def to_unit_float(rgb_HWC: np.ndarray) -> np.ndarray:
    """uint8 [h, w, 3] -> float32 [3, h, w] in [0, 1], as torchvision's ToTensor (x / 255 in float32)."""
    return np.ascontiguousarray(rgb_HWC.transpose(2, 0, 1)).astype(np.float32) / np.float32(255)


def decode_image(cell: dict, where: str) -> np.ndarray:
    """An image cell of the Parquet (Hugging Face datasets' Image: {"bytes", "path"}) as RGB uint8."""
    from PIL import Image

    data = cell.get("bytes") if isinstance(cell, dict) else None
    if not data:
        raise ConfigError(f"{where}: the image is not embedded in the Parquet (no bytes; path {cell.get('path')!r})"
                          if isinstance(cell, dict) else f"{where}: not an image cell ({type(cell).__name__})")
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


class VideoReader:
    """Frames of MP4 files by timestamp; one open container per file and thread (a PyAV container
    is not safe to share between threads)."""

    def __init__(self):
        self._local = threading.local()

    def _container(self, path: str):
        import av

        open_files = self._local.__dict__.setdefault("files", {})
        if path not in open_files:
            try:
                open_files[path] = av.open(path)
            except av.error.FFmpegError as err:
                raise ConfigError(f"{path}: not a video PyAV can open ({err})") from None
        return open_files[path]

    def close(self) -> None:
        """Closes this thread's open files."""
        for container in self._local.__dict__.pop("files", {}).values():
            container.close()

    def frame(self, path: str, t: float, where: str) -> np.ndarray:
        """The RGB uint8 [h, w, 3] frame of `path` at `t` seconds (ConfigError naming `where` and
        the time if no frame lies within TOLERANCE_S of it)."""
        import av

        container = self._container(path)
        stream = container.streams.video[0]
        base = float(stream.time_base)
        best, best_dist = None, np.inf
        try:
            container.seek(max(0, int(t / base)), stream=stream, backward=True, any_frame=False)
            for frame in container.decode(stream):
                ft = frame.pts * base
                if abs(ft - t) < best_dist:
                    best, best_dist = frame, abs(ft - t)
                if ft >= t:
                    break
        except av.error.FFmpegError as err:
            raise ConfigError(f"{where}: cannot decode {path} at t={t:.4f} s ({err})") from None
        if best is None or not best_dist < TOLERANCE_S:
            near = "no frame" if best is None else f"the nearest frame is at {best.pts * base:.4f} s"
            raise ConfigError(f"{where}: {path} has no frame at t={t:.4f} s ({near}; tolerance {TOLERANCE_S} s)")
        return best.to_ndarray(format="rgb24")


def video_span(path: str) -> tuple[float, float]:
    """The first frame's time and the end of the last frame of an MP4's video stream, in seconds,
    from its headers (nothing decoded)."""
    import av

    try:
        container = av.open(path)
    except av.error.FFmpegError as err:
        raise ConfigError(f"{path}: not a video PyAV can open ({err})") from None
    with container:
        if not container.streams.video:  # a file cut before its index (moov) still opens
            raise ConfigError(f"{path}: no video stream in it (a file cut short, or not a video?)")
        stream = container.streams.video[0]
        base = float(stream.time_base)
        start = (stream.start_time or 0) * base
        if stream.duration is not None:
            return start, start + stream.duration * base
        return start, (container.duration or 0) / 1e6


def bilinear_weights(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """torch's `F.interpolate(mode="bilinear", align_corners=False)` along one dim: source
    indices i0, i1 and their weights (float32, as torch's CPU kernel computes them)."""
    scale = np.float32(n_in / n_out)
    src = scale * (np.arange(n_out, dtype=np.float32) + np.float32(0.5)) - np.float32(0.5)
    src = np.maximum(src, np.float32(0))
    i0 = np.floor(src).astype(np.int64)
    i1 = np.minimum(i0 + 1, n_in - 1)
    w1 = np.clip(src - i0.astype(np.float32), 0, 1).astype(np.float32)
    return i0, i1, np.float32(1) - w1, w1


def resizable(h: int, w: int, size: int) -> bool:
    """Whether an h x w image keeps at least a pixel on each side once `resize_with_pad` fits it
    into size x size (a 1 x 1000 strip into 224 x 224 would be 0 pixels high)."""
    ratio = max(w / size, h / size)
    return (h, w) == (size, size) or (int(h / ratio) >= 1 and int(w / ratio) >= 1)


def resize_with_pad(image_CHW: np.ndarray, size: int, pad_before: bool = False) -> np.ndarray:
    """An image in [-1, 1] resized to fit size x size without distortion (bilinear), then padded
    with -1 (black), centred: openpi's `resize_with_pad`, which LeRobot 0.4's pi0 copies.
    `pad_before`: all the padding on the top and left instead (LeRobot 0.3.x's `resize_with_pad`,
    what its checkpoints were trained with). A frame already size x size is left as it is."""
    _, h, w = image_CHW.shape
    if (h, w) == (size, size):
        return image_CHW
    ratio = max(w / size, h / size)
    rh, rw = int(h / ratio), int(w / ratio)
    y0, y1, wy0, wy1 = bilinear_weights(h, rh)
    x0, x1, wx0, wx1 = bilinear_weights(w, rw)
    # gathers, not matrix products: BLAS's own threads on a few busy cores cost 30x more here
    rows = image_CHW[:, y0] * wy0[:, None] + image_CHW[:, y1] * wy1[:, None]  # [3, rh, w]
    resized = np.clip(rows[:, :, x0] * wx0 + rows[:, :, x1] * wx1, -1, 1)
    top, left = (size - rh, size - rw) if pad_before else ((size - rh) // 2, (size - rw) // 2)
    out = np.full((image_CHW.shape[0], size, size), -1, np.float32)
    out[:, top:top + rh, left:left + rw] = resized
    return out
