"""The run configuration (docs/design.md §5): typed sections, YAML and KEY=VALUE loading, and the
rules between keys. Importing it imports no jax.

    sections.py   one frozen dataclass per YAML section, each checking itself
    data.py       the data section: data.* (DataConfig, the augmentation's sub-sections), the kinds of data.source
    rules.py      the enumerations (the CLI's choices) and every rule between keys, once
    normalization.py  LeRobot's normalization modes, and each one's spelling on each side
    load.py       defaults <- YAML <- KEY=VALUE, with suggestions for unknown keys
    values.py     parsing a YAML or command-line value to a field's type
    hf_config.py  a checkpoint's model keys (a Hugging Face or LeRobot config.json, an openpi tree), through
                  its format's record (`zerojax.checkpoints`) and the family's layout
    openpi_dir.py an openpi checkpoint directory (params/, assets/): its tree's shapes, statistics, family
    policy_keys.py  the run keys a policy's model and checkpoint set (shapes, normalization, tokenizer, optimizer)
    devices.py    device kinds (peak FLOP/s, memory, bandwidths) for `zerojax plan` and MFU; sizes

The package names the sections, loading and the config.json readers; the enumerations are
`rules.NAME` (`from zerojax.config import rules`).
"""

from zerojax.config.hf_config import hf_model_keys, read_json_object
from zerojax.config.load import dump, file_in_the_way, load, load_with_origins, to_dict
from zerojax.config.rules import EXPORT_WEIGHTS
from zerojax.config.data import DataConfig
from zerojax.config.sections import (Config, LoraConfig, MeshConfig, ModelConfig, OptimConfig,
                                     PrecisionConfig, SharedModelConfig, TrainConfig, VisionConfig, ZeroConfig)
from zerojax.config.values import coerce
from zerojax.errors import ConfigError

__all__ = ["EXPORT_WEIGHTS", "Config", "ConfigError", "DataConfig", "LoraConfig", "MeshConfig",
           "ModelConfig", "OptimConfig", "PrecisionConfig", "SharedModelConfig", "TrainConfig", "VisionConfig",
           "ZeroConfig", "coerce", "dump", "file_in_the_way", "hf_model_keys", "load", "load_with_origins",
           "read_json_object", "to_dict"]
