"""LeRobot 0.6 policy directories: zerojax's π0 read from one gives LeRobot 0.6.1's own losses and
sampled actions (tests/fixtures/lerobot06/, scripts/fixtures/make_lerobot06_fixtures.py), the
prompt's embedding read from `embed_tokens` (0.6) and not the untied `lm_head` beside it, and
the normalization read from 0.6's processor files gives LeRobot's normalized state and actions."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from conftest import ROOT, run
from zerojax.data.lerobot import normalize
from zerojax.interop import lerobot

FIXTURE = ROOT / "tests" / "fixtures" / "lerobot06"
EMBED = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
LM_HEAD = "model.paligemma_with_expert.paligemma.lm_head.weight"
KEYS = ("images", "image_masks", "tokens", "token_mask", "state", "actions")


def reference(name):
    return load_file(FIXTURE / f"{name}.reference.safetensors")


def losses_of(model, ref):
    batch = {k: jnp.asarray(ref[k]) for k in KEYS}
    return np.asarray(model.flow_loss(batch, jnp.asarray(ref["noise"]), jnp.asarray(ref["time"])))


@pytest.mark.parametrize("name", ["pi0", "pi0_finetuned"])
def test_pi0_from_lerobot06_gives_lerobots_losses_and_actions(name):
    """The fine-tuned one: three of LeRobot's AdamW steps moved embed_tokens, not lm_head."""
    ref = reference(name)
    cfg, model = lerobot.load(FIXTURE / name, vision_heads=2)
    assert (cfg.vocab_size, cfg.n_heads, cfg.head_dim, cfg.action.prompt_len) == (288, 8, 4, 8)
    np.testing.assert_allclose(losses_of(model, ref), ref["losses"], atol=1e-4, rtol=1e-4)
    sampled = model.sample_actions({k: jnp.asarray(ref[k]) for k in KEYS}, jnp.asarray(ref["sample_noise"]))
    # LeRobot 0.6 takes its Euler grid as 1 + step*dt in float64, zerojax accumulates t += dt in
    # float32 (as openpi and LeRobot 0.3 do): about 4e-5 of the difference is that alone.
    np.testing.assert_allclose(sampled, ref["actions_sampled"], atol=1e-4, rtol=1e-4)


def test_a_file_with_lm_head_alone_is_read_as_lerobot03s(tmp_path):
    """LeRobot 0.3 saved the two tied, as lm_head alone: read it there. On the fine-tuned 0.6
    file that is the wrong table, and LeRobot's losses show it (the fixture tells the two apart)."""
    ref = reference("pi0_finetuned")
    tensors = load_file(FIXTURE / "pi0_finetuned" / "model.safetensors")
    base = load_file(FIXTURE / "pi0" / "model.safetensors")
    assert np.array_equal(tensors[LM_HEAD], base[LM_HEAD]) and not np.allclose(tensors[EMBED], base[EMBED])
    shutil.copytree(FIXTURE / "pi0_finetuned", tmp_path / "tied")
    save_file({k: v for k, v in tensors.items() if k != EMBED}, tmp_path / "tied" / "model.safetensors")
    _, model = lerobot.load(tmp_path / "tied", vision_heads=2)
    embedding = nnx.to_pure_dict(nnx.state(model, nnx.Param))["embed_tokens"]["embedding"]
    np.testing.assert_array_equal(embedding, tensors[LM_HEAD])
    assert np.abs(losses_of(model, ref) - ref["losses"]).max() > 1e-2


