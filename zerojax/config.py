"""Typed run configuration: one frozen dataclass per YAML section (docs/design.md §5).

The dataclass defaults are the tiny default run (`configs/tiny.yaml` spells them out). A YAML
file only overrides defaults, and `KEY=VALUE` overrides by dotted name (`zero.stage=1`) are
parsed to the field's type. Every section checks itself in `__post_init__`; checks that need
the mesh (batch divisibility) live where the mesh is known (`train.prepare`). Bad input, here and
everywhere else in zerojax, is a `ConfigError` whose message names the key (or path), the value
and what would be valid; the CLI turns it into one `zerojax: error:` line and exit code 2. Any
other exception (a bug, in zerojax or in a user's model) keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

class ConfigError(ValueError):
    """Bad input: a config key, value, file or checkpoint that cannot be used as given."""


DTYPES = ("float32", "bfloat16", "float16")
QUANTIZED_GATHERS = ("int8", "float8_e4m3fn")  # block-quantized weight gathers (zerojax.quant)
OFFLOADS = ("none", "optimizer", "optimizer+master")  # zero.offload: what lives in pinned host memory
BUILTIN_FAMILIES = ("gpt", "llama")  # model.family values that need no import
RENAMED = {"model.name": "model.family (gpt | llama | module:factory)"}  # old key -> its replacement
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
FLOAT32_MAX = 3.4028234663852886e38  # loss scales are float32 scalars in the train state


def _choice(key: str, value: Any, valid: tuple) -> None:
    if value not in valid:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of {', '.join(map(str, valid))}")


def _at_least(key: str, value: float, low: float) -> None:
    if not value >= low:  # written so that NaN fails too
        raise ConfigError(f"{key}={value!r} is not valid; it must be >= {low}")


def _finite(key: str, value: float, low: float, *, above: bool = False, high: float = math.inf) -> None:
    """A float key: finite (YAML and the command line both accept nan and inf), >= low (> low
    with `above`) and <= high."""
    if not (math.isfinite(value) and (value > low if above else value >= low) and value <= high):
        bound = f"> {low:g}" if above else f">= {low:g}"
        raise ConfigError(f"{key}={value!r} is not valid; it must be a finite number {bound}"
                          + (f" and <= {high:g}" if high < math.inf else ""))


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    family: str = "gpt"  # gpt | llama | module:factory (a model of your own, README "Bring your own model")
    vocab_size: int = 256  # tokens; 256 for the byte-level corpora
    d_model: int = 128  # width of the residual stream
    n_layers: int = 4  # transformer blocks (units of the FSDP schedule)
    n_heads: int = 4  # attention heads; must divide d_model
    n_kv_heads: int = 0  # llama: key/value heads (grouped-query attention); 0 = n_heads
    d_ff: int = 512  # hidden width of the MLP (llama: SwiGLU's intermediate size)
    seq_len: int = 128  # context length in tokens
    rope_theta: float = 10000.0  # llama: rotary embedding base
    norm_eps: float = 1e-5  # epsilon of the norms (llama: RMSNorm, gpt: LayerNorm)
    remat: str = "full"  # activation checkpointing per block: none | full | dots (MaxText default: full)
    tie_embeddings: bool | None = None  # LM head reuses the token embedding; null = the family's default (gpt: true, llama: false)
    init_from: str = ""  # start from: a `zerojax export` safetensors file, or a Hugging Face model directory

    def __post_init__(self):
        if self.family not in BUILTIN_FAMILIES and ":" not in self.family:
            raise ConfigError(f"model.family={self.family!r} is not valid; choose one of "
                              f"{', '.join(BUILTIN_FAMILIES)}, or module:factory for a model of your own")
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len"):
            _at_least(f"model.{key}", getattr(self, key), 1)
        _at_least("model.n_kv_heads", self.n_kv_heads, 0)
        for key in ("rope_theta", "norm_eps"):
            _finite(f"model.{key}", getattr(self, key), 0, above=True)
        _choice("model.remat", self.remat, ("none", "full", "dots"))
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads}; "
                f"try model.n_heads={_largest_divisor(self.d_model, self.n_heads)}"
            )
        if self.n_kv_heads and self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_heads={self.n_heads} must be divisible by model.n_kv_heads={self.n_kv_heads}; "
                              f"try model.n_kv_heads={_largest_divisor(self.n_heads, self.n_kv_heads)}")
        if self.family == "gpt" and self.n_kv_heads not in (0, self.n_heads):
            raise ConfigError(f"model.n_kv_heads={self.n_kv_heads}: grouped-query attention is llama's; gpt has one "
                              "key/value head per query head (leave model.n_kv_heads=0, or use model.family=llama)")
        if self.family == "llama" and (self.d_model // self.n_heads) % 2:
            even = [h for h in range(self.n_heads, 0, -1) if self.d_model % h == 0 and self.d_model // h % 2 == 0]
            fix = f"try model.n_heads={even[0]}" if even else "use an even model.d_model"
            raise ConfigError(f"model.d_model={self.d_model} / model.n_heads={self.n_heads} = "
                              f"{self.d_model // self.n_heads}: llama's rotary embedding needs an even head "
                              f"dimension; {fix}")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str = "stdlib"  # stdlib (Python's own sources, bytes) | a .txt file | a .bin/.npy token file
    val_fraction: float = 0.1  # tail of the corpus held out for evaluation
    tokenizer: str = ""  # a Hugging Face tokenizer.json (or its directory) for a text source; empty = bytes

    def __post_init__(self):
        if self.source != "stdlib" and Path(self.source).suffix not in (".txt", ".bin", ".npy"):
            raise ConfigError(
                f"data.source={self.source!r} is not valid; use 'stdlib', a .txt file, "
                "or a .bin/.npy token file"
            )
        if self.tokenizer and self.source != "stdlib" and Path(self.source).suffix != ".txt":
            raise ConfigError(f"data.tokenizer applies to text (data.source=stdlib or a .txt file); "
                              f"data.source={self.source!r} already holds tokens")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction} must be between 0 and 1")


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    data: int = -1  # devices on the ZeRO (sharding) axis; -1 = all remaining devices
    replica: int = -1  # replicas of the sharded group (hybrid sharding); -1 = one per process
    cpu_devices: int = 8  # devices simulated on a CPU backend
    distributed: str = "auto"  # auto: jax.distributed when a cluster is detected | off
    timeout_s: int = 300  # joining the other processes, and noticing one has died

    def __post_init__(self):
        for key in ("data", "replica"):
            if getattr(self, key) != -1 and not getattr(self, key) >= 1:
                raise ConfigError(f"mesh.{key}={getattr(self, key)} is not valid; it must be >= 1, or -1 to fill "
                                  "the devices the other axis leaves")
        _at_least("mesh.cpu_devices", self.cpu_devices, 1)
        _choice("mesh.distributed", self.distributed, ("auto", "off"))
        _at_least("mesh.timeout_s", self.timeout_s, 1)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    stage: int = 3  # ZeRO stage: 0 DDP, 1 optimizer states, 2 + gradients, 3 + parameters
    schedule: str = "shard_map"  # shard_map (explicit FSDP unit schedule) | gspmd (annotations only)
    reshard_after_forward: bool = True  # stage 3: free gathered weights after forward
    prefetch: int = 1  # units gathered ahead of the one computing
    min_shard_size: int = 16384  # parameters with fewer elements (per layer) stay replicated
    quant_block: int = 2048  # precision.gather=int8|float8_e4m3fn: elements per fp32 scale (0.2% more bytes)
    offload: str = "none"  # none | optimizer (Adam m, v in pinned host memory) | optimizer+master (and the fp32 master)

    def __post_init__(self):
        _choice("zero.stage", self.stage, (0, 1, 2, 3))
        _choice("zero.schedule", self.schedule, ("shard_map", "gspmd"))
        _at_least("zero.prefetch", self.prefetch, 0)
        _at_least("zero.min_shard_size", self.min_shard_size, 0)
        _at_least("zero.quant_block", self.quant_block, 1)
        _choice("zero.offload", self.offload, OFFLOADS)


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    param: str = "float32"  # master weights
    compute: str = "auto"  # auto: bfloat16 on GPU/TPU, float32 on CPU (bf16 is emulated there)
    gather: str = "auto"  # dtype weights are all-gathered in; auto = compute; int8 | float8_e4m3fn: block-quantized
    reduce: str = "float32"  # dtype gradients are reduced in
    loss_scale: str | float = "dynamic"  # dynamic (applied to fp16 compute only) | none | a static scale
    initial_scale_power: int = 16  # dynamic scaling starts at 2**this
    loss_scale_window: int = 1000  # finite steps before the scale doubles
    hysteresis: int = 2  # overflows tolerated before the scale halves
    min_loss_scale: float = 1.0  # the scale never drops below this
    max_skipped_steps: int = 10  # consecutive non-finite steps before the run stops
    frozen: str = "bfloat16"  # how frozen parameters (optim.freeze, a LoRA base) are stored: no master copy

    def __post_init__(self):
        for key in ("param", "compute", "gather", "reduce", "frozen"):  # presets fp32 / bf16 / fp16
            object.__setattr__(self, key, DTYPE_ALIASES.get(getattr(self, key), getattr(self, key)))
        _choice("precision.param", self.param, ("float32",))
        _choice("precision.compute", self.compute, ("auto",) + DTYPES)
        _choice("precision.gather", self.gather, ("auto",) + DTYPES + QUANTIZED_GATHERS)
        _choice("precision.reduce", self.reduce, DTYPES)
        _choice("precision.frozen", self.frozen, DTYPES)
        if isinstance(self.loss_scale, str):
            _choice("precision.loss_scale", self.loss_scale, ("dynamic", "none"))
        elif not 0 < self.loss_scale <= FLOAT32_MAX:  # NaN and inf fail too
            raise ConfigError(f"precision.loss_scale={self.loss_scale} must be 'dynamic', 'none' or a static scale "
                              f"> 0 that float32 holds (<= {FLOAT32_MAX:.3g})")
        _finite("precision.min_loss_scale", self.min_loss_scale, 0, above=True, high=FLOAT32_MAX)
        power = self.initial_scale_power  # the dynamic scale starts at 2**power, a float32
        if power > 127:
            raise ConfigError(f"precision.initial_scale_power={power}: 2**{power} overflows float32; "
                              "choose a power <= 127 (DeepSpeed's default: 16)")
        if 2.0**power < self.min_loss_scale:  # (2.0**-2000 is 0.0 in Python, not an error)
            raise ConfigError(f"precision.initial_scale_power={power} starts the dynamic scale at 2**{power}, below "
                              f"precision.min_loss_scale={self.min_loss_scale}; raise the power or lower the minimum")
        _at_least("precision.loss_scale_window", self.loss_scale_window, 1)
        _at_least("precision.hysteresis", self.hysteresis, 1)
        _at_least("precision.max_skipped_steps", self.max_skipped_steps, 1)


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    rank: int = 0  # adapter rank r; 0 = LoRA off
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
    targets: tuple[str, ...] = ("*attn*kernel", "*mlp*kernel")  # glob patterns over the kernels of nnx.Linear layers
    init_from: str = ""  # adapters to continue from: a PEFT directory (`zerojax export --format peft`)

    def __post_init__(self):
        _at_least("optim.lora.rank", self.rank, 0)
        _finite("optim.lora.alpha", self.alpha, 0, above=True)
        if self.rank and not self.targets:
            raise ConfigError("optim.lora.targets is empty; give glob patterns over kernel paths, e.g. *attn*kernel")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 3e-3  # peak learning rate
    b1: float = 0.9  # Adam first-moment decay
    b2: float = 0.95  # Adam second-moment decay
    eps: float = 1e-8  # Adam denominator epsilon
    weight_decay: float = 0.1  # decoupled weight decay (never on norms and biases)
    clip_norm: float = 1.0  # clip the global gradient norm to this; 0 = off
    warmup_steps: int = 50  # linear warmup from 0 to lr
    schedule: str = "cosine"  # after warmup: cosine (to lr/10 at the last step) | constant
    freeze: tuple[str, ...] = ()  # parameter-path patterns (or unit names) that are not trained
    lora: LoraConfig = field(default_factory=LoraConfig)  # low-rank adapters on a frozen base

    def __post_init__(self):
        _finite("optim.lr", self.lr, 0)
        for key in ("b1", "b2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"optim.{key}={getattr(self, key)} must be in [0, 1)")
        # eps > 0: Adam divides by sqrt(v) + eps, and v is 0 for a parameter with no gradient yet
        # (the embedding row of a token not yet seen): eps = 0 would make it 0/0 = NaN.
        _finite("optim.eps", self.eps, 0, above=True)
        _finite("optim.weight_decay", self.weight_decay, 0)
        _finite("optim.clip_norm", self.clip_norm, 0)  # 0 = off
        _at_least("optim.warmup_steps", self.warmup_steps, 0)
        _choice("optim.schedule", self.schedule, ("cosine", "constant"))


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 400  # optimizer steps
    global_batch: int = 32  # sequences per step, over all devices
    grad_accum: int = 1  # microbatches per step
    seed: int = 0  # parameters and data order
    log_every: int = 10  # steps between metrics lines; 0 = off
    eval_every: int = 100  # steps between eval losses (and at the end); 0 = off
    eval_batches: int = 8  # global batches of held-out data per eval
    out_dir: str = ""  # run directory; empty = runs/<config name>
    ckpt_every: int = 100  # steps between checkpoints (and one at the end); 0 = no checkpoints
    keep: int = 3  # checkpoints kept
    resume: str = "auto"  # auto: continue from the newest checkpoint | never
    report: bool = True  # write report.html (curves, format explorer, memory calculator) into the run directory at the end

    def __post_init__(self):
        _at_least("train.steps", self.steps, 1)
        _at_least("train.global_batch", self.global_batch, 1)
        _at_least("train.grad_accum", self.grad_accum, 1)
        for key in ("seed", "log_every", "eval_every", "ckpt_every"):
            _at_least(f"train.{key}", getattr(self, key), 0)
        _at_least("train.eval_batches", self.eval_batches, 1)
        _at_least("train.keep", self.keep, 1)
        _choice("train.resume", self.resume, ("auto", "never"))
        if self.global_batch % self.grad_accum:
            raise ConfigError(
                f"train.global_batch={self.global_batch} must be divisible by "
                f"train.grad_accum={self.grad_accum}"
            )


@dataclass(frozen=True, kw_only=True)
class Config:
    name: str = "tiny"  # run name; the default run directory is runs/<name>
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):
        if not self.name:
            raise ConfigError("name='' is not valid; give the run a name (its default run directory is runs/<name>)")
        gather, z = self.precision.gather, self.zero
        if gather in QUANTIZED_GATHERS and (z.schedule != "shard_map" or z.stage == 0):
            raise ConfigError(f"precision.gather={gather} (block-quantized weight gathers) is supported with "
                              f"zero.schedule=shard_map at zero.stage 1, 2 or 3, not with zero.schedule={z.schedule} "
                              f"at zero.stage {z.stage}; use those, or precision.gather=auto|{'|'.join(DTYPES)}")
        if z.offload != "none" and z.schedule != "shard_map":
            raise ConfigError(f"zero.offload={z.offload} (the update streamed unit by unit from host memory) is "
                              f"supported with zero.schedule=shard_map, not {z.schedule}; use zero.schedule=shard_map, "
                              "or zero.offload=none")
        byte_corpus = (self.data.source == "stdlib" or self.data.source.endswith(".txt")) and not self.data.tokenizer
        if byte_corpus and self.model.vocab_size < 256:
            raise ConfigError(
                f"model.vocab_size={self.model.vocab_size} is too small for the byte corpus "
                f"data.source={self.data.source}; it needs model.vocab_size >= 256"
            )

    @property
    def run_dir(self) -> Path:
        return Path(self.train.out_dir or f"runs/{self.name}")


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config) if f.name != "name"}


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, at_most + 1) if n % d == 0)


def file_in_the_way(path: Path) -> Path | None:
    """The existing file (not a directory) at `path` or above it, which stops a directory from
    being created there; None if the directory exists or can be made."""
    for where in (path, *path.absolute().parents):
        if where.exists():
            return None if where.is_dir() else where
    return None


def _section_class(name: str) -> type:
    return {f.name: f.default_factory for f in dataclasses.fields(Config) if f.name != "name"}[name]


def _keys(prefix: str, cls: type) -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        nested = _nested_class(cls, f.name)
        keys += _keys(f"{prefix}.{f.name}", nested) if nested else [f"{prefix}.{f.name}"]
    return keys


def _nested_class(cls: type, name: str) -> type | None:
    """The dataclass of a sub-section (optim.lora), or None for a plain key."""
    typ = _field_type(cls, name)
    return typ if dataclasses.is_dataclass(typ) else None


def valid_keys() -> list[str]:
    keys = ["name"]
    for section in SECTIONS:
        keys += _keys(section, _section_class(section))
    return keys


def _unknown_key(key: str) -> ValueError:
    close = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else "; see configs/tiny.yaml for every key"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def coerce(key: str, value: Any, typ: Any) -> Any:
    """Parse `value` (a YAML scalar or a command-line string) to the field type `typ`."""
    bad = ConfigError(f"{key} expects {_type_name(typ)}, got {value!r}")
    if isinstance(typ, types.UnionType) and type(None) in typ.__args__:  # bool | None: null/auto = default
        if value is None or str(value).strip().lower() in ("", "null", "none", "auto"):
            return None
        return coerce(key, value, next(t for t in typ.__args__ if t is not type(None)))
    if isinstance(typ, types.UnionType):  # str | float: a number if it parses as one
        try:
            return coerce(key, value, float)
        except ConfigError:
            return coerce(key, value, str)
    if typ is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "yes", "on", "1"):
            return True
        if text in ("false", "no", "off", "0"):
            return False
        raise bad
    if typ is int:
        if isinstance(value, bool) or isinstance(value, float):
            raise bad
        try:
            return int(str(value).strip())
        except ValueError:
            raise bad from None
    if typ is float:
        if isinstance(value, bool):
            raise bad
        try:
            return float(str(value).strip())
        except ValueError:
            raise bad from None
    if typ is str:
        if isinstance(value, (dict, list)):
            raise bad
        return "" if value is None else str(value)
    if typing.get_origin(typ) is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise bad
        return tuple(value)
    raise TypeError(f"no parser for {key}: {typ}")


def _type_name(typ: Any) -> str:
    if isinstance(typ, types.UnionType) and type(None) in typ.__args__:
        return _type_name(next(t for t in typ.__args__ if t is not type(None))) + " (or null: the default)"
    if isinstance(typ, types.UnionType):
        return "a number or one of its named values"
    if typing.get_origin(typ) is tuple:
        return "a list of strings"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[typ]


def _set(tree: dict, key: str, value: Any) -> None:
    """Put a raw value under its dotted key, validating the key's name."""
    parts = key.split(".")
    if parts == ["name"]:
        tree["name"] = coerce("name", value, str)
        return
    if len(parts) < 2 or parts[0] not in SECTIONS:
        raise _unknown_key(key)
    if key in RENAMED:
        raise ConfigError(f"{key} was replaced by {RENAMED[key]}; use {RENAMED[key].split()[0]}=...")
    cls, node = _section_class(parts[0]), tree.setdefault(parts[0], {})
    for name in parts[1:-1]:  # sub-sections: optim.lora.rank
        if name not in {f.name for f in dataclasses.fields(cls)} or not _nested_class(cls, name):
            raise _unknown_key(key)
        cls, node = _nested_class(cls, name), node.setdefault(name, {})
    name = parts[-1]
    if name in {f.name for f in dataclasses.fields(cls)} and _nested_class(cls, name):
        example = next(k for k in valid_keys() if k.startswith(key + "."))
        raise ConfigError(f"{key} is a section, not a key; set its keys, e.g. {example}=...")
    if name not in {f.name for f in dataclasses.fields(cls)}:
        raise _unknown_key(key)
    node[name] = coerce(key, value, _field_type(cls, name))


