"""A policy run served: an observation in the robot's units in, an action chunk in the
robot's units out (`zerojax serve`, docs/design.md "Serving a policy").

The observation is one frame of the training dataset's features, keyed as the run saw them
(RUN_DIR/lerobot.json):

    observation.state         [D_s]            any real dtype, finite: the robot's state
    observation.images.<cam>  uint8 [h, w, 3]  one per camera the run was trained on (uint8
                              [3, h, w], or float [3, h, w] / [h, w, 3] in [0, 1], also read);
                              any h x w, resized with padding as in training
    prompt (or task)          str              the instruction

It becomes the family's batch of one row through the functions training builds its rows with
(`lerobot.observation`, then the family's `PolicyAdapter.observation`): normalized with the run's statistics,
resized with padding, tokenized with the run's tokenizer. `sample_actions` runs on it (jitted
once) with fresh noise for each request: request n (the server counts them from 0 over its
life, all connections together) draws jax.random.normal(fold_in(key(seed), n), [1, *chunk]), the
chunk the adapter names ([H, max_action_dim] for π0), so a restarted server answers the same
requests with the same actions. The actions are cut to the dataset's action width and
unnormalized with the run's statistics: float32 [H, D_a].
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zerojax.config.hf_config import LEROBOT, init_source
from zerojax.data import corpus, lerobot, lerobot_frames
from zerojax.errors import ConfigError
from zerojax.models import registry
from zerojax.models.vla import rtc
from zerojax.models.family import ACTION, CAMERA, POLICY, STATE

PROMPT_KEYS = ("prompt", "task")  # openpi's clients send "prompt"; LeRobot's frames call it "task"
# real-time chunking, optional (an openpi client sends neither): the previous chunk's actions not yet
# executed, float [K, D_a] in the robot's units, and how many of them run while this request is served
RTC_KEYS = ("prev_actions", "inference_delay")


class ObservationError(ValueError):
    """An observation the policy cannot read: the message names the key and what it expects."""


@dataclass
class ServedPolicy:
    """A run's policy with what it needs to read observations and write actions (module docstring)."""

    where: str  # "RUN_DIR (step N)"
    model: object  # the loaded policy, one device, fp32
    features: dict  # lerobot.json's features: the state, the cameras, the action
    norms: dict  # lerobot.json's normalization: feature -> {"mode", statistics}
    tokenizer: object  # tokenizers.Tokenizer, or None (bytes)
    image_size: int
    prompt_len: int
    model_keys: dict  # the run's model section (model.family and the family's keys), as saved
    num_steps: int
    seed: int
    fps: float = 0.0
    # top-left image padding (lerobot_frames.resize_with_pad): a LeRobot 0.3.x π0 checkpoint's, or the family's
    pad_before: bool = False
    compile_s: float = 0.0  # the first call (compiling sample_actions)
    call_ms: float = 0.0  # a call after it
    max_batch: int = 1  # observations sampled in one call at most (`infer_rows`; 1: one at a time, as openpi)
    rtc_horizon: int = 10  # real-time chunking's execution horizon (LeRobot's execution_horizon)
    rtc_jacobian: bool = False  # the paper's correction through the denoiser, not LeRobot's (models/vla/rtc.py)

    def __post_init__(self):
        self.cameras = [k for k in self.features if k.startswith(CAMERA)]
        self.state_dim = width(self.features[STATE])
        self.action_dim = width(self.features[ACTION])
        self.adapter = registry.adapter(self.model_keys["family"])
        self.pad_before = self.pad_before or self.adapter.pad_before  # SmolVLA pads top and left in every version
        self.horizon, chunk_width = self.adapter.chunk(self.model_keys)
        graphdef, self.params = nnx.split(self.model)
        shape = (1, self.horizon, chunk_width)

        def noise(request):
            return jax.random.normal(jax.random.fold_in(jax.random.key(self.seed), request), shape, jnp.float32)

        def sample(params, batch, noise):
            batch = dict(batch)  # a row without a leftover has weights 0: its velocity is left as it is
            guide = rtc.Guide(batch.pop("rtc_leftover"), batch.pop("rtc_weights"), jacobian=self.rtc_jacobian)
            return nnx.merge(graphdef, params).sample_actions(batch, noise, self.num_steps, guide=guide)

        self._noise, self._sample = jax.jit(noise), jax.jit(sample)

    @property
    def max_message_bytes(self) -> int:
        """The largest observation accepted: every camera as float32 at its dataset size or up
        to 512 x 512, whichever is larger, and 1 MiB for the state, the prompt and msgpack."""
        pixels = sum(max(math.prod(self.features[c]["shape"][:2]), 512 * 512) for c in self.cameras)
        return 2**20 + 4 * 3 * pixels

    def metadata(self) -> dict:
        """What the server sends on connect: enough for a client to build an observation."""
        observation = {STATE: {"shape": [self.state_dim], "dtype": "float32"}}
        observation.update({c: {"shape": list(self.features[c]["shape"]), "dtype": "uint8"} for c in self.cameras})
        observation["prompt"] = {"dtype": "str"}
        return {"policy": f"zerojax {self.model_keys['family']}", "run": self.where, "observation": observation,
                "action_horizon": self.horizon, "action_dim": self.action_dim,
                "action_names": self.features[ACTION].get("names"), "fps": self.fps, "num_steps": self.num_steps,
                "seed": self.seed, "max_message_bytes": self.max_message_bytes}

    def batch(self, obs) -> dict:
        """The family's batch of one row for the observation, as training builds its rows."""
        raw = self.check(obs)
        row = lerobot.observation(raw, self.cameras, self.norms[STATE], self.norms[STATE]["mode"], self.image_size,
                                  self.prompt_len, self.tokenizer, self.pad_before)
        batch = self.adapter.observation({k: v[None] for k, v in row.items()}, self.cameras, self.model_keys,
                                         self.tokenizer)
        return {**batch, **self.rtc_row(raw.get("prev_actions"), raw.get("inference_delay", 0))}

    def rtc_row(self, leftover, delay: int) -> dict:
        """The row's real-time-chunking guide: the leftover normalized as the actions were, padded."""
        norm = self.norms[ACTION]
        _, width = self.adapter.chunk(self.model_keys)
        x = None if leftover is None else lerobot.normalize(leftover, norm, norm["mode"])
        padded, weights = rtc.leftover_rows(x, delay, self.rtc_horizon, self.horizon, width)
        return {"rtc_leftover": padded[None], "rtc_weights": weights[None]}

    def noise(self, request: int) -> jax.Array:
        """The noise of request number `request` (module docstring): [1, *chunk]."""
        return self._noise(np.uint32(request))

    def actions(self, batch: dict, noise) -> np.ndarray:
        """float32 [H, D_a] in the robot's units: `sample_actions` on the batch from `noise`, cut to
        the dataset's action width and unnormalized with the run's statistics (a batch of rows:
        [B, H, D_a])."""
        out = self.rows_actions(batch, noise)
        return out[0] if len(out) == 1 else out

    def rows_actions(self, batch: dict, noise) -> np.ndarray:
        """`actions` of every row, [B, H, D_a] whatever B."""
        actions = np.asarray(self._sample(self.params, batch, jnp.asarray(noise, jnp.float32)))
        norm = self.norms[ACTION]
        return lerobot.unnormalize(actions[..., : self.action_dim], norm, norm["mode"])

    def infer(self, obs, request: int) -> dict:
        """{"actions": float32 [H, D_a]} in the robot's units, for one observation, with the
        noise of request number `request`."""
        return {"actions": self.actions(self.batch(obs), self.noise(request))}

    # -- batched serving: the server checks each observation as it arrives (`prepare`), then
    # samples the rows that arrived together in one call (`infer_rows`)

    def prepare(self, obs) -> dict:
        """The observation checked and made into its batch row (ObservationError if it is bad)."""
        return self.batch(obs)

    def infer_rows(self, rows: list[dict], requests: list[int]) -> list[dict]:
        """`infer` for several prepared rows in one `sample_actions` call, each row with its own
        request's noise: the same actions as one at a time. The batch is padded (with its first
        row) to the next power of two up to `max_batch`, so that few shapes are ever compiled."""
        size = bucket(len(rows), self.max_batch)
        padded = rows + [rows[0]] * (size - len(rows))
        batch = {k: np.concatenate([r[k] for r in padded]) for k in rows[0]}
        noise = np.concatenate([np.asarray(self.noise(q)) for q in requests + [requests[0]] * (size - len(rows))])
        actions = self.rows_actions(batch, noise)
        return [{"actions": actions[i]} for i in range(len(rows))]

    def check(self, obs) -> dict:
        """The observation as a dataset frame before normalization (lerobot's raw item), or an
        ObservationError naming the key."""
        if not isinstance(obs, dict):
            raise ObservationError(f"an observation is a map of {self.expected()}; got a {type(obs).__name__}")
        unknown = [k for k in obs if k not in (STATE, *self.cameras, *PROMPT_KEYS, *RTC_KEYS)]
        missing = [k for k in (STATE, *self.cameras) if k not in obs]
        if unknown or missing:
            what = "; ".join([f"unknown key {', '.join(map(repr, unknown))}"] * bool(unknown) +
                             [f"no {', '.join(map(repr, missing))}"] * bool(missing))
            raise ObservationError(f"observation: {what}; this policy reads {self.expected()}")
        raw = {STATE: state(obs[STATE], self.state_dim), "task": instruction(obs)}
        raw.update({c: camera(c, obs[c], self.image_size) for c in self.cameras})
        raw.update(committed(obs, self.horizon, self.action_dim))
        return raw

    @property
    def expected_keys(self) -> tuple:
        return (STATE, *self.cameras, "prompt")

    def expected(self) -> str:
        return ", ".join([f"{STATE!r} [{self.state_dim}]", *(f"{c!r} uint8 [h, w, 3]" for c in self.cameras),
                          "'prompt' str"])

    def warm_up(self) -> None:
        """Compile sample_actions for every batch size `infer_rows` uses (1, 2, 4, ... max_batch),
        and time one call of one row after it, on a blank observation."""
        blank = {STATE: np.zeros(self.state_dim, np.float32), "prompt": "",
                 **{c: np.zeros(self.features[c]["shape"], np.uint8) for c in self.cameras}}
        row = self.batch(blank)
        start = time.perf_counter()
        for size in sorted({bucket(n, self.max_batch) for n in range(1, self.max_batch + 1)}):
            self.infer_rows([row] * size, [0] * size)
        self.compile_s = time.perf_counter() - start
        start = time.perf_counter()
        jax.block_until_ready(self._sample(self.params, row, self.noise(0)))
        self.call_ms = (time.perf_counter() - start) * 1e3


