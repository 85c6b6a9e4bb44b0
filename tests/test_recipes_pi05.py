"""π0.5's fine-tuning recipes (`model.family=pi05`): π0's component keys (`tests/test_recipes.py`)
on π0.5, whose time conditions the expert through adaptive norms. The π0.5-specific risk is
where the adaRMS projections (`layers/expert/*_layernorm/dense`, `expert_norm/dense`) and the
time MLP (`time_mlp_in`, `time_mlp_out`) land: each recipe's frozen set is written here from
LeRobot 0.6.1's `PI05Pytorch._set_requires_grad` (`freeze_vision_encoder`: the SigLIP tower;
`train_expert_only`: all of `self.paligemma`, the expert's adaRMS and the time MLP trained) and
openpi's `Pi0Config.get_freeze_filter` (`.*llm.*` and `.*llm.*_1.*`, the adapters `.*lora.*`
excepted: the expert's adaptive norms are `llm/.../pre_attention_norm_1/Dense_0`, so frozen with
gemma_300m_lora), and the adapted kernels from openpi's `lora.Einsum` (attn) and
`lora.FeedForward` (ffn): the attention and MLP projections, not the norms' dense layers."""

import json

import jax
import numpy as np
import pytest

import test_pi05
import test_pi05_export
from conftest import ROOT, run
from test_recipes import frozen_and_trained, leaves, moments_of, under
from zerojax import cli, config, data, train
from zerojax.analysis import measure
from zerojax.optim.lora import is_adapter
from zerojax.train import state as state_lib
from zerojax.train import step as step_lib

TINY = test_pi05.TINY + ["optim.schedule=constant", "train.steps=3"]
TOWER = ("vision", "vision_embeddings", "vision_post_layernorm")
PALIGEMMA = (*TOWER, "multi_modal_projector", "embed_tokens", "norm", "layers/vlm")  # LeRobot's self.paligemma
LLM = ("embed_tokens", "norm", "layers/vlm", "layers/expert", "expert_norm")  # openpi's llm: both Gemmas
ADARMS = ("layers/expert/input_layernorm/dense", "layers/expert/post_attention_layernorm/dense", "expert_norm/dense")
HEADS = ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")
# openpi's low-memory recipe with its two ranks (gemma_2b_lora rank 16 alpha 16, gemma_300m_lora
# rank 32 alpha 32; openpi has no π0.5 LoRA config): here 4 and 8 on the tiny π0.5.
TWO_RANKS = ["optim.lora.rank=4", "optim.lora.alpha=4", "optim.lora.targets=language,expert", "optim.lora.base=targets",
             "optim.lora.rank_pattern=expert:8", "optim.lora.alpha_pattern=expert:8"]
OPENPI = ["optim.lora.rank=16", "optim.lora.alpha=16", "optim.lora.targets=language,expert", "optim.lora.base=targets",
          "optim.lora.rank_pattern=expert:32", "optim.lora.alpha_pattern=expert:32"]
ONE_DEVICE = ["mesh.data=1", "zero.stage=0", "zero.schedule=gspmd"]


def adapted(paths):
    return {p.rsplit("/", 1)[0] for p in paths if is_adapter(p)}


