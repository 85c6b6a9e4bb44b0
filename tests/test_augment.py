"""data.augment (zerojax/data/augment.py): openpi's and LeRobot's image augmentation equal their
references at fixed parameters (tests/fixtures/augment/, scripts/fixtures/make_*_augment_fixture.py),
train on 8 devices at stage 3 as on one, and never reach evaluation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, run
from test_family import LEROBOT_TINY, POLICY_KEYS
from zerojax import config
from zerojax.config.data import LeRobotAugmentConfig, OpenpiAugmentConfig
from zerojax.data import augment
from zerojax.errors import ConfigError

FIXTURES = ROOT / "tests" / "fixtures" / "augment"
RUN = POLICY_KEYS + ["model.family=pi0", "train.steps=2", "train.log_every=1", "train.eval_every=0",
                     "train.sample_tokens=0", "train.ckpt_every=0", "zero.min_shard_size=64", "train.global_batch=16"]


def test_openpi_equals_preprocess_observation_on_a_fixed_key():
    """openpi's base camera (crop, resize, rotation, colour) and wrist camera (colour only), one
    key a row, the same for both cameras: augmax in openpi's pinned jax 0.5.3 wrote the
    reference; equal to float32 rounding (atol 1e-6)."""
    ref = np.load(FIXTURES / "openpi.npz")
    cameras = ["base_0_rgb", "left_wrist_0_rgb"]
    images = jnp.stack([jnp.moveaxis(jnp.asarray(ref[f"{c}/in"]), -1, 1) for c in cameras], axis=1)
    wrist = augment.wrist_slots((), [f"observation.images.{c}" for c in cameras])
    assert wrist == (False, True)
    out = augment.openpi_images(jnp.asarray(ref["key"]), images, wrist, OpenpiAugmentConfig())
    for i, camera in enumerate(cameras):
        np.testing.assert_allclose(np.moveaxis(np.asarray(out[:, i]), 1, -1), ref[f"{camera}/out"], atol=1e-6)
        assert np.abs(ref[f"{camera}/out"] - ref[f"{camera}/in"]).max() > 0.1  # the reference did augment


@pytest.mark.parametrize("op", ["brightness", "contrast", "saturation", "hue", "sharpness"])
def test_lerobots_colour_ops_equal_torchvisions(op):
    """Each colour op at the ends of LeRobot's default range and inside it, against torchvision
    0.29.1's v2 functional op: within 2e-7 (float32 rounding of the blends)."""
    ref = np.load(FIXTURES / "lerobot.npz")
    names = [k for k in ref.files if k.startswith(f"{op}/")]
    assert len(names) == 3
    for name in names:
        factor = float(name.split("/")[1])
        out = jax.vmap(lambda x: getattr(augment, f"adjust_{op}")(x, factor))(jnp.asarray(ref["in"]))
        np.testing.assert_allclose(out, ref[name], atol=2e-7, err_msg=name)


def test_lerobots_affine_equals_torchvisions_pixel_for_pixel():
    """RandomAffine's op (rotation, whole-pixel shift, nearest, zero fill) at four fixed draws:
    every pixel equal (a rotation's nearest pixel could flip where it falls on .5; none does here)."""
    ref = np.load(FIXTURES / "lerobot.npz")
    names = [k for k in ref.files if k.startswith("affine/")]
    assert len(names) == 4
    for name in names:
        degrees, tx, ty = map(float, name.split("/")[1].split("_"))
        out = jax.vmap(lambda x: augment.affine(x, degrees, tx, ty))(jnp.asarray(ref["in"]))
        np.testing.assert_array_equal(np.asarray(out), ref[name], err_msg=name)


def test_lerobot_draws_its_subset_per_image_and_its_ranges():
    """max_num_transforms of the six a (row, camera), every factor inside LeRobot's range."""
    p = LeRobotAugmentConfig()
    keys = jax.random.split(jax.random.PRNGKey(0), 2000)
    applies, (b, c, s, h, sharp, (degrees, tx, ty)) = jax.vmap(lambda k: augment.lerobot_params(k, 16, p))(keys)
    assert (applies.sum(1) == 3).all()
    np.testing.assert_allclose(applies.mean(0), 0.5, atol=0.05)  # each transform in half the subsets
    for x, lo, hi in ((b, 0.8, 1.2), (c, 0.8, 1.2), (s, 0.5, 1.5), (h, -0.05, 0.05), (sharp, 0.5, 1.5),
                      (degrees, -5, 5), (tx, -1, 1), (ty, -1, 1)):
        assert lo <= float(x.min()) and float(x.max()) <= hi and float(x.max() - x.min()) > 0.9 * (hi - lo)