@pytest.mark.parametrize("name,mode", [("pi0", "mean_std"), ("pi05", "quantiles")])
def test_lerobot06_processor_files_give_lerobots_normalization(name, mode):
    """policy_preprocessor.json's normalizer (LeRobot 0.6: a later step, quantiles for π0.5) read
    by zerojax normalizes the raw state and actions as LeRobot's preprocessor did."""
    ref, config = reference(name), json.loads((FIXTURE / name / "config.json").read_text())
    _, norms = lerobot.features_of(config, lerobot.read_stats(FIXTURE / name), name)
    assert {k: v["mode"] for k, v in norms.items()} == {"observation.state": mode, "action": mode}
    state, actions = ref["raw_state"], ref["raw_actions"]
    np.testing.assert_allclose(normalize(state, norms["observation.state"], mode),
                               ref["state"][:, :state.shape[1]], atol=1e-6)
    np.testing.assert_allclose(normalize(actions, norms["action"], mode),
                               ref["actions"][..., :actions.shape[-1]], atol=1e-6)


def test_a_lerobot06_pi0_is_read_for_serving():
    """0.6's config.json names the image side `image_resolution` (0.3's `resize_imgs_with_padding`)."""
    policy = lerobot.read_policy(FIXTURE / "pi0")
    assert (policy.image_size, policy.prompt_len, policy.pad_before, policy.version) == (28, 8, False, "0.6")
    assert policy.norms["observation.state"]["mode"] == "mean_std"


