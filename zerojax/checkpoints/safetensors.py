"""zerojax's own export (`zerojax export`, the default format): one safetensors file of zerojax's
parameter paths, the run's config, its data files (lerobot.json) and its tokenizer in the file's
metadata; a file, where every other format is a directory."""

from __future__ import annotations

from pathlib import Path

from zerojax.checkpoints.format import KEPT, CheckpointFormat

FORMAT = CheckpointFormat(
    name="safetensors", what="a zerojax export file (zerojax export --format safetensors)", detect=Path.is_file,
    read="zerojax.interop.hf:read_export", write="zerojax.train.export:write_safetensors", adapters=KEPT,
    serve="zerojax.serve.loaders:export_policy")
