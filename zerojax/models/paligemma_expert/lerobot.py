"""PaliGemma with an action expert in LeRobot's checkpoints (`PaliGemmaWithExpertModel`:
`model.paligemma_with_expert.…`), as LeRobot 0.6 (with transformers 5) and 0.3 (with transformers
4.5x) write π0 and π0.5: the tensor names both families share, the model keys their shapes
imply, and the processor steps LeRobot 0.6.1 makes for them. `pi0.lerobot` and `pi05.lerobot`
add their expert's norms and heads.

The prompt's embedding table: LeRobot 0.6 saves the VLM's `embed_tokens` and its `lm_head`
untied, and reads only `embed_tokens` (a LeRobot 0.6 fine-tune moves it and leaves `lm_head`);
LeRobot 0.3 saved the two tied, as `lm_head` alone. zerojax reads `embed_tokens` where the file
has it, else `lm_head` (`EMBED_ALIASES`), and writes both from its one table. The expert's
`lm_head` (random, never used: the policy predicts velocities, not tokens) is written back as
LeRobot expects it (`unused`).
"""

from __future__ import annotations

from typing import Callable

from zerojax.errors import ConfigError
from zerojax.models import decoder, siglip
from zerojax.models.family import LeRobotLayout, Tensor
from zerojax.models.vla import lerobot

ROOT = "model.paligemma_with_expert."
VLM = ROOT + "paligemma.model."
TOWER = VLM + "vision_tower.vision_model."
VLM_LAYER = VLM + "language_model.layers.{i}."
EXPERT_LAYER = ROOT + "gemma_expert.model.layers.{i}."
EXPERT_NORM = ROOT + "gemma_expert.model.norm"
EMBED, LM_HEAD = VLM + "language_model.embed_tokens.weight", ROOT + "paligemma.lm_head.weight"
EXPERT_LM_HEAD = ROOT + "gemma_expert.lm_head.weight"  # random in LeRobot, never used
EMBED_ALIASES = {EMBED: LM_HEAD}  # 0.6's embed_tokens -> where 0.3 keeps it (tied)
SO400M_HEADS = 16  # SigLIP So400m/14, the tower of every published π0 and π0.5: its head count is in no shape

PALIGEMMA_TENSORS = {  # the tower, projector, embedding, final norm and the VLM's half of each joint layer
    **siglip.hf_tensors("vision", "vision_embeddings", "vision_post_layernorm", TOWER),
    "multi_modal_projector/kernel": Tensor(VLM + "multi_modal_projector.linear.weight", True),
    "multi_modal_projector/bias": Tensor(VLM + "multi_modal_projector.linear.bias"),
    "embed_tokens/embedding": Tensor(EMBED),
    "norm/scale": Tensor(VLM + "language_model.norm.weight"),
    **decoder.hf_tensors("layers/vlm", VLM_LAYER, nested=False),
}


def expert_tensors(norms: bool) -> dict[str, Tensor]:
    """The expert's half of each joint layer: its projections and MLP, and its norms' scales
    where they have one (an adaptive norm has its dense layer instead)."""
    return decoder.hf_tensors("layers/expert", EXPERT_LAYER, nested=False, norms=norms)


def unused(model: dict) -> dict:
    """The expert's lm_head LeRobot's model holds and zerojax's does not use: {name: shape}."""
    return {EXPERT_LM_HEAD: (model["vocab_size"], model["expert"]["d_model"])}


