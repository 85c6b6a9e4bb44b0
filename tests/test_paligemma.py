"""The PaliGemma family (SigLIP + projector + Gemma): HF PaliGemmaForConditionalGeneration's
layout checked against transformers (tests/fixtures/hf/paligemma, written by
scripts/fixtures/make_hf_fixtures.py --only paligemma) with and without token_type_ids; imported onto 8
devices at stage 3 and exported back bit for bit; a few steps on 8 devices equal one device's,
the tower trained or frozen; a checkpoint whose vision config does not tile its images refused."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from conftest import ROOT, export_initial_state, run
from zerojax import cli, config, train
from zerojax.analysis import measure
from zerojax.errors import ConfigError
from zerojax.interop import hf
from zerojax.models import paligemma, registry, siglip
from zerojax.precision import Policy
from zerojax.train import model as model_lib

FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "paligemma"
TINY = ["model.family=paligemma", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=1",
        "model.head_dim=16", "model.d_ff=64", "model.seq_len=32", "model.image_token_id=255",
        "model.vision.image_size=16", "model.vision.patch_size=4", "model.vision.d_model=32",
        "model.vision.n_layers=2", "model.vision.n_heads=4", "model.vision.d_ff=64",
        "data.source=vlm_source:build", "train.global_batch=16", "zero.min_shard_size=64", "train.steps=3",
        "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "train.ckpt_every=0", "optim.warmup_steps=0",
        "model.remat=none"]


@pytest.fixture(scope="module")
def reference():
    return load_file(FIXTURE.parent / "paligemma.logits.safetensors")


@pytest.fixture(scope="module")
def loaded():
    return hf.load(str(FIXTURE))


def test_the_config_comes_from_the_nested_config_json(loaded):
    cfg, _ = loaded
    assert (cfg.family, cfg.d_model, cfg.n_kv_heads, cfg.head_dim, cfg.image_token_id) == ("paligemma", 32, 1, 16, 255)
    v = cfg.vision
    assert (v.image_size, v.patch_size, v.d_model, v.n_layers, v.n_heads, v.d_ff, v.image_tokens) == \
        (16, 4, 32, 2, 4, 64, 16)


@pytest.mark.parametrize("prefix_lm", [True, False], ids=["token_type_ids", "causal"])
def test_logits_equal_transformers(loaded, reference, prefix_lm):
    _, model = loaded
    token_type_ids = reference["token_type_ids"] if prefix_lm else None
    logits = model.logits(reference["tokens"], reference["pixel_values"], token_type_ids)
    want = reference["logits" if prefix_lm else "logits_causal"]
    np.testing.assert_allclose(np.asarray(logits), want, atol=1e-4, rtol=0)


def test_the_unit_protocol_gives_the_prefix_lm_loss_of_the_logits(loaded, reference):
    # enter / vision / between / layers / exit, as the schedules run them, give the loss of the
    # one-device logits on the answer's targets: the stacks, the merge and the prefix agree.
    _, model = loaded
    tokens = np.concatenate([reference["tokens"], reference["tokens"][:, -1:]], axis=1)
    prefix = reference["token_type_ids"] == 0
    loss_mask = ~prefix[:, 1:]
    loss_mask = np.concatenate([loss_mask, np.zeros((2, 1), bool)], axis=1)
    batch = {"tokens": tokens, "pixel_values": reference["pixel_values"], "prefix": prefix, "loss_mask": loss_mask}
    from zerojax.models import protocol

    units = protocol.Units.of(model)
    loss, weight = protocol.forward(units, nnx.to_pure_dict(nnx.state(model, nnx.Param)), batch)
    logp = jax.nn.log_softmax(jnp.asarray(reference["logits"]), axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), tokens[:, 1:, None], axis=-1)[..., 0]
    assert weight == loss_mask.sum() > 0
    np.testing.assert_allclose(float(loss), (nll * loss_mask).sum() / loss_mask.sum(), rtol=1e-5)


def test_the_layout_and_its_flops():
    cfg = config.load(overrides=TINY)
    model = registry.build(cfg.model, Policy(), seed=0)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert set(params) == {"vision_embeddings", "vision", "vision_post_layernorm", "multi_modal_projector",
                           "embed_tokens", "layers", "norm"}
    assert params["vision_embeddings"]["patch_embedding"]["kernel"].shape == (4, 4, 3, 32)  # HF's [D, C, P, P] reversed
    assert params["vision"]["self_attn"]["q_proj"]["bias"].shape == (2, 32)  # a stack of 2 biased layers
    size = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
    tower = size([params[k] for k in ("vision_embeddings", "vision", "vision_post_layernorm", "multi_modal_projector")])
    text = size(params) - tower
    T, N = 32, 16
    per_row = (6 * text + 12 * 2 * T * 64) * T + (6 * tower + 12 * 2 * N * 32) * N  # PaLM's per token, N patches
    assert model.flops_per_token(T) == pytest.approx(per_row / T, rel=1e-12)


def break_vision(d, **changes):
    c = json.loads((d / "config.json").read_text())
    c["vision_config"].update(changes)
    (d / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("changes, message", [
    ({"image_size": 30}, "config.json: model.vision.image_size=30 is not divisible by model.vision.patch_size=4"),
    ({"image_size": 20}, "tensor 'vision_tower.vision_model.embeddings.position_embedding.weight' has shape "
                         "[16, 32], the model needs [25, 32]"),
    ({"patch_size": [4, 8]}, "vision_config.patch_size=[4, 8] is not square"),
], ids=["not tiled", "positions", "not square"])
def test_a_vision_config_that_does_not_fit_exits_2_with_one_line(changes, message, tmp_path, capsys):
    d = tmp_path / "model"
    shutil.copytree(FIXTURE, d)
    break_vision(d, **changes)
    assert cli.main(["train", f"model.init_from={d}", "data.source=vlm_source:build", "train.steps=1",
                     f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax: error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, message", [
    (["model.seq_len=16"], "model.seq_len=16 leaves no room for text after the 16 image tokens"),
    (["model.vision.d_model=30"], "model.vision.d_model=30 must be divisible by model.vision.n_heads=4"),
    (["model.vision=3"], "model.vision is a section, not a key"),
])
def test_bad_vision_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.load(overrides=TINY + overrides)


def test_import_on_8_devices_at_stage_3_and_export_give_the_checkpoint_back(reference, tmp_path):
    overrides = TINY + ["zero.stage=3", f"model.init_from={FIXTURE}", f"train.out_dir={tmp_path / 'run'}",
                        "train.steps=1"]
    setup = train.prepare(config.load(overrides=overrides))
    state = train.start_state(setup, None, None, None)
    tower = state.params["vision"]["mlp"]["fc1"]["kernel"]
    assert tower.sharding.spec != jax.sharding.PartitionSpec() and len(tower.sharding.device_set) == 8
    out = export_initial_state(setup, state, tmp_path / "run", tmp_path / "export")
    # transformers 5 saves the tower as `vision_tower.`; the export writes the published checkpoints'
    # `vision_tower.vision_model.` (which transformers 4 and 5 both load with no missing key)
    original = {k.replace("vision_tower.", paligemma.VISION_PREFIX): v
                for k, v in load_file(FIXTURE / "model.safetensors").items()}
    exported = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert set(exported) == set(original), set(exported) ^ set(original)
    for key, value in original.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)  # bit for bit
    written, source = (json.loads((d / "config.json").read_text()) for d in (out, FIXTURE))
    assert written["architectures"] == ["PaliGemmaForConditionalGeneration"]
    for section in ("vision_config", "text_config"):
        keys = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"}
        keys |= {"image_size", "patch_size"} if section == "vision_config" else {"num_key_value_heads", "head_dim"}
        assert {k: written[section][k] for k in keys} == {k: source[section][k] for k in keys}, section
    assert written["image_token_index"] == 255 and written["projection_dim"] == 32
    _, reloaded = hf.load(str(out))
    logits = reloaded.logits(reference["tokens"], reference["pixel_values"], reference["token_type_ids"])
    np.testing.assert_allclose(np.asarray(logits), reference["logits"], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """One device's losses (stage 0), the tower trained and frozen."""
    out = tmp_path_factory.mktemp("one")
    return {frozen: run(TINY + ["mesh.replica=1", "mesh.data=1", "zero.stage=0", f"train.out_dir={out / str(frozen)}"]
                        + (["optim.freeze=vision*"] if frozen else []))[0] for frozen in (False, True)}


