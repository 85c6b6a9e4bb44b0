"""The tiny LeRobot dataset of tests/fixtures/lerobot/, whichever LeRobot writes it: its features,
episodes, tasks and frames, and the indices its reference items are taken at. Imported by
scripts/make_lerobot_dataset.py (LeRobot 0.4, codebase v3.0) and
scripts/make_lerobot_v21_dataset.py (LeRobot 0.3, codebase v2.1); numpy only."""

import numpy as np

FPS = 10
LENGTHS = (6, 9, 4)  # frames per episode
TASKS = ("pick up the red cube", "open the drawer", "pick up the red cube")  # per episode: two tasks
HORIZON = 4
INDICES = (0, 3, 5, 6, 12, 14, 15, 16, 18)  # episode starts, ends, and chunks that run past them
SIZE = 20  # resize_with_pad target: pads the 24x32 camera top and bottom, resizes the 16x16 one
FEATURES = {
    "observation.state": {"dtype": "float32", "shape": (3,), "names": ["x", "y", "gripper"]},
    "action": {"dtype": "float32", "shape": (2,), "names": ["dx", "dy"]},
    "observation.images.front": {"dtype": "video", "shape": (24, 32, 3), "names": ["height", "width", "channels"]},
    "observation.images.wrist": {"dtype": "image", "shape": (16, 16, 3), "names": ["height", "width", "channels"]},
}


def frame_of(rng, episode, t):
    """One frame: smooth images (video codecs keep them close) that change from frame to frame."""
    yy, xx = np.mgrid[0:24, 0:32]
    front = np.stack([(xx * 8 + t * 20) % 256, (yy * 10 + episode * 60) % 256,
                      np.full_like(xx, 40 * t % 256)], -1).astype(np.uint8)
    wrist = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)  # PNG is lossless: noise is fine
    return {"observation.state": (episode * 10 + t + rng.normal(0, 0.1, 3)).astype(np.float32),
            "action": rng.normal(episode, 1.0, 2).astype(np.float32),
            "observation.images.front": front, "observation.images.wrist": wrist, "task": TASKS[episode]}
