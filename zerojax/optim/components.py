"""Which parameters a key names: path patterns, or a model's named components.

`optim.freeze`, `optim.lora.targets` take glob patterns over parameter paths (`vision*`,
`layers/vlm/*`). A model may also name its parts, so that a fine-tuning recipe is one word: a
class attribute `COMPONENTS = {"vision": ("vision", "vision_embeddings", ...), ...}`, each name
standing for patterns as `optim.freeze` reads them (a path, or a part whose whole subtree it
covers). PaliGemma names `vision` and `decoder`; π0 names `vision`, `language`, `vlm`, `expert`
and `action` (`models/paligemma_expert/model.py` `components`). A written entry that is a component's name is that component;
any other entry is a pattern, as before. LoRA on a component adapts every `nnx.Linear` kernel under
it, unless the model's `LORA_KERNELS` names the kernel globs a component's LoRA adapts (π0.5: the
expert's attention and MLP projections, not its adaptive norms' dense layers, as openpi's LoRA).
"""

from __future__ import annotations


def components_of(model) -> dict[str, tuple[str, ...]]:
    """The model's named components (none for a model that declares no COMPONENTS)."""
    return dict(getattr(type(model), "COMPONENTS", {}))


def expand(entry: str, components: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The path patterns one written entry stands for."""
    return tuple(components[entry]) if entry in components else (entry,)


def expand_all(entries: tuple[str, ...], components: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    return tuple(p for entry in entries for p in expand(entry, components))


def lora_kernels_of(model) -> dict[str, tuple[str, ...]]:
    """The kernel globs LoRA on a component adapts, where not every kernel under it (`LORA_KERNELS`)."""
    return dict(getattr(type(model), "LORA_KERNELS", {}))


def kernel_globs(entry: str, components: dict[str, tuple[str, ...]],
                 lora_kernels: dict[str, tuple[str, ...]] | None = None) -> tuple[str, ...]:
    """The kernel globs of an `optim.lora.targets` entry: a component's kernels (those its
    `LORA_KERNELS` entry names, else every `nnx.Linear` kernel under its patterns), or the entry
    itself, a glob over kernel paths."""
    if entry not in components:
        return (entry,)
    if lora_kernels and entry in lora_kernels:
        return tuple(lora_kernels[entry])
    return tuple(p.rstrip("/") + "/*kernel" for p in components[entry])


def names_hint(components: dict[str, tuple[str, ...]]) -> str:
    """A clause for error messages: the components a model names, if any."""
    return f" or one of the model's components ({', '.join(sorted(components))})" if components else ""