@pytest.mark.parametrize("recipe, frozen_of", [
    (["optim.freeze=vision"], lambda paths: under(paths, *TOWER)),  # LeRobot's freeze_vision_encoder
    (["optim.freeze=vlm"], lambda paths: under(paths, *PALIGEMMA)),  # LeRobot's train_expert_only
    # openpi's gemma_2b_lora alone: the VLM's Gemma frozen, the expert (its adaptive norms) trained
    (["optim.lora.rank=4", "optim.lora.targets=language", "optim.lora.base=targets"],
     lambda paths: under(paths, "embed_tokens", "norm", "layers/vlm") - {p for p in paths if is_adapter(p)}),
    # openpi's gemma_2b_lora + gemma_300m_lora: all of llm frozen but the adapters, adaRMS included
    (TWO_RANKS, lambda paths: under(paths, *LLM) - {p for p in paths if is_adapter(p)}),
], ids=["freeze=vision", "freeze=vlm", "lora language", "two ranks"])
def test_each_pi05_recipe_freezes_what_it_says(recipe, frozen_of):
    frozen, trained = frozen_and_trained(TINY + recipe)
    assert frozen == frozen_of(frozen | trained) and frozen and trained
    assert under(trained, *HEADS) == under(frozen | trained, *HEADS)  # the time MLP trains in every recipe
    adaptive = under(frozen | trained, *ADARMS)
    assert len(adaptive) == 6  # kernel and bias of the three adaptive norms' dense layers
    assert adaptive <= (frozen if "optim.lora.rank_pattern=expert:8" in recipe else trained)


def test_lora_adapts_openpis_projections_not_the_adaptive_norms():
    frozen, trained = frozen_and_trained(TINY + TWO_RANKS)
    want = {f"layers/{half}/{p}" for half in ("vlm", "expert") for p in PROJECTIONS}
    assert adapted(trained) == want  # openpi's lora.Einsum and lora.FeedForward, nothing else
    assert not adapted(frozen)


def test_two_ranks_give_the_hand_counted_trainables_on_the_tiny_pi05():
    # By hand, r·(in + out) per projection, 2 layers: the VLM (width 32, 2 heads of 8, 1 kv head,
    # MLP 32) at rank 4, the expert (width 16, MLP 32) at rank 8; no adapter on the adaRMS dense.
    vlm = (32 + 16) + (32 + 8) + (32 + 8) + (16 + 32) + 3 * (32 + 32)
    expert = (16 + 16) + (16 + 8) + (16 + 8) + (16 + 16) + 3 * (16 + 32)
    _, trained = measure.param_counts(config.load(overrides=TINY + TWO_RANKS))
    _, rest = measure.param_counts(config.load(overrides=TINY + ["optim.freeze=language,expert"]))
    assert trained - rest == 2 * (4 * vlm + 8 * expert) == 7040


def test_memory_counts_openpi_s_two_ranks_on_the_full_size_pi05(capsys):
    def trainable(*overrides):
        assert cli.main(["memory", "--config", str(ROOT / "configs" / "pi05.yaml"), "--devices", "8", "--json",
                         *overrides]) == 0
        return json.loads(capsys.readouterr().out)["trainable"]

    # By hand from Gemma 2B (width 2048, 8 heads and 1 kv head of 256, MLP 16384) at rank 16 and
    # gemma_300m (width 1024, the same heads, MLP 4096) at rank 32, 18 layers each: π0's count,
    # since the adaptive norms' dense layers take no adapter.
    vlm = (2048 + 2048) + 2 * (2048 + 256) + (2048 + 2048) + 3 * (2048 + 16384)
    expert = (1024 + 2048) + 2 * (1024 + 256) + (2048 + 1024) + 3 * (1024 + 4096)
    assert trainable(*OPENPI) - trainable("optim.freeze=language,expert") == 18 * (16 * vlm + 32 * expert) == 33_472_512


# ---------------------------------------------------------------------------------------------
# The two-rank recipe with optim.ema and train.grad_accum=2 on 8 devices at stage 3, fine-tuning
# LeRobot 0.6.1's tiny π0.5 (tests/fixtures/lerobot06/pi05, its adaRMS projections random) on the
# dataset LeRobot wrote. Not a random init: there (zerojax's, as openpi's `kernel_init=zeros`) the
# adaRMS projections are zero, so every expert residual's gate is 0, the expert passes its input
# through, and only action_in_proj and action_out_proj get a gradient; with the projections frozen,
# as this recipe freezes them, they would stay so. The recipe is for a pretrained π0.5.
# Ranks 2 and 4 (the fixture's k_proj is [16, 4] in the expert).

