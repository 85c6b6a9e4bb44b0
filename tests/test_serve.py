"""`zerojax serve` speaks openpi's websocket policy protocol: a tiny π0 trained for a step on the
LeRobot fixture, served on a free port in a background thread, driven by a client written as
openpi's `WebsocketClientPolicy` is (websockets' sync client; msgpack-numpy encoded here as
openpi_client.msgpack_numpy does, apart from zerojax's own encoder). The actions must equal
`sample_actions` on the training batch of the same frame, with the same noise, unnormalized."""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import jax
import msgpack
import numpy as np
import pytest
import websockets
import websockets.sync.client
from flax import nnx

from conftest import ROOT, TINY, one_error_line
from zerojax import cli, config
from zerojax.data import sources
from zerojax.interop import safetensors as safetensors_io
from zerojax.serve import loaders, server
from zerojax.serve.observation import ObservationError
from zerojax.train import export

FIXTURE = ROOT / "tests" / "fixtures" / "lerobot" / "tiny"
CAMERAS = ("observation.images.front", "observation.images.wrist")  # video [24, 32, 3], image [16, 16, 3]
# tests/test_lerobot.py's π0 (a third camera slot the dataset lacks), its actions normalized by quantiles
TRAIN = [f"data.source=lerobot:{FIXTURE}", "data.norm_action=quantiles", "model.family=pi0", "model.vocab_size=256",
         "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=8",
         "model.d_ff=32", "model.expert.d_model=16", "model.expert.d_ff=32", "model.vision.image_size=8",
         "model.vision.patch_size=4", "model.vision.d_model=16", "model.vision.n_layers=1", "model.vision.n_heads=2",
         "model.vision.d_ff=32", "model.action.horizon=2", "model.action.prompt_len=16",
         "model.action.max_state_dim=8", "model.action.max_action_dim=4", "model.action.action_dim=2",
         "model.action.cameras=3", "data.image_size=8", "data.action_horizon=2", "data.prompt_len=16",
         "train.global_batch=8", "train.steps=1", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0",
         "train.ckpt_every=1", "train.report=false", "zero.min_shard_size=64",
         "optim.warmup_steps=0"]  # the step changes the weights (a warmup from 0 would leave them at init)
SEED, STEPS = 3, 3  # the noise's seed; Euler steps (not π0's 10: the reference runs them too)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "run"
    assert cli.main(["train", "--no-progress", *TRAIN, f"train.out_dir={out}"]) == 0
    return out


@pytest.fixture(scope="module")
def served(run_dir):
    return loaders.load(run_dir, num_steps=STEPS, seed=SEED)


@pytest.fixture(scope="module")
def sample(run_dir):
    """sample_actions of the run's model, loaded again apart from the server's, jitted."""
    _, _, model = export.load_model(run_dir)
    graphdef, params = nnx.split(model)
    return jax.jit(lambda obs, noise: nnx.merge(graphdef, params).sample_actions(obs, noise, STEPS))


@pytest.fixture
def port(served):
    """A fresh server (its request count from 0) on a free port, for one test: the socket bound
    first, as `zerojax serve` binds it before loading the model."""
    sock = server.bind("127.0.0.1", 0)
    srv = server.PolicyServer(served, sock=sock)
    assert srv.start() == sock.getsockname()[1]
    yield srv.port
    srv.stop()


# -- a client as openpi's: openpi_client.msgpack_numpy and websocket_client_policy ----------------

def pack(obj) -> bytes:
    def default(x):
        if isinstance(x, np.ndarray):
            return {b"__ndarray__": True, b"data": x.tobytes(), b"dtype": x.dtype.str, b"shape": x.shape}
        if isinstance(x, np.generic):
            return {b"__npgeneric__": True, b"data": x.item(), b"dtype": x.dtype.str}
        return x

    return msgpack.packb(obj, default=default)


