"""Hugging Face checkpoints in and out: `LlamaForCausalLM` (and Mistral's identical layout) and
`GPT2LMHeadModel`, as safetensors, one tensor at a time.

In: `model.init_from=DIR` (config.json, and model.safetensors or model.safetensors.index.json
with its shards). config.json sets the model's keys (`config.hf_model_keys`); every parameter
is then built straight into the sharded master layout with `jax.make_array_from_callback`: each
device's callback reads only its slice of the HF tensor(s) through `safe_open(...).get_slice`
(the layers of a stacked leaf are separate HF tensors, HF's [out, in] kernels are read
transposed), so no tensor is read or gathered whole and each process reads only what its
devices hold (measured on 8 CPU devices, the import's peak still adds 1.4x to 1.7x the largest
tensor of host memory, not one device's slice: BENCHMARKS.md, "Hugging Face import and export").

Out: `save` (what `zerojax export --format hf` runs) writes config.json, generation_config.json
and safetensors shards with HF names plus model.safetensors.index.json, one zerojax leaf at a
time.

`load(DIR) -> (ModelConfig, model)`: the model on one device in fp32 (tests and checks): its
`logits(tokens)` is what transformers' model computes; its `enter`/`exit` are the unit
protocol's, so the same object trains.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zerojax import data
from zerojax import sharding as sharding_lib
from zerojax import step as step_lib
from zerojax.config import HF_ARCHITECTURES, ConfigError, ModelConfig, hf_model_keys, read_json_object
from zerojax.precision import Policy


@dataclass(frozen=True)
class Tensor:
    """Where a zerojax leaf lives in an HF checkpoint: the name (`{i}`: the layer of a stacked
    leaf) and whether HF stores it transposed ([out, in] for a zerojax [in, out] kernel)."""

    name: str
    transposed: bool = False


LLAMA_LAYER = "model.layers.{i}."
LLAMA = {
    "embed_tokens/embedding": Tensor("model.embed_tokens.weight"),
    "norm/scale": Tensor("model.norm.weight"),
    "lm_head/kernel": Tensor("lm_head.weight", True),
    "layers/input_layernorm/scale": Tensor(LLAMA_LAYER + "input_layernorm.weight"),
    "layers/post_attention_layernorm/scale": Tensor(LLAMA_LAYER + "post_attention_layernorm.weight"),
    **{f"layers/self_attn/{p}/kernel": Tensor(LLAMA_LAYER + f"self_attn.{p}.weight", True)
       for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{f"layers/mlp/{p}/kernel": Tensor(LLAMA_LAYER + f"mlp.{p}.weight", True)
       for p in ("gate_proj", "up_proj", "down_proj")},
}
GPT2_LAYER = "transformer.h.{i}."
GPT2 = {  # GPT-2's Conv1D weights are stored [in, out], as zerojax's kernels
    "embed/wte/embedding": Tensor("transformer.wte.weight"),
    "embed/wpe": Tensor("transformer.wpe.weight"),
    "head/ln_f/scale": Tensor("transformer.ln_f.weight"),
    "head/ln_f/bias": Tensor("transformer.ln_f.bias"),
    "head/lm_head/kernel": Tensor("lm_head.weight", True),
    **{f"blocks/{ours}/{k}": Tensor(GPT2_LAYER + f"{theirs}.{'weight' if k in ('scale', 'kernel') else 'bias'}")
       for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2"), ("attn/qkv", "attn.c_attn"),
                            ("attn/out", "attn.c_proj"), ("mlp/up", "mlp.c_fc"), ("mlp/down", "mlp.c_proj"))
       for k in (("scale", "bias") if ours.startswith("ln") else ("kernel", "bias"))},
}
MAPPINGS = {"llama": LLAMA, "gpt": GPT2}


def mapping(family: str) -> dict:
    if family not in MAPPINGS:
        raise ConfigError(f"model.family={family}: no Hugging Face layout; zerojax converts "
                          f"{', '.join(MAPPINGS)} ({', '.join(HF_ARCHITECTURES)})")
    return MAPPINGS[family]


# ---------------------------------------------------------------------------------------------
# Reading: the tensors of a directory, lazily.


DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16, "F64": np.float64}


class SafetensorsFile:
    """One safetensors file read with positioned reads, not a memory map (a map's touched pages
    count as the process's memory): a slice reads only the rows it covers."""

    def __init__(self, path: Path):
        size = path.stat().st_size
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))  # (struct.error if the file is shorter than 8 bytes)
            if n > size - 8:  # any other file's first 8 bytes make a huge length: do not try to read it
                raise ValueError(f"its first 8 bytes give a header of {n:,} bytes, the file has {size:,}")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self.path, self.start, self.header = path, 8 + n, header
        for name, entry in header.items():
            if entry["dtype"] not in DTYPES:
                raise ValueError(f"tensor {name} has dtype {entry['dtype']}; zerojax reads {', '.join(DTYPES)}")
            begin, end = entry["data_offsets"]
            if end - begin != math.prod(entry["shape"]) * np.dtype(DTYPES[entry["dtype"]]).itemsize:
                raise ValueError(f"tensor {name}'s byte range does not match its shape")
        if self.start + max((e["data_offsets"][1] for e in header.values()), default=0) > size:
            raise ValueError("the file is shorter than its header says (truncated)")

    def read(self, name: str, index: tuple) -> np.ndarray:
        entry = self.header[name]
        shape, dtype = tuple(entry["shape"]), np.dtype(DTYPES[entry["dtype"]])
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        rows = range(*index[0].indices(shape[0])) if shape else range(1)
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        with self.path.open("rb") as f:
            f.seek(self.start + entry["data_offsets"][0] + rows.start * row_bytes)
            block = np.frombuffer(f.read(len(rows) * row_bytes), dtype).reshape((len(rows),) + shape[1:])
        return np.array(block[(slice(None),) + index[1:]] if shape else block.reshape(()), np.float32)


