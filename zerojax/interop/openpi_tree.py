"""An openpi `params/` tree seen as zerojax's leaves (`TreeCheckpoint`), through its family's
`OpenpiLayout` rules: what `interop.hf.init_checkpoint` reads for `model.init_from` of an openpi
checkpoint directory (`interop.openpi`'s module docstring)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from zerojax.config.openpi_dir import PARAMS, family_of, flat_tree, orbax_tree, tree_shapes
from zerojax.errors import ConfigError
from zerojax.models import registry


class TreeCheckpoint:
    """An openpi params/ tree seen as zerojax's leaves, through its family's rules (the reading
    side of `interop.safetensors.Checkpoint`'s interface): the shapes from orbax's metadata
    (jax.eval_shape of each rule), the tree read whole on the first `read`."""

    def __init__(self, directory: str, family: str):
        import jax

        self.directory, where = directory, f"model.init_from={directory}"
        self.openpi_shapes = tree_shapes(directory)
        family_of(self.openpi_shapes, where, family)
        layout = registry.openpi_layouts()[family]
        self.rules = layout.rules(layout.model_keys(self.openpi_shapes, where, {}))
        used = {name for rule in self.rules for name in rule.openpi}
        missing = sorted(used - set(self.openpi_shapes))
        if missing:
            raise ConfigError(f"{where}: no leaf {missing[0]!r} in {PARAMS}/, which the {family} model needs")
        extra = sorted(set(self.openpi_shapes) - used)
        if extra:
            raise ConfigError(f"{where}: {PARAMS}/ holds {len(extra)} leaves the {family} model has no place for "
                              f"(e.g. {extra[0]!r}; LoRA adapters of an openpi *_lora config?); zerojax reads none of "
                              "a tree it cannot read all of")
        self.shapes, self._arrays = {}, None
        for rule in self.rules:
            specs = [jax.ShapeDtypeStruct(self.openpi_shapes[n], np.float32) for n in rule.openpi]
            out = jax.eval_shape(lambda *a, rule=rule: rule.from_openpi(jax.numpy, *a), *specs)
            self.shapes.update({path: tuple(o.shape) for path, o in zip(rule.zerojax, out)})

    def resolve(self, name: str) -> str | None:
        return name if name in self.shapes else None

    def read(self, name: str, index: tuple) -> np.ndarray:
        """The fp32 slice `index` of zerojax leaf `name` (the whole tree converted on the first call)."""
        if self._arrays is None:
            self._arrays = self._convert()
        return self._arrays[name][index]

    def _convert(self) -> dict:
        tree = read_tree(self.directory)
        out = {}
        for rule in self.rules:
            values = rule.from_openpi(np, *[tree.pop(n) for n in rule.openpi])
            out.update({path: np.ascontiguousarray(v, np.float32) for path, v in zip(rule.zerojax, values)})
        return out


def read_tree(directory) -> dict:
    """openpi path -> float32 numpy array of DIR/params, read whole (bf16 leaves widened)."""
    import jax
    import orbax.checkpoint as ocp

    params = Path(directory).absolute() / PARAMS  # orbax takes absolute paths only
    tree = orbax_tree(params)
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    with ocp.PyTreeCheckpointer() as ckptr:
        try:
            restored = ckptr.restore(params, ocp.args.PyTreeRestore(item=tree, restore_args=args))
        except (ValueError, OSError) as err:  # tensorstore: a data file cut short or missing
            said = str(err).splitlines()[0][:240] if str(err) else type(err).__name__
            raise ConfigError(f"{params}: orbax cannot read its arrays ({said}); the checkpoint was cut short "
                              "or changed after it was written: copy its params/ again, whole") from None
    return {k: np.asarray(v, np.float32) for k, v in flat_tree(restored).items()}
