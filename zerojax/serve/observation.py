"""An observation read as training reads a dataset frame, and the actions written back: the
input and output transforms of a served policy (openpi's `Policy` transforms).

The observation is one frame of the training dataset's features, keyed as the run saw them
(RUN_DIR/lerobot.json):

    observation.state         [D_s]            any real dtype, finite: the robot's state
    observation.images.<cam>  uint8 [h, w, 3]  one per camera the run was trained on (uint8
                              [3, h, w], or float [3, h, w] / [h, w, 3] in [0, 1], also read);
                              any h x w, resized with padding as in training
    prompt (or task)          str              the instruction

`Observations.check` validates it key by key (an ObservationError naming the key); `row` makes it
the family's batch of one row through the functions training builds its rows with
(`lerobot.observation`, then the family's `PolicyAdapter.observation`): normalized with the run's
statistics, resized with padding, tokenized with the run's tokenizer. `robot_actions` cuts the
sampled chunk to the dataset's action width and unnormalizes it with the run's statistics; a run of
relative actions (lerobot.json's `relative_actions`, model.action.relative) then has the
observation's state added back on its relative joints (`data.lerobot.relative`), so the actions
served are absolute, as LeRobot's AbsoluteActionsProcessorStep and openpi's AbsoluteActions give them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from zerojax.data import lerobot, mixture
from zerojax.data.lerobot import frames, relative
from zerojax.models import registry
from zerojax.models.family import ACTION, CAMERA, STATE

PROMPT_KEYS = ("prompt", "task")  # openpi's clients send "prompt"; LeRobot's frames call it "task"
# real-time chunking, optional (an openpi client sends neither): the previous chunk's actions not yet
# executed, float [K, D_a] in the robot's units, and how many of them run while this request is served
RTC_KEYS = ("prev_actions", "inference_delay")
# a mixture run's request names its dataset (serve/mixture.py); its row carries the dataset's index
DATASET = "dataset"


class ObservationError(ValueError):
    """An observation the policy cannot read: the message names the key and what it expects."""


@dataclass
class Observations:
    """What reads a run's observations and writes its actions: lerobot.json's features and
    statistics, the tokenizer, the model's image size and prompt length (module docstring)."""

    features: dict  # lerobot.json's features: the state, the cameras, the action
    norms: dict  # lerobot.json's normalization: feature -> {"mode", statistics}
    tokenizer: object  # tokenizers.Tokenizer, or None (bytes)
    image_size: int
    prompt_len: int
    model_keys: dict  # the run's model section (model.family and the family's keys), as saved
    # top-left image padding (frames.resize_with_pad): a LeRobot 0.3.x π0 checkpoint's, or the family's
    pad_before: bool = False
    relative: dict | None = None  # lerobot.json's relative_actions (its "mask" [D_a]), or None: absolute actions
    # one dataset of a mixture run (serve/mixture.py): the run's camera slots and state width, which
    # its rows fill as training's did (a camera it lacks all -1 and masked, the state zero-padded),
    # and its index, which its rows carry under DATASET; (), 0 and -1: a run of one dataset
    slots: tuple = ()
    state_width: int = 0
    index: int = -1

    def __post_init__(self):
        self.cameras = [k for k in self.features if k.startswith(CAMERA)]
        self.state_dim = width(self.features[STATE])
        self.action_dim = width(self.features[ACTION])
        self.adapter = registry.adapter(self.model_keys["family"])
        self.pad_before = self.pad_before or self.adapter.pad_before  # SmolVLA pads top and left in every version
        self.horizon, self.chunk_width = self.adapter.chunk(self.model_keys)

    def member(self, obs) -> "Observations":
        """What reads `obs`: these observations (a mixture run's pick its dataset's, serve/mixture.py)."""
        return self

    def check(self, obs) -> dict:
        """The observation as a dataset frame before normalization (lerobot's raw item), or an
        ObservationError naming the key."""
        if not isinstance(obs, dict):
            raise ObservationError(f"an observation is a map of {self.expected()}; got a {type(obs).__name__}")
        known = (STATE, *self.cameras, *PROMPT_KEYS, *RTC_KEYS, *[DATASET] * (self.index >= 0))
        unknown = [k for k in obs if k not in known]
        missing = [k for k in (STATE, *self.cameras) if k not in obs]
        if unknown or missing:
            what = "; ".join([f"unknown key {', '.join(map(repr, unknown))}"] * bool(unknown) +
                             [f"no {', '.join(map(repr, missing))}"] * bool(missing))
            raise ObservationError(f"observation: {what}; this policy reads {self.expected()}")
        raw = {STATE: state(obs[STATE], self.state_dim), "task": instruction(obs)}
        raw.update({c: camera(c, obs[c], self.image_size) for c in self.cameras})
        raw.update(committed(obs, self.horizon, self.action_dim))
        return raw

    def row(self, raw: dict) -> dict:
        """The family's batch of one row for a checked observation, as training builds its rows."""
        row = lerobot.observation(raw, self.cameras, self.norms[STATE], self.norms[STATE]["mode"], self.image_size,
                                  self.pad_before)
        if self.index < 0:
            return self.adapter.observation({k: v[None] for k, v in row.items()}, self.cameras, self.model_keys,
                                            self.tokenizer)
        # as zerojax.data.mixture builds a mixture's rows (MixtureSource.item, then Masked)
        empty = np.full((3, self.image_size, self.image_size), -1.0, np.float32)
        row = {**{c: empty for c in self.slots}, **row, STATE: mixture.pad_last(row[STATE], self.state_width)}
        out = self.adapter.observation({k: v[None] for k, v in row.items()}, list(self.slots), self.model_keys,
                                       self.tokenizer)
        out["image_masks"][:, :len(self.slots)] &= np.array([c in self.cameras for c in self.slots])
        return {**out, DATASET: np.array([self.index], np.int32)}

    def normalized_actions(self, actions: np.ndarray, state: np.ndarray) -> np.ndarray:
        """Actions [K, D_a] in the robot's units normalized as the run's were (a real-time chunk's
        leftover), made relative to the observation's `state` [D_s] first where the run's were."""
        norm = self.norms[ACTION]
        if self.relative:
            actions = relative.to_relative(actions, state, self.relative["mask"])
        return lerobot.normalize(actions, norm, norm["mode"])

    def robot_actions(self, actions: np.ndarray, state: np.ndarray | None = None, datasets=None) -> np.ndarray:
        """Sampled actions [..., H, chunk width] cut to the dataset's action width and
        unnormalized with the run's statistics: float32 [..., H, D_a] in the robot's units; with
        relative actions, the observations' `state` [..., D_s] (in the robot's units; zero-padded
        beyond the dataset's width in a mixture's rows) added back on their joints. `datasets`,
        each row's DATASET, is for a mixture's observations (serve/mixture.py) and unused here."""
        norm = self.norms[ACTION]
        out = lerobot.unnormalize(actions[..., : self.action_dim], norm, norm["mode"])
        if self.relative:
            out = relative.to_absolute(out, state, self.relative["mask"])
        return out

    def blank(self) -> dict:
        """An observation of zeros and an empty prompt (what warm-up compiles on)."""
        return {STATE: np.zeros(self.state_dim, np.float32), "prompt": "",
                **{c: np.zeros(self.features[c]["shape"], np.uint8) for c in self.cameras}}

    def describe(self) -> dict:
        """The server's metadata of what it reads and writes (ServedPolicy.metadata)."""
        observation = {STATE: {"shape": [self.state_dim], "dtype": "float32"}}
        observation.update({c: {"shape": list(self.features[c]["shape"]), "dtype": "uint8"} for c in self.cameras})
        observation["prompt"] = {"dtype": "str"}
        return {"observation": observation, "action_dim": self.action_dim,
                "action_names": self.features[ACTION].get("names")}

    @property
    def camera_shapes(self) -> dict:
        """{camera: its dataset's frame shape} (the largest message the server accepts)."""
        return {c: self.features[c]["shape"] for c in self.cameras}

    @property
    def expected_keys(self) -> tuple:
        return (STATE, *self.cameras, "prompt")

    def expected(self) -> str:
        return ", ".join([f"{STATE!r} [{self.state_dim}]", *(f"{c!r} uint8 [h, w, 3]" for c in self.cameras),
                          "'prompt' str"])


