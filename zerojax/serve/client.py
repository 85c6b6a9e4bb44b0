"""A client of openpi's websocket policy protocol, for `zerojax client`: connect as openpi's
`WebsocketClientPolicy` does, read the server's metadata, send one observation and time the
answer (server.py describes the frames, wire.py the messages). The observation is a LeRobot
dataset's frame, built as a robot would send it (the state, each camera the server names as
uint8 [h, w, 3], the task as the prompt), or one saved in an .npz file (one array per key, the
prompt a str array), which `save` writes.

Everything here is numpy and the `websockets` library's sync client: no jax, and no model.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zerojax.errors import ConfigError
from zerojax.serve import wire

CAMERA = "observation.images."
STATE = "observation.state"
LEROBOT = "lerobot:"
DATASET = "dataset"  # a mixture run's request names its dataset (zerojax.serve.mixture)


@dataclass(frozen=True)
class Answer:
    actions: np.ndarray  # float32 [H, D_a], in the robot's units, as the server sent them
    latency_s: float  # from sending the observation to the answer's arrival (one round trip)


class Connection:
    """One connection to a policy server, opened as openpi's client opens it (no compression, no
    message size limit, the API key in the Authorization header)."""

    def __init__(self, host: str, port: int, api_key: str | None = None, timeout_s: float = 60):
        import websockets
        from websockets.sync.client import connect

        self.url = f"ws://{host}:{port}"
        headers = {"Authorization": f"Api-Key {api_key}"} if api_key else None
        self._open = contextlib.ExitStack()  # websockets closes what its context manager opened
        try:
            self.ws = self._open.enter_context(connect(self.url, compression=None, max_size=None,
                                                       additional_headers=headers, open_timeout=timeout_s))
        except (OSError, TimeoutError, websockets.exceptions.WebSocketException) as err:
            raise ConfigError(f"cannot connect to {self.url} ({err}); is `zerojax serve` running there? "
                              "(--host, --port; --api-key where the server asks for one)") from None
        self.timeout_s = timeout_s
        self.metadata = wire.unpack(self.ws.recv(timeout_s))

    def infer(self, obs: dict) -> Answer:
        start = time.perf_counter()
        self.ws.send(wire.pack(obs))
        reply = self.ws.recv(self.timeout_s)
        latency = time.perf_counter() - start
        if isinstance(reply, str):  # openpi's server sends its error as text, then closes
            raise ConfigError(f"{self.url} refused the observation: {reply.strip()}")
        return Answer(np.asarray(wire.unpack(reply)["actions"]), latency)

    def close(self) -> None:
        self._open.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def dataset_frame(source: str, frame: int, metadata: dict, name: str | None = None) -> tuple[dict, np.ndarray]:
    """(the observation at dataset index `frame` of `lerobot:DIR`: the state, the task and each
    camera the server's metadata names that the dataset has (a camera it lacks is left for the
    server to mask or refuse), and for a mixture run's server the dataset's name (`name`, else
    the one of its datasets DIR is: `mixture_name`); the dataset's own actions from that frame on:
    the chunk of the server's horizon, its padding past the episode's end dropped)."""
    from zerojax import config
    from zerojax.data import sources

    if not source.startswith(LEROBOT):
        raise ConfigError(f"--from {source!r}: give lerobot:DIR, a LeRobot dataset directory")
    cfg = config.load(overrides=[f"data.source={source}"])  # every camera of the dataset
    dataset = importlib.import_module(sources.KINDS["lerobot"]).open(cfg)  # the dataset as it is, no family's batch
    mixture = "datasets" in metadata  # a mixture run's server: the request names its dataset (serve/mixture.py)
    name = (name or mixture_name(source[len(LEROBOT):], metadata)) if mixture else None
    cameras = [key for key in metadata["observation"] if key in dataset.cameras]
    frames = dataset.dataset.index
    if frame not in frames:
        raise ConfigError(f"--frame {frame} is not a frame of {source[len(LEROBOT):]}: its frames are "
                          f"{int(frames.min())} to {int(frames.max())}")
    numbers = dataset.dataset.numbers(frame, int(metadata["action_horizon"]))
    obs = {STATE: np.asarray(numbers[STATE], np.float32), "prompt": str(numbers["task"]),
           **{camera: dataset.dataset.image(camera, frame, dataset.video) for camera in cameras},
           **({DATASET: name} if mixture else {})}
    return obs, np.asarray(numbers["action"])[~np.asarray(numbers["action_is_pad"], bool)]


def mixture_name(directory: str, metadata: dict) -> str:
    """The name of the mixture server's dataset that `directory` is (the same directory, else
    the same directory name); ConfigError naming the server's datasets where none is."""
    datasets = list(metadata["datasets"])
    same = [d for d in datasets if Path(d).resolve() == Path(directory).resolve()] or \
        [d for d in datasets if Path(d).name == Path(directory).name]
    if len(same) != 1:
        raise ConfigError(f"--from lerobot:{directory}: the server's policy trained on a mixture of datasets "
                          f"({', '.join(datasets)}) and {directory} is {'none' if not same else 'more than one'} of "
                          "them by its directory; give --dataset NAME")
    return same[0]


def load(path: Path) -> dict:
    """An observation saved by `save`: each array under its key, the prompt a str."""
    if not path.is_file():
        raise ConfigError(f"--observation {str(path)!r}: no such file; give an .npz that `zerojax client "
                          "--save` wrote (one array per key, the prompt a str array)")
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {key: str(npz[key]) if key in ("prompt", DATASET) else npz[key] for key in npz.files}
    except (ValueError, OSError) as err:  # not an .npz, or one holding objects
        raise ConfigError(f"--observation {str(path)!r} is not an observation .npz ({err})") from None


def save(obs: dict, path: Path) -> None:
    if not path.parent.is_dir():
        raise ConfigError(f"--save {str(path)!r}: no directory {str(path.parent)!r}")
    with path.open("wb") as f:  # np.savez would add .npz to a name without it
        np.savez(f, **{key: np.asarray(value) for key, value in obs.items()})
