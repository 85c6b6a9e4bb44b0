"""Hugging Face checkpoints in and out, for every family that declares a Hugging Face layout
(`models.family.HfLayout`, next to the family's modules: its architectures, its config.json keys
both ways, its tensor table), as safetensors, one tensor at a time. This converter names no family
and no architecture; it reads them from the registry.

In: `model.init_from=DIR` (config.json, and model.safetensors or model.safetensors.index.json
with its shards). config.json's architecture picks the family, whose layout turns the file into
the model's keys (`config.hf_model_keys`); every parameter is then built straight into the sharded
master layout with `jax.make_array_from_callback`: each device's callback reads only its slice
of the HF tensor(s) through positioned reads (the layers of a stacked leaf are separate HF
tensors, HF's [out, in] kernels are read transposed), so no tensor is read or gathered whole and
each process reads only what its devices hold (measured on 8 CPU devices, the import's peak
still adds 1.4x to 1.7x the largest tensor of host memory, not one device's slice:
BENCHMARKS.md, "Hugging Face import and export").

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
from pathlib import Path
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from zerojax import data
from zerojax.config import ModelConfig, hf_model_keys
from zerojax.checkpoints import format as checkpoints
from zerojax.errors import ConfigError
from zerojax.precision import Policy
from zerojax.parallel import plan as plan_lib
from zerojax.parallel import trees
from zerojax.models import registry
from zerojax.models.family import Tensor
from zerojax.models.protocol import Units
from zerojax.optim.lora import is_adapter
from zerojax.interop.safetensors import Checkpoint, Entry, create_safetensors, fill, shard_plan


# ---------------------------------------------------------------------------------------------
# config.json: which family, and the model's keys.


def hf_config(model: dict, dtype: str) -> dict:
    """config.json for a zerojax model config (the keys of `run/config.yaml`'s model section)."""
    layout = registry.hf_layout(model["family"])
    return {"architectures": [layout.architectures[0]], **layout.to_hf_config(model), "torch_dtype": dtype,
            "dtype": dtype}


# ---------------------------------------------------------------------------------------------
# Tensors in: checked from the headers, read slice by slice into the sharded layout.


def _expected_shape(leaf: plan_lib.LeafPlan, tensor: Tensor, stacked: bool) -> tuple:
    shape = leaf.shape[1:] if stacked else leaf.shape
    return tuple(reversed(shape)) if tensor.transposed else tuple(shape)


def base_leaves(plan: plan_lib.Plan):
    """The plan's leaves that a model checkpoint holds: all but LoRA adapters (a nested dict)."""
    return trees.select(plan.leaves, jax.tree.map(lambda leaf: is_adapter(leaf.path), plan.leaves), False)


def check(ckpt: Checkpoint, plan: plan_lib.Plan, table: dict, stacked: tuple[str, ...],
          all_leaves: bool = False) -> None:
    """Every leaf of the plan (its model's, or `all_leaves`) has its tensor(s), of the shape the config implies."""
    for leaf in jax.tree.leaves(plan.leaves if all_leaves else base_leaves(plan)):
        tensor, layered = table[leaf.path], leaf.path.split("/")[0] in stacked
        names = [tensor.at(i) for i in range(leaf.shape[0])] if layered else [tensor.name]
        want = _expected_shape(leaf, tensor, layered)
        for name in names:
            have = ckpt.shapes.get(ckpt.resolve(name))
            if have is None:
                raise ConfigError(f"model.init_from={ckpt.directory}: no tensor {name!r}, which the model needs "
                                  f"(it has {len(ckpt.shapes)} tensors, e.g. {sorted(ckpt.shapes)[:2]})")
            fits = have == want or (tensor.may_be_longer and have[1:] == want[1:] and have[0] >= want[0])
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
    value = np.stack([read(tensor.at(i)) for i in range(true[0].start, true[0].stop)]) if layered \
        else read(tensor.name)
    block[tuple(slice(0, s.stop - s.start) for s in true)] = value
    return block


def sharded_params(ckpt: Checkpoint, table: dict, plan: plan_lib.Plan, mesh, stacked: tuple[str, ...],
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


def init_checkpoint(init_from: str, plan: plan_lib.Plan, family: str, stacked: tuple[str, ...]):
    """(checkpoint, name table, stacked names) of `model.init_from`, by the reader of its format
    (`zerojax.checkpoints`: a Hugging Face directory, a LeRobot policy directory, an openpi
    checkpoint, a zerojax export file, ...), checked against the plan from the files' headers
    alone (ConfigError if anything is missing or misshapen, or the format holds no model)."""
    return checkpoints.call(checkpoints.start(init_from).read, init_from, plan, family, stacked)


def read_hf(init_from: str, plan: plan_lib.Plan, family: str, stacked: tuple[str, ...]):
    """A Hugging Face directory (`zerojax.checkpoints.hf`), named by its family's HF layout."""
    layout = registry.hf_layout(family)
    ckpt, table = Checkpoint.of_directory(init_from, layout.optional_prefix, layout.aliases), layout.tensors
    check(ckpt, plan, table, stacked)
    return ckpt, table, stacked


def read_export(init_from: str, plan: plan_lib.Plan, family: str, stacked: tuple[str, ...]):
    """One safetensors file of zerojax parameter paths (`zerojax.checkpoints.safetensors`), which
    keeps the layer axis: read as the plan's leaves."""
    ckpt = Checkpoint([Path(init_from)], init_from)
    table = {leaf.path: Tensor(leaf.path) for leaf in jax.tree.leaves(base_leaves(plan))}
    check(ckpt, plan, table, ())
    return ckpt, table, ()


def init_params(init_from: str, plan: plan_lib.Plan, mesh, family: str, stacked: tuple[str, ...]):
    """`model.init_from`'s weights, built straight into the plan's sharded master layout."""
    ckpt, table, layered = init_checkpoint(init_from, plan, family, stacked)
    return sharded_params(ckpt, table, plan, mesh, layered)


def load(directory: str):
    """(ModelConfig, model) from an HF directory, on one device in fp32: `model.logits(tokens)`
    gives [B, T, V] logits; `enter`/`exit` make it trainable through the unit protocol."""
    cfg = ModelConfig(**hf_model_keys(directory), init_from=directory)
    return cfg, one_device(cfg)


def one_device(cfg: ModelConfig):
    """cfg's model on one device in fp32, its weights read from cfg.init_from through the same path
    as training's `model.init_from` (the Python APIs' `load`: this one, LeRobot's, openpi's)."""
    model = nnx.eval_shape(lambda: registry.build(cfg, Policy(), seed=0))
    units = Units.of(model)
    plan = plan_lib.make_plan(nnx.to_pure_dict(nnx.state(model, nnx.Param)), 0, 1, 0, stacked=units.names)
    device = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    loaded = init_params(cfg.init_from, plan, device, cfg.family, units.names)
    nnx.update(model, jax.tree.map(jnp.asarray, jax.device_get(loaded)))
    return model


def hf_tensors(family: str, shapes: dict, stacked: tuple[str, ...], table: dict | None = None) -> list[Entry]:
    """The export's tensors, in order (a leaf's tensors together), named by the family's table
    (its Hugging Face layout's, or `table`)."""
    table, out = table or registry.hf_layout(family).tensors, []
    for path, shape in shapes.items():
        tensor = table[path]
        flip = (lambda s: tuple(reversed(s))) if tensor.transposed else tuple
        if path.split("/")[0] in stacked:
            out += [Entry(tensor.at(i), path, i, flip(shape[1:]), tensor.transposed)
                    for i in range(shape[0])]
        else:
            out.append(Entry(tensor.name, path, None, flip(shape), tensor.transposed))
    return out


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
        names = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")  # the chat template too
        tokenizer_files = [path] + [path.with_name(n) for n in names if path.with_name(n).is_file()]
    tensors = hf_tensors(model["family"], shapes, stacked)
    files = shard_plan(tensors, jnp.dtype(dtype).itemsize, max_shard_bytes)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    names = [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    regions = {}
    for name, group in zip(names, files):
        regions.update(create_safetensors(tmp / name, group, dtype))
    fill(regions, tensors, blocks_of, dtype)
    total = sum(math.prod(t.shape) for t in tensors) * jnp.dtype(dtype).itemsize
    index = {"metadata": {"total_size": total}, "weight_map": {t.name: n for n, g in zip(names, files) for t in g}}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(hf_config(model, dtype), indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"_from_model_config": True}, indent=2))
    for f in tokenizer_files:
        shutil.copyfile(f, tmp / f.name)
    tmp.rename(out)  # the directory appears only once complete
    return sum(f.stat().st_size for f in out.iterdir()), len(tensors)



def write(job) -> tuple[int, int]:
    """`zerojax export --format hf` (`zerojax.checkpoints.hf`): `save` of an `ExportJob`."""
    return save(job.out, job.config["model"], job.shapes, job.stacked(), job.blocks_of, dtype=job.dtype,
                max_shard_bytes=job.max_shard_bytes, tokenizer=job.config["data"].get("tokenizer", ""))