def model_keys(config: dict, shapes: dict, where: str, given: dict, family: str, name: str,
               expert_width: Callable[[Callable[[str], tuple]], int]) -> dict:
    """The model.* keys of a LeRobot π0 or π0.5 checkpoint, from its config.json and its tensors'
    shapes (LeRobot's config.json does not name the sizes: it fixes them at gemma_2b and
    gemma_300m). The experts have one key/value head, so the head dim is k_proj's rows and the
    query heads q_proj's rows over it; `expert_width(shape)` reads the expert's width from its
    norms. The tower's head count: the user's model.vision.n_heads, else So400m's. `family`: the
    model.family; `name`: the family's name in messages."""
    shape = lerobot.shape_reader(shapes, where, name)
    vlm, expert = VLM_LAYER.format(i=0), EXPERT_LAYER.format(i=0)
    vocab, width = shape(EMBED if EMBED in shapes else LM_HEAD)
    head_dim, kv_rows = shape(vlm + "self_attn.k_proj.weight")[0], shape(expert + "self_attn.k_proj.weight")[0]
    layers = lerobot.depth(shapes, VLM + "language_model.layers.")
    expert_layers = lerobot.depth(shapes, ROOT + "gemma_expert.model.layers.")
    heads = shape(vlm + "self_attn.q_proj.weight")[0] // head_dim
    expert_heads = shape(expert + "self_attn.q_proj.weight")[0] // kv_rows
    if (layers, heads, head_dim) != (expert_layers, expert_heads, kv_rows):
        raise ConfigError(f"{where}: the experts differ in depth, heads or head_dim (VLM {layers} layers, {heads} "
                          f"heads of {head_dim}; expert {expert_layers} layers, {expert_heads} heads of {kv_rows}); "
                          f"{name}'s joint layers need them equal")
    vision = lerobot.tower_keys(shapes, shape, TOWER)
    return {
        "family": family, "vocab_size": vocab, "d_model": width, "n_layers": layers, "n_heads": heads,
        "n_kv_heads": 1, "head_dim": head_dim, "d_ff": shape(vlm + "mlp.gate_proj.weight")[0], "norm_eps": 1e-6,
        "expert": {"d_model": expert_width(shape), "d_ff": shape(expert + "mlp.gate_proj.weight")[0]},
        "vision": {**vision, "n_heads": int((given.get("vision") or {}).get("n_heads") or SO400M_HEADS)},
        "action": lerobot.action_keys(config, where, name),
    }


def processor_steps(config: dict) -> dict:
    """LeRobot 0.6.1's processor steps for π0 and π0.5 (`make_pi0_pre_post_processors`,
    `make_pi05_pre_post_processors`), by registry name, as policy_preprocessor.json and
    policy_postprocessor.json list them; each family orders its own. The normalizers' features,
    modes and files are filled in by the writer."""
    tokenizer = {"max_length": config["tokenizer_max_length"], "task_key": "task", "padding_side": "right",
                 "padding": "max_length", "truncation": True, "tokenizer_name": "google/paligemma-3b-pt-224"}
    relative = {"enabled": False, "exclude_joints": ["gripper"], "action_names": None}
    steps = [("rename_observations_processor", {"rename_map": {}}), ("to_batch_processor", {}),
             ("pi0_new_line_processor", {}), ("tokenizer_processor", tokenizer),
             ("device_processor", {"device": "cpu", "float_dtype": None}),
             ("relative_actions_processor", relative), ("normalizer_processor", {"eps": 1e-08}),
             ("pi05_prepare_state_tokenizer_processor_step", {}), ("unnormalizer_processor", {"eps": 1e-08}),
             ("absolute_actions_processor", {"enabled": False})]
    return {name: {"registry_name": name, "config": step} for name, step in steps}


def layout(kind: str, tensors: dict, model_keys: Callable, to_config: Callable, pre: tuple[str, ...]) -> LeRobotLayout:
    """π0's or π0.5's `LeRobotLayout`: its type, tensors, model keys and config.json, its
    preprocessor steps in order (`processor_steps`' names), and what both share: the embedding's
    alias, the postprocessor, the expert's unused lm_head."""
    def processors(config: dict) -> tuple[list, list]:
        steps = processor_steps(config)
        post = ("unnormalizer_processor", "absolute_actions_processor", "device_processor")
        return [steps[name] for name in pre], [steps[name] for name in post]

    return LeRobotLayout(type=kind, model_keys=model_keys, tensors=tensors, to_config=to_config,
                         aliases=EMBED_ALIASES, processors=processors, unused=unused)
