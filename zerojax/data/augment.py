"""Image augmentation in the train step, the way openpi and LeRobot train their policies:
`data.augment=none|openpi|lerobot`, each transform's parameters under data.openpi_augment.* and
data.lerobot_augment.*.

Where: on the device, inside the jitted train step (`train.step.make_train_step`), on the
policy batch's camera images (`images` float32 [B, C, 3, S, S] in [-1, 1] and `image_masks` bool
[B, C], every built-in policy's batch: `models/vla/batch.py`). Evaluation (`make_eval_step`),
`zerojax serve` and `rollout` never call it. A camera slot the dataset lacks (masked) stays as
it was.

Randomness: a step's key is fold_in(fold_in(key(train.seed), STREAM), step), split into one key
a row of the global batch as openpi splits its key (`jax.random.split(rng, B)`). Each row's draws
are so a pure function of (seed, step, row): the same images on any mesh, any number of
processes and any train.grad_accum (the whole global batch is augmented before the schedule cuts
it into microbatches). `step` is the train state's step, the optimizer's count, which a step
skipped for a non-finite fp16 gradient does not advance.

openpi (`openpi/models/model.py` `preprocess_observation`, with augmax): the images mapped to
[0, 1]; a camera not named wrist gets augmax.RandomCrop to `crop_scale` of each side, Resize back
and Rotate(±rotate_degrees), which augmax fuses into one bilinear resampling with zero fill; every
camera gets augmax.ColorJitter(brightness, contrast, saturation, hue, p). zerojax calls augmax
itself (pyproject says why): its quirks are openpi's augmentation. Its ColorJitter works on HSV's
value and hue, draws the saturation and discards it, and applies with p = 0.5 (augmax's default,
which openpi leaves, as it leaves hue = 0.1). As in openpi, every camera of a row uses the row's
key, so two cameras of a row with the same chain get the same crop and colours. Wrist cameras:
`data.wrist_cameras`, by default those whose name holds "wrist" (openpi's `"wrist" not in key`).

LeRobot (0.6.1's `ImageTransformsConfig` enabled, `lerobot/datasets/transforms.py`; torchvision's
v2 functional ops written here in JAX): each camera's image gets `max_num_transforms` of the six
(each of weight 1: a subset drawn uniformly without replacement, as `RandomSubsetApply` draws
it), applied in LeRobot's order: brightness, contrast, saturation, hue, sharpness, affine. Each
camera draws its own (LeRobot transforms each camera's frame apart). One difference, measured
nowhere by LeRobot: LeRobot transforms a frame at its own size, before the policy resizes it with
padding; here the batch's images are already padded to S x S, so the pad band (0 in [0, 1]) takes
part: contrast moves it toward the image's mean, the affine moves it with the image.

tests/test_augment.py checks both against their references at fixed parameters, written in their
own venvs: scripts/fixtures/make_openpi_augment_fixture.py (augmax in openpi's pinned jax 0.5.3)
and make_lerobot_augment_fixture.py (torchvision 0.29.1's ops).
"""

from __future__ import annotations

from dataclasses import dataclass

import augmax
import jax
import jax.numpy as jnp

from zerojax.errors import ConfigError
from zerojax.models.family import CAMERA

STREAM = 0x41554701  # fold_in's constant for augmentation: its keys apart from any other stream of train.seed
LEROBOT_TRANSFORMS = ("brightness", "contrast", "saturation", "hue", "sharpness", "affine")  # LeRobot's order
GRAY_RGB = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale weights (ITU-R 601-2 luma, as PIL)
SHARPNESS_KERNEL = ((1.0, 1.0, 1.0), (1.0, 5.0, 1.0), (1.0, 1.0, 1.0))  # torchvision's (PIL's SMOOTH), / 13


@dataclass(frozen=True)
class Augment:
    """`data.augment` for one run: `augment(batch, step)` is the batch with its images augmented."""

    kind: str  # openpi | lerobot
    seed: int  # train.seed
    wrist: tuple[bool, ...]  # per camera slot of the batch: a wrist camera (openpi: no crop, no rotation)
    params: object  # data.openpi_augment or data.lerobot_augment

    def __call__(self, batch: dict, step) -> dict:
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(self.seed), STREAM), step)
        images = batch["images"]
        wrist = self.wrist + (False,) * (images.shape[1] - len(self.wrist))  # empty slots: masked anyway
        augmented = KINDS[self.kind](key, images, wrist, self.params)
        kept = batch["image_masks"][:, :, None, None, None]
        return {**batch, "images": jnp.where(kept, augmented, images)}


def make(cfg) -> Augment | None:
    """The run's augmentation (None: data.augment=none); ConfigError if data.wrist_cameras names
    a camera the batch does not hold."""
    d = cfg.data
    if d.augment == "none":
        return None
    check_batch(cfg)
    cameras = camera_slots(cfg)
    params = d.openpi_augment if d.augment == "openpi" else d.lerobot_augment
    return Augment(d.augment, cfg.train.seed, wrist_slots(d.wrist_cameras, cameras), params)


