"""An openpi checkpoint directory: `params/`, an orbax tree (the family whose `OpenpiLayout` heads
it has reads it), beside `assets/<asset_id>/norm_stats.json`, and no config.json. `zerojax serve`
takes one that `zerojax export --format openpi` wrote (its zerojax.json holds the run's config,
features and tokenizer: `serve.loaders.openpi_policy`)."""

from __future__ import annotations

from pathlib import Path

from zerojax.checkpoints.format import MERGED, CheckpointFormat

PARAMS, ASSETS = "params", "assets"


def detect(path: Path) -> bool:
    """A directory meant as an openpi checkpoint: no config.json, and params/ or assets/."""
    return path.is_dir() and not (path / "config.json").exists() and (
        (path / PARAMS).exists() or (path / ASSETS).is_dir())


FORMAT = CheckpointFormat(
    name="openpi", what="an openpi checkpoint directory (params/ and assets/)", detect=detect,
    model_keys="zerojax.config.hf_config:openpi_model_keys", run_keys="zerojax.config.policy_keys:openpi_keys",
    read="zerojax.interop.openpi:read_checkpoint",
    keep="zerojax.interop.openpi:init_files", write="zerojax.interop.openpi:write", adapters=MERGED,
    serve="zerojax.serve.loaders:openpi_policy")