class Checkpoint:
    """Safetensors file(s), read lazily: name -> shape, and slices on demand."""

    def __init__(self, paths: list[Path], where: str):
        self.files, self.shapes, self.where, self.directory = {}, {}, {}, where
        for path in paths:
            try:
                handle = SafetensorsFile(path)
            except Exception as err:  # noqa: BLE001 - a bad header can fail in many ways
                raise ConfigError(f"{path} is not a readable safetensors file ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0][:120] if str(err) else ''})") from None
            for key, entry in handle.header.items():
                self.shapes[key], self.where[key] = tuple(entry["shape"]), path.name
            self.files[path.name] = handle

    @classmethod
    def of_directory(cls, directory: str) -> "Checkpoint":
        """A Hugging Face directory's model.safetensors, or the shards its index names."""
        root = Path(directory)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ConfigError(f"{index} is not a safetensors index ({type(err).__name__})") from None
            missing = sorted(f for f in set(weight_map.values()) if not (root / f).is_file())
            if missing:
                raise ConfigError(f"{index} names {missing[0]}, which is not in {directory}")
            return cls([root / f for f in sorted(set(weight_map.values()))], directory)
        if (root / "model.safetensors").is_file():
            return cls([root / "model.safetensors"], directory)
        raise ConfigError(f"model.init_from={directory!r} has no model.safetensors nor model.safetensors.index.json")

    def resolve(self, name: str) -> str | None:
        """The name as stored: the original hub GPT-2 files drop the `transformer.` prefix."""
        if name in self.shapes:
            return name
        bare = name.removeprefix("transformer.")
        return bare if bare in self.shapes else None

    def read(self, name: str, index: tuple) -> np.ndarray:
        """The fp32 slice `index` (a tuple of slices) of tensor `name`."""
        name = self.resolve(name)
        return self.files[self.where[name]].read(name, index)


def _expected_shape(leaf: sharding_lib.LeafPlan, tensor: Tensor, stacked: bool) -> tuple:
    shape = leaf.shape[1:] if stacked else leaf.shape
    return tuple(reversed(shape)) if tensor.transposed else tuple(shape)


def base_leaves(plan: sharding_lib.Plan):
    """The plan's leaves that a model checkpoint holds: all but LoRA adapters (a nested dict)."""
    from zerojax.lora import is_adapter

    return sharding_lib.select(plan.leaves, jax.tree.map(lambda leaf: is_adapter(leaf.path), plan.leaves), False)