def unpack(data: bytes):
    def hook(d):
        if b"__ndarray__" in d:
            return np.ndarray(buffer=d[b"data"], dtype=np.dtype(d[b"dtype"]), shape=d[b"shape"])
        return d

    return msgpack.unpackb(data, object_hook=hook)


class Client:
    """WebsocketClientPolicy's connect, metadata and infer."""

    def __init__(self, port: int, api_key: str | None = None):
        headers = {"Authorization": f"Api-Key {api_key}"} if api_key else None
        self.ws = websockets.sync.client.connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None,
                                                 additional_headers=headers)
        self.metadata = unpack(self.ws.recv())

    def infer(self, obs: dict) -> dict:
        self.ws.send(pack(obs))
        response = self.ws.recv()
        if isinstance(response, str):  # as openpi's client: text is the server's error
            raise RuntimeError(f"Error in inference server:\n{response}")
        return unpack(response)


# -- the training batch's frames as observations --------------------------------------------------

@pytest.fixture(scope="module")
def frames():
    """(observations as a robot sends them, π0's training batch of the same frames)."""
    src = sources.open_source(config.load(overrides=TRAIN))
    ds, batch = src.source.dataset, src.rows(0, 0, slice(None))
    observations = []
    for index in src.source.frames_of(0, 0):
        numbers = ds.numbers(int(index), 2)
        observations.append({"observation.state": numbers["observation.state"].astype(np.float64),
                             "prompt": numbers["task"],
                             **{c: ds.image(c, int(index), src.source.video) for c in CAMERAS}})  # uint8 HWC
    return observations, batch


def direct(run_dir, sample, batch, row: int, request: int) -> np.ndarray:
    """sample_actions on the training batch's row, request `request`'s noise, the actions unnormalized
    by hand (quantiles: (x + 1)(q99 - q01) / 2 + q01)."""
    obs = {k: batch[k][row:row + 1] for k in ("images", "image_masks", "tokens", "token_mask", "state")}
    noise = jax.random.normal(jax.random.fold_in(jax.random.key(SEED), request), (1, 2, 4))
    x = np.asarray(sample(obs, noise))[0, :, :2]
    stats = json.loads((run_dir / "lerobot.json").read_text())["normalization"]["action"]
    q01, q99 = np.asarray(stats["q01"], np.float32), np.asarray(stats["q99"], np.float32)
    return (x + 1) * (q99 - q01) / 2 + q01