def _make(cls: type, values: dict):
    return cls(**{k: _make(_nested_class(cls, k), v) if _nested_class(cls, k) else v for k, v in values.items()})


def _build(tree: dict) -> Config:
    sections = {name: _make(_section_class(name), values) for name, values in tree.items() if name != "name"}
    return Config(**sections, **({"name": tree["name"]} if "name" in tree else {}))


def _flatten_yaml(doc: Any, path: Path) -> dict[str, Any]:
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping of config sections, got {type(doc).__name__}")
    flat = {}
    for section, body in doc.items():
        if section == "name":
            flat["name"] = body
        elif isinstance(body, dict):
            flat.update(_flatten(str(section), body))
        elif body is None and section in SECTIONS:  # a section whose keys are all commented out
            continue
        elif section in SECTIONS:
            raise ConfigError(f"{path}: section '{section}' must be a mapping of keys")
        else:
            raise _unknown_key(str(section))
    return flat


def _flatten(prefix: str, body: dict) -> dict[str, Any]:
    """{lora: {rank: 8}} under optim -> {optim.lora.rank: 8}; a key that is not a sub-section
    keeps its mapping as its value (and is then refused by its parser)."""
    flat = {}
    for k, v in body.items():
        key = f"{prefix}.{k}"
        if isinstance(v, dict) and any(x.startswith(key + ".") for x in valid_keys()):
            flat.update(_flatten(key, v))
        else:
            flat[key] = v
    return flat