def check(ckpt: Checkpoint, plan: sharding_lib.Plan, table: dict, stacked: tuple[str, ...],
          all_leaves: bool = False) -> None:
    """Every leaf of the plan (its model's, or `all_leaves`) has its tensor(s), of the shape the config implies."""
    for leaf in jax.tree.leaves(plan.leaves if all_leaves else base_leaves(plan)):
        tensor, layered = table[leaf.path], leaf.path.split("/")[0] in stacked
        names = [tensor.name.format(i=i) for i in range(leaf.shape[0])] if layered else [tensor.name]
        want = _expected_shape(leaf, tensor, layered)
        for name in names:
            have = ckpt.shapes.get(ckpt.resolve(name))
            if have is None:
                raise ConfigError(f"model.init_from={ckpt.directory}: no tensor {name!r}, which the model needs "
                                  f"(it has {len(ckpt.shapes)} tensors, e.g. {sorted(ckpt.shapes)[:2]})")
            # GPT-2's position table may be longer than the context trained (model.seq_len).
            fits = have == want or (leaf.path == "embed/wpe" and have[1:] == want[1:] and have[0] >= want[0])
            if not fits:
                raise ConfigError(f"model.init_from={ckpt.directory}: tensor {name!r} has shape {list(have)}, the "
                                  f"model needs {list(want)}")


def _leaf_slice(ckpt: Checkpoint, leaf, tensor: Tensor, layered: bool, index: tuple) -> np.ndarray:
    """The block `index` (of the stored, padded shape) of a zerojax leaf, read from HF tensors;
    zeros where the block reaches into padding."""
    block = np.zeros([len(range(*s.indices(n))) for s, n in zip(index, leaf.stored)], np.float32)
    true = tuple(slice(s.start or 0, min(s.stop if s.stop is not None else n, t))
                 for s, n, t in zip(index, leaf.stored, leaf.shape))
    if any(s.stop <= s.start for s in true):
        return block
    inner = true[1:] if layered else true
    hf_index = tuple(reversed(inner)) if tensor.transposed else inner
    read = lambda name: (lambda x: x.T if tensor.transposed else x)(ckpt.read(name, hf_index))
    value = np.stack([read(tensor.name.format(i=i)) for i in range(true[0].start, true[0].stop)]) if layered \
        else read(tensor.name)
    block[tuple(slice(0, s.stop - s.start) for s in true)] = value
    return block


def sharded_params(ckpt: Checkpoint, table: dict, plan: sharding_lib.Plan, mesh, stacked: tuple[str, ...],
                   all_leaves: bool = False):
    """The model's weights (the plan's stored layout, dtypes and shardings: fp32 master weights
    and frozen leaves in precision.frozen) from a checkpoint whose tensors `table` names, each
    device reading only its slices. LoRA adapters are not a model checkpoint's: left out."""
    sharded = plan.layout.master

    def build(leaf):
        layered = leaf.path.split("/")[0] in stacked
        sharding = jax.sharding.NamedSharding(mesh, leaf.spec(sharded))
        dtype = jnp.dtype(leaf.dtype)
        return jax.make_array_from_callback(
            leaf.stored, sharding, lambda index: _leaf_slice(ckpt, leaf, table[leaf.path], layered, index).astype(dtype))

    return jax.tree.map(build, plan.leaves if all_leaves else base_leaves(plan))


def init_source(init_from: str, plan: sharding_lib.Plan, family: str, stacked: tuple[str, ...]):
    """(checkpoint, name table, stacked names) of `model.init_from`, checked against the plan
    from the files' headers alone (ConfigError if anything is missing or misshapen): a Hugging
    Face directory, or one safetensors file of zerojax parameter paths (`zerojax export`)."""
    path = Path(init_from)
    if path.is_dir():
        ckpt, table = Checkpoint.of_directory(init_from), mapping(family)
        check(ckpt, plan, table, stacked)
        return ckpt, table, stacked
    if not path.is_file():
        raise ConfigError(f"model.init_from={init_from!r}: no such file or directory")
    ckpt = Checkpoint([path], init_from)
    table = {leaf.path: Tensor(leaf.path) for leaf in jax.tree.leaves(base_leaves(plan))}
    check(ckpt, plan, table, ())  # zerojax's own files keep the layer axis
    return ckpt, table, ()


def init_params(init_from: str, plan: sharding_lib.Plan, mesh, family: str, stacked: tuple[str, ...]):
    """`model.init_from`'s weights, built straight into the plan's sharded master layout."""
    ckpt, table, layered = init_source(init_from, plan, family, stacked)
    return sharded_params(ckpt, table, plan, mesh, layered)