def width(feature: dict) -> int:
    return int(math.prod(feature["shape"]))


def array(key: str, value) -> np.ndarray:
    """`value` as a numpy array, or an ObservationError naming `key` (a ragged nested list, say)."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError, OverflowError) as err:
        raise ObservationError(f"observation: {key!r} is not an array of numbers ({str(err).splitlines()[0][:120]})"
                               ) from None


def state(value, dim: int) -> np.ndarray:
    x = array(STATE, value)
    if x.dtype.kind not in "fiu" or x.shape != (dim,):
        raise ObservationError(f"observation: {STATE!r} must be {dim} real numbers (shape [{dim}], as the dataset's "
                               f"state); got shape {list(x.shape)}, dtype {x.dtype}")
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise ObservationError(f"observation: {STATE!r} holds a NaN or an infinity: {x.tolist()}")
    return x


def committed(obs: dict, horizon: int, width: int) -> dict:
    """A real-time-chunking request's leftover and delay (RTC_KEYS), checked: {} where it sends none."""
    if "prev_actions" not in obs:
        if "inference_delay" in obs:
            raise ObservationError("observation: 'inference_delay' goes with 'prev_actions' (the previous chunk's "
                                   "actions not yet executed), which is missing")
        return {}
    x = array("prev_actions", obs["prev_actions"])
    if x.dtype.kind not in "fiu" or x.ndim != 2 or x.shape[1] != width or not 0 < len(x) <= horizon:
        raise ObservationError(f"observation: 'prev_actions' must be the previous chunk's unexecuted actions, "
                               f"[K, {width}] numbers with 0 < K <= {horizon}; got shape {list(x.shape)}, dtype {x.dtype}")
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise ObservationError("observation: 'prev_actions' holds a NaN or an infinity")
    delay = obs.get("inference_delay", 0)
    if isinstance(delay, bool) or not isinstance(delay, (int, np.integer)) or not 0 <= delay <= len(x):
        raise ObservationError(f"observation: 'inference_delay' must be an int from 0 to the {len(x)} actions of "
                               f"'prev_actions' (those executed while this request is served); got {delay!r}")
    return {"prev_actions": x, "inference_delay": int(delay)}