def parse_override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not KEY=VALUE (e.g. zero.stage=1)")
    return key.strip(), value


def load(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the YAML file (its stem names the run), then KEY=VALUE overrides."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            problem = "is a directory, not a YAML file" if path.is_dir() else "does not exist"
            raise ConfigError(f"config file {str(path)!r} {problem}")
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from None
        except UnicodeDecodeError as err:
            problem = f"is not UTF-8 text ({err.reason} at byte {err.start})"
            raise ConfigError(f"config file {str(path)!r} {problem}") from None
        tree["name"] = path.stem
        for key, value in _flatten_yaml(doc, path).items():
            _set(tree, key, value)
    for text in overrides:
        _set(tree, *parse_override(text))
    _from_hugging_face(tree)
    return _build(tree)


# A Hugging Face model directory as model.init_from: its config.json sets the model's keys.
HF_ARCHITECTURES = {  # architecture -> (model.family, {model key: config.json key})
    "LlamaForCausalLM": ("llama", {"vocab_size": "vocab_size", "d_model": "hidden_size",
                                   "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                                   "n_kv_heads": "num_key_value_heads", "d_ff": "intermediate_size",
                                   "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
                                   "tie_embeddings": "tie_word_embeddings"}),
    "GPT2LMHeadModel": ("gpt", {"vocab_size": "vocab_size", "d_model": "n_embd", "n_layers": "n_layer",
                                "n_heads": "n_head", "d_ff": "n_inner", "norm_eps": "layer_norm_epsilon",
                                "tie_embeddings": "tie_word_embeddings"}),
}
HF_ARCHITECTURES["MistralForCausalLM"] = HF_ARCHITECTURES["LlamaForCausalLM"]  # same layout (no sliding window)
HF_DEFAULTS = {"n_kv_heads": 0, "rope_theta": 10000.0, "tie_embeddings": None}  # keys a config.json may omit
TIED_BY_DEFAULT = {"llama": False, "gpt": True}  # transformers' LlamaConfig / GPT2Config tie_word_embeddings defaults


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in `path` (ConfigError, naming the file, if it is not one)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} holds a JSON {type(doc).__name__}, not {what} (a JSON object)")
    return doc