def load(directory: str):
    """(ModelConfig, model) from an HF directory, on one device in fp32: `model.logits(tokens)`
    gives [B, T, V] logits; `enter`/`exit` make it trainable through the unit protocol."""
    from zerojax.models import Units

    cfg = ModelConfig(**hf_model_keys(directory), init_from=directory)
    model = step_lib.build_model(cfg, Policy(), 0)
    units = Units.of(model)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    plan = sharding_lib.make_plan(params, 0, 1, 0, stacked=units.names)
    device = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    loaded = init_params(directory, plan, device, cfg.family, units.names)
    nnx.update(model, jax.device_get(loaded))
    return cfg, model


# ---------------------------------------------------------------------------------------------
# Writing: config.json, safetensors shards with HF names, the index.

SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16"}
BLOCK_BYTES = 16 * 2**20  # what a writer maps and fills at a time


def hf_config(model: dict, dtype: str) -> dict:
    """config.json for a zerojax model config (the keys of `run/config.yaml`'s model section)."""
    family = model["family"]
    arch = {"llama": "LlamaForCausalLM", "gpt": "GPT2LMHeadModel"}[family]
    keys = HF_ARCHITECTURES[arch][1]
    tie = model["tie_embeddings"] if model["tie_embeddings"] is not None else family == "gpt"
    out = {keys[k]: model[k] for k in keys if k not in ("tie_embeddings", "n_kv_heads")}
    out["tie_word_embeddings"] = tie
    if family == "llama":  # rope_theta for transformers 4, rope_parameters for 5
        out.update(model_type="llama", num_key_value_heads=model["n_kv_heads"] or model["n_heads"],
                   rope_parameters={"rope_type": "default", "rope_theta": model["rope_theta"]},
                   hidden_act="silu", max_position_embeddings=model["seq_len"], attention_bias=False,
                   mlp_bias=False, bos_token_id=None, eos_token_id=None)
    else:
        out.update(model_type="gpt2", n_positions=model["seq_len"], activation_function="gelu_new",
                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    return {"architectures": [arch], **out, "torch_dtype": dtype, "dtype": dtype}


def hf_tensors(family: str, shapes: dict, stacked: tuple[str, ...]) -> list[tuple]:
    """(HF name, zerojax path, layer or None, HF shape, transposed) for every tensor of the
    export, in order (a leaf's tensors together)."""
    table, out = mapping(family), []
    for path, shape in shapes.items():
        tensor = table[path]
        flip = (lambda s: tuple(reversed(s))) if tensor.transposed else tuple
        if path.split("/")[0] in stacked:
            out += [(tensor.name.format(i=i), path, i, flip(shape[1:]), tensor.transposed) for i in range(shape[0])]
        else:
            out.append((tensor.name, path, None, flip(shape), tensor.transposed))
    return out


PEFT_PREFIX = "base_model.model."


def peft_mapping(family: str) -> dict:
    """Adapter path -> PEFT tensor: the adapter of a kernel that HF calls `X.weight` is
    `base_model.model.X.lora_A.weight` [r, in] and `...lora_B.weight` [out, r] (zerojax's A [in, r]
    and B [r, out], transposed, whatever HF's own layout for X)."""
    out = {}
    for path, tensor in mapping(family).items():
        if path.endswith("/kernel"):
            base, layer = PEFT_PREFIX + tensor.name.removesuffix(".weight"), path.removesuffix("/kernel")
            out[f"{layer}/lora_a"] = Tensor(f"{base}.lora_A.weight", True)
            out[f"{layer}/lora_b"] = Tensor(f"{base}.lora_B.weight", True)
    return out


def peft_tensors(family: str, shapes: dict, stacked: tuple[str, ...]) -> list[tuple]:
    """`hf_tensors`' rows for the LoRA adapters among `shapes`, with PEFT's names."""
    from zerojax.lora import is_adapter

    table, out = peft_mapping(family), []
    for path, shape in shapes.items():
        if not is_adapter(path):
            continue
        name = table[path].name
        if path.split("/")[0] in stacked:
            out += [(name.format(i=i), path, i, tuple(reversed(shape[1:])), True) for i in range(shape[0])]
        else:
            out.append((name, path, None, tuple(reversed(shape)), True))
    return out


def init_adapters(directory: str, plan: sharding_lib.Plan, mesh, family: str, stacked: tuple[str, ...],
                  lora: dict, build: bool = True):
    """`optim.lora.init_from`: a PEFT adapter directory's A and B, in the plan's layout (checked
    from the headers first: its rank and alpha must be the run's, and it must hold an adapter
    for exactly the kernels the run's targets name). `build=False`: only check."""
    from zerojax.lora import is_adapter

    where = f"optim.lora.init_from={directory}"
    config_file, weights = Path(directory) / "adapter_config.json", Path(directory) / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise ConfigError(f"{where}: not a PEFT adapter directory (adapter_config.json and "
                          "adapter_model.safetensors); `zerojax export --format peft` writes one")
    peft = read_json_object(config_file, "a PEFT config")
    if peft.get("peft_type", "LORA") != "LORA" or peft.get("use_dora") or peft.get("use_rslora"):
        raise ConfigError(f"{where}: only plain LoRA adapters are supported (not DoRA or rsLoRA)")
    for key, ours in (("r", "rank"), ("lora_alpha", "alpha")):
        if peft.get(key) != lora[ours]:
            raise ConfigError(f"{where}: its {key}={peft.get(key)!r} differs from optim.lora.{ours}={lora[ours]!r}; "
                              f"set optim.lora.{ours}={peft.get(key)}")
    adapters = sharding_lib.select(plan.leaves, jax.tree.map(lambda leaf: is_adapter(leaf.path), plan.leaves))
    ckpt, table = Checkpoint([weights], directory), peft_mapping(family)
    wanted = {table[leaf.path].name.format(i=i) for leaf in jax.tree.leaves(adapters)
              for i in (range(leaf.shape[0]) if leaf.path.split("/")[0] in stacked else [0])}
    extra = sorted(set(ckpt.shapes) - wanted)
    if extra:
        raise ConfigError(f"{where}: it adapts {extra[0]!r}, which optim.lora.targets does not name "
                          f"({len(extra)} such tensors); make the targets match the adapter's")
    check(ckpt, sharding_lib.Plan(plan.stage, plan.data_size, adapters), table, stacked, all_leaves=True)
    if not build:
        return None
    return sharded_params(ckpt, table, sharding_lib.Plan(plan.stage, plan.data_size, adapters), mesh, stacked,
                          all_leaves=True)


def peft_config(config: dict, targets: list[str]) -> dict:
    """adapter_config.json: PEFT's LoraConfig for a run's `optim.lora` (no dropout, no bias)."""
    lora, model = config["optim"]["lora"], config["model"]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora["rank"], "lora_alpha": lora["alpha"],
            "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": model["family"] == "gpt",  # GPT-2's Conv1D keeps its weight [in, out]
            "base_model_name_or_path": model.get("init_from") or None, "inference_mode": True,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}


