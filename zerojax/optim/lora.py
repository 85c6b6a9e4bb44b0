"""LoRA: low-rank adapters on the `nnx.Linear` layers of any model, over a frozen base.

`optim.lora.targets` are glob patterns over kernel paths (`layers/self_attn/q_proj/kernel`). Each
targeted `nnx.Linear` keeps its kernel where it was and gains two parameters beside it, as PEFT
defines them (Hu et al. 2021):

    y = x·W + (alpha / rank) · (x·A)·B        A [in, r] ~ U(±1/sqrt(in)),  B [r, out] = 0

so a new adapter leaves the model's output unchanged. Each kernel's rank and alpha are
optim.lora.rank and alpha, or what `rank_pattern` / `alpha_pattern` give the entry naming it
(PEFT's keys of those names; openpi's low-memory recipe: 16 on `language`, 32 on `expert`). A and B live at `<layer>/lora_a` and
`<layer>/lora_b`; on a stacked layer they carry the stack's layer axis like the kernel, so they
travel with its unit. The base is frozen (no master, no optimizer state, no gradient): all of it
(`optim.lora.base=all`, PEFT's way), or only what the targets adapt (`targets`, openpi's way:
the adapted kernels, and every leaf of a component named in the targets), the rest trained
beside the adapters. A target is a glob over kernel paths or a component the model names
(`optim.components`: `decoder`, `language`, `expert`). PEFT stores A transposed (`lora_A.weight` [r, in]) and B too
(`lora_B.weight` [out, r]); `zerojax export --format peft` writes them so.

The layer is changed in place into a subclass of its own class that adds the adapter's term to
the class's own `__call__`, so whatever the layer did (dtype, precision, bias) it still does.
"""

from __future__ import annotations

import fnmatch
import math
import jax
import jax.numpy as jnp
from flax import nnx
from zerojax.errors import ConfigError
from zerojax.config import LoraConfig
from zerojax.optim.adamw import is_frozen
from zerojax.optim.components import components_of, expand_all, kernel_globs, lora_kernels_of, names_hint
from zerojax.parallel.trees import path_name


ADAPTERS = ("lora_a", "lora_b")


_SUBCLASSES: dict[type, type] = {}


def _with_adapter(cls: type) -> type:
    """The LoRA subclass of a layer class: its own `__call__` plus the adapter's term. One per
    class (so graphdefs compare equal), with the class as its only base and no slots of its
    own, so that an existing layer's class can be swapped for it."""
    if cls not in _SUBCLASSES:

        def __call__(self, x, *args, **kwargs):
            y = cls.__call__(self, x, *args, **kwargs)
            a, b = self.lora_a[...].astype(y.dtype), self.lora_b[...].astype(y.dtype)
            return y + (self.lora_scale * ((x.astype(y.dtype) @ a) @ b)).astype(y.dtype)

        _SUBCLASSES[cls] = type(cls)(f"LoRA{cls.__name__}", (cls,),
                                     {"__call__": __call__, "__module__": __name__, "__slots__": ()})
    return _SUBCLASSES[cls]


def is_adapter(path: str) -> bool:
    return path.rsplit("/", 1)[-1] in ADAPTERS


def kernel_paths(model) -> list[str]:
    """Paths of every parameter of `model` (for error messages)."""
    return [path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))]


def targets_of(model, cfg: LoraConfig) -> list[tuple[str, nnx.Module]]:
    """(kernel path, layer) of every nnx.Linear whose kernel a target matches: a glob over kernel
    paths, or a component the model names (`optim.components`: every kernel under it)."""
    components, adapted = components_of(model), lora_kernels_of(model)
    globs = {entry: kernel_globs(entry, components, adapted) for entry in cfg.targets}
    found, matched = [], set()
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Linear):
            continue
        kernel = "/".join(str(k) for k in path) + "/kernel"
        hits = [entry for entry, patterns in globs.items() if any(fnmatch.fnmatchcase(kernel, p) for p in patterns)]
        if hits:
            found.append((kernel, node))
            matched.update(hits)
    unmatched = [p for p in cfg.targets if p not in matched]
    if unmatched:
        kernels = [p for p in kernel_paths(model) if p.endswith("kernel")]
        raise ConfigError(f"optim.lora.targets pattern {unmatched[0]!r} matches no nnx.Linear kernel; the model's "
                          f"kernels look like {', '.join(kernels[:4]) or '(none)'}; give a glob over them"
                          f"{names_hint(components)}")
    return found


