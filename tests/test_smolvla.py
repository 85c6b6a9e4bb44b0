"""SmolVLA (`model.family=smolvla`): its flow-matching losses and sampled actions equal LeRobot
0.6.1's own PyTorch SmolVLA on a tiny random checkpoint (tests/fixtures/lerobot06/smolvla, made by
scripts/fixtures/make_smolvla_fixtures.py in fp32, every constant-initialised tensor random), and
its units (a VLM self-attention layer and a cross-attention layer with the expert layers that read
them) train on 8 devices at stage 3 as on one, each gathered once per pass."""

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import ROOT, run
from zerojax.errors import ConfigError
from zerojax.interop import lerobot

FIXTURE = ROOT / "tests" / "fixtures" / "lerobot06"
OBSERVATION = ("images", "image_masks", "tokens", "token_mask", "state", "actions")
TINY = ["model.family=smolvla", "data.source=pi0_source:build", "model.vocab_size=64", "model.d_model=32",
        "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8", "model.d_ff=64",
        "model.expert.d_model=24", "model.expert.d_ff=48", "model.action.horizon=4", "model.action.cameras=2",
        "model.action.prompt_len=6", "model.action.action_dim=3", "model.vision.image_size=32",
        "model.vision.patch_size=8", "model.vision.d_model=16", "model.vision.n_layers=1", "model.vision.n_heads=2",
        "model.vision.d_ff=32", "train.global_batch=16", "zero.min_shard_size=64", "train.steps=3",
        "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "train.ckpt_every=0",
        "optim.warmup_steps=0", "model.remat=none"]


@pytest.fixture(scope="module")
def reference():
    return load_file(FIXTURE / "smolvla.reference.safetensors")


@pytest.fixture(scope="module")
def loaded():
    return lerobot.load(FIXTURE / "smolvla")


def test_losses_and_sampled_actions_equal_lerobots(loaded, reference):
    cfg, model = loaded
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.expert.d_model) == (4, 4, 2, 16, 48)
    assert (cfg.smolvla.pixel_shuffle, cfg.smolvla.num_steps, cfg.action.cameras, cfg.action.action_dim) == (2, 10, 2, 3)
    batch = {k: jnp.asarray(reference[k]) for k in OBSERVATION}
    losses = model.flow_loss(batch, jnp.asarray(reference["noise"]), jnp.asarray(reference["time"]))
    assert losses.shape == reference["losses"].shape == (2, 4, 32)
    np.testing.assert_allclose(losses, reference["losses"], atol=1e-4, rtol=1e-4)
    sampled = model.sample_actions(batch, jnp.asarray(reference["sample_noise"]))
    np.testing.assert_allclose(sampled, reference["actions_sampled"], atol=1e-4, rtol=1e-4)


def test_the_masks_and_the_state_matter(loaded, reference):
    """Control: a missing camera, padded prompt tokens and the state token change the model's
    losses (so the match above is not the unmasked or stateless model's by accident)."""
    _, model = loaded
    batch = {k: jnp.asarray(reference[k]) for k in OBSERVATION}
    noise, time = jnp.asarray(reference["noise"]), jnp.asarray(reference["time"])
    losses = np.asarray(model.flow_loss(batch, noise, time))
    unmasked = {**batch, "image_masks": jnp.ones_like(batch["image_masks"]),
                "token_mask": jnp.ones_like(batch["token_mask"])}
    assert np.abs(np.asarray(model.flow_loss(unmasked, noise, time)[1]) - losses[1]).max() > 1e-3
    stateless = {**batch, "state": jnp.zeros_like(batch["state"])}
    assert np.abs(np.asarray(model.flow_loss(stateless, noise, time)) - losses).max() > 1e-3


