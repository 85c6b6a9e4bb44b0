"""Typed run configuration: one frozen dataclass per YAML section (docs/design.md §5; the data
section, the largest, in `config.data`).

The dataclass defaults are the tiny default run (`configs/tiny.yaml` spells them out). A YAML
file only overrides defaults, and `KEY=VALUE` overrides by dotted name (`zero.stage=1`) are
parsed to the field's type. Every section checks itself in `__post_init__`, against the
enumerations of `rules`; `Config` then applies the rules between keys (`rules.check_between_keys`).
Checks that need the mesh (batch divisibility) live where the mesh is known (`train.step.make_engine`).
Bad input, here and everywhere else in zerojax, is a `ConfigError` whose message names the key
(or path), the value and what would be valid; the CLI turns it into one `zerojax: error:` line
and exit code 2. Any other exception (a bug, in zerojax or in a user's model) keeps its
traceback.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from zerojax.config import rules
from zerojax.config.rules import (ATTENTIONS, DECAY_MASKS, DISTRIBUTED, DTYPE_ALIASES, DTYPES, FLOAT32_MAX, LORA_BASES, LOSS_SCALES, LR_SCHEDULES, OFFLOADS,
                                  PARAM_DTYPES, QUANTIZED_GATHERS, REMATS, RESUMES, SCHEDULES, STAGES)
from zerojax.config.rules import _at_least, _choice, _finite, _largest_divisor
from zerojax.config.data import DataConfig
from zerojax.errors import ConfigError
from zerojax.models import registry


@dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """model.vision: the SigLIP vision tower of model.family=paligemma (ignored by the others)."""

    image_size: int = 32  # side of the square image in pixels (pixel_values [B, 3, image_size, image_size])
    patch_size: int = 8  # side of a patch; image tokens per image = (image_size / patch_size) ** 2
    d_model: int = 64  # width of the tower's residual stream (SigLIP's hidden_size)
    n_layers: int = 2  # encoder layers (units of the FSDP schedule, a stack of their own)
    n_heads: int = 4  # attention heads; must divide d_model
    d_ff: int = 256  # hidden width of the tower's MLP (intermediate_size)
    norm_eps: float = 1e-6  # epsilon of the tower's LayerNorms

    def __post_init__(self):
        for key in ("image_size", "patch_size", "d_model", "n_layers", "n_heads", "d_ff"):
            _at_least(f"model.vision.{key}", getattr(self, key), 1)
        _finite("model.vision.norm_eps", self.norm_eps, 0, above=True)
        if self.image_size % self.patch_size:
            raise ConfigError(f"model.vision.image_size={self.image_size} is not divisible by model.vision.patch_size="
                              f"{self.patch_size}: the patches must tile the image; try model.vision.patch_size="
                              f"{_largest_divisor(self.image_size, self.patch_size)}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.vision.d_model={self.d_model} must be divisible by model.vision.n_heads="
                              f"{self.n_heads}; try model.vision.n_heads={_largest_divisor(self.d_model, self.n_heads)} "
                              f"(divides {self.d_model})")

    @property
    def image_tokens(self) -> int:
        """Image tokens per image: one per patch."""
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True, kw_only=True)
class SharedModelConfig:
    """model.*: the keys every family reads; `ModelConfig` adds the families' own sections."""

    family: str = registry.DEFAULT  # gpt | llama | gemma | paligemma | pi0 | pi05 | smolvla | module:factory (a model of your own: docs/guides/bring-your-own-model.md)
    vocab_size: int = 256  # tokens; 256 for the byte-level corpora
    d_model: int = 128  # width of the residual stream
    n_layers: int = 4  # transformer blocks (units of the FSDP schedule)
    n_heads: int = 4  # attention heads; must divide d_model
    n_kv_heads: int = 0  # llama: key/value heads (grouped-query attention); 0 = n_heads
    head_dim: int = 0  # 0 = d_model // n_heads (gemma may set its own; gpt and llama use the quotient)
    d_ff: int = 512  # hidden width of the MLP (llama: SwiGLU's intermediate size)
    seq_len: int = 128  # context length in tokens
    rope_theta: float = 10000.0  # llama: rotary embedding base
    norm_eps: float = 1e-5  # epsilon of the norms (llama: RMSNorm, gpt: LayerNorm)
    remat: str = "full"  # activation checkpointing per block: none | full | dots (MaxText default: full)
    attention: str = "auto"  # auto | blockwise | cudnn | naive (models/attention.py; auto: cudnn on GPU where the mask allows, else blockwise)
    attention_block: int = 128  # keys per block of the blockwise attention (need not divide the sequence)
    loss_chunk: int = 1024  # tokens whose logits the loss holds at once (models/protocol.py chunked_text_loss)
    tie_embeddings: bool | None = None  # LM head reuses the token embedding; null = the family's default (gpt: true, llama: false, gemma: true)
    init_from: str = ""  # start from: a `zerojax export` safetensors file, or a Hugging Face model directory
    vision: VisionConfig = field(default_factory=VisionConfig)  # paligemma: the SigLIP tower (model.vision.*)
    image_token_id: int = 0  # paligemma: the id of the image token, image_tokens of which open each row (PaliGemma's <image>: 257152)
    # + the sections the families declare (`registry.SECTIONS`: π0's model.expert.*, model.action.*)

    def __post_init__(self):
        for key, cls in (("vision", VisionConfig), *registry.sections().items()):
            if isinstance(getattr(self, key), dict):  # ModelConfig(**a saved config's model section)
                object.__setattr__(self, key, cls(**getattr(self, key)))
        if self.family not in registry.FAMILIES and ":" not in self.family:
            raise ConfigError(f"model.family={self.family!r} is not valid; choose one of "
                              f"{', '.join(registry.FAMILIES)}, or module:factory for a model of your own")
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len"):
            _at_least(f"model.{key}", getattr(self, key), 1)
        _at_least("model.n_kv_heads", self.n_kv_heads, 0)
        _at_least("model.head_dim", self.head_dim, 0)
        _at_least("model.image_token_id", self.image_token_id, 0)
        for key in ("rope_theta", "norm_eps"):
            _finite(f"model.{key}", getattr(self, key), 0, above=True)
        _choice("model.remat", self.remat, REMATS)
        _choice("model.attention", self.attention, ATTENTIONS)
        _at_least("model.attention_block", self.attention_block, 1)
        _at_least("model.loss_chunk", self.loss_chunk, 1)
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads}; "
                f"try model.n_heads={_largest_divisor(self.d_model, self.n_heads)}"
            )
        if self.n_kv_heads and self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_heads={self.n_heads} must be divisible by model.n_kv_heads={self.n_kv_heads}; "
                              f"try model.n_kv_heads={_largest_divisor(self.n_heads, self.n_kv_heads)}")
        registry.check_config(self)  # a built-in family's own rules (imports its module, and jax)