def test_metadata_first_then_actions_equal_sample_actions_on_the_training_batch(run_dir, port, frames, sample):
    observations, batch = frames
    client = Client(port)
    meta = client.metadata
    assert meta["observation"] == {"observation.state": {"shape": [3], "dtype": "float32"},
                                   CAMERAS[0]: {"shape": [24, 32, 3], "dtype": "uint8"},
                                   CAMERAS[1]: {"shape": [16, 16, 3], "dtype": "uint8"}, "prompt": {"dtype": "str"}}
    assert (meta["action_horizon"], meta["action_dim"], meta["action_names"]) == (2, 2, ["dx", "dy"])
    first, second = client.infer(observations[0]), client.infer(observations[1])
    assert first["actions"].shape == (2, 2) and first["actions"].dtype == np.float32
    assert first["server_timing"]["infer_ms"] > 0 and "prev_total_ms" not in first["server_timing"]
    assert second["server_timing"]["prev_total_ms"] >= first["server_timing"]["infer_ms"]
    np.testing.assert_allclose(first["actions"], direct(run_dir, sample, batch, 0, 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(second["actions"], direct(run_dir, sample, batch, 1, 1), rtol=1e-5, atol=1e-6)


# -- openpi's own client, from PyPI, in a venv of its own ------------------------------------------

OPENPI_CLIENT = ("openpi-client==0.1.2", "typing_extensions")  # it imports typing_extensions undeclared
OPENPI_VENV = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zerojax" / "venvs"
               / "openpi-client-0.1.2")  # the user's cache (never the repository or runs/): built once


def build_venv(venv: Path, packages: tuple) -> str | None:
    """`venv` with `packages` installed, built once (a lock for concurrent sessions; a marker
    written last, so a half-built venv is built again); None, or why it cannot be built."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / "zerojax-complete").is_file():
            return None
        shutil.rmtree(venv, ignore_errors=True)
        python = venv / "bin" / "python"
        for argv in ([sys.executable, "-m", "venv", str(venv)],
                     [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *packages]):
            try:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
            except (OSError, subprocess.TimeoutExpired) as err:
                done = subprocess.CompletedProcess(argv, 1, "", f"{type(err).__name__}: {err}")
            if done.returncode != 0:
                shutil.rmtree(venv, ignore_errors=True)
                lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()] or ["no output"]
                return f"`{' '.join(argv[2:4] + argv[-len(packages):] * (len(argv) > 5))}` failed (no network or no pip?): {lines[-1]}"
        (venv / "zerojax-complete").write_text(" ".join(packages) + "\n")
    return None


@pytest.fixture(scope="module")
def openpi_python() -> str:
    why = build_venv(OPENPI_VENV, OPENPI_CLIENT)
    if why:
        pytest.skip(f"cannot build {OPENPI_VENV} with {' '.join(OPENPI_CLIENT)}: {why}")
    return str(OPENPI_VENV / "bin" / "python")


@pytest.mark.slow
def test_openpi_clients_own_websocket_client_policy_gets_sample_actions(openpi_python, run_dir, served, port, frames,
                                                                        sample, tmp_path):
    """scripts/checks/openpi_client_infer.py, in openpi-client's venv, sends two training frames, one built
    from the metadata alone, then one without its state: the actions equal sample_actions on the
    training batch with requests 0 and 1's noise (and the in-process policy's bit for bit), and
    the bad one comes back as openpi's client raises a server's error."""
    observations, batch = frames
    np.savez(tmp_path / "obs.npz", **{f"{i}/{k}": np.asarray(v) for i, obs in enumerate(observations[:2])
                                      for k, v in obs.items()})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of zerojax's on its path
    done = subprocess.run([openpi_python, str(ROOT / "scripts" / "checks" / "openpi_client_infer.py"), "--port", str(port),
                           str(tmp_path / "obs.npz")], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["openpi_client"] == "0.1.2" and out["numpy"].startswith("1."), out  # the real one, its numpy
    assert out["metadata"] == json.loads(json.dumps(served.metadata()))
    assert out["actions_dtype"] == "float32"
    for request in (0, 1):
        actions = np.asarray(out["actions"][request], np.float32)
        np.testing.assert_array_equal(actions, served.infer(observations[request], request)["actions"])
        np.testing.assert_allclose(actions, direct(run_dir, sample, batch, request, request), rtol=1e-5, atol=1e-6)
    assert out["from_metadata"] == {"shape": [2, 2], "dtype": "float32"}
    assert out["error"].startswith("Error in inference server:\nobservation: no 'observation.state'"), out["error"]


def test_each_request_has_fresh_noise_and_a_restart_repeats_them(served, frames):
    obs = frames[0][0]
    answers = []
    for _ in range(2):  # the server started twice, with the same seed
        srv = server.PolicyServer(served, port=0)
        client = Client(srv.start())
        answers.append([client.infer(obs)["actions"] for _ in range(2)])
        srv.stop()
    assert not np.allclose(answers[0][0], answers[0][1])  # the same observation, new noise
    np.testing.assert_array_equal(answers[0][0], answers[1][0])
    np.testing.assert_array_equal(answers[0][1], answers[1][1])


def test_images_are_read_as_uint8_hwc_chw_or_unit_floats_alike(served, frames):
    obs = frames[0][0]
    reference = served.batch(obs)
    for convert in (lambda x: x.transpose(2, 0, 1), lambda x: x.transpose(2, 0, 1) / np.float32(255)):
        other = served.batch({**obs, **{c: convert(obs[c]) for c in CAMERAS}})
        np.testing.assert_allclose(other["images"], reference["images"], rtol=0, atol=1e-6)


BAD = {  # what is sent, what the error must say
    "missing camera": (lambda obs: pack({k: v for k, v in obs.items() if k != CAMERAS[1]}),
                       "no 'observation.images.wrist'; this policy reads 'observation.state' [3], "
                       "'observation.images.front' uint8 [h, w, 3], 'observation.images.wrist'"),
    "wrong state size": (lambda obs: pack({**obs, "observation.state": np.zeros(4)}),
                         "'observation.state' must be 3 real numbers (shape [3]"),
    "NaN in the state": (lambda obs: pack({**obs, "observation.state": np.array([0, np.nan, 0])}),
                         "'observation.state' holds a NaN"),
    "unknown key": (lambda obs: pack({**obs, "observation/image": obs[CAMERAS[0]]}), "unknown key 'observation/image'"),
    "image dtype": (lambda obs: pack({**obs, CAMERAS[0]: obs[CAMERAS[0]].astype(np.int64)}),
                    "'observation.images.front' must be uint8 (0-255) or float in [0, 1]"),
    "no prompt": (lambda obs: pack({k: v for k, v in obs.items() if k != "prompt"}), "no 'prompt'"),
    "ragged state": (lambda obs: pack({**obs, "observation.state": [[0.5, 1.0], [2.0]]}),
                     "'observation.state' is not an array of numbers"),
    "a sliver of an image": (lambda obs: pack({**obs, CAMERAS[0]: np.zeros((1, 4000, 3), np.uint8)}),
                             "'observation.images.front' is 1 x 4000 pixels: resized to fit the model's"),
    "malformed msgpack": (lambda obs: b"\xc1\x00", "not a msgpack message"),
    "a text frame": (lambda obs: "hello", "expected a binary msgpack frame"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_observation_is_answered_with_its_error_and_others_are_still_served(case, port, frames):
    obs = frames[0][0]
    bystander = Client(port)  # connected before, served after
    bad = Client(port)
    make, message = BAD[case]
    bad.ws.send(make(obs))
    reply = bad.ws.recv()
    assert isinstance(reply, str) and message in reply, reply
    with pytest.raises(websockets.ConnectionClosed) as closed:
        bad.ws.recv()
    assert closed.value.rcvd.code == 1008
    assert bystander.infer(obs)["actions"].shape == (2, 2)
    assert Client(port).infer(obs)["actions"].shape == (2, 2)


class Failing:
    """A policy whose inference fails as a bug would, its message holding a server path."""

    max_message_bytes = 1 << 20

    def metadata(self):
        return {"action_horizon": 1}

    def infer(self, obs, request):
        if obs.get("fail"):
            raise RuntimeError(f"bug in {Path(server.__file__).resolve()}")
        return {"actions": np.zeros((1, 1), np.float32)}


def test_a_failure_inside_the_policy_shows_the_client_no_traceback_and_others_are_served():
    srv = server.PolicyServer(Failing(), port=0)
    port = srv.start()
    try:
        bystander, bad = Client(port), Client(port)
        bad.ws.send(pack({"fail": True}))
        reply = bad.ws.recv()
        assert isinstance(reply, str) and "the policy failed on this observation (error 1" in reply, reply
        assert "Traceback" not in reply and "/" not in reply and "bug in" not in reply, reply
        with pytest.raises(websockets.ConnectionClosed) as closed:
            bad.ws.recv()
        assert closed.value.rcvd.code == 1011
        assert bystander.infer({})["actions"].shape == (1, 1)
    finally:
        srv.stop()


class Quick:
    """A policy that answers at once (the connection handling under test, not the model)."""

    max_message_bytes = 1 << 20

    def metadata(self):
        return {"action_horizon": 1}

    def infer(self, obs, request):
        return {"actions": np.full((1, 1), request, np.float32)}


def raw_handshake(port: int) -> "socket.socket":
    """A websocket client's opening handshake by hand, then nothing: it never reads or answers a ping."""
    import base64
    import socket

    sock = socket.create_connection(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    return sock


def closed_within(sock, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (whatever it sent before)."""
    sock.settimeout(seconds)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if not sock.recv(65536):
                return True
    except (TimeoutError, OSError):
        return False
    return False


def test_stalled_half_open_and_trickling_clients_are_dropped_and_never_slow_the_others():
    import socket

    limits = server.Limits(open_timeout_s=1, ping_interval_s=0.5, ping_timeout_s=0.5, close_timeout_s=0.5)
    srv = server.PolicyServer(Quick(), port=0, limits=limits)
    port = srv.start()
    try:
        bare = socket.create_connection(("127.0.0.1", port))  # connects, never says a word
        silent = raw_handshake(port)  # upgrades, then never reads nor answers the keepalive pings
        trickler = raw_handshake(port)
        trickler.sendall(bytes([0x82, 0xFE, 0x03, 0xE8]) + b"\0" * 4)  # a 1000-byte binary frame begun, masked
        bystander = Client(port)
        latencies = []
        for _ in range(20):
            start = time.monotonic()
            bystander.infer({})
            latencies.append(time.monotonic() - start)
        assert max(latencies) < 0.5, latencies  # the stalled ones hold nothing the others wait on
        assert closed_within(bare, 5) and closed_within(silent, 5) and closed_within(trickler, 5)
        assert Client(port).infer({})["actions"].shape == (1, 1)
    finally:
        srv.stop()


def test_past_max_connections_a_new_one_is_refused_until_one_closes():
    srv = server.PolicyServer(Quick(), port=0, limits=server.Limits(max_connections=2))
    port = srv.start()
    try:
        first, second = Client(port), Client(port)
        with pytest.raises(websockets.InvalidStatus, match="503"):
            Client(port)
        first.ws.close()
        deadline = time.monotonic() + 5
        while True:  # the server counts the closed one out once its handler returns
            try:
                third = Client(port)
                break
            except websockets.InvalidStatus:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert second.infer({})["actions"].shape == third.infer({})["actions"].shape == (1, 1)
    finally:
        srv.stop()


class Batching:
    """A policy that batches: each reply echoes its own observation's value; the call sizes are kept."""

    max_message_bytes, max_batch = 1 << 20, 4

    def __init__(self):
        self.calls = []

    def metadata(self):
        return {"action_horizon": 1}

    def prepare(self, obs):
        if not isinstance(obs.get("x"), int):
            raise ObservationError("observation: 'x' must be an int")
        return obs["x"]

    def infer_rows(self, rows, requests):
        self.calls.append(len(rows))
        time.sleep(0.2)  # the others arrive meanwhile
        return [{"actions": np.full((1, 1), x, np.float32)} for x in rows]


def test_requests_that_wait_together_are_sampled_in_one_call_and_each_gets_its_own_reply():
    import threading

    batching = Batching()
    srv = server.PolicyServer(batching, port=0)
    port = srv.start()
    try:
        clients = [Client(port) for _ in range(6)]
        replies = {}

        def ask(i):
            replies[i] = [float(clients[i].infer({"x": 10 * i + k})["actions"][0, 0]) for k in range(3)]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert replies == {i: [10.0 * i + k for k in range(3)] for i in range(6)}
        assert max(batching.calls) > 1 and max(batching.calls) <= 4 and sum(batching.calls) == 18, batching.calls
        bad = Client(port)  # a bad observation is refused alone, before it joins a batch
        bad.ws.send(pack({"x": "one"}))
        assert bad.ws.recv() == "observation: 'x' must be an int"
        assert clients[0].infer({"x": 7})["actions"][0, 0] == 7
    finally:
        srv.stop()


def test_rows_sampled_together_get_the_actions_of_one_at_a_time(lerobot_reference):
    batched = loaders.load(LEROBOT / "pi0", num_steps=10, tokenizer=str(LEROBOT / "pi0_tokenizer.json"), vision_heads=2,
                          max_batch=4)
    observations = lerobot_reference[0] * 2  # 3 rows: padded to 4 with the first
    rows = [batched.prepare(obs) for obs in observations[:3]]
    together = batched.infer_rows(rows, [5, 6, 7])
    for obs, request, reply in zip(observations, [5, 6, 7], together):
        np.testing.assert_allclose(reply["actions"], batched.infer(obs, request)["actions"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(together[0]["actions"], together[2]["actions"])  # the same observation, its own noise


@pytest.mark.slow
def test_the_batching_benchmark_runs_both_servers_in_one_run():
    """scripts/bench/serve_batching.py at its smallest: its table has the two rows, each with its
    five columns filled (what it measures is checked by the next test)."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "serve_batching.py"), "--clients", "2",
                           "--requests", "2", "--max-batch", "2"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| one at a time") or
            line.startswith("| `--max-batch 2`")]
    assert [r[0].strip() for r in rows] == ["one at a time (default)", "`--max-batch 2`"], done.stdout
    assert all(len(r) == 5 and all(float(x) >= 0 for x in r[1:]) for r in rows), done.stdout


class Sleeping(Batching):
    """A policy each of whose calls takes `SECONDS`, one row or several: the benchmark's clock has
    a floor that it must respect."""

    SECONDS = 0.05

    def __init__(self, max_batch):
        super().__init__()
        self.max_batch = max_batch

    def metadata(self):
        return {"observation": {"x": {"shape": [1], "dtype": "float32"}, "prompt": {"dtype": "str"}}}

    def prepare(self, obs):
        return obs

    def infer_rows(self, rows, requests):
        self.calls.append(len(rows))
        time.sleep(self.SECONDS)
        return [{"actions": np.zeros((1, 1), np.float32)} for _ in rows]


def test_the_batching_benchmark_measures_requests_over_their_time():
    """serve_batching.fleet's requests/s is the requests answered over the time they took: every
    request is timed, none answered sooner than a call takes, and the rate is within what the
    calls' own time allows (one worker, one call at a time: the run lasts at least calls x SECONDS)
    and at least the requests over the time measured around it."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    try:
        import serve_batching
    finally:
        sys.path.remove(str(ROOT / "scripts" / "bench"))
    clients, requests = 3, 4
    for max_batch in (1, clients):
        policy = Sleeping(max_batch)
        srv = server.PolicyServer(policy, port=0)
        port = srv.start()
        try:
            start = time.perf_counter()
            rate, latencies = serve_batching.fleet(port, clients, requests)
            outside = time.perf_counter() - start
        finally:
            srv.stop()
        assert len(latencies) == sum(policy.calls) == clients * requests
        assert min(latencies) >= Sleeping.SECONDS * 1e3
        assert clients * requests / outside <= rate <= clients * requests / (len(policy.calls) * Sleeping.SECONDS)
        if max_batch == 1:
            assert policy.calls == [1] * clients * requests and rate <= 1 / Sleeping.SECONDS


def test_an_api_key_is_required_where_one_is_set_and_healthz_answers(served, frames):
    srv = server.PolicyServer(served, port=0, api_key="s3cret")
    port = srv.start()
    try:
        with pytest.raises(websockets.InvalidStatus, match="401"):
            Client(port)
        with pytest.raises(websockets.InvalidStatus, match="401"):
            Client(port, api_key="guess")
        assert Client(port, api_key="s3cret").infer(frames[0][0])["actions"].shape == (2, 2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz") as answer:
            assert (answer.status, answer.read()) == (200, b"OK\n")
    finally:
        srv.stop()


# -- an exported checkpoint: one safetensors file, its config and statistics in its metadata ------------

@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "policy.safetensors"
    assert cli.main(["export", str(run_dir), "--out", str(out)]) == 0
    return out


def test_an_exported_checkpoint_alone_serves_the_runs_policy(exported, run_dir, served, frames, tmp_path):
    alone = tmp_path / "elsewhere" / "policy.safetensors"  # away from the run directory, which is not read
    alone.parent.mkdir()
    shutil.copy(exported, alone)
    from_export = loaders.load(alone, num_steps=STEPS, seed=SEED)
    assert from_export.where == f"{alone} (exported at step 1)"
    assert {**from_export.metadata(), "run": None} == {**served.metadata(), "run": None}
    for request, obs in enumerate(frames[0][:2]):
        np.testing.assert_array_equal(from_export.infer(obs, request)["actions"], served.infer(obs, request)["actions"])


def test_a_file_that_is_not_a_zerojax_policy_export_is_refused(exported, tmp_path, capsys):
    text = tmp_path / "notes.safetensors"
    text.write_text("not tensors")
    assert "is not a readable safetensors file" in one_error_line(["serve", str(text)], capsys)
    bare = tmp_path / "bare.safetensors"  # safetensors as others write it: no zerojax config in the metadata
    safetensors_io.fill(safetensors_io.create_safetensors(bare, [safetensors_io.Entry("w", "w", None, (2,))],
                                                          "float32"), [], None, "float32")
    assert "without the run's config in its metadata" in one_error_line(["serve", str(bare)], capsys)
    assert "drop --step, or give the run directory" in one_error_line(["serve", str(exported), "--step", "1"], capsys)


# -- bad command lines: one line, exit 2 -------------------------------------------------------------

def test_a_port_in_use_is_said_before_anything_is_loaded(tmp_path, capsys):
    """The cheap check first: here the run directory does not even exist, and the port is named."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        line = one_error_line(["serve", str(tmp_path / "no-such-run"), "--port", str(port)], capsys)
    assert f"cannot listen on 127.0.0.1:{port} (Address already in use); choose another --port" in line, line


def test_a_directory_without_checkpoints_is_refused(tmp_path, capsys):
    assert "holds no checkpoints/ directory" in one_error_line(["serve", str(tmp_path)], capsys)


def test_a_step_the_run_does_not_have_is_refused(run_dir, capsys):
    assert "has no step 7 (complete steps: [1])" in one_error_line(["serve", str(run_dir), "--step", "7"], capsys)


def test_a_run_without_lerobot_statistics_is_refused(run_dir, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "lerobot.json").unlink()
    assert "lerobot.json: no such file" in one_error_line(["serve", str(copy)], capsys)


def test_a_run_that_is_not_pi0_is_refused(tmp_path, capsys):
    out = tmp_path / "gpt"
    assert cli.main(["train", "--no-progress", *TINY, "model.n_layers=1", "model.seq_len=8", "train.steps=1",
                     "train.ckpt_every=1", "train.report=false", "train.global_batch=8", "mesh.data=1",
                     "zero.stage=0", f"train.out_dir={out}"]) == 0
    capsys.readouterr()
    line = one_error_line(["serve", str(out)], capsys)
    assert "is a gpt run (model.family=gpt)" in line and "model.family=pi0" in line


def test_a_bad_port_and_a_missing_extra_are_one_line(run_dir, capsys, monkeypatch):
    assert "'70000' is not a port; use 0-65535" in one_error_line(["serve", str(run_dir), "--port", "70000"], capsys)
    monkeypatch.setitem(sys.modules, "websockets", None)  # as if the serve extra were not installed
    assert "pip install 'zerojax[serve]'" in one_error_line(["serve", str(run_dir)], capsys)


# -- a LeRobot π0 checkpoint, served as LeRobot's own PI0Policy.select_action answers -----------------

LEROBOT = ROOT / "tests" / "fixtures" / "lerobot"
LEROBOT_ARGS = ["--tokenizer", str(LEROBOT / "pi0_tokenizer.json"), "--vision-heads", "2"]


@pytest.fixture(scope="module")
def lerobot_reference():
    """scripts/fixtures/make_lerobot_serve_fixture.py: LeRobot 0.3.3's select_action chunks for two robot
    observations (state in its units, uint8 HWC cameras, cam0 20 x 28: padded), fixed noise."""
    from safetensors import safe_open

    with safe_open(LEROBOT / "pi0.serve_reference.safetensors", "numpy") as f:
        ref = {k: f.get_tensor(k) for k in f.keys()}
        tasks = json.loads(f.metadata()["tasks"])
    obs = [{"observation.state": ref["state"][b], "observation.images.cam0": ref["cam0"][b],
            "observation.images.cam1": ref["cam1"][b], "prompt": tasks[b]} for b in range(len(tasks))]
    return obs, ref


@pytest.fixture(scope="module")
def lerobot_served():
    return loaders.load(LEROBOT / "pi0", num_steps=10, tokenizer=str(LEROBOT / "pi0_tokenizer.json"), vision_heads=2)


def test_a_lerobot_checkpoint_answers_as_lerobots_select_action(lerobot_served, lerobot_reference):
    obs, ref = lerobot_reference
    meta = lerobot_served.metadata()
    assert meta["observation"] == {"observation.state": {"shape": [5], "dtype": "float32"},
                                   "observation.images.cam0": {"shape": [28, 28, 3], "dtype": "uint8"},
                                   "observation.images.cam1": {"shape": [28, 28, 3], "dtype": "uint8"},
                                   "prompt": {"dtype": "str"}}
    assert (meta["action_horizon"], meta["action_dim"]) == (4, 3) and "LeRobot 0.3 pi0 checkpoint" in meta["run"]
    for b, o in enumerate(obs):  # normalized, padded top-left as 0.3.x pads, tokenized, sampled, unnormalized
        actions = lerobot_served.actions(lerobot_served.batch(o), ref["noise"][b:b + 1])
        np.testing.assert_allclose(actions, ref["actions"][b], rtol=1e-5, atol=1e-5)


def test_a_lerobot_04_checkpoint_reads_its_processor_files_and_centres_its_padding(lerobot_served, lerobot_reference,
                                                                                  tmp_path):
    new = tmp_path / "pi0-0.4"  # LeRobot 0.4's layout: the statistics in the processors' files
    new.mkdir()
    for path in [LEROBOT / "pi0" / "config.json", LEROBOT / "pi0" / "model.safetensors",
                 *(LEROBOT / "pi0_processors").iterdir()]:
        shutil.copy(path, new)
    served = loaders.load(new, num_steps=10, tokenizer=str(LEROBOT / "pi0_tokenizer.json"), vision_heads=2)
    assert "LeRobot 0.4+ pi0 checkpoint" in served.where and not served.pad_before and lerobot_served.pad_before
    modes = lambda policy: {k: v["mode"] for k, v in policy.observations.norms.items()}  # noqa: E731
    assert modes(served) == modes(lerobot_served)
    obs, ref = lerobot_reference
    square = {**obs[0], "observation.images.cam0": obs[0]["observation.images.cam1"]}  # nothing to pad
    noise = ref["noise"][:1]
    np.testing.assert_allclose(served.actions(served.batch(square), noise),
                               lerobot_served.actions(lerobot_served.batch(square), noise), rtol=1e-6, atol=1e-6)


def test_a_lerobot_checkpoint_without_its_tokenizer_or_statistics_is_refused(run_dir, tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    assert "does not carry its tokenizer" in one_error_line(["serve", str(LEROBOT / "pi0")], capsys)
    assert "drop --step" in one_error_line(["serve", str(LEROBOT / "pi0"), "--step", "3", *LEROBOT_ARGS], capsys)
    assert "are for a LeRobot checkpoint directory" in one_error_line(["serve", str(run_dir), *LEROBOT_ARGS], capsys)
    bare = tmp_path / "no-stats"  # 0.3's layout with its statistics buffers taken out
    bare.mkdir()
    shutil.copy(LEROBOT / "pi0" / "config.json", bare)
    tensors = load_file(LEROBOT / "pi0" / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith(("normalize_", "unnormalize_"))},
              bare / "model.safetensors")
    line = one_error_line(["serve", str(bare), *LEROBOT_ARGS], capsys)
    assert "no observation.state mean/std statistics" in line
