"""`zerojax client` against `zerojax serve`'s server: LeRobot 0.6.1's tiny π0.5 checkpoint served
on a free port of the loopback in a background thread (as tests/test_serve.py serves), asked for
one chunk through the CLI. The frame the client builds is checked against the dataset's Parquet
read with pyarrow, and the served actions against the policy's own `infer` of the same
observation and request number (its noise)."""

import io
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from conftest import ROOT, one_error_line
from zerojax import cli
from zerojax.serve import client, loaders, server

CHECKPOINT = ROOT / "tests" / "fixtures" / "lerobot06" / "pi05"  # two cameras, cam0 and cam1; H = 4
DATASET = ROOT / "tests" / "fixtures" / "lerobot06" / "dataset"  # LeRobot 0.6.1's: 16 frames, one camera, cam0
CAM0, CAM1 = "observation.images.cam0", "observation.images.cam1"
FRAME = 5


@pytest.fixture(scope="module")
def served():
    return loaders.load(CHECKPOINT, num_steps=2, seed=7, vision_heads=2)


@pytest.fixture
def port(served):
    """A fresh server (request numbers from 0) on a free port, for one test."""
    sock = server.bind("127.0.0.1", 0)
    srv = server.PolicyServer(served, sock=sock)
    yield srv.start()
    srv.stop()


def parquet_rows():
    return pq.read_table(DATASET / "data" / "chunk-000" / "file-000.parquet").to_pylist()


def test_a_frame_is_the_datasets_row_and_its_chunk_the_next_actions():
    rows = {row["index"]: row for row in parquet_rows()}
    metadata = {"observation": {"observation.state": {}, CAM0: {}, CAM1: {}, "prompt": {}}, "action_horizon": 4}
    obs, actions = client.dataset_frame(f"lerobot:{DATASET}", FRAME, metadata)
    assert set(obs) == {"observation.state", CAM0, "prompt"}  # cam1: not in the dataset, left to the server
    np.testing.assert_array_equal(obs["observation.state"], np.float32(rows[FRAME]["observation.state"]))
    image = np.asarray(Image.open(io.BytesIO(rows[FRAME][CAM0]["bytes"])).convert("RGB"))
    np.testing.assert_array_equal(obs[CAM0], image)
    episode = [i for i, row in rows.items() if row["episode_index"] == rows[FRAME]["episode_index"]]
    chunk = [i for i in range(FRAME, FRAME + 4) if i in episode]  # the episode may end inside the chunk
    np.testing.assert_array_equal(actions, np.float32([rows[i]["action"] for i in chunk]))
    assert isinstance(obs["prompt"], str) and obs["prompt"]


def test_the_client_asks_serve_for_one_chunk(served, port, capsys, tmp_path):
    obs, _ = client.dataset_frame(f"lerobot:{DATASET}", FRAME, served.metadata())
    obs[CAM1] = obs[CAM0][::-1].copy()  # the checkpoint's second camera, which the dataset lacks
    client.save(obs, tmp_path / "obs.npz")
    assert cli.main(["client", "--port", str(port), "--observation", str(tmp_path / "obs.npz"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    want = served.infer(obs, 0)["actions"]  # request 0's noise: the server's first request
    np.testing.assert_array_equal(np.float32(doc["actions"]), want)
    assert doc["latency_s"] > 0 and doc["dataset_actions"] is None and doc["prompt"] == obs["prompt"]
    assert doc["policy"] == "zerojax pi05"

    assert cli.main(["client", "--port", str(port), "--observation", str(tmp_path / "obs.npz")]) == 0
    text = capsys.readouterr().out.splitlines()
    assert "ms (one round trip)" in text[0] and len(text) == 2 + want.shape[0]  # the heading, a line a step
    assert np.float32([float(x) for x in text[2].split()[1:]]) == pytest.approx(served.infer(obs, 1)["actions"][0],
                                                                               abs=1e-4)


def test_bad_input_is_one_line(port, capsys):
    # the dataset has no cam1: the server refuses, naming the key
    assert "refused the observation" in one_error_line(
        ["client", "--port", str(port), "--from", f"lerobot:{DATASET}", "--frame", "3"], capsys)
    assert "its frames are 0 to 15" in one_error_line(
        ["client", "--port", str(port), "--from", f"lerobot:{DATASET}", "--frame", "16"], capsys)
    assert "one of the two" in one_error_line(["client", "--port", str(port)], capsys)
    assert "no such file" in one_error_line(["client", "--port", str(port), "--observation", "nope.npz"], capsys)
    sock = server.bind("127.0.0.1", 0)
    free = sock.getsockname()[1]
    sock.close()
    assert "cannot connect to ws://127.0.0.1:" in one_error_line(
        ["client", "--port", str(free), "--observation", "x.npz"], capsys)