FINETUNE = [x for x in test_pi05_export.OVERRIDES if not x.startswith(("zero.stage", "mesh.data", "train.steps",
                                                                      "train.ckpt_every", "train.global_batch"))]
FINETUNE += [f"model.init_from={test_pi05_export.FIXTURE / 'pi05'}", "optim.schedule=constant", "train.steps=3",
             "train.ckpt_every=0", "train.global_batch=16"]
FIXTURE_RANKS = ["optim.lora.rank=2", "optim.lora.alpha=2", "optim.lora.targets=language,expert",
                 "optim.lora.base=targets", "optim.lora.rank_pattern=expert:4", "optim.lora.alpha_pattern=expert:4"]


def steps_by_hand(overrides, out):
    """3 steps of the two-rank recipe with optim.ema=0.9: the start, the losses, the trained
    masters after each step (the EMA's start first), the final state and the plan."""
    cfg = config.load(overrides=FINETUNE + FIXTURE_RANKS + ["optim.ema=0.9", f"train.out_dir={out}"] + overrides)
    setup = train.prepare(cfg)
    engine = setup.engine
    abstract = state_lib.init_state(engine, abstract=True)
    state = train.start_state(setup, None, abstract, state_lib.state_shardings(engine, abstract))
    start, plan = leaves(state.params, engine.plan), engine.plan
    masters, losses, step = [leaves(state.ema, plan)], [], step_lib.make_train_step(engine, abstract)
    for i in range(3):
        state, metrics = step(state, train.global_batch(setup, data.TRAIN, i))
        losses.append(float(metrics["loss"]))
        masters.append({p: x for p, x in leaves(state.params, plan).items() if p in masters[0]})
    return start, np.array(losses), masters, state, plan


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    return steps_by_hand(["zero.stage=3", "zero.schedule=shard_map", "mesh.data=8", "train.grad_accum=2"],
                         tmp_path_factory.mktemp("eight"))


@pytest.mark.slow
def test_the_two_rank_recipe_with_ema_and_grad_accum_on_8_devices_gives_one_devices_losses(eight, tmp_path):
    one, _ = run(FINETUNE + FIXTURE_RANKS + ONE_DEVICE + [f"train.out_dir={tmp_path}"])
    np.testing.assert_allclose(eight[1], one, rtol=1e-5)
    assert len(one) == 3 and len(set(one)) == 3  # three steps that move the loss


@pytest.mark.slow
def test_the_two_rank_recipe_trains_what_it_says_and_its_ema_is_by_hand(eight):
    start, _, masters, state, plan = eight
    end = leaves(state.params, plan)
    frozen = {leaf.path for leaf in jax.tree.leaves(plan.leaves) if leaf.frozen}
    assert frozen == under(end, *LLM) - {p for p in end if is_adapter(p)} and under(end, *ADARMS) <= frozen
    for p in frozen:  # the adaRMS projections among them: bit for bit as they started
        np.testing.assert_array_equal(end[p].view(np.uint16), start[p].view(np.uint16), err_msg=p)
    for p in ("layers/vlm/q_proj/lora_b", "layers/expert/mlp/down_proj/lora_b", "vision/mlp/fc1/kernel",
              "multi_modal_projector/kernel", "action_out_proj/kernel", "time_mlp_in/kernel"):
        assert np.abs(end[p] - start[p]).max() > 0, p  # trained beside the adapters
    assert moments_of(state.opt_state, end) == set(end) - frozen
    for x, leaf in zip(jax.tree.leaves(state.ema), jax.tree.leaves(plan.trained_leaves)):
        assert x.sharding.spec == leaf.spec(True)  # laid out as its master
    ema, got = dict(masters[0]), leaves(state.ema, plan)
    for master in masters[1:]:
        ema = {p: np.float32(0.9) * ema[p] + np.float32(0.1) * master[p] for p in ema}
    assert got.keys() == set(end) - frozen
    for p in got:
        np.testing.assert_allclose(got[p], ema[p], rtol=1e-6, atol=1e-7, err_msg=p)