def settings(model, cfg: LoraConfig) -> dict[str, tuple[int, float]]:
    """(rank, alpha) of every targeted kernel, as PEFT's rank_pattern and alpha_pattern give
    them: the value of the pattern entry that names the kernel (a glob over kernel paths, or a
    component: every kernel under it), optim.lora.rank / alpha where none does. An entry that
    names no targeted kernel, and a kernel two entries give different values, are bad input."""
    components, found = components_of(model), [kernel for kernel, _ in targets_of(model, cfg)]
    out = {kernel: [cfg.rank, cfg.alpha] for kernel in found}
    for key, slot in (("rank_pattern", 0), ("alpha_pattern", 1)):
        given: dict[str, str] = {}
        for entry, value in getattr(cfg, key):
            globs = kernel_globs(entry, components, lora_kernels_of(model))
            hits = [k for k in found if any(fnmatch.fnmatchcase(k, g) for g in globs)]
            if not hits:
                raise ConfigError(f"optim.lora.{key} entry {entry!r} names none of the kernels optim.lora.targets "
                                  f"adapts ({', '.join(found[:3])}, ...); give a glob over them"
                                  f"{names_hint(components)}")
            for kernel in hits:
                if kernel in given and out[kernel][slot] != value:
                    raise ConfigError(f"optim.lora.{key}: {kernel} is named by {given[kernel]!r} "
                                      f"({out[kernel][slot]}) and by {entry!r} ({value}); make the entries disjoint")
                given[kernel], out[kernel][slot] = entry, value
    return {kernel: (int(rank), float(alpha)) for kernel, (rank, alpha) in out.items()}


def attach(model, cfg: LoraConfig, stacked: tuple[str, ...], rngs: nnx.Rngs):
    """Give every targeted layer of `model` an adapter of its rank and alpha (`settings`), in
    place."""
    if cfg.rank <= 0:
        raise ConfigError(f"optim.lora.rank={cfg.rank} is not valid; it must be >= 1")
    ranks = settings(model, cfg)
    for kernel, layer in targets_of(model, cfg):
        shape = tuple(layer.kernel[...].shape)
        lead, (d_in, d_out) = shape[:-2], shape[-2:]
        rank, alpha = ranks[kernel]
        key = f"optim.lora.rank={rank}" if rank == cfg.rank else f"optim.lora.rank_pattern's rank {rank}"
        if len(shape) != 2 + (kernel.split("/")[0] in stacked):
            raise ConfigError(f"optim.lora.targets: {kernel} has shape {list(shape)}, not a [in, out] kernel")
        if rank > min(d_in, d_out):
            raise ConfigError(f"{key} is larger than {kernel}'s smaller dim "
                              f"({min(d_in, d_out)} of {list(shape)}); choose rank <= {min(d_in, d_out)}")
        bound = 1 / math.sqrt(d_in)  # PEFT: kaiming_uniform_(a=sqrt(5)) on lora_A [r, in]
        param_dtype = layer.kernel[...].dtype
        layer.__class__ = _with_adapter(type(layer))
        layer.lora_scale = alpha / rank
        layer.lora_a = nnx.Param(jax.random.uniform(rngs.lora(), lead + (d_in, rank), param_dtype, -bound, bound))
        layer.lora_b = nnx.Param(jnp.zeros(lead + (rank, d_out), param_dtype))
    return model


def frozen_mask(params, freeze: tuple[str, ...], lora: LoraConfig | None, components=None):
    """Leaves not trained: those `optim.freeze` names (patterns or components), and with LoRA its
    base. `optim.lora.base=all` (PEFT's way): every leaf but the adapters. `targets` (openpi's):
    the base of what the targets name, the adapted kernels and every leaf of a component named
    in the targets; the rest of the model trains beside the adapters."""
    components = components or {}
    frozen_patterns = expand_all(freeze, components)
    on = lora is not None and lora.rank > 0
    base_patterns = () if not on else expand_all(tuple(t for t in lora.targets if t in components), components)
    kernels = () if not on else tuple(t for t in lora.targets if t not in components)

    def in_base(name: str) -> bool:
        if not on or is_adapter(name):
            return False
        return lora.base == "all" or is_frozen(name, base_patterns) or any(fnmatch.fnmatchcase(name, k) for k in kernels)

    def frozen(path, _):
        name = path_name(path)
        return is_frozen(name, frozen_patterns) or in_base(name)

    return jax.tree_util.tree_map_with_path(frozen, params)
