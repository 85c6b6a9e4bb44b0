"""The fine-tuning recipes people use, each named by a model's components (`optim.freeze=vision`,
`optim.freeze=vlm`, `optim.lora.targets=language,expert` with `optim.lora.base=targets`,
`optim.lora.targets=decoder`), and `optim.ema`: each recipe trains exactly the leaves it says on
tiny π0 and PaliGemma models; the EMA equals one computed by hand from the master after each
step, survives a checkpoint and resume bit for bit, is the same on 8 devices at stage 3 as on
one, and `zerojax export --weights` chooses it or the raw weights."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import test_paligemma
import test_pi0
from conftest import ROOT, run
from zerojax import cli, config, data, train
from zerojax.analysis import measure
from zerojax.errors import ConfigError
from zerojax.models.pi0 import model as pi0
from zerojax.optim.lora import is_adapter
from zerojax.parallel.trees import path_name
from zerojax.precision import Policy
from zerojax.train import model as model_lib
from zerojax.train import state as state_lib
from zerojax.train import step as step_lib

PI0 = test_pi0.TINY + ["optim.schedule=constant"]  # a schedule that does not depend on train.steps (resume)
EMA = ["optim.ema=0.9"]
PI0_LR = config.load(overrides=PI0).optim.lr
ONE_DEVICE = ["mesh.replica=1", "mesh.data=1", "zero.stage=0", "zero.schedule=gspmd"]


def frozen_and_trained(overrides):
    cfg = config.load(overrides=overrides)
    model = model_lib.abstract_model(cfg.model, Policy(), lora=cfg.optim.lora)
    leaves = jax.tree.leaves(model_lib.param_plan(cfg, model, model.STACKED, 3, 8).leaves)
    return {x.path for x in leaves if x.frozen}, {x.path for x in leaves if not x.frozen}


def under(paths, *prefixes):
    return {p for p in paths if any(p == q or p.startswith(q + "/") for q in prefixes)}


# The sets each recipe must give, written from LeRobot's and openpi's definitions, not from the
# component tables: LeRobot's PaliGemma is its SigLIP tower, the projector, Gemma's embeddings,
# final norm and its half of each joint layer; openpi's `llm` is both experts' Gemma weights.
TOWER = ("vision", "vision_embeddings", "vision_post_layernorm")
PALIGEMMA = (*TOWER, "multi_modal_projector", "embed_tokens", "norm", "layers/vlm")
LLM = ("embed_tokens", "norm", "layers/vlm", "layers/expert", "expert_norm")


@pytest.mark.parametrize("recipe, frozen_of", [
    (["optim.freeze=vision"], lambda paths: under(paths, *TOWER)),  # LeRobot's freeze_vision_encoder
    (["optim.freeze=vision*"], lambda paths: under(paths, *TOWER)),  # the same as a pattern
    (["optim.freeze=vlm"], lambda paths: under(paths, *PALIGEMMA)),  # LeRobot's train_expert_only
    # openpi's gemma_2b_lora: LoRA on the VLM's Gemma, the rest (tower, projector, expert) trained
    (["optim.lora.rank=4", "optim.lora.targets=language", "optim.lora.base=targets"],
     lambda paths: under(paths, "embed_tokens", "norm", "layers/vlm") - {p for p in paths if is_adapter(p)}),
    # openpi's low-memory recipe (gemma_2b_lora + gemma_300m_lora): every Gemma weight frozen but the adapters
    (["optim.lora.rank=4", "optim.lora.targets=language,expert", "optim.lora.base=targets"],
     lambda paths: under(paths, *LLM) - {p for p in paths if is_adapter(p)}),
], ids=["freeze=vision", "freeze=vision*", "freeze=vlm", "lora language", "lora language,expert"])
def test_each_pi0_recipe_freezes_what_it_says(recipe, frozen_of):
    frozen, trained = frozen_and_trained(test_pi0.TINY + recipe)
    assert frozen == frozen_of(frozen | trained) and frozen and trained


# openpi's low-memory recipe as it is written there: gemma_2b_lora (rank 16, alpha 16) on the VLM's
# Gemma, gemma_300m_lora (rank 32, alpha 32) on the expert; here 4 and 8 on the tiny model.
TWO_RANKS = ["optim.lora.rank=4", "optim.lora.alpha=4", "optim.lora.targets=language,expert", "optim.lora.base=targets",
             "optim.lora.rank_pattern=expert:8", "optim.lora.alpha_pattern=expert:8"]
OPENPI = ["optim.lora.rank=16", "optim.lora.alpha=16", "optim.lora.targets=language,expert", "optim.lora.base=targets",
          "optim.lora.rank_pattern=expert:32", "optim.lora.alpha_pattern=expert:32"]


def test_two_ranks_give_each_component_its_adapters_and_the_hand_counted_trainables():
    cfg = config.load(overrides=test_pi0.TINY + TWO_RANKS)
    model = model_lib.abstract_model(cfg.model, Policy(), lora=cfg.optim.lora)
    shapes = {p: x.shape for p, x in leaves_of(model).items()}
    adapters = {p: s for p, s in shapes.items() if is_adapter(p)}
    kernels = {p.removesuffix("/kernel") for p in shapes if p.startswith(("layers/vlm/", "layers/expert/"))
               and p.endswith("kernel")}
    assert {p.rsplit("/", 1)[0] for p in adapters} == kernels  # every Gemma projection of both, nothing else
    for p, shape in adapters.items():  # A [L, in, r], B [L, r, out]
        rank = 4 if p.startswith("layers/vlm/") else 8
        assert shape[-1 if p.endswith("lora_a") else -2] == rank, (p, shape)
    assert {layer.lora_scale for _, layer in nnx.iter_graph(model) if hasattr(layer, "lora_scale")} == {1.0}  # alpha / r
    # By hand, r·(in + out) per projection, 2 layers: the VLM (width 32, 2 heads of 8, 1 kv head,
    # MLP 64) at rank 4, the expert (width 16, MLP 48) at rank 8.
    vlm = (32 + 16) + (32 + 8) + (32 + 8) + (16 + 32) + 3 * (32 + 64)
    expert = (16 + 16) + (16 + 8) + (16 + 8) + (16 + 16) + 3 * (16 + 48)
    _, trained = measure.param_counts(cfg)
    _, rest = measure.param_counts(config.load(overrides=test_pi0.TINY + ["optim.freeze=language,expert"]))
    assert trained - rest == 2 * (4 * vlm + 8 * expert) == 8576


def test_memory_counts_openpi_s_two_ranks_on_the_full_size_pi0(capsys):
    def trainable(*overrides):
        assert cli.main(["memory", "--config", str(ROOT / "configs" / "pi0.yaml"), "--devices", "8", "--json",
                         *overrides]) == 0
        return json.loads(capsys.readouterr().out)["trainable"]

    # By hand from Gemma 2B (width 2048, 8 heads and 1 kv head of 256, MLP 16384) at rank 16 and
    # gemma_300m (width 1024, the same heads, MLP 4096) at rank 32, 18 layers each.
    vlm = (2048 + 2048) + 2 * (2048 + 256) + (2048 + 2048) + 3 * (2048 + 16384)
    expert = (1024 + 2048) + 2 * (1024 + 256) + (2048 + 1024) + 3 * (1024 + 4096)
    assert trainable(*OPENPI) - trainable("optim.freeze=language,expert") == 18 * (16 * vlm + 32 * expert) == 33_472_512


@pytest.mark.parametrize("overrides, message", [
    (["optim.lora.rank_pattern=experts:8"], "optim.lora.rank_pattern entry 'experts' names none of the kernels"),
    (["optim.lora.rank_pattern=expert:0"], "optim.lora.rank_pattern['expert']=0 is not valid; it must be >= 1"),
    (["optim.lora.alpha_pattern=expert:-1"], "optim.lora.alpha_pattern['expert']=-1.0 is not valid"),
    (["optim.lora.rank=0"], "optim.lora.rank_pattern is set but optim.lora.rank=0 (LoRA off)"),
    (["optim.lora.rank_pattern=expert:9"], "optim.lora.rank_pattern's rank 9 is larger than layers/expert/k_proj"),
    (["optim.lora.rank_pattern=expert=8"], "optim.lora.rank_pattern expects a mapping NAME: VALUE"),
], ids=["unknown component", "rank 0", "alpha < 0", "LoRA off", "rank too large", "not a mapping"])
def test_bad_rank_patterns_exit_2_before_anything_is_written(overrides, message, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", "--no-progress", *PI0, *TWO_RANKS, *overrides, f"train.out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax: error: ") and message in err and err.count("\n") == 1, err
    assert not out.exists()


def leaves_of(model):
    return {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_lora_targets_name_the_adapted_kernels_and_base_all_freezes_the_rest():
    frozen, trained = frozen_and_trained(test_pi0.TINY + ["optim.lora.rank=4", "optim.lora.targets=expert"])
    assert trained == {p for p in frozen | trained if is_adapter(p)}  # PEFT's way: only adapters train
    assert {p.rsplit("/", 1)[0] for p in trained} == {p.rsplit("/", 1)[0] for p in frozen | trained
                                                      if p.startswith("layers/expert/") and p.endswith("kernel")}


def test_lora_on_the_paligemma_decoder_only_is_one_key():
    frozen, trained = frozen_and_trained(test_paligemma.TINY + ["optim.lora.rank=4", "optim.lora.targets=decoder"])
    adapted = {p.rsplit("/", 1)[0] for p in trained}
    assert trained == {p for p in frozen | trained if is_adapter(p)}
    assert adapted == {p.removesuffix("/kernel") for p in frozen if p.startswith("layers/") and p.endswith("kernel")}
    assert not any(p.startswith(("vision", "multi_modal_projector")) for p in trained)  # not the tower


@pytest.mark.parametrize("overrides, message", [
    (["optim.freeze=visoin"], r"matches no parameter.*model's components \(action, expert, language, vision, vlm\)"),
    (["optim.lora.rank=4", "optim.lora.targets=experts"], r"'experts' matches no nnx.Linear kernel.*components"),
    (["optim.lora.base=some"], r"optim.lora.base='some'.*all, targets"),
    (["optim.ema=1"], r"optim.ema=1.0 must be in \[0, 1\)"),
])
def test_bad_recipe_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        frozen_and_trained(test_pi0.TINY + overrides)


# ---------------------------------------------------------------------------------------------
# optim.ema, on π0 trained expert-only (the frozen VLM shows that frozen leaves neither change
# nor get moments, gradients or an average).


def leaves(tree, plan=None):
    tree = plan.unpad(tree) if plan is not None else tree
    return {path_name(path): np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def moments_of(opt_state, params) -> set[str]:
    """The parameters whose copies (Adam's mu and nu) the optimizer state holds."""
    paths = [p for p, x in leaves(opt_state).items() if x.ndim > 0]
    owners = {p: [q for q in params if p.endswith("/" + q)] for p in paths}
    assert all(len(o) == 1 for o in owners.values()), owners
    return {o[0] for o in owners.values()}


def steps_by_hand(overrides, out):
    """3 expert-only steps with optim.ema=0.9: the start, the trained master after each step
    (the EMA's start first), the final state and the plan."""
    cfg = config.load(overrides=PI0 + EMA + ["optim.freeze=vlm", f"train.out_dir={out}"] + overrides)
    setup = train.prepare(cfg)
    engine = setup.engine
    abstract = state_lib.init_state(engine, abstract=True)
    state = train.start_state(setup, None, abstract, state_lib.state_shardings(engine, abstract))
    start, plan = leaves(state.params, engine.plan), engine.plan
    masters, step = [leaves(state.ema, plan)], step_lib.make_train_step(engine, abstract)
    for i in range(3):
        state, _ = step(state, train.global_batch(setup, data.TRAIN, i))
        masters.append({p: x for p, x in leaves(state.params, plan).items() if p in masters[0]})
    return start, masters, state, plan


def ema_by_hand(masters, decay=0.9):
    ema = dict(masters[0])
    for master in masters[1:]:
        ema = {p: np.float32(decay) * ema[p] + np.float32(1 - decay) * master[p] for p in ema}
    return ema


@pytest.fixture(scope="module")
def by_hand(tmp_path_factory):
    return steps_by_hand(ONE_DEVICE, tmp_path_factory.mktemp("hand"))


def test_the_ema_is_the_masters_average_computed_by_hand(by_hand):
    start, masters, state, _ = by_hand
    ema = ema_by_hand(masters)
    got = leaves(state.ema)
    assert set(got) == set(masters[0]) and got.keys() == under(start, *pi0.EXPERT, *pi0.ACTION)
    for p in got:
        np.testing.assert_allclose(got[p], ema[p], rtol=1e-6, atol=1e-7, err_msg=p)
        assert not np.allclose(got[p], masters[-1][p]) or np.allclose(masters[0][p], masters[-1][p]), p
    end = leaves(state.params)
    for p in set(start) - set(got):  # the frozen VLM: bit for bit as it started
        np.testing.assert_array_equal(end[p].view(np.uint16), start[p].view(np.uint16), err_msg=p)
    assert moments_of(state.opt_state, end) == set(got)  # only the trained leaves have moments


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """The same 3 steps as `by_hand`, stopped after 2 (a checkpoint) and resumed."""
    out = tmp_path_factory.mktemp("resumed")
    common = PI0 + EMA + ONE_DEVICE + ["optim.freeze=vlm", f"train.out_dir={out}"]
    run(common + ["train.steps=2", "train.ckpt_every=2"])
    _, result = run(common + ["train.steps=3", "train.ckpt_every=3"])
    assert result.resumed_from == 2
    return out, result.state


def test_the_ema_survives_a_checkpoint_and_resume_bit_for_bit(by_hand, resumed):
    uninterrupted = by_hand[2]
    got, want = leaves(resumed[1].ema), leaves(uninterrupted.ema)
    assert got.keys() == want.keys()
    for p in want:
        np.testing.assert_array_equal(got[p], want[p], err_msg=p)


@pytest.mark.slow
def test_the_ema_on_8_devices_at_stage_3_is_one_devices(by_hand, tmp_path):
    _, masters, state, plan = steps_by_hand(["zero.stage=3", "zero.schedule=shard_map"], tmp_path)
    assert any(leaf.dim is not None for leaf in jax.tree.leaves(plan.trained_leaves))  # sharded over 8
    for x, leaf in zip(jax.tree.leaves(state.ema), jax.tree.leaves(plan.trained_leaves)):
        assert x.sharding.spec == leaf.spec(True)  # laid out as its master
    got, mine, one = leaves(state.ema, plan), ema_by_hand(masters), leaves(by_hand[2].ema)
    # The same update on each device's shard as on one device: the EMA of this run's own masters.
    for p in one:
        np.testing.assert_allclose(got[p], mine[p], rtol=1e-6, atol=1e-7, err_msg=p)
    # And one device's EMA, as far as the masters agree: fp32 sums reordered, which Adam's
    # lr·m/(sqrt(v) + eps) can magnify on an element whose gradient is near 0 (measured: 5e-7 on
    # one element in 1536 with jax 0.10, 3.2e-6 with jax 0.12). The EMA is a convex combination of
    # the masters (weights summing to 1), so it can differ by no more than they do at some step.
    bound = max(np.abs(m8[p] - m1[p]).max() for m8, m1 in zip(masters, by_hand[1]) for p in one)
    assert bound < 1e-2 * PI0_LR  # the masters agree, up to that magnification (a wrong step: ~lr)
    for p in one:
        assert np.abs(got[p] - one[p]).max() <= bound * (1 + 1e-6) + 1e-8, p


def test_export_writes_the_ema_by_default_or_the_raw_weights(resumed, tmp_path):
    out, state = resumed
    ema, raw = leaves(state.ema), leaves(state.params)
    for weights, args in (("ema", []), ("ema", ["--weights", "ema"]), ("raw", ["--weights", "raw"])):
        path = tmp_path / f"{weights}{len(args)}.safetensors"
        assert cli.main(["export", str(out), "--out", str(path), *args]) == 0
        written = load_file(path)
        assert written.keys() == raw.keys()
        for p, x in written.items():
            want = ema[p] if weights == "ema" and p in ema else raw[p]
            np.testing.assert_array_equal(x, want.astype(np.float32), err_msg=f"{weights} {p}")
    assert any(not np.array_equal(ema[p], raw[p]) for p in ema)  # the two choices differ


# ---------------------------------------------------------------------------------------------
# openpi's low-memory recipe (its two ranks) on 8 devices at stage 3, with a checkpoint but no EMA.


@pytest.fixture(scope="module")
def low_memory(tmp_path_factory):
    out = tmp_path_factory.mktemp("lowmem")
    cfg = config.load(overrides=PI0 + TWO_RANKS + ["zero.stage=3", "zero.schedule=shard_map", "train.ckpt_every=3",
                                                   f"train.out_dir={out}"])
    setup = train.prepare(cfg)
    start = leaves(train.start_state(setup, None, None, None).params, setup.engine.plan)
    result = train.run(cfg, show_progress=False, setup=setup)
    return out, setup.engine.plan, start, result


@pytest.mark.slow
def test_the_low_memory_recipe_trains_the_adapters_tower_and_projections_only(low_memory):
    _, plan, start, result = low_memory
    end = leaves(result.state.params, plan)
    frozen = {leaf.path for leaf in jax.tree.leaves(plan.leaves) if leaf.frozen}
    assert frozen == under(end, *LLM) - {p for p in end if is_adapter(p)}
    for p in frozen:
        np.testing.assert_array_equal(end[p].view(np.uint16), start[p].view(np.uint16), err_msg=p)
    for p in ("layers/vlm/q_proj/lora_b", "layers/expert/mlp/down_proj/lora_b", "vision/mlp/fc1/kernel",
              "multi_modal_projector/kernel", "action_out_proj/kernel"):
        assert np.abs(end[p] - start[p]).max() > 0, p  # trained beside the adapters
    assert moments_of(result.state.opt_state, end) == set(end) - frozen and result.state.ema is None


@pytest.mark.slow
def test_the_two_rank_recipe_on_8_devices_equals_one_device(low_memory, tmp_path):
    one, _ = run(PI0 + TWO_RANKS + ONE_DEVICE + [f"train.out_dir={tmp_path}"])
    eight = [line["loss"] for line in low_memory[3].history]
    np.testing.assert_allclose(eight, one, rtol=1e-5)
    assert len(one) == 3 and len(set(one)) == 3  # three steps that move the loss


def test_resuming_with_other_ranks_exits_2(low_memory):
    cfg = config.load(low_memory[0] / "config.yaml", overrides=["optim.lora.rank_pattern=expert:4", "train.steps=4"])
    with pytest.raises(ConfigError, match=r"holds a different model.*\(LoRA rank 8 there, 4 in the config: "
                                          r"optim.lora.rank and optim.lora.rank_pattern\)"):
        train.prepare(cfg)


def test_exports_a_run_without_ema_or_with_a_trained_base_refuses_exit_2(low_memory, tmp_path, capsys):
    out = str(low_memory[0])
    assert cli.main(["export", out, "--weights", "ema", "--out", str(tmp_path / "a.safetensors")]) == 2
    assert "holds no EMA of its weights (it trained with optim.ema=0); use --weights raw" in capsys.readouterr().err
    assert cli.main(["export", out, "--format", "peft", "--out", str(tmp_path / "adapter")]) == 2
    assert "beside its adapters (optim.lora.base=targets)" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_resuming_with_another_ema_choice_exits_2(low_memory, resumed):
    for out, ema, message in ((low_memory[0], "0.9", "holds no EMA of the weights"),
                              (resumed[0], "0", "holds an EMA of the weights")):
        cfg = config.load(out / "config.yaml", overrides=[f"optim.ema={ema}", "train.steps=4"])
        with pytest.raises(ConfigError, match=message):
            train.prepare(cfg)


def test_memory_bills_the_ema_as_4_bytes_a_trained_parameter_sharded_like_the_master(capsys):
    def stages(*overrides):
        assert cli.main(["memory", "--config", str(ROOT / "configs" / "pi0.yaml"), "--devices", "8", "--json", *overrides]) == 0
        return json.loads(capsys.readouterr().out)

    plain, ema = stages("optim.freeze=vlm"), stages("optim.freeze=vlm", "optim.ema=0.99")
    trained = ema["trainable"]
    assert 0 < trained < ema["params"] and ema["ema_bytes_per_param"] == 4
    for stage, n in (("0", 1), ("1", 8), ("2", 8), ("3", 8)):
        assert ema["stages"][stage] - plain["stages"][stage] == pytest.approx(4 * trained / n, rel=1e-12)