def test_an_interleaving_zerojax_does_not_map_is_refused(tmp_path):
    shutil.copytree(FIXTURE / "smolvla", tmp_path / "p")
    config = json.loads((tmp_path / "p" / "config.json").read_text())
    (tmp_path / "p" / "config.json").write_text(json.dumps({**config, "self_attn_every_n_layers": 3}))
    with pytest.raises(ConfigError, match="self_attn_every_n_layers=3; zerojax reads SmolVLA's cross_attn with "
                                          "self_attn_every_n_layers=2"):
        lerobot.load(tmp_path / "p")


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return run(TINY + ["mesh.data=1", "zero.stage=0", "zero.schedule=gspmd",
                       f"train.out_dir={tmp_path_factory.mktemp('one')}"])[0]


def test_units_on_8_devices_at_stage_3_give_one_devices_losses(one_device, tmp_path):
    losses, result = run(TINY + ["zero.stage=3", f"train.out_dir={tmp_path}"])
    np.testing.assert_allclose(losses, one_device, rtol=1e-5)
    params = result.state.params
    assert set(params["layers"]) == {"vlm_0", "vlm_1", "expert_0", "expert_1"}  # one unit: both streams, both kinds
    # the expert's self-attention layer reads its width, its cross-attention layer the VLM's keys (G·K = 16)
    assert params["layers"]["expert_0"]["k_proj"]["kernel"].shape == (2, 24, 16)
    assert params["layers"]["expert_1"]["k_proj"]["kernel"].shape == (2, 16, 16)


def test_each_unit_is_gathered_once_per_pass_with_both_streams():
    """Stage 3's HLO: the units' loops (6 layers: 3 units; the tower has 2 layers) gather one unit
    per iteration forward and backward and reduce-scatter one backward: the VLM's layers and the
    expert's that read them travel together."""
    from zerojax import config
    from zerojax.analysis import hlo, measure

    cfg = config.load(overrides=TINY + ["model.n_layers=6", "model.vision.n_layers=2", "zero.stage=3",
                                        "zero.schedule=shard_map", "zero.prefetch=0"])
    engine, compiled = measure.compile_step(cfg, measured_only=True)
    assert set(engine.plan.leaves["layers"]) == {"vlm_0", "vlm_1", "expert_0", "expert_1"}
    loops = [x for x in hlo.loop_collectives(compiled.as_text(), 8) if x["per_iteration"]["all-gather"]]
    units = sorted((x for x in loops if x["trip_count"] == 3), key=lambda x: x["per_iteration"]["reduce-scatter"])
    assert len(units) == 2, loops  # the forward's loop and the backward's
    forward, backward = units
    assert forward["per_iteration"]["all-gather"] == backward["per_iteration"]["all-gather"] == 1
    assert forward["per_iteration"]["reduce-scatter"] == 0 and backward["per_iteration"]["reduce-scatter"] == 1
    assert [x["trip_count"] for x in loops if x["trip_count"] != 3] == [2, 2]  # the tower's two loops


# ---------------------------------------------------------------------------------------------
# LeRobot checkpoints in (model.init_from=DIR) and out (zerojax export --format lerobot);
# scripts/checks/check_smolvla_export.py loads an export in LeRobot 0.6.1 itself.


