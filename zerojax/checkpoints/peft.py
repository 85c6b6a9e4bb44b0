"""A PEFT adapter directory (`PeftModel.save_pretrained`: adapter_config.json and
adapter_model.safetensors): LoRA adapters alone, for `optim.lora.init_from`, never a model to
start from, and what `zerojax export --format peft` writes of a LoRA run."""

from __future__ import annotations

from pathlib import Path

from zerojax.checkpoints.format import ONLY, CheckpointFormat

ADAPTER_CONFIG = "adapter_config.json"


def detect(path: Path) -> bool:
    """A directory of adapters: adapter_config.json and no model's config.json."""
    return path.is_dir() and (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").exists()


FORMAT = CheckpointFormat(
    name="peft", what="a PEFT adapter directory (adapter_config.json; for optim.lora.init_from)", detect=detect,
    write="zerojax.interop.peft:write", adapters=ONLY)
