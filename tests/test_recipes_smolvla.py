"""SmolVLA's LoRA recipe (`model.family=smolvla`), against what LeRobot 0.6.1 and PEFT adapt
themselves: tests/fixtures/lerobot06/smolvla_lora.json, written by
scripts/fixtures/make_smolvla_lora_fixture.py (`SmolVLAPolicy.wrap_with_peft()` with its default
targets on the tiny fixture: the expert's q and v projections, the state and action projections,
r = 8, lora_alpha = 8). `optim.lora.targets=lerobot_lora` names the same modules; PEFT's way
(`optim.lora.base=all`, the default) freezes everything else.

The recipes that freeze (`optim.freeze=vlm`, `optim.freeze=vision`) are in tests/test_smolvla.py."""

import json
import re

import jax
import numpy as np
import pytest

from conftest import ROOT, run
from test_recipes import frozen_and_trained, leaves, moments_of
from zerojax import config, data, train
from zerojax.analysis import measure
from zerojax.models.smolvla.lerobot import LEROBOT_TENSORS
from zerojax.optim.lora import is_adapter
from zerojax.train import state as state_lib
from zerojax.train import step as step_lib

FIXTURE = ROOT / "tests" / "fixtures" / "lerobot06"
LEROBOT_LORA = ["optim.lora.rank=8", "optim.lora.alpha=8", "optim.lora.targets=lerobot_lora"]
FROM_FIXTURE = [f"model.init_from={FIXTURE / 'smolvla'}", "data.source=pi0_source:build", "train.global_batch=16",
                "train.steps=3", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0",
                "train.ckpt_every=0", "optim.warmup_steps=0", "optim.schedule=constant", "optim.lr=1e-2",
                "zero.min_shard_size=64", "model.remat=none", "precision.frozen=float32"]
ONE_DEVICE = ["mesh.data=1", "zero.stage=0", "zero.schedule=gspmd"]


@pytest.fixture(scope="module")
def peft_fixture():
    return json.loads((FIXTURE / "smolvla_lora.json").read_text())


def lerobot_modules(kernel_paths, units: int) -> set[str]:
    """LeRobot's module names of zerojax kernels (`.../kernel`), through the checkpoint's tensor
    table; a unit-stacked kernel is one module per unit."""
    out = set()
    for path in kernel_paths:
        tensor = LEROBOT_TENSORS[path]
        names = [tensor.at(i) for i in range(units)] if "{i}" in tensor.name else [tensor.name]
        out |= {name.removesuffix(".weight") for name in names}
    return out


@pytest.fixture(scope="module")
def the_fixtures_recipe(monkeypatch_module):
    return frozen_and_trained(FROM_FIXTURE + LEROBOT_LORA)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # the fixture's config.json names its SmolVLM directory from the repository root
        yield mp


def test_lerobot_lora_adapts_the_modules_lerobot_and_peft_adapt(the_fixtures_recipe, peft_fixture):
    frozen, trained = the_fixtures_recipe
    units = config.load(overrides=FROM_FIXTURE).model.n_layers // 2
    kernels = {p.rsplit("/", 1)[0] + "/kernel" for p in trained if is_adapter(p)}
    assert lerobot_modules(kernels, units) == set(peft_fixture["adapted"])
    # ... and those are what LeRobot's regex names among its Linear layers, PEFT's fullmatch
    linear = lerobot_modules([path for path in LEROBOT_TENSORS if path.endswith("/kernel")], units)
    assert {m for m in linear if re.fullmatch(peft_fixture["target_modules"], m)} == set(peft_fixture["adapted"])
    assert trained == {p for p in frozen | trained if is_adapter(p)}  # PEFT's way: only the adapters train


def test_lerobot_lora_trains_as_many_parameters_as_peft(monkeypatch_module, peft_fixture):
    params, trained = measure.param_counts(config.load(overrides=FROM_FIXTURE + LEROBOT_LORA))
    base, _ = measure.param_counts(config.load(overrides=FROM_FIXTURE))
    assert trained == params - base == peft_fixture["trainable_count"] == 9856


def test_each_adapter_has_pefts_shape(monkeypatch_module, peft_fixture):
    """zerojax's A [in, r] and B [r, out] per layer are PEFT's lora_A [r, in] and lora_B [out, r]
    transposed, module by module."""
    cfg = config.load(overrides=FROM_FIXTURE + LEROBOT_LORA)
    plan = train.prepare(cfg).engine.plan
    units = cfg.model.n_layers // 2
    seen = 0
    for leaf in jax.tree.leaves(plan.leaves):
        if not is_adapter(leaf.path):
            continue
        kernel, ab = leaf.path.rsplit("/", 1)[0] + "/kernel", leaf.path.rsplit("/", 1)[1]
        shape = tuple(leaf.shape[1:]) if "{i}" in LEROBOT_TENSORS[kernel].name else tuple(leaf.shape)
        for module in lerobot_modules([kernel], units):
            theirs = peft_fixture["trainable"][f"{module}.lora_{ab[-1].upper()}.default.weight"]
            assert shape == tuple(reversed(theirs)), (leaf.path, module)
            seen += 1
    assert seen == len(peft_fixture["trainable"]) == 26


# ---------------------------------------------------------------------------------------------
# LeRobot's LoRA recipe fine-tuning the fixture, 3 steps, at stage 3 on 8 devices against one.

def steps(overrides, out):
    cfg = config.load(overrides=FROM_FIXTURE + LEROBOT_LORA + [f"train.out_dir={out}"] + overrides)
    setup = train.prepare(cfg)
    engine = setup.engine
    abstract = state_lib.init_state(engine, abstract=True)
    state = train.start_state(setup, None, abstract, state_lib.state_shardings(engine, abstract))
    start, step, losses = leaves(state.params, engine.plan), step_lib.make_train_step(engine, abstract), []
    for i in range(3):
        state, metrics = step(state, train.global_batch(setup, data.TRAIN, i))
        losses.append(float(metrics["loss"]))
    return start, np.array(losses), state, engine.plan


@pytest.mark.slow
def test_lerobot_lora_on_8_devices_at_stage_3_gives_one_devices_losses_and_moves_only_adapters(
        monkeypatch_module, tmp_path):
    start, losses, state, plan = steps(["zero.stage=3", "zero.schedule=shard_map", "mesh.data=8"], tmp_path / "eight")
    one, _ = run(FROM_FIXTURE + LEROBOT_LORA + ONE_DEVICE + [f"train.out_dir={tmp_path / 'one'}"])
    np.testing.assert_allclose(losses, one, rtol=1e-5)
    assert len(set(one)) == 3  # three steps that move the loss
    end = leaves(state.params, plan)
    frozen = {leaf.path for leaf in jax.tree.leaves(plan.leaves) if leaf.frozen}
    assert frozen == {p for p in end if not is_adapter(p)}
    for p in frozen:  # LeRobot's base weights, bit for bit
        np.testing.assert_array_equal(end[p], start[p], err_msg=p)
    for p in ("layers/expert_0/q_proj/lora_b", "layers/expert_1/v_proj/lora_b", "state_proj/lora_b",
              "action_time_mlp_out/lora_b"):
        assert np.abs(end[p] - start[p]).max() > 0, p
    assert moments_of(state.opt_state, end) == set(end) - frozen


def test_the_component_is_named_in_the_message_for_an_unknown_target(monkeypatch_module):
    from zerojax.errors import ConfigError

    with pytest.raises(ConfigError, match="lerobot_lora"):
        frozen_and_trained(FROM_FIXTURE + ["optim.lora.rank=8", "optim.lora.targets=lerobot_lroa"])