# Every stage under both schedules, and at every stage the tower trained and frozen (a pairwise
# cover of stages x schedules x frozen: 7 runs, not 12); gspmd at stage 1 on a 2x4 hybrid mesh.
MATRIX = [(3, "shard_map", False, []), (3, "shard_map", True, []), (3, "gspmd", False, []),
          (2, "shard_map", False, []), (2, "gspmd", True, []),
          (1, "shard_map", True, []), (1, "gspmd", False, ["mesh.replica=2", "mesh.data=4"])]


@pytest.mark.slow
@pytest.mark.parametrize("stage, schedule, frozen, mesh", MATRIX,
                         ids=[f"stage{s}-{k}-{'frozen' if f else 'trained'}" for s, k, f, _ in MATRIX])
def test_steps_on_8_devices_equal_one_device(one_device, stage, schedule, frozen, mesh, tmp_path):
    eight, _ = run(TINY + mesh + [f"zero.stage={stage}", f"zero.schedule={schedule}", f"train.out_dir={tmp_path}"]
                   + (["optim.freeze=vision*"] if frozen else []))
    np.testing.assert_allclose(eight, one_device[frozen], rtol=1e-5)  # fp32: only the order of sums differs
    assert one_device[frozen][-1] < one_device[frozen][0]
    assert not np.allclose(one_device[True], one_device[False])  # freezing changed the training