def test_wrist_cameras_by_name_and_bad_names():
    cameras = ["observation.images.front", "observation.images.wrist", "observation.images.side"]
    assert augment.wrist_slots((), cameras) == (False, True, False)
    assert augment.wrist_slots(("side", "observation.images.front"), cameras) == (True, False, True)
    with pytest.raises(ConfigError, match="data.wrist_cameras names observation.images.hand.*front, "):
        augment.wrist_slots(("hand",), cameras)


def test_augment_needs_a_policys_batch():
    cfg = config.load(overrides=["model.family=twostack_model:build", f"data.source=lerobot:{LEROBOT_TINY}",
                                 "train.global_batch=4", "data.image_size=8", "data.action_horizon=2",
                                 "data.prompt_len=16", "data.augment=lerobot"])
    with pytest.raises(ConfigError, match="data.augment=lerobot augments a policy's batch .* "
                                          "model.family=twostack_model:build's batch has none"):
        augment.make(cfg)


def test_augment_needs_a_lerobot_dataset_and_a_known_kind():
    with pytest.raises(ConfigError, match="data.augment='flip' is not valid; choose one of none, openpi, lerobot"):
        config.load(overrides=["data.augment=flip"])
    with pytest.raises(ConfigError, match="data.augment=openpi .* needs data.source=lerobot:DIR"):
        config.load(overrides=["data.augment=openpi"])
    with pytest.raises(ConfigError, match=r"data.lerobot_augment.max_num_transforms=7 .* \[1, 6\]"):
        config.load(overrides=["data.lerobot_augment.max_num_transforms=7"])


# lerobot trains (the default lr) on 1 and 8 devices; openpi runs at lr 0, so that its runs also
# show that evaluation is never augmented: the weights never move, and the eval losses of an
# augmented run equal a plain run's while its train losses differ.
LR0 = ["optim.lr=0", "train.eval_every=2", "train.eval_batches=1", "data.val_fraction=0.34"]
KIND_KEYS = {"lerobot": ["data.augment=lerobot"], "openpi": ["data.augment=openpi", *LR0]}


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return {kind: run(RUN + keys + ["mesh.data=1", "mesh.replica=1", "zero.stage=0",
                                    f"train.out_dir={tmp_path_factory.mktemp(kind)}"])
            for kind, keys in KIND_KEYS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["openpi", "lerobot"])
def test_augmented_steps_on_8_devices_at_stage_3_give_one_devices_losses(kind, one_device, tmp_path):
    losses, _ = run(RUN + KIND_KEYS[kind] + ["zero.stage=3", "train.grad_accum=2", f"train.out_dir={tmp_path}"])
    np.testing.assert_allclose(losses, one_device[kind][0], rtol=1e-5)


@pytest.mark.slow
def test_evaluation_is_never_augmented(one_device, tmp_path):
    """At lr 0 the weights never move: the eval losses with and without augmentation are equal,
    while the train losses (of augmented images) differ."""
    plain = run(RUN + LR0 + ["data.augment=none", f"train.out_dir={tmp_path}"])[1].history
    augmented = one_device["openpi"][1].history
    evals = [[line["eval_loss"] for line in h if "eval_loss" in line] for h in (augmented, plain)]
    assert len(evals[0]) == 1
    np.testing.assert_allclose(evals[0], evals[1], rtol=1e-6)
    assert abs(augmented[0]["loss"] - plain[0]["loss"]) > 1e-4

def test_the_cost_benchmarks_configs_load():
    """scripts/bench/augment_step.py's three steps (BENCHMARKS.md, "Image augmentation's cost")."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import augment_step

    for kind in augment_step.KINDS:
        tiny = str(ROOT / "tests" / "fixtures" / "lerobot" / "tiny")
        cfg = config.load(overrides=augment_step.overrides(kind, 8, 224, tiny))
        made = augment.make(cfg)
        assert (made is None) == (kind == "none")
        if made is not None:
            assert made.wrist == (False, True) and made.params == getattr(cfg.data, f"{kind}_augment")


@pytest.mark.slow
def test_each_device_augments_its_own_rows_no_collective_added():
    """Stage 3 on 8 devices: the augmented step's HLO holds the same collectives, of the same
    bytes, as the plain step's (no image crosses devices; `zerojax analyze` stays exact). LeRobot's
    ops only, to keep the suite short: openpi's (augmax's per-row resampling) added none either
    when this was written (2026-12-06)."""
    from zerojax.analysis import hlo, measure

    counted = {}
    for kind in ("none", "lerobot"):
        cfg = config.load(overrides=[*RUN, f"data.augment={kind}"])
        _, compiled = measure.compile_step(cfg, measured_only=True)
        counted[kind] = hlo.collective_bytes(compiled.as_text(), 8)
    assert counted["none"]["counts"]["all-gather"] > 0
    assert counted["lerobot"] == counted["none"]
