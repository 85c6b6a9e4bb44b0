"""PEFT's LoRA adapters in and out: the adapter names a family's tensor table implies,
`optim.lora.init_from` (adapter_config.json + adapter_model.safetensors into the plan's layout)
and `zerojax export --format peft`."""

from __future__ import annotations

import json
import re
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


def module_names(family: str, settings: dict, stacked: tuple[str, ...], n_layers: dict) -> dict:
    """PEFT's module name (`model.layers.3.self_attn.q_proj`) -> (rank, alpha) of every adapted
    kernel of `settings` (`optim.lora.settings`: kernel path -> (rank, alpha)), one per layer of
    a stack (`n_layers`: stack -> its depth)."""
    table, out = peft_mapping(family), {}
    for kernel, value in settings.items():
        name = table[kernel.removesuffix("/kernel") + "/lora_a"].name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        stack = kernel.split("/")[0]
        for i in range(n_layers[stack]) if stack in stacked else [None]:
            out[name.format(i=i) if i is not None else name] = value
    return out


def pattern_value(patterns: dict, module: str, default):
    r"""What PEFT's rank_pattern / alpha_pattern give a module (peft.utils.other.get_pattern_key:
    the first key, a regex, with `re.match(rf"(.*\.)?({key})$", module)`), else `default`."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def init_adapters(directory: str, plan: plan_lib.Plan, mesh, family: str, stacked: tuple[str, ...],
                  lora: dict, settings: dict, build: bool = True):
    """`optim.lora.init_from`: a PEFT adapter directory's A and B, in the plan's layout (checked
    from the headers first: its rank and alpha, per module with its rank_pattern and
    alpha_pattern, must be the run's (`settings`: kernel path -> (rank, alpha)), and it must hold
    an adapter for exactly the kernels the run's targets name). `build=False`: only check."""
    where = f"optim.lora.init_from={directory}"
    config_file, weights = Path(directory) / "adapter_config.json", Path(directory) / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise ConfigError(f"{where}: not a PEFT adapter directory (adapter_config.json and "
                          "adapter_model.safetensors); `zerojax export --format peft` writes one")
    peft = read_json_object(config_file, "a PEFT config")
    if peft.get("peft_type", "LORA") != "LORA" or peft.get("use_dora") or peft.get("use_rslora"):
        raise ConfigError(f"{where}: only plain LoRA adapters are supported (not DoRA or rsLoRA)")
    patterns = {"r": peft.get("rank_pattern") or {}, "lora_alpha": peft.get("alpha_pattern") or {}}
    for key, ours in (("r", "rank"), ("lora_alpha", "alpha")):
        if peft.get(key) != lora[ours] and not (patterns["r"] or patterns["lora_alpha"] or lora["rank_pattern"]
                                                or lora["alpha_pattern"]):
            raise ConfigError(f"{where}: its {key}={peft.get(key)!r} differs from optim.lora.{ours}={lora[ours]!r}; "
                              f"set optim.lora.{ours}={peft.get(key)}")
    depth = {name: leaf.shape[0] for leaf in jax.tree.leaves(plan.leaves) for name in stacked
             if leaf.path.startswith(name + "/")}
    for module, (rank, alpha) in module_names(family, settings, stacked, depth).items():
        theirs = (pattern_value(patterns["r"], module, peft.get("r")),
                  pattern_value(patterns["lora_alpha"], module, peft.get("lora_alpha")))
        if theirs != (rank, alpha):
            raise ConfigError(f"{where}: it gives {module} r={theirs[0]!r}, lora_alpha={theirs[1]!r} (its r, "
                              f"lora_alpha, rank_pattern and alpha_pattern), the run's optim.lora rank {rank}, alpha "
                              f"{alpha:g} (optim.lora.rank, alpha, rank_pattern, alpha_pattern); make them agree")
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


def peft_config(config: dict, targets: list[str], modules: dict | None = None) -> dict:
    """adapter_config.json: PEFT's LoraConfig for a run's `optim.lora` (no dropout, no bias);
    `modules` (module name -> (rank, alpha), `module_names`) puts every module whose rank or
    alpha is not optim.lora.rank / alpha into rank_pattern / alpha_pattern, by its full name."""
    lora, model, modules = config["optim"]["lora"], config["model"], modules or {}
    rank_pattern = {m: r for m, (r, _) in modules.items() if r != lora["rank"]}
    alpha_pattern = {m: a for m, (_, a) in modules.items() if a != lora["alpha"]}
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora["rank"], "lora_alpha": lora["alpha"],
            "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": registry.hf_layout(model["family"]).fan_in_fan_out,  # [in, out] weights
            "base_model_name_or_path": model.get("init_from") or None, "inference_mode": True,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "layers_to_transform": None, "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern}


def save_peft(out: Path, config: dict, shapes: dict, stacked: tuple[str, ...], blocks_of, *,
              dtype: str = "float32", settings: dict | None = None) -> tuple[int, int]:
    """A PEFT adapter directory at `out` (what `zerojax export --format peft` writes):
    adapter_config.json and adapter_model.safetensors, written to `out`.tmp and renamed once
    complete; `settings` (kernel path -> (rank, alpha)) gives PEFT's rank_pattern and
    alpha_pattern. Returns (bytes, tensors)."""
    if out.exists():
        raise ConfigError(f"--out {str(out)!r} already exists; give a new directory")
    tensors = peft_tensors(config["model"]["family"], shapes, stacked)
    targets = sorted({t.name.split(".")[-3] for t in tensors})  # q_proj, ... (the HF module names)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    fill(create_safetensors(tmp / "adapter_model.safetensors", tensors, dtype), tensors, blocks_of, dtype)
    depth = {path.split("/")[0]: shape[0] for path, shape in shapes.items() if path.split("/")[0] in stacked}
    modules = module_names(config["model"]["family"], settings or {}, stacked, depth)
    (tmp / "adapter_config.json").write_text(json.dumps(peft_config(config, targets, modules), indent=2))
    tmp.rename(out)
    return sum(f.stat().st_size for f in out.iterdir()), len(tensors)



def write(job) -> tuple[int, int]:
    """`zerojax export --format peft` (`zerojax.checkpoints.peft`): `save_peft` of an `ExportJob`."""
    return save_peft(job.out, job.config, job.shapes, job.stacked(), job.blocks_of, dtype=job.dtype, settings=job.lora())