def test_a_lerobot06_pi05_is_served_with_its_quantiles_and_the_state_in_its_prompt():
    from zerojax.serve import loaders

    served = loaders.load(FIXTURE / "pi05", num_steps=10, tokenizer=str(FIXTURE / "tokenizer" / "tokenizer.json"),
                             vision_heads=2)
    assert "(LeRobot 0.6 pi05 checkpoint)" in served.where and served.observations.norms["action"]["mode"] == "quantiles"
    rng = np.random.default_rng(0)
    obs = {"observation.state": rng.standard_normal(served.state_dim), "prompt": "pick up the cube",
           **{c: rng.integers(0, 256, served.observations.features[c]["shape"], dtype=np.uint8) for c in served.cameras}}
    batch = served.batch(obs)
    assert "state" not in batch  # π0.5 reads it from the prompt's tokens
    actions = served.infer(obs, 0)["actions"]
    assert actions.shape == (served.horizon, served.action_dim) and np.isfinite(actions).all()


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A copy of the LeRobot 0.6 π0 to start from: one test takes it away."""
    return shutil.copytree(FIXTURE / "pi0", tmp_path_factory.mktemp("start06") / "pi0")


@pytest.fixture(scope="module")
def imported(start, tmp_path_factory):
    """A stage-3 run from the LeRobot 0.6 π0: one step at lr 0 (the weights stay the checkpoint's)."""
    out = tmp_path_factory.mktemp("imported06")
    run(["data.source=pi0_source:build", f"model.init_from={start}", "model.vision.n_heads=2",
         "train.global_batch=16", "zero.min_shard_size=64", "train.log_every=1", "train.eval_every=0",
         "train.sample_tokens=0", "optim.warmup_steps=0", "model.remat=none", "zero.stage=3", "train.steps=1",
         "train.ckpt_every=1", "optim.lr=0", f"train.out_dir={out}"])
    return out


def test_an_export_is_in_lerobot06s_layout(imported, tmp_path):
    """0.6's layout, as LeRobot 0.6.1 writes it: every tensor of the checkpoint the run started
    from, the prompt's embedding under embed_tokens and lm_head both (from zerojax's one table; the
    fixture's lm_head is LeRobot's untied, unused one), and its processor files, statistics and all.
    (scripts/checks/check_lerobot06_export.py loads one in LeRobot 0.6.1 itself.)"""
    from zerojax import cli

    assert cli.main(["export", str(imported), "--format", "lerobot", "--out", str(tmp_path / "out")]) == 0
    out, fixture = load_file(tmp_path / "out" / "model.safetensors"), load_file(FIXTURE / "pi0" / "model.safetensors")
    assert set(out) == set(fixture)
    assert [k for k in fixture if not np.array_equal(out[k], fixture[k])] == [LM_HEAD]
    np.testing.assert_array_equal(out[LM_HEAD], fixture[EMBED])
    for name in ("policy_preprocessor.json", "policy_postprocessor.json"):
        assert json.loads((tmp_path / "out" / name).read_text()) == json.loads((FIXTURE / "pi0" / name).read_text())
    for name in ("policy_preprocessor_step_6_normalizer_processor.safetensors",
                 "policy_postprocessor_step_0_unnormalizer_processor.safetensors"):
        want = load_file(FIXTURE / "pi0" / name)
        assert {k: v.tobytes() for k, v in load_file(tmp_path / "out" / name).items()} == \
            {k: v.tobytes() for k, v in want.items()}
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["image_resolution"] == [28, 28] and "resize_imgs_with_padding" not in config


def test_an_export_without_processor_steps_to_keep_writes_lerobots_defaults(imported, tmp_path):
    """A run that kept no processor files (it did not start from a 0.4+ checkpoint) gets π0's
    default steps: those LeRobot 0.6.1's make_pi0_pre_post_processors wrote for the fixture."""
    from zerojax import cli

    shutil.copytree(imported, tmp_path / "run")
    for name in ("policy_preprocessor.json", "policy_postprocessor.json"):
        (tmp_path / "run" / "lerobot_init" / name).unlink()
    assert cli.main(["export", str(tmp_path / "run"), "--format", "lerobot", "--out", str(tmp_path / "out")]) == 0
    for name in ("policy_preprocessor.json", "policy_postprocessor.json"):
        got, want = (json.loads((d / name).read_text()) for d in (tmp_path / "out", FIXTURE / "pi0"))
        for step in want["steps"]:  # the fixture's tokenizer is its own; LeRobot's default is the hub's
            if step["registry_name"] == "tokenizer_processor":
                step["config"]["tokenizer_name"] = "google/paligemma-3b-pt-224"
        assert got == want


def test_an_export_without_its_starting_checkpoint_still_has_every_tensor_lerobot06_loads(start, imported, tmp_path):
    """LeRobot 0.6 loads strictly: the expert's lm_head (never used: π0 predicts velocities),
    which zerojax does not hold, is written as zeros when model.init_from is gone."""
    from zerojax import cli

    start.rename(start.with_name("gone"))
    try:
        assert cli.main(["export", str(imported), "--format", "lerobot", "--out", str(tmp_path / "out")]) == 0
    finally:
        start.with_name("gone").rename(start)
    out, fixture = load_file(tmp_path / "out" / "model.safetensors"), load_file(FIXTURE / "pi0" / "model.safetensors")
    assert set(out) == set(fixture)
    expert_head = "model.paligemma_with_expert.gemma_expert.lm_head.weight"
    assert out[expert_head].shape == fixture[expert_head].shape and not out[expert_head].any()


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_the_vision_head_hint_divides_the_width_and_says_no_file_records_the_count(name, tmp_path, capsys):
    """LeRobot's π0/π0.5 config.json has no field for the SigLIP head count and HF's q_proj [E, E]
    hides it: the fixture's tower is 24 wide with 2 heads, So400m's 16 does not divide 24. The
    hint names a divisor of the width and says the count is the one the tower was trained with."""
    from zerojax import cli

    code = cli.main(["train", f"model.init_from={FIXTURE / name}", f"data.source=lerobot:{FIXTURE / 'dataset'}",
                     f"train.out_dir={tmp_path / 'run'}", "train.steps=1"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("zerojax: error: ") and err.count("\n") == 1, err
    assert "the vision tower's head count cannot be read from the checkpoint's files (LeRobot's config.json does " \
           "not record it" in err and "16, the family's usual tower's, does not divide its width " \
           "model.vision.d_model=24" in err and "one of 1, 2, 3, 4, 6, 8, 12, 24" in err, err
    hint = int(err.split("try model.vision.n_heads=")[1].split()[0])
    assert 24 % hint == 0 and "(divides 24)" in err
    assert not (tmp_path / "run").exists()
