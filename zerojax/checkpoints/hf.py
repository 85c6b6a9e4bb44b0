"""A Hugging Face model directory: config.json naming its `architectures` (the family that declares
one reads it), safetensors shards with or without their index, the tokenizer's files."""

from __future__ import annotations

from pathlib import Path

from zerojax.checkpoints.format import MERGED, CheckpointFormat, config_json, is_lerobot


def detect(path: Path) -> bool:
    """A directory whose config.json is a model's, not a LeRobot policy's."""
    config = config_json(path)
    return config is not None and not is_lerobot(config)


FORMAT = CheckpointFormat(
    name="hf", what="a Hugging Face model directory (config.json and model.safetensors)", detect=detect,
    model_keys="zerojax.config.hf_config:hf_dir_model_keys", read="zerojax.interop.hf:read_hf",
    write="zerojax.interop.hf:write", adapters=MERGED)