def hf_model_keys(directory: str) -> dict:
    """The model.* values a Hugging Face directory's config.json implies (ConfigError if it
    cannot be read or describes a model zerojax does not have)."""
    where = Path(directory) / "config.json"
    if not where.is_file():
        raise ConfigError(f"model.init_from={directory!r} is a directory without config.json; give a Hugging Face "
                          "model directory (config.json and model.safetensors) or a zerojax export file")
    hf = read_json_object(where, "a Hugging Face config")
    archs = hf.get("architectures")
    if not (isinstance(archs, list) and archs and isinstance(archs[0], str)):
        raise ConfigError(f"{where}: architectures={archs!r} is not a list of model classes, e.g. ['LlamaForCausalLM']")
    if archs[0] not in HF_ARCHITECTURES:
        raise ConfigError(f"{where}: architecture {archs[0]!r} is not supported; zerojax reads "
                          f"{', '.join(HF_ARCHITECTURES)}")
    family, keys = HF_ARCHITECTURES[archs[0]]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}  # transformers 5 keeps rope_theta in here
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default":
        kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else rope
        raise ConfigError(f"{where}: rope scaling {kind!r} is not supported by zerojax's {family}")
    hf.setdefault("rope_theta", rope.get("rope_theta", HF_DEFAULTS["rope_theta"]))
    for unsupported in ("sliding_window", "attention_bias", "mlp_bias"):
        if hf.get(unsupported) not in (None, False):
            raise ConfigError(f"{where}: {unsupported}={hf[unsupported]!r} is not supported by zerojax's {family}")
    if family == "gpt" and (hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh")
                            or hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn")):
        raise ConfigError(f"{where}: only GPT-2's own attention and gelu_new (tanh) MLP are supported")
    needed = [hf_key for key, hf_key in keys.items() if key not in HF_DEFAULTS and (family, key) != ("gpt", "d_ff")]
    missing = [hf_key for hf_key in needed + (["n_positions"] if family == "gpt" else []) if hf.get(hf_key) is None]
    if missing:
        raise ConfigError(f"{where} has no {', '.join(missing)}; zerojax needs {'it' if len(missing) == 1 else 'them'} "
                          f"to build the {family} model")
    out = {"family": family}
    for key, hf_key in keys.items():
        value = hf.get(hf_key, TIED_BY_DEFAULT[family] if key == "tie_embeddings" else HF_DEFAULTS.get(key))
        out[key] = 4 * hf["n_embd"] if key == "d_ff" and value is None else value
    if family == "gpt":
        out["seq_len"] = hf["n_positions"]
    try:  # the values must make a model: the same checks as the keys given in YAML
        out = {k: coerce(f"model.{k}", v, _field_type(ModelConfig, k)) for k, v in out.items()}
        model = ModelConfig(**out)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    if family == "llama" and hf.get("head_dim") not in (None, model.d_model // model.n_heads):
        raise ConfigError(f"{where}: head_dim={hf['head_dim']} is not hidden_size / num_attention_heads")
    return out


def _from_hugging_face(tree: dict) -> None:
    """With model.init_from a directory, take the model's keys from its config.json; a key also
    set in the YAML or on the command line must agree with it (model.seq_len may be shorter)."""
    model = tree.get("model", {})
    if not model.get("init_from") or not Path(model["init_from"]).is_dir():
        return
    for key, value in hf_model_keys(model["init_from"]).items():
        given = model.get(key)
        if key == "seq_len" and given is not None and given <= value:
            continue  # a shorter context uses the first rows of the position table
        if given is not None and given != value:
            raise ConfigError(f"model.{key}={given!r} contradicts {model['init_from']}/config.json, which says "
                              f"{value!r}; drop the override (or use another checkpoint)")
        model[key] = value
    tree["model"] = model


def to_dict(cfg: Config) -> dict:
    def plain(v):
        return list(v) if isinstance(v, tuple) else v

    def walk(d: dict) -> dict:
        return {k: walk(v) if isinstance(v, dict) else plain(v) for k, v in d.items()}

    out = {"name": cfg.name}
    for section in SECTIONS:
        out[section] = walk(dataclasses.asdict(getattr(cfg, section)))
    return out


def dump(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
