"""A Hugging Face model directory as `model.init_from`: its config.json sets the model's keys."""

from __future__ import annotations

import json
from pathlib import Path
from zerojax.config.sections import ModelConfig
from zerojax.config.values import _field_type, coerce
from zerojax.errors import ConfigError


# A Hugging Face model directory as model.init_from: its config.json sets the model's keys.
HF_ARCHITECTURES = {  # architecture -> (model.family, {model key: config.json key})
    "LlamaForCausalLM": ("llama", {"vocab_size": "vocab_size", "d_model": "hidden_size",
                                   "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                                   "n_kv_heads": "num_key_value_heads", "d_ff": "intermediate_size",
                                   "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
                                   "tie_embeddings": "tie_word_embeddings"}),
    "GPT2LMHeadModel": ("gpt", {"vocab_size": "vocab_size", "d_model": "n_embd", "n_layers": "n_layer",
                                "n_heads": "n_head", "d_ff": "n_inner", "norm_eps": "layer_norm_epsilon",
                                "tie_embeddings": "tie_word_embeddings"}),
}
HF_ARCHITECTURES["MistralForCausalLM"] = HF_ARCHITECTURES["LlamaForCausalLM"]  # same layout (no sliding window)
HF_DEFAULTS = {"n_kv_heads": 0, "rope_theta": 10000.0, "tie_embeddings": None}  # keys a config.json may omit
TIED_BY_DEFAULT = {"llama": False, "gpt": True}  # transformers' LlamaConfig / GPT2Config tie_word_embeddings defaults


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in `path` (ConfigError, naming the file, if it is not one)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} holds a JSON {type(doc).__name__}, not {what} (a JSON object)")
    return doc


def hf_model_keys(directory: str) -> dict:
    """The model.* values a Hugging Face directory's config.json implies (ConfigError if it
    cannot be read or describes a model zerojax does not have)."""
    where = Path(directory) / "config.json"
    if not where.is_file():
        raise ConfigError(f"model.init_from={directory!r} is a directory without config.json; give a Hugging Face "
                          "model directory (config.json and model.safetensors) or a zerojax export file")
    hf = read_json_object(where, "a Hugging Face config")
    archs = hf.get("architectures")
    if not (isinstance(archs, list) and archs and isinstance(archs[0], str)):
        raise ConfigError(f"{where}: architectures={archs!r} is not a list of model classes, e.g. ['LlamaForCausalLM']")
    if archs[0] not in HF_ARCHITECTURES:
        raise ConfigError(f"{where}: architecture {archs[0]!r} is not supported; zerojax reads "
                          f"{', '.join(HF_ARCHITECTURES)}")
    family, keys = HF_ARCHITECTURES[archs[0]]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}  # transformers 5 keeps rope_theta in here
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default":
        kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else rope
        raise ConfigError(f"{where}: rope scaling {kind!r} is not supported by zerojax's {family}")
    hf.setdefault("rope_theta", rope.get("rope_theta", HF_DEFAULTS["rope_theta"]))
    for unsupported in ("sliding_window", "attention_bias", "mlp_bias"):
        if hf.get(unsupported) not in (None, False):
            raise ConfigError(f"{where}: {unsupported}={hf[unsupported]!r} is not supported by zerojax's {family}")
    if family == "gpt" and (hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh")
                            or hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn")):
        raise ConfigError(f"{where}: only GPT-2's own attention and gelu_new (tanh) MLP are supported")
    needed = [hf_key for key, hf_key in keys.items() if key not in HF_DEFAULTS and (family, key) != ("gpt", "d_ff")]
    missing = [hf_key for hf_key in needed + (["n_positions"] if family == "gpt" else []) if hf.get(hf_key) is None]
    if missing:
        raise ConfigError(f"{where} has no {', '.join(missing)}; zerojax needs {'it' if len(missing) == 1 else 'them'} "
                          f"to build the {family} model")
    out = {"family": family}
    for key, hf_key in keys.items():
        value = hf.get(hf_key, TIED_BY_DEFAULT[family] if key == "tie_embeddings" else HF_DEFAULTS.get(key))
        out[key] = 4 * hf["n_embd"] if key == "d_ff" and value is None else value
    if family == "gpt":
        out["seq_len"] = hf["n_positions"]
    try:  # the values must make a model: the same checks as the keys given in YAML
        out = {k: coerce(f"model.{k}", v, _field_type(ModelConfig, k)) for k, v in out.items()}
        model = ModelConfig(**out)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    if family == "llama" and hf.get("head_dim") not in (None, model.d_model // model.n_heads):
        raise ConfigError(f"{where}: head_dim={hf['head_dim']} is not hidden_size / num_attention_heads")
    return out


def _from_hugging_face(tree: dict) -> None:
    """With model.init_from a directory, take the model's keys from its config.json; a key also
    set in the YAML or on the command line must agree with it (model.seq_len may be shorter)."""
    model = tree.get("model", {})
    if not model.get("init_from") or not Path(model["init_from"]).is_dir():
        return
    for key, value in hf_model_keys(model["init_from"]).items():
        given = model.get(key)
        if key == "seq_len" and given is not None and given <= value:
            continue  # a shorter context uses the first rows of the position table
        if given is not None and given != value:
            raise ConfigError(f"model.{key}={given!r} contradicts {model['init_from']}/config.json, which says "
                              f"{value!r}; drop the override (or use another checkpoint)")
        model[key] = value
    tree["model"] = model
