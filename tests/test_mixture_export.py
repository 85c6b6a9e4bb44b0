"""A mixture run's LeRobot and openpi exports (zerojax/interop/lerobot_export.py, interop/openpi.py;
docs/design.md §5, "Dataset mixtures").

The premise of a per-dataset LeRobot export: in a mixture run a row of a dataset that lacks a
camera has that camera's slot all -1 and masked (data/mixture.py), while the dataset's own LeRobot
policy directory names only the cameras it has, in its order, the rest LeRobot's empty cameras
after them. The two layouts must give the same actions: a masked slot's tokens are no key of any
attention, and the positions are the cumulative sum of the mask (π0, π0.5 and SmolVLA alike), so
a camera that moves to an earlier slot past a masked one keeps its positions."""

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import ROOT
from zerojax.interop import lerobot

FIXTURES = ROOT / "tests" / "fixtures"
CHECKPOINTS = {"pi0": FIXTURES / "lerobot" / "pi0", "pi05": FIXTURES / "lerobot06" / "pi05",
               "smolvla": FIXTURES / "lerobot06" / "smolvla"}
OBSERVATION = ("tokens", "token_mask", "state")


@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_a_masked_camera_slot_changes_no_action(family):
    """Row 0 of the family's LeRobot reference batch, its second camera alone: in the mixture's
    layout (slot 0 masked and -1, the camera in slot 1) and in its export's (the camera in slot 0,
    slot 1 LeRobot's empty camera), and with garbage in the masked slot: the same actions from the
    same noise. Control: the -1 slot unmasked changes them."""
    directory = CHECKPOINTS[family]
    reference = load_file(directory.with_name(directory.name + ".reference.safetensors"))
    _, model = lerobot.load(directory, vision_heads=2)
    row = {k: jnp.asarray(reference[k][:1]) for k in OBSERVATION}
    camera, empty = reference["images"][0, 1], np.full_like(reference["images"][0, 1], -1.0)
    garbage = np.random.default_rng(0).uniform(-1, 1, camera.shape).astype(np.float32)
    noise = jnp.asarray(reference["sample_noise"][:1])

    def actions(images, masks):
        batch = {**row, "images": jnp.asarray(np.stack(images)[None]), "image_masks": jnp.asarray([masks])}
        return np.asarray(model.sample_actions(batch, noise))

    mixture = actions([empty, camera], [False, True])
    export = actions([camera, empty], [True, False])
    np.testing.assert_allclose(export, mixture, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(actions([garbage, camera], [False, True]), mixture, rtol=1e-6, atol=1e-6)
    assert np.abs(actions([empty, camera], [True, True]) - mixture).max() > 1e-3