def save_peft(out: Path, config: dict, shapes: dict, stacked: tuple[str, ...], blocks_of, *,
              dtype: str = "float32") -> tuple[int, int]:
    """A PEFT adapter directory at `out` (what `zerojax export --format peft` writes):
    adapter_config.json and adapter_model.safetensors, written to `out`.tmp and renamed once
    complete. Returns (bytes, tensors)."""
    if out.exists():
        raise ConfigError(f"--out {str(out)!r} already exists; give a new directory")
    tensors = peft_tensors(config["model"]["family"], shapes, stacked)
    targets = sorted({t[0].split(".")[-3] for t in tensors})  # q_proj, ... (the HF module names)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    fill(create_safetensors(tmp / "adapter_model.safetensors", tensors, dtype), tensors, blocks_of, dtype)
    (tmp / "adapter_config.json").write_text(json.dumps(peft_config(config, targets), indent=2))
    tmp.rename(out)
    return sum(f.stat().st_size for f in out.iterdir()), len(tensors)


def shard_plan(tensors: list, itemsize: int, max_shard_bytes: int) -> list[list]:
    """Tensors grouped into files of at most `max_shard_bytes` (a bigger tensor alone), in order."""
    files, size = [[]], 0
    for t in tensors:
        nbytes = math.prod(t[3]) * itemsize
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(t)
        size += nbytes
    return files


