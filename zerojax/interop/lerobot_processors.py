"""LeRobot 0.4+'s processor files, written for a `zerojax export --format lerobot` in the 0.6
layout: policy_preprocessor.json and policy_postprocessor.json (the steps LeRobot's
`PolicyProcessorPipeline.from_pretrained` rebuilds), and the normalizer's and unnormalizer's
safetensors of statistics (`feature.stat` -> float32, as `NormalizerProcessorStep.state_dict`
saves them).

The steps are those of the checkpoint the run started from where it kept them
(RUN_DIR/lerobot_init/), else the family's defaults (`LeRobotLayout.processors`); the
normalizers' features and modes are config.json's, their statistics the run's, the tokenizer's
prompt length the model's and its tokenizer the export's own copy of the run's data.tokenizer
(TOKENIZER_DIR, named relatively to the export, so it is served from any directory) where it has
one. Every file is written as a new file of the umask's mode, as the run's own files are.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from zerojax.config.normalization import NormalizationMode
from zerojax.data import corpus
from zerojax.errors import ConfigError

PRE, POST = "policy_preprocessor", "policy_postprocessor"
FILES = (f"{PRE}.json", f"{POST}.json")  # what a run keeps of the checkpoint it started from
NORMALIZERS = {"normalizer_processor": "normalizer_processor", "unnormalizer_processor": "unnormalizer_processor"}
# LeRobot 0.6's relative actions: the preprocessor's step subtracts the state, the postprocessor's adds it back
RELATIVE_STEP, ABSOLUTE_STEP = "relative_actions_processor", "absolute_actions_processor"


def steps_of(kept: dict, default) -> tuple[list, list]:
    """(pre, post) steps: the kept files' ({file name: bytes}), else `default` (the family's)."""
    if all(name in kept for name in FILES):
        return tuple(json.loads(kept[name])["steps"] for name in FILES)
    if default is None:
        raise ConfigError("this family declares no LeRobot processor steps and the run kept none: "
                          "--format lerobot cannot write LeRobot 0.6's processor files")
    return default


def check_stats(config: dict, stats: dict) -> dict:
    """{feature: {stat: float32}}: the statistics config.json's modes need, and any others the
    run has (LeRobot keeps them all); ConfigError naming one that is missing."""
    mapping, out = config.get("normalization_mapping") or {}, {}
    features = {**(config.get("input_features") or {}), **(config.get("output_features") or {})}
    for feature, spec in features.items():
        name = mapping.get(spec.get("type"), NormalizationMode.IDENTITY.value)
        mode = NormalizationMode.of_lerobot(name)
        if mode is None:
            raise ConfigError(f"normalization_mapping {spec.get('type')}={name!r}: LeRobot normalizes with "
                              f"{', '.join(m.value for m in NormalizationMode)}")
        missing = [s for s in mode.stats if s not in stats.get(feature, {})]
        if missing:
            raise ConfigError(f"the run has no normalization statistic {feature}.{'/'.join(missing)} ({name}); train "
                              "on a LeRobot dataset (data.source=lerobot:DIR) or start from a LeRobot checkpoint "
                              "that has its statistics (model.init_from)")
        if feature in stats:
            out[feature] = {s: np.asarray(v, np.float32) for s, v in stats[feature].items()}
    return out


TOKENIZER_DIR = "tokenizer"  # an export's copy of the run's tokenizer, named by its tokenizer step
# what transformers' AutoTokenizer reads of a tokenizer directory, copied where the run's has them
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "chat_template.jinja")


def copy_tokenizer(tokenizer: str, out: Path) -> None:
    """The run's data.tokenizer (a tokenizer.json, or its directory) into directory `out`: its
    tokenizer.json and the files beside it that AutoTokenizer reads (ConfigError if it is gone)."""
    source = corpus.tokenizer_file(tokenizer).parent
    out.mkdir()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            (out / name).write_bytes((source / name).read_bytes())  # a new file: the umask's mode, as the run's


KEEP = "keep"  # `write`'s relative: the steps as the kept files have them (a run on no LeRobot dataset)


def write(out: Path, config: dict, stats: dict, steps: tuple[list, list], tokenizer: str = "",
          relative: dict | str | None = KEEP) -> None:
    """The two pipelines' JSON and their normalizers' statistics into directory `out`; the
    tokenizer step names `tokenizer`, the export's copy of the run's data.tokenizer (TOKENIZER_DIR,
    relative to the export: LeRobot must tokenize the prompt as the model learnt it), where the run
    tokenized with one, else keeps the name it had. The relative and absolute steps are on where
    the run learnt relative actions (`relative`, lerobot.json's record: the excluded joints and the
    action's names), else off, whatever the checkpoint the run started from said (KEEP: as it said)."""
    from safetensors.numpy import save

    flat = {f"{feature}.{stat}": value for feature, values in check_stats(config, stats).items()
            for stat, value in values.items()}
    outputs = config.get("output_features") or {}
    features = {"normalizer_processor": {**(config.get("input_features") or {}), **outputs},
                "unnormalizer_processor": outputs}  # what LeRobot's make_default_policy_processor_steps gives each
    for name, pipeline in zip((PRE, POST), steps):
        written = []
        for i, step in enumerate(pipeline):
            step = {**step, "config": dict(step.get("config") or {})}
            if step["registry_name"] in NORMALIZERS:
                step["config"].update(features=features[step["registry_name"]], norm_map=config.get("normalization_mapping") or {})
                step["state_file"] = f"{name}_step_{i}_{NORMALIZERS[step['registry_name']]}.safetensors"
                # bytes written here, not save_file: safetensors 0.8 makes its files 0600
                (out / step["state_file"]).write_bytes(save(flat))
            elif step["registry_name"] == RELATIVE_STEP and relative != KEEP:
                step["config"]["enabled"] = relative is not None
                if relative:
                    step["config"].update(exclude_joints=relative["exclude_joints"],
                                          action_names=relative["action_names"])
            elif step["registry_name"] == ABSOLUTE_STEP and relative != KEEP:
                step["config"]["enabled"] = relative is not None
            elif step["registry_name"] == "tokenizer_processor":
                step["config"]["max_length"] = config["tokenizer_max_length"]
                if tokenizer:
                    step["config"]["tokenizer_name"] = tokenizer
            written.append(step)
        (out / f"{name}.json").write_text(json.dumps({"name": name, "steps": written}, indent=2))