def check_batch(cfg) -> None:
    """The batch holds a policy's `images` and `image_masks` (ConfigError naming the family if not:
    a model of the user's that reads the dataset's own features gets nothing augmented)."""
    from zerojax.data import sources

    spec = sources.batch_spec(cfg)
    if not isinstance(spec, dict) or not {"images", "image_masks"} <= set(spec):
        raise ConfigError(f"data.augment={cfg.data.augment} augments a policy's batch (its `images` and "
                          f"`image_masks`); model.family={cfg.model.family}'s batch has none; use a built-in "
                          "policy family, or data.augment=none")


def camera_slots(cfg) -> list[str]:
    """The cameras of the batch's image slots, in order (the dataset's or the mixture's features,
    from their info.json)."""
    from zerojax.data import sources  # the readers: imported when a run augments, not by every train step

    return [k for k in sources.features_spec(cfg) if k.startswith(CAMERA)]


def wrist_slots(named: tuple[str, ...], cameras: list[str]) -> tuple[bool, ...]:
    """Which slots are wrist cameras: those `data.wrist_cameras` names, or by default those whose
    name holds "wrist" (openpi's rule)."""
    if not named:
        return tuple("wrist" in c[len(CAMERA):] for c in cameras)
    full = [n if n.startswith(CAMERA) else CAMERA + n for n in named]
    unknown = [n for n in full if n not in cameras]
    if unknown:
        raise ConfigError(f"data.wrist_cameras names {', '.join(unknown)}, which the batch does not hold; "
                          f"its cameras: {', '.join(cameras) or 'none'}")
    return tuple(c in full for c in cameras)


# ---------------------------------------------------------------------------------------------
# openpi: augmax's chain, as preprocess_observation builds it.


def openpi_chain(size: int, wrist: bool, p) -> augmax.Chain:
    """The augmax chain of one camera of S x S images (p: data.openpi_augment)."""
    transforms = []
    if not wrist:
        crop = int(size * p.crop_scale)
        transforms += [augmax.RandomCrop(crop, crop), augmax.Resize(size, size),
                       augmax.Rotate((-p.rotate_degrees, p.rotate_degrees))]
    transforms.append(augmax.ColorJitter(brightness=p.brightness, contrast=p.contrast, saturation=p.saturation,
                                         hue=p.hue, p=p.jitter_p))
    return augmax.Chain(*transforms)


def openpi_images(key, images_BC3SS, wrist: tuple[bool, ...], p):
    """openpi's augmentation of every camera (module docstring): images in [-1, 1], out likewise."""
    B, C, _, S, _ = images_BC3SS.shape
    row_keys = jax.random.split(key, B)
    out = []
    for c in range(C):
        unit_BSS3 = jnp.moveaxis(images_BC3SS[:, c], 1, -1) / 2.0 + 0.5
        augmented = jax.vmap(openpi_chain(S, wrist[c], p))(row_keys, unit_BSS3)
        out.append(jnp.moveaxis(augmented * 2.0 - 1.0, -1, 1))
    return jnp.stack(out, axis=1)


# ---------------------------------------------------------------------------------------------
# LeRobot: torchvision's v2 functional ops on one image x[3, H, W] in [0, 1].


def _gray(x_3HW):
    r, g, b = GRAY_RGB
    return x_3HW[0] * r + x_3HW[1] * g + x_3HW[2] * b


def _blend(x, y, factor):
    """torchvision's `_blend`: factor·x + (1 - factor)·y, clamped to [0, 1]."""
    return jnp.clip(factor * x + (1.0 - factor) * y, 0.0, 1.0)


def adjust_brightness(x_3HW, factor):
    return jnp.clip(x_3HW * factor, 0.0, 1.0)


def adjust_contrast(x_3HW, factor):
    return _blend(x_3HW, jnp.mean(_gray(x_3HW)), factor)


def adjust_saturation(x_3HW, factor):
    return _blend(x_3HW, _gray(x_3HW)[None], factor)


def adjust_hue(x_3HW, shift):
    """torchvision's adjust_hue: to HSV, the hue turned by `shift` (mod 1), back to RGB."""
    h, s, v = _rgb_to_hsv(x_3HW)
    return _hsv_to_rgb(jnp.mod(h + shift, 1.0), s, v)


def _rgb_to_hsv(x_3HW):
    r, g, b = x_3HW
    maxc, minc = x_3HW.max(0), x_3HW.min(0)
    equal = maxc == minc
    span = maxc - minc
    s = span / jnp.where(equal, 1.0, maxc)
    divisor = jnp.where(equal, 1.0, span)
    rc, gc, bc = (maxc - r) / divisor, (maxc - g) / divisor, (maxc - b) / divisor
    max_is_r, max_is_g = maxc == r, (maxc == g) & (maxc != r)
    max_is_b = ~max_is_r & ~max_is_g
    h = (jnp.where(max_is_r, bc - gc, 0.0) + jnp.where(max_is_g, 2.0 + rc - bc, 0.0)
         + jnp.where(max_is_b, 4.0 + gc - rc, 0.0))
    return jnp.mod(h / 6.0 + 1.0, 1.0), s, maxc