def bucket(n: int, most: int) -> int:
    """The batch size n rows are padded to: the next power of two, at most `most` (n <= most)."""
    return min(1 << (n - 1).bit_length(), most) if n > 1 else 1


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
    if not lerobot_frames.resizable(h, w, size):
        raise ObservationError(f"observation: {key!r} is {h} x {w} pixels: resized to fit the model's {size} x {size} "
                               f"its short side would vanish; give an image at most {size}:1 in aspect")
    if x.dtype == np.uint8:  # [h, w, 3] unless only the first axis is 3
        return lerobot_frames.to_unit_float(x if x.shape[-1] == 3 else x.transpose(1, 2, 0))
    if x.dtype.kind != "f":
        raise ObservationError(f"observation: {key!r} must be uint8 (0-255) or float in [0, 1]; got dtype {x.dtype}")
    chw = (x if x.shape[0] == 3 else x.transpose(2, 0, 1)).astype(np.float32)  # [3, h, w] unless only the last is 3
    if not (np.isfinite(chw).all() and chw.min() >= 0 and chw.max() <= 1):
        raise ObservationError(f"observation: {key!r} is a float image, so its values must lie in [0, 1]; got "
                               f"{np.nanmin(chw)} to {np.nanmax(chw)}")
    return np.ascontiguousarray(chw)