def test_vision_star_freezes_the_tower_and_nothing_else():
    cfg = config.load(overrides=TINY + ["optim.freeze=vision*", "zero.stage=3"])
    model = model_lib.abstract_model(cfg.model, Policy())
    plan = model_lib.param_plan(cfg, model, model.STACKED, 3, 8)
    leaves = {leaf.path: leaf for leaf in jax.tree.leaves(plan.leaves)}
    tower = {path for path in leaves if path.split("/")[0] in paligemma.TOWER}
    assert {path for path, leaf in leaves.items() if leaf.frozen} == tower
    assert tower == set(siglip.hf_tensors(*paligemma.TOWER, ""))  # every SigLIP tensor
    assert {leaf.dtype for path, leaf in leaves.items() if path in tower} == {"bfloat16"}  # precision.frozen


def test_a_frozen_tower_sends_no_gradient_bytes():
    # The compiled stage-3 step's reduce-scatters carry exactly the trained sharded leaves'
    # gradients (fp32, 7/8 of each sent on 8 devices): none of the tower's.
    cfg = config.load(overrides=TINY + ["optim.freeze=vision*", "zero.stage=3", "zero.schedule=shard_map"])
    engine, program = measure.compile_step(cfg)
    report = measure.stage_report(cfg, engine, program, measure.count_params(cfg))
    leaves = jax.tree.leaves(engine.plan.leaves)
    sharded = lambda frozen: sum(np.prod(leaf.stored) for leaf in leaves if leaf.frozen == frozen and leaf.dim is not None)
    assert sharded(True) > 0.5 * sharded(False)  # the tower is sharded, and a good part of the model
    assert report["comm"]["reduce-scatter"] == pytest.approx(7 / 8 * 4 * sharded(False), rel=1e-9)


def test_a_source_without_images_exits_2_before_anything_is_written(tmp_path, capsys):
    # the default source yields bare tokens: the model's forward, traced on the batch's shapes
    # when the run is prepared, says what it needs
    assert cli.main(["train", "model.family=paligemma", "train.steps=1", f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax: error: ") and err.count("\n") == 1, err
    assert "model.family=paligemma reads images: its batch needs pixel_values" in err, err
    assert not (tmp_path / "run").exists()