def _hsv_to_rgb(h, s, v):
    h6 = h * 6.0
    i = jnp.floor(h6)
    f = h6 - i
    i = jnp.mod(i.astype(jnp.int32), 6)
    p = jnp.clip(v * (1.0 - s), 0.0, 1.0)
    q = jnp.clip(v * (1.0 - s * f), 0.0, 1.0)
    t = jnp.clip(v * (1.0 - s + s * f), 0.0, 1.0)
    r = jnp.select([i == 0, i == 1, i == 2, i == 3, i == 4], [v, q, p, p, t], v)
    g = jnp.select([i == 0, i == 1, i == 2, i == 3, i == 4], [t, v, v, q, p], p)
    b = jnp.select([i == 0, i == 1, i == 2, i == 3, i == 4], [p, p, t, v, v], q)
    return jnp.stack([r, g, b])


def adjust_sharpness(x_3HW, factor):
    """torchvision's adjust_sharpness: blended with its smoothed copy (the 3x3 kernel over the
    interior; the one-pixel border kept)."""
    kernel = jnp.asarray(SHARPNESS_KERNEL, x_3HW.dtype) / 13.0
    H, W = x_3HW.shape[1:]
    smooth = sum(kernel[i, j] * x_3HW[:, i:H - 2 + i, j:W - 2 + j] for i in range(3) for j in range(3))
    degenerate = x_3HW.at[:, 1:-1, 1:-1].set(smooth)
    return _blend(x_3HW, degenerate, factor)


def affine(x_3HW, degrees, tx, ty):
    """torchvision's affine (rotation by `degrees` about the centre, then a shift of (tx, ty)
    pixels; scale 1, no shear), nearest-neighbour, zero fill: each output pixel reads the input
    at the inverse map, as F.affine's grid (align_corners=False) does."""
    H, W = x_3HW.shape[1:]
    a = jnp.deg2rad(degrees)
    cos, sin = jnp.cos(a), jnp.sin(a)
    y_out, x_out = jnp.meshgrid(jnp.arange(H) - (H - 1) / 2.0, jnp.arange(W) - (W - 1) / 2.0, indexing="ij")
    x_in = cos * x_out + sin * y_out + (cos * -tx + sin * -ty)
    y_in = -sin * x_out + cos * y_out + (-sin * -tx + cos * -ty)
    col, row = jnp.round(x_in + (W - 1) / 2.0).astype(jnp.int32), jnp.round(y_in + (H - 1) / 2.0).astype(jnp.int32)
    inside = (col >= 0) & (col < W) & (row >= 0) & (row < H)
    return jnp.where(inside, x_3HW[:, jnp.clip(row, 0, H - 1), jnp.clip(col, 0, W - 1)], 0.0)


def lerobot_params(key, size: int, p) -> tuple:
    """One image's draws: which transforms apply (bool [6]) and their factors, as LeRobot's
    transforms draw them (torchvision's ColorJitter and RandomAffine: each uniform in its range,
    the affine's shift rounded to whole pixels)."""
    choose, draw = jax.random.split(key)
    picked = jax.random.permutation(choose, len(LEROBOT_TRANSFORMS))[:p.max_num_transforms]
    applies = jnp.zeros(len(LEROBOT_TRANSFORMS), bool).at[picked].set(True)
    u = jax.random.uniform(draw, (8,), minval=-1.0, maxval=1.0)
    shift = p.translate * size  # square images: the same bound across and down
    factors = (1.0 + p.brightness * u[0], 1.0 + p.contrast * u[1], 1.0 + p.saturation * u[2], p.hue * u[3],
               1.0 + p.sharpness * u[4], (p.degrees * u[5], jnp.round(shift * u[6]), jnp.round(shift * u[7])))
    return applies, factors


def lerobot_image(key, x_3HW, p):
    """One camera image in [0, 1] through LeRobot's random subset of transforms."""
    applies, (b, c, s, h, sharp, (degrees, tx, ty)) = lerobot_params(key, x_3HW.shape[-1], p)
    ops = (lambda x: adjust_brightness(x, b), lambda x: adjust_contrast(x, c), lambda x: adjust_saturation(x, s),
           lambda x: adjust_hue(x, h), lambda x: adjust_sharpness(x, sharp), lambda x: affine(x, degrees, tx, ty))
    for i, op in enumerate(ops):
        x_3HW = jnp.where(applies[i], op(x_3HW), x_3HW)
    return x_3HW


def lerobot_images(key, images_BC3SS, wrist: tuple[bool, ...], p):
    """LeRobot's augmentation of every camera of every row (module docstring), each (row, camera)
    drawing its own; images in [-1, 1], out likewise. LeRobot has no wrist rule: `wrist` is unused."""
    B, C = images_BC3SS.shape[:2]
    keys = jax.vmap(lambda k: jax.random.split(k, C))(jax.random.split(key, B))
    unit = images_BC3SS / 2.0 + 0.5
    out = jax.vmap(jax.vmap(lambda k, x: lerobot_image(k, x, p)))(keys, unit)
    return out * 2.0 - 1.0


KINDS = {"openpi": openpi_images, "lerobot": lerobot_images}  # data.augment -> the batch's images augmented
