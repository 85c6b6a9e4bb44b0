"""The run configuration (docs/design.md §5): typed sections, YAML and KEY=VALUE loading, and the
rules between keys. Importing it imports no jax.

    sections.py   one frozen dataclass per YAML section, each checking itself
    rules.py      the enumerations (the CLI's choices) and every rule between keys, once
    load.py       defaults <- YAML <- KEY=VALUE, with suggestions for unknown keys
    values.py     parsing a YAML or command-line value to a field's type
    hf_config.py  a Hugging Face config.json as model keys, through the family's layout
    devices.py    device kinds (peak FLOP/s, memory, bandwidths) for `zerojax plan` and MFU; sizes
"""

from zerojax.config.hf_config import hf_model_keys, lerobot_dir, read_json_object  # noqa: F401
from zerojax.config.load import *  # noqa: F401,F403
from zerojax.config.rules import *  # noqa: F401,F403
from zerojax.config.sections import *  # noqa: F401,F403
from zerojax.config.values import coerce  # noqa: F401
from zerojax.errors import ConfigError  # noqa: F401