def load(target: Path, step: int | None = None, num_steps: int = 10, seed: int = 0, tokenizer: str | None = None,
         vision_heads: int | None = None, max_batch: int = 1, rtc_jacobian: bool = False) -> ServedPolicy:
    """A policy, compiled and warmed up (for batches of up to `max_batch` observations): a run
    directory's checkpoint (the newest, or `step`) and its lerobot.json, a safetensors file
    `zerojax export` wrote of such a run (its config, lerobot.json and tokenizer travel in the
    file's metadata: export.run_metadata), or a LeRobot policy directory (`lerobot_policy`:
    `tokenizer` and `vision_heads` are for it alone). ConfigError, before any weight is read, for
    a run that is not a policy trained on LeRobot data."""
    served = _policy(Path(target), step, num_steps, seed, tokenizer, vision_heads)
    served.max_batch, served.rtc_jacobian = max_batch, rtc_jacobian  # before the first trace
    served.warm_up()
    return served


def _policy(target: Path, step, num_steps: int, seed: int, tokenizer, vision_heads) -> ServedPolicy:
    from zerojax.train import export

    target = Path(target)
    if target.is_dir() and init_source(target) == LEROBOT:
        return lerobot_policy(target, step, num_steps, seed, tokenizer, vision_heads)
    if tokenizer is not None or vision_heads is not None:
        raise ConfigError(f"--tokenizer and --vision-heads are for a LeRobot checkpoint directory (its config.json "
                          f"names no tokenizer and no tower heads); {target} is a zerojax run or export, which "
                          "carries both: drop them")
    if target.is_file():
        if step is not None:
            raise ConfigError(f"--step {step} picks a checkpoint of a run directory; {target} is an export of one "
                              "step: drop --step, or give the run directory")
        saved, step, metadata, weights = export.read_export(target)
        where = f"{target} (exported at step {step})"
        check_family(saved, where)
        doc_text = metadata.get(export.RUN_FILE_KEY.format(name="lerobot.json"))
        if doc_text is None:
            raise ConfigError(f"{target}: the export carries no lerobot.json; zerojax serve needs the statistics and "
                              "features of a run trained on data.source=lerobot:DIR (this run's data.source="
                              f"{saved['data']['source']})")
        tokenizer = None
        if saved["data"].get("tokenizer"):
            if export.TOKENIZER_KEY not in metadata:
                raise ConfigError(f"{target}: the export carries no tokenizer (data.tokenizer="
                                  f"{saved['data']['tokenizer']} was not there when it was exported); export again")
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_str(metadata[export.TOKENIZER_KEY])
        doc = json.loads(doc_text)
        model = export.exported_model(saved, weights, str(target))
    else:
        saved, step = export.saved_config(target, step)
        where = f"{target} (step {step})"
        check_family(saved, str(target))
        doc_path = target / "lerobot.json"
        if not doc_path.is_file():
            raise ConfigError(f"{doc_path}: no such file; zerojax serve needs the statistics and features a run of "
                              f"data.source=lerobot:DIR writes there (this run's data.source={saved['data']['source']})")
        doc = json.loads(doc_path.read_text())
        _, _, model = export.load_model(target, step)
        tokenizer = corpus.load_tokenizer(saved["data"]["tokenizer"]) if saved["data"].get("tokenizer") else None
    served = ServedPolicy(where, model, doc["features"], doc["normalization"], tokenizer, doc["image_size"],
                          doc["prompt_len"], saved["model"], num_steps, seed, fps=doc.get("fps", 0.0))
    return served