def instruction(obs: dict) -> str:
    given = [k for k in PROMPT_KEYS if k in obs]
    if not given:
        raise ObservationError("observation: no 'prompt' (the instruction, a str; 'task' is read too)")
    text = obs[given[0]]
    if not isinstance(text, str):
        raise ObservationError(f"observation: {given[0]!r} must be a str; got a {type(text).__name__}")
    return text


def camera(key: str, value, size: int) -> np.ndarray:
    """A camera image as the dataset's frames come out of decoding: float32 [3, h, w] in [0, 1]
    (`size`: the model's square input, which the image must still cover once resized to fit it)."""
    x = array(key, value)
    if x.ndim != 3 or 3 not in (x.shape[0], x.shape[-1]) or min(x.shape) == 0:
        raise ObservationError(f"observation: {key!r} must be an RGB image, uint8 [h, w, 3] (or [3, h, w]); got "
                               f"shape {list(x.shape)}")
    h, w = x.shape[:2] if x.shape[-1] == 3 else x.shape[1:]
    if not frames.resizable(h, w, size):
        raise ObservationError(f"observation: {key!r} is {h} x {w} pixels: resized to fit the model's {size} x {size} "
                               f"its short side would vanish; give an image at most {size}:1 in aspect")
    if x.dtype == np.uint8:  # [h, w, 3] unless only the first axis is 3
        return frames.to_unit_float(x if x.shape[-1] == 3 else x.transpose(1, 2, 0))
    if x.dtype.kind != "f":
        raise ObservationError(f"observation: {key!r} must be uint8 (0-255) or float in [0, 1]; got dtype {x.dtype}")
    chw = (x if x.shape[0] == 3 else x.transpose(2, 0, 1)).astype(np.float32)  # [3, h, w] unless only the last is 3
    if not (np.isfinite(chw).all() and chw.min() >= 0 and chw.max() <= 1):
        raise ObservationError(f"observation: {key!r} is a float image, so its values must lie in [0, 1]; got "
                               f"{np.nanmin(chw)} to {np.nanmax(chw)}")
    return np.ascontiguousarray(chw)
