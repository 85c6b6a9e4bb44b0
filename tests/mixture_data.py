"""A second tiny LeRobot dataset for mixtures (tests/test_mixture.py): tests/fixtures/lerobot/tiny
copied and changed into another robot's, at 20 fps, with one camera (its wrist, no front), a state
of 5 and an action of 4 dimensions (the tiny one's, scaled and shifted, two more appended) and its
own statistics (meta/stats.json recomputed from its frames)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

TINY = Path(__file__).resolve().parent / "fixtures" / "lerobot" / "tiny"
STATS = ("min", "max", "mean", "std", "q01", "q10", "q50", "q90", "q99")


def stats_of(x_ND: np.ndarray) -> dict:
    q = {f"q{p:02d}": np.quantile(x_ND, p / 100, axis=0).tolist() for p in (1, 10, 50, 90, 99)}
    return {"min": x_ND.min(0).tolist(), "max": x_ND.max(0).tolist(), "mean": x_ND.mean(0).tolist(),
            "std": x_ND.std(0).tolist(), "count": [len(x_ND)], **q}


def other_robot(out: Path) -> Path:
    """The second dataset, written under `out` (returned)."""
    shutil.copytree(TINY, out)
    info = json.loads((out / "meta" / "info.json").read_text())
    del info["features"]["observation.images.front"]
    info["fps"] = 20  # another robot's rate: its chunks are its own next frames
    info["features"]["observation.state"]["shape"], info["features"]["observation.state"]["names"] = [5], list("abcde")
    info["features"]["action"]["shape"], info["features"]["action"]["names"] = [4], list("wxyz")
    (out / "meta" / "info.json").write_text(json.dumps(info, indent=4))
    shutil.rmtree(out / "videos")
    path = next((out / "data").glob("*/*.parquet"))
    table = pq.read_table(path)
    state = np.asarray(table.column("observation.state").to_pylist(), np.float32)
    action = np.asarray(table.column("action").to_pylist(), np.float32)
    state = np.concatenate([state * 3 + 40, np.cos(state[:, :2])], axis=1)
    action = np.concatenate([action * 0.5 + 4, action[:, :1] ** 2, -action[:, 1:]], axis=1)
    for name, x in (("observation.state", state), ("action", action)):
        column = pa.array(x.tolist(), type=pa.list_(pa.float32(), x.shape[1]))
        table = table.set_column(table.schema.get_field_index(name), name, column)
    frame = np.asarray(table.column("frame_index").to_pylist())
    table = table.set_column(table.schema.get_field_index("timestamp"), "timestamp",
                             pa.array((frame / 20).astype(np.float32)))  # 20 fps
    pq.write_table(table.replace_schema_metadata(None), path)
    stats = json.loads((out / "meta" / "stats.json").read_text())
    del stats["observation.images.front"]
    stats["observation.state"], stats["action"] = stats_of(state), stats_of(action)
    (out / "meta" / "stats.json").write_text(json.dumps(stats))
    episodes = next((out / "meta" / "episodes").glob("*/*.parquet"))
    table = pq.read_table(episodes)
    kept = [n for n in table.column_names if "observation.images.front" not in n
            and not n.startswith(("stats/observation.state/", "stats/action/"))]
    pq.write_table(table.select(kept), episodes)
    return out