def check_family(saved: dict, where: str) -> None:
    family = saved["model"]["family"]
    if not registry.is_policy(family):
        raise ConfigError(f"{where} is a {family} run (model.family={family}); zerojax serve and rollout take "
                          f"policies: a run of model.family={' or '.join(registry.of_kind(POLICY))} trained on "
                          "data.source=lerobot:DIR")


# ---------------------------------------------------------------------------------------------
# A LeRobot policy checkpoint (PI0Policy.save_pretrained's directory), served as LeRobot runs it.


def lerobot_policy(directory: Path, step, num_steps: int, seed: int, tokenizer: str | None,
                   vision_heads: int | None) -> ServedPolicy:
    """A LeRobot policy directory served as LeRobot's `select_action` answers, with what
    `interop.lerobot.read_policy` reads of it: its features (cameras in its order, CHW shapes read
    as HWC frames), normalization, image padding (top and left: LeRobot 0.3.x's π0 and SmolVLA;
    centred: 0.4+'s π0 and π0.5, openpi) and prompt length. `tokenizer`, a tokenizer.json, or the
    one the directory names where it is at hand (`lerobot_processors.named_tokenizer`); LeRobot's
    π0 fetches PaliGemma's from the Hub, which its directory does not hold."""
    from zerojax.interop import lerobot as lerobot_io
    from zerojax.interop.lerobot_processors import named_tokenizer

    where = str(directory)
    if step is not None:
        raise ConfigError(f"--step {step} picks a checkpoint of a run directory; {where} is a LeRobot checkpoint (one "
                          "step): drop --step")
    tokenizer = tokenizer or named_tokenizer(directory, lerobot_io.read_config(directory))
    if tokenizer is None:
        raise ConfigError(f"{where} is a LeRobot checkpoint, which does not carry its tokenizer (LeRobot's π0 loads "
                          "google/paligemma-3b-pt-224's from the Hub; a SmolVLA names its SmolVLM, here not a local "
                          "directory): give --tokenizer PATH, that model's tokenizer.json (or the one the policy was "
                          "trained with)")
    found = lerobot_io.read_policy(directory)
    tok = corpus.load_tokenizer(tokenizer)
    cfg, model = lerobot_io.load(directory, vision_heads)
    if cfg.vision.image_size != found.image_size:
        key = "resize_imgs_with_padding" if "resize_imgs_with_padding" in found.config else "image_resolution"
        raise ConfigError(f"{where}/config.json: {key}={found.config.get(key)}, "
                          f"but the tower reads {cfg.vision.image_size} x {cfg.vision.image_size} images")
    cameras = [k for k in found.features if k.startswith(CAMERA)]
    if len(cameras) > cfg.action.cameras:
        raise ConfigError(f"{where}: {len(cameras)} cameras in config.json but the model takes {cfg.action.cameras}")
    served = ServedPolicy(f"{where} (LeRobot {found.version} {found.config['type']} checkpoint)", model,
                          found.features, found.norms, tok, found.image_size, found.prompt_len or cfg.action.prompt_len,
                          dataclasses.asdict(cfg), num_steps, seed, pad_before=found.pad_before)
    return served