def tokenizers_resolved(doc: dict, directory: Path) -> dict:
    """A processor file with its tokenizer step's directory read as the tokenizer.json it holds:
    the run took the checkpoint's tokenizer (its `tokenizer_name`, relative to the repository) as
    data.tokenizer, and the export carries a copy of it in its own `tokenizer/`, named relatively."""
    for step in doc.get("steps", []):
        name = step.get("config", {}).get("tokenizer_name")
        if name:
            found = next(p for p in (directory / name, ROOT / name) if (p / "tokenizer.json").is_file())
            step["config"]["tokenizer_name"] = (found / "tokenizer.json").read_text()
    return doc


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A stage-3 run on 8 devices from the LeRobot fixture: one step at lr 0 (the weights stay the
    checkpoint's), checkpointed."""
    out = tmp_path_factory.mktemp("imported")
    losses, _ = run(["data.source=pi0_source:build", f"model.init_from={FIXTURE / 'smolvla'}",
                     "train.global_batch=16", "zero.min_shard_size=64", "train.log_every=1", "train.eval_every=0",
                     "train.sample_tokens=0", "optim.warmup_steps=0", "model.remat=none", "zero.stage=3",
                     "train.steps=1", "train.ckpt_every=1", "optim.lr=0", f"train.out_dir={out}"])
    assert np.isfinite(losses).all()
    return out


def test_import_on_8_devices_and_export_give_every_tensor_and_file_bit_for_bit(imported, tmp_path):
    """LeRobot 0.6's layout: every tensor of the checkpoint the run started from (the unit's two
    layers back at LeRobot's layers 2i and 2i + 1; SmolVLM's unused lm_head copied from the start),
    its config.json and its processor files, statistics and all."""
    from zerojax import cli

    assert cli.main(["export", str(imported), "--format", "lerobot", "--out", str(tmp_path / "out")]) == 0
    out, fixture = load_file(tmp_path / "out" / "model.safetensors"), load_file(FIXTURE / "smolvla" / "model.safetensors")
    assert set(out) == set(fixture)
    assert [k for k in fixture if out[k].tobytes() != fixture[k].tobytes()] == []
    for name in ("config.json", "policy_preprocessor.json", "policy_postprocessor.json"):
        got, want = json.loads((tmp_path / "out" / name).read_text()), json.loads((FIXTURE / "smolvla" / name).read_text())
        assert tokenizers_resolved(got, tmp_path / "out") == tokenizers_resolved(want, FIXTURE / "smolvla")
    for name in ("policy_preprocessor_step_5_normalizer_processor.safetensors",
                 "policy_postprocessor_step_0_unnormalizer_processor.safetensors"):
        want = load_file(FIXTURE / "smolvla" / name)
        assert {k: v.tobytes() for k, v in load_file(tmp_path / "out" / name).items()} == \
            {k: v.tobytes() for k, v in want.items()}
    from zerojax.interop import lerobot as lerobot_io

    assert lerobot_io.image_padding(tmp_path / "out") == "before"  # named in its metadata, as SmolVLA pads
    assert lerobot_io.read_policy(FIXTURE / "smolvla").pad_before  # LeRobot's own directory, which names none


# ---------------------------------------------------------------------------------------------
# Everywhere π0 goes: a LeRobot dataset, `zerojax serve`'s batch, the recipes as keys.

DATASET = ["model.family=smolvla", "model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
           "model.n_kv_heads=2", "model.head_dim=8", "model.d_ff=64", "model.expert.d_model=24",
           "model.expert.d_ff=48", "model.vision.image_size=32", "model.vision.patch_size=8",
           "model.vision.d_model=16", "model.vision.n_layers=1", "model.vision.n_heads=2", "model.vision.d_ff=32",
           "model.action.horizon=2", "model.action.prompt_len=32", "model.action.max_state_dim=8",
           "model.action.max_action_dim=4", "model.action.action_dim=2", "model.action.cameras=2",
           "data.image_size=32", "data.action_horizon=2", "data.prompt_len=32",
           f"data.source=lerobot:{ROOT / 'tests' / 'fixtures' / 'lerobot' / 'tiny'}", "train.global_batch=8",
           "zero.min_shard_size=64", "train.steps=1", "train.log_every=1", "train.eval_every=0",
           "train.sample_tokens=0", "train.ckpt_every=1", "train.report=false", "optim.warmup_steps=0",
           "model.remat=none", "mesh.data=1", "zero.stage=0", "zero.schedule=gspmd"]


def test_serve_builds_the_batch_training_builds_and_answers_with_rtc(tmp_path):
    """`zerojax serve`'s batch of a dataset frame (through π0's adapter, which SmolVLA declares)
    equals the training row of that frame, and the served policy answers, with and without a
    leftover chunk for real-time chunking."""
    from zerojax import cli, config
    from zerojax.data import sources
    from zerojax.serve import loaders

    assert cli.main(["train", "--no-progress", *DATASET, f"train.out_dir={tmp_path / 'run'}"]) == 0
    served = loaders.load(tmp_path / "run", num_steps=2)
    src = sources.open_source(config.load(overrides=DATASET))
    ds, batch = src.source.dataset, src.rows(0, 0, slice(None))
    index = int(src.source.frames_of(0, 0)[0])
    numbers = ds.numbers(index, 2)
    obs = {"observation.state": numbers["observation.state"].astype(np.float64), "prompt": numbers["task"],
           **{c: ds.image(c, index, src.source.video) for c in src.cameras}}
    got = served.batch(obs)
    for key in ("tokens", "token_mask", "image_masks", "state"):
        np.testing.assert_allclose(got[key][0], batch[key][0], atol=1e-6)
    np.testing.assert_allclose(got["images"][0], batch["images"][0], atol=1e-6)
    plain = served.actions(got, served.noise(0))
    assert plain.shape == (2, 2) and np.isfinite(plain).all()
    guided = served.batch({**obs, "prev_actions": np.ones((2, 2)), "inference_delay": 1})
    assert guided["rtc_weights"].any()
    assert not np.allclose(served.actions(guided, served.noise(0)), plain)


@pytest.mark.parametrize("family, padding", [("pi0", "centred"), ("pi05", "centred"), ("smolvla", "before")])
def test_a_camera_that_is_not_square_is_padded_as_lerobot_061_pads_it(family, padding):
    """tests/fixtures/lerobot06/padding.safetensors, from LeRobot 0.6.1's own functions
    (scripts/fixtures/make_lerobot06_padding.py): π0 and π0.5 centre (openpi's), SmolVLA pads the
    top and left; the family's declaration says which, for training and serving alike."""
    from zerojax.data.lerobot import frames
    from zerojax.models import registry

    ref = load_file(FIXTURE / "padding.safetensors")
    for name in ("wide", "tall"):
        image = ref[name][0] * np.float32(2) - np.float32(1)
        got = frames.resize_with_pad(image, 16, registry.pads_before(family))
        np.testing.assert_allclose(got, ref[f"{name}.{padding}"][0], atol=1e-6, err_msg=name)


def test_smolvlas_training_rows_pad_a_wide_camera_on_top():
    """The fixture dataset's front camera is 24 x 32: resized into 32 x 32, SmolVLA's row has its 8
    rows of padding on top, as LeRobot's SmolVLA would see it (and so would its export)."""
    from zerojax import config
    from zerojax.data import sources

    src = sources.open_source(config.load(overrides=DATASET))
    front = src.source.item(int(src.source.frames_of(0, 0)[0]))["observation.images.front"]
    assert (front[:, :8] == -1).all() and not (front[:, -8:] == -1).all()


def test_a_lerobot_smolvla_directory_is_served_as_lerobot_061_answers(monkeypatch):
    """`zerojax serve DIR` of LeRobot's own SmolVLA directory, against LeRobot 0.6.1's processors and
    `predict_action_chunk` on robot observations (scripts/fixtures/make_smolvla_serve_fixture.py:
    the state in robot units, uint8 HWC cameras, cam0 48 x 64 padded on top, fixed noise): the
    tokenizer is the SmolVLM directory's that config.json names, and the chunk is unnormalized."""
    import json

    from safetensors import safe_open

    from zerojax.serve import loaders

    monkeypatch.chdir(ROOT)  # config.json names its SmolVLM directory from the repository root
    with safe_open(FIXTURE / "smolvla.serve_reference.safetensors", "numpy") as f:
        ref = {k: f.get_tensor(k) for k in f.keys()}
        tasks = json.loads(f.metadata()["tasks"])
    served = loaders.load(FIXTURE / "smolvla", num_steps=10)  # no --tokenizer: the SmolVLM directory's
    assert "LeRobot 0.4+ smolvla checkpoint" in served.where and served.pad_before
    for b, task in enumerate(tasks):
        obs = {"observation.state": ref["state"][b], "observation.images.cam0": ref["cam0"][b],
               "observation.images.cam1": ref["cam1"][b], "prompt": task}
        actions = served.actions(served.batch(obs), ref["noise"][b:b + 1])
        np.testing.assert_allclose(actions, ref["actions"][b], rtol=1e-5, atol=1e-5)


def test_serve_tokenizes_with_what_the_preprocessor_names_before_the_smolvlm_directory(tmp_path, monkeypatch):
    """LeRobot tokenizes with its tokenizer step's `tokenizer_name`, which a zerojax export sets to
    the run's data.tokenizer; config.json's `vlm_model_name` is the fallback."""
    import shutil

    from zerojax.interop import lerobot as lerobot_io

    monkeypatch.chdir(ROOT)
    policy_dir = tmp_path / "smolvla"
    shutil.copytree(FIXTURE / "smolvla", policy_dir)
    assert lerobot_io.named_tokenizer(policy_dir) == str(ROOT / "tests/fixtures/lerobot06/smolvla_vlm/tokenizer.json")
    doc = json.loads((policy_dir / "policy_preprocessor.json").read_text())
    for step in doc["steps"]:
        if "tokenizer_name" in step.get("config", {}):
            step["config"]["tokenizer_name"] = "tests/fixtures/lerobot06/tokenizer"
    (policy_dir / "policy_preprocessor.json").write_text(json.dumps(doc))
    assert lerobot_io.named_tokenizer(policy_dir) == str(ROOT / "tests/fixtures/lerobot06/tokenizer/tokenizer.json")


@pytest.fixture(scope="module")
def start_params(tmp_path_factory):
    """The parameters every recipe's run starts from: a step at lr 0."""
    from zerojax import cli
    from zerojax.train import export

    out = tmp_path_factory.mktemp("start")
    assert cli.main(["train", "--no-progress", *DATASET, "optim.lr=0", f"train.out_dir={out}"]) == 0
    return nnx_params(export.load_model(out)[2])


@pytest.mark.parametrize("recipe, trained", [("optim.freeze=vlm", {"expert_norm", "state_proj", "action_in_proj"}),
                                             ("optim.freeze=vision", {"connector", "embed_tokens", "expert_norm"})])
def test_the_recipes_are_keys(recipe, trained, start_params, tmp_path):
    """LeRobot's train_expert_only (its default) and freeze_vision_encoder as one key each: the
    frozen components' parameters do not move in a step, the rest do."""
    from zerojax import cli
    from zerojax.train import export

    # frozen parameters kept in fp32 (precision.frozen), so that "did not move" is exact
    assert cli.main(["train", "--no-progress", *DATASET, recipe, "optim.lr=1e-2", "precision.frozen=float32",
                     f"train.out_dir={tmp_path}"]) == 0
    before, after = start_params, nnx_params(export.load_model(tmp_path)[2])
    moved = {k for k in before if k != "layers" and not np.array_equal(before[k], after[k])}
    frozen = {"vision", "vision_embeddings", "vision_post_layernorm"} | (
        {"connector", "embed_tokens", "norm"} if recipe.endswith("vlm") else set())
    assert trained <= moved and not moved & frozen
    layers = {k: not np.array_equal(before["layers"][k], after["layers"][k]) for k in ("vlm_0", "expert_0")}
    assert layers == {"vlm_0": not recipe.endswith("vlm"), "expert_0": True}


def nnx_params(model) -> dict:
    """{top-level name: its leaves concatenated} of a model's parameters; `layers` by unit member."""
    import jax
    from flax import nnx

    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])  # noqa: E731
    out = {k: flat(v) for k, v in params.items() if k != "layers"}
    out["layers"] = {k: flat(v) for k, v in params["layers"].items()}
    return out
