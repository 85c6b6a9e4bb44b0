"""A LeRobot policy directory (`PreTrainedPolicy.save_pretrained`): config.json with "type" (the
family whose `LeRobotLayout` declares it reads it) and model.safetensors; 0.3.x keeps the
statistics as buffers in the weights, 0.4+ (0.6) beside them in its processors' files. A fine-tune
from one takes its normalization, tokenizer and optimizer preset (`run_keys`)."""

from __future__ import annotations

from pathlib import Path

from zerojax.checkpoints.format import MERGED, CheckpointFormat, config_json, is_lerobot


def detect(path: Path) -> bool:
    """A directory whose config.json is a LeRobot policy's."""
    config = config_json(path)
    return config is not None and is_lerobot(config)


FORMAT = CheckpointFormat(
    name="lerobot", what="a LeRobot policy directory (config.json with \"type\", model.safetensors)", detect=detect,
    model_keys="zerojax.config.hf_config:lerobot_model_keys", run_keys="zerojax.config.policy_keys:lerobot_keys",
    read="zerojax.interop.lerobot:read_checkpoint", keep="zerojax.interop.lerobot:init_files",
    write="zerojax.interop.lerobot_export:write", adapters=MERGED, serve="zerojax.serve.loaders:lerobot_policy")