def create_safetensors(path: Path, tensors: list, dtype: str) -> dict:
    """A safetensors file of `tensors` (from `hf_tensors`), its header written and its data
    region allocated (zeros), to be filled by `fill`. Returns name -> (file, data offset)."""
    np_dtype = jnp.dtype(dtype)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, _, _, shape, _ in tensors:
        size = math.prod(shape) * np_dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return {name: (path, 8 + len(blob) + header[name]["data_offsets"][0]) for name, *_ in tensors}


def _put(path: Path, offset: int, shape: tuple, dtype, index: tuple, value: np.ndarray) -> None:
    """value -> tensor[index] in the file, a few MB of rows at a time, each through its own
    short-lived map of just those rows (a map's touched pages are the process's memory until
    it is unmapped)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    rows = range(*index[0].indices(shape[0]))
    row_bytes = math.prod(shape[1:]) * jnp.dtype(dtype).itemsize
    step = max(1, BLOCK_BYTES // max(1, row_bytes))
    for a in range(0, len(rows), step):
        r0, r1 = rows.start + a, min(rows.start + a + step, rows.stop)
        region = np.memmap(path, dtype=dtype, mode="r+", offset=offset + r0 * row_bytes, shape=(r1 - r0,) + shape[1:])
        region[(slice(None),) + index[1:]] = value[a:a + (r1 - r0)]
        region.flush()
        del region


def fill(regions: dict, tensors: list, blocks_of, dtype: str) -> None:
    """Write every tensor of `tensors` into its region (from `create_safetensors`), leaf by leaf:
    `blocks_of(path)` yields (index, fp32 block) pieces of a zerojax leaf (its true shape), and
    each piece goes to the tensor(s) it covers, transposed where HF stores [out, in]."""
    by_leaf: dict = {}
    for t in tensors:
        by_leaf.setdefault(t[1], {})[t[2]] = t
    np_dtype = jnp.dtype(dtype)
    for path, layers in by_leaf.items():
        for index, block in blocks_of(path):
            for layer, t in layers.items():
                if layer is not None and not index[0].start <= layer < index[0].stop:
                    continue
                value, inner = (block, index) if layer is None else (block[layer - index[0].start], index[1:])
                if t[4]:  # transposed: HF's [out, in]
                    value, inner = value.T, tuple(reversed(inner))
                _put(*regions[t[0]], t[3], np_dtype, inner, value)
            del block


def save(out: Path, model: dict, shapes: dict, stacked: tuple[str, ...], blocks_of, *, dtype: str = "float32",
         max_shard_bytes: int = 5 * 10**9, tokenizer: str = "") -> tuple[int, int]:
    """A Hugging Face directory at `out` (what `zerojax export --format hf` writes): config.json
    and generation_config.json from `model` (a run's model config, as a dict), safetensors shards
    of at most `max_shard_bytes` with HF names and their index, and the tokenizer's files.
    `shapes`: zerojax parameter path -> true shape; `blocks_of(path)` yields a leaf's pieces
    (see `fill`). Written to `out`.tmp and renamed once complete. Returns (bytes, tensors)."""
    import shutil

    if out.exists():
        raise ConfigError(f"--out {str(out)!r} already exists; give a new directory")
    tokenizer_files = []
    if tokenizer:  # the run's tokenizer travels with the model (its directory's other HF tokenizer files too)
        path = data.tokenizer_file(tokenizer)
        tokenizer_files = [path] + [path.with_name(n) for n in ("tokenizer_config.json", "special_tokens_map.json")
                                    if path.with_name(n).is_file()]
    tensors = hf_tensors(model["family"], shapes, stacked)
    files = shard_plan(tensors, jnp.dtype(dtype).itemsize, max_shard_bytes)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    names = [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    regions = {}
    for name, group in zip(names, files):
        regions.update(create_safetensors(tmp / name, group, dtype))
    fill(regions, tensors, blocks_of, dtype)
    total = sum(math.prod(t[3]) for t in tensors) * jnp.dtype(dtype).itemsize
    index = {"metadata": {"total_size": total}, "weight_map": {t[0]: n for n, g in zip(names, files) for t in g}}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(hf_config(model, dtype), indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"_from_model_config": True}, indent=2))
    for f in tokenizer_files:
        shutil.copyfile(f, tmp / f.name)
    tmp.rename(out)  # the directory appears only once complete
    return sum(f.stat().st_size for f in out.iterdir()), len(tensors)