# The model section: the shared keys and, from the registry, each section a family declares
# (model.expert, model.action: π0's), so that a family's keys live in the family's room.
ModelConfig = dataclasses.make_dataclass(
    "ModelConfig", [(name, cls, field(default_factory=cls)) for name, cls in registry.sections().items()],
    bases=(SharedModelConfig,), frozen=True, kw_only=True)
ModelConfig.__module__ = __name__  # (make_dataclass's `module=` is Python 3.12's)
ModelConfig.__doc__ = "model.*: the shared keys (`SharedModelConfig`) and the families' sections (`registry.sections`)."


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
        _choice("mesh.distributed", self.distributed, DISTRIBUTED)
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
        _choice("zero.stage", self.stage, STAGES)
        _choice("zero.schedule", self.schedule, SCHEDULES)
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
        _choice("precision.param", self.param, PARAM_DTYPES)
        _choice("precision.compute", self.compute, ("auto",) + DTYPES)
        _choice("precision.gather", self.gather, ("auto",) + DTYPES + QUANTIZED_GATHERS)
        _choice("precision.reduce", self.reduce, DTYPES)
        _choice("precision.frozen", self.frozen, DTYPES)
        if isinstance(self.loss_scale, str):
            _choice("precision.loss_scale", self.loss_scale, LOSS_SCALES)
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
    targets: tuple[str, ...] = ("*attn*kernel", "*mlp*kernel")  # glob patterns over the kernels of nnx.Linear layers, or components the model names (decoder, language, expert)
    base: str = "all"  # what LoRA freezes: all (every leaf but the adapters, PEFT's way) | targets (only what the targets adapt, openpi's way; the rest trains)
    init_from: str = ""  # adapters to continue from: a PEFT directory (`zerojax export --format peft`)
    rank_pattern: tuple[tuple[str, int], ...] = ()  # PEFT's rank_pattern: {target (a glob or component): rank}; optim.lora.rank for the rest
    alpha_pattern: tuple[tuple[str, float], ...] = ()  # PEFT's alpha_pattern: {target: alpha}; optim.lora.alpha for the rest

    def __post_init__(self):
        _at_least("optim.lora.rank", self.rank, 0)
        _choice("optim.lora.base", self.base, LORA_BASES)
        _finite("optim.lora.alpha", self.alpha, 0, above=True)
        if self.rank and not self.targets:
            raise ConfigError("optim.lora.targets is empty; give glob patterns over kernel paths, e.g. *attn*kernel")
        for key in ("rank_pattern", "alpha_pattern"):  # a mapping from Python or a saved config: kept as pairs
            value = getattr(self, key)
            object.__setattr__(self, key, tuple(value.items()) if isinstance(value, dict) else tuple(map(tuple, value)))
        for target, rank in self.rank_pattern:
            _at_least(f"optim.lora.rank_pattern[{target!r}]", rank, 1)
        for target, alpha in self.alpha_pattern:
            _finite(f"optim.lora.alpha_pattern[{target!r}]", alpha, 0, above=True)
        if (self.rank_pattern or self.alpha_pattern) and not self.rank:
            key = "rank_pattern" if self.rank_pattern else "alpha_pattern"
            raise ConfigError(f"optim.lora.{key} is set but optim.lora.rank=0 (LoRA off); set optim.lora.rank >= 1, "
                              "the rank of the targets the patterns do not name")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 3e-3  # peak learning rate
    b1: float = 0.9  # Adam first-moment decay
    b2: float = 0.95  # Adam second-moment decay
    eps: float = 1e-8  # Adam denominator epsilon
    weight_decay: float = 0.1  # decoupled weight decay, on the parameters decay_mask names
    decay_mask: str = "matrices"  # matrices: not norms' scales or biases (nanoGPT's, MaxText's) | all: every parameter (torch AdamW over a policy's parameters(), as LeRobot trains; openpi's weight_decay_mask=None)
    clip_norm: float = 1.0  # clip the global gradient norm to this; 0 = off
    warmup_steps: int = 50  # linear warmup from 0 to lr (with decay_steps: LeRobot's, from lr/(warmup+1))
    schedule: str = "cosine"  # after warmup: cosine (to final_lr at the last step, or over decay_steps) | constant
    decay_steps: int = 0  # cosine: LeRobot's cosine_decay_with_warmup, over steps 0..decay_steps (both it and warmup scaled by train.steps/decay_steps when the run is shorter); 0 = from warmup's end to the last step
    final_lr: float | None = None  # cosine: the lr the decay ends at (LeRobot's scheduler_decay_lr); null = lr/10
    freeze: tuple[str, ...] = ()  # parameter-path patterns, or components the model names (vision, vlm, ...), that are not trained
    ema: float = 0.0  # decay of an exponential moving average of the trained weights (openpi: 0.99); 0 = off
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
        _choice("optim.schedule", self.schedule, LR_SCHEDULES)
        _choice("optim.decay_mask", self.decay_mask, DECAY_MASKS)
        _at_least("optim.decay_steps", self.decay_steps, 0)
        if self.final_lr is not None:
            _finite("optim.final_lr", self.final_lr, 0)
        if not 0.0 <= self.ema < 1.0:
            raise ConfigError(f"optim.ema={self.ema} must be in [0, 1): the EMA's decay per step (openpi's is 0.99), "
                              "0 for no EMA")


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
    tensorboard: bool = True  # write TensorBoard event files of the logged metrics into the run directory
    wandb: str = ""  # a W&B project to log the metrics to (pip install 'zerojax[wandb]'); empty = off
    sample_tokens: int = 200  # new tokens of the end-of-run sample.txt (a chat reply also stops at its end token); 0 = none
    profile: str = ""  # START:STOP: a jax.profiler trace of steps START+1..STOP into <run dir>/plugins/profile; empty = off

    def __post_init__(self):
        _at_least("train.steps", self.steps, 1)
        _at_least("train.global_batch", self.global_batch, 1)
        _at_least("train.grad_accum", self.grad_accum, 1)
        for key in ("seed", "log_every", "eval_every", "ckpt_every", "sample_tokens"):
            _at_least(f"train.{key}", getattr(self, key), 0)
        _at_least("train.eval_batches", self.eval_batches, 1)
        _at_least("train.keep", self.keep, 1)
        _choice("train.resume", self.resume, RESUMES)
        rules.profile_range(self.profile, self.steps)
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
        rules.check_between_keys(self)

    @property
    def run_dir(self) -> Path:
        return Path(self.train.out_dir or f"runs/{self.name}")
