"""PEFT's LoRA adapters in and out: the adapter names a family's tensor table implies,
`optim.lora.init_from` (adapter_config.json + adapter_model.safetensors into the plan's layout)
and `zerojax export --format peft`."""

from __future__ import annotations

import json
from pathlib import Path
import jax
from zerojax.errors import ConfigError
from zerojax.parallel import plan as plan_lib
from zerojax.parallel import trees
from zerojax.models import registry
from zerojax.models.family import Tensor
from zerojax.config import read_json_object
from zerojax.optim.lora import is_adapter
from zerojax.interop.hf import check, sharded_params
from zerojax.interop.safetensors import Checkpoint, Entry, create_safetensors, fill


PEFT_PREFIX = "base_model.model."


def peft_mapping(family: str) -> dict:
    """Adapter path -> PEFT tensor: the adapter of a kernel that HF calls `X.weight` is
    `base_model.model.X.lora_A.weight` [r, in] and `...lora_B.weight` [out, r] (zerojax's A [in, r]
    and B [r, out], transposed, whatever HF's own layout for X)."""
    out = {}
    for path, tensor in registry.hf_layout(family).tensors.items():
        if path.endswith("/kernel"):
            base, layer = PEFT_PREFIX + tensor.name.removesuffix(".weight"), path.removesuffix("/kernel")
            out[f"{layer}/lora_a"] = Tensor(f"{base}.lora_A.weight", True)
            out[f"{layer}/lora_b"] = Tensor(f"{base}.lora_B.weight", True)
    return out


def peft_tensors(family: str, shapes: dict, stacked: tuple[str, ...]) -> list[Entry]:
    """`hf_tensors`' rows for the LoRA adapters among `shapes`, with PEFT's names."""
    table, out = peft_mapping(family), []
    for path, shape in shapes.items():
        if not is_adapter(path):
            continue
        name = table[path].name
        if path.split("/")[0] in stacked:
            out += [Entry(name.format(i=i), path, i, tuple(reversed(shape[1:])), True) for i in range(shape[0])]
        else:
            out.append(Entry(name, path, None, tuple(reversed(shape)), True))
    return out


def init_adapters(directory: str, plan: plan_lib.Plan, mesh, family: str, stacked: tuple[str, ...],
                  lora: dict, build: bool = True):
    """`optim.lora.init_from`: a PEFT adapter directory's A and B, in the plan's layout (checked
    from the headers first: its rank and alpha must be the run's, and it must hold an adapter
    for exactly the kernels the run's targets name). `build=False`: only check."""
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
    adapters = trees.select(plan.leaves, jax.tree.map(lambda leaf: is_adapter(leaf.path), plan.leaves))
    ckpt, table = Checkpoint([weights], directory), peft_mapping(family)
    wanted = {table[leaf.path].name.format(i=i) for leaf in jax.tree.leaves(adapters)
              for i in (range(leaf.shape[0]) if leaf.path.split("/")[0] in stacked else [0])}
    extra = sorted(set(ckpt.shapes) - wanted)
    if extra:
        raise ConfigError(f"{where}: it adapts {extra[0]!r}, which optim.lora.targets does not name "
                          f"({len(extra)} such tensors); make the targets match the adapter's")
    check(ckpt, plan_lib.Plan(plan.stage, plan.data_size, adapters), table, stacked, all_leaves=True)
    if not build:
        return None
    return sharded_params(ckpt, table, plan_lib.Plan(plan.stage, plan.data_size, adapters), mesh, stacked,
                          all_leaves=True)


def peft_config(config: dict, targets: list[str]) -> dict:
    """adapter_config.json: PEFT's LoraConfig for a run's `optim.lora` (no dropout, no bias)."""
    lora, model = config["optim"]["lora"], config["model"]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora["rank"], "lora_alpha": lora["alpha"],
            "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": registry.hf_layout(model["family"]).fan_in_fan_out,  # [in, out] weights
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
    targets = sorted({t.name.split(".")[-3] for t in tensors})  # q_proj, ... (the HF module names)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    fill(create_safetensors(tmp / "adapter_model.safetensors", tensors, dtype), tensors, blocks_of, dtype)
    (tmp / "adapter_config.json").write_text(json.dumps(peft_config(config, targets), indent=2))
    tmp.rename(out)
    return sum(f.stat().st_size for f in out.iterdir()), len(tensors)
