"""The batch is a pytree: a source of the user's own (tests/packed_source.py) yields packed rows
as a dict of named fields (tokens, loss_mask, segment_ids, positions); every leaf is sharded
over the mesh and split into microbatches alike; each packed example's loss equals its loss
alone, in every family; and a packed, masked run on 8 devices gives one device's losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import run
from zerojax import cli, config
from zerojax.models import protocol, registry
from zerojax.precision import Policy

import packed_source

T = 16
FAMILIES = {"gpt": [], "llama": ["model.n_kv_heads=1"], "gemma": ["model.n_kv_heads=1", "model.head_dim=8"]}


def tiny_model(family, extra=()):
    cfg = config.load(overrides=[f"model.family={family}", "model.d_model=32", "model.n_layers=2",
                                 "model.n_heads=2", "model.d_ff=64", f"model.seq_len={T}", *extra])
    return registry.build(cfg.model, Policy(), seed=0), cfg


def loss_of(model, batch):
    units = protocol.Units.of(model)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    loss, weight = protocol.forward(units, params, jax.tree.map(jnp.asarray, batch))
    return float(loss), float(weight)


def alone(row, k):
    """Example k of a packed row on its own, padded: (tokens, loss_mask) as a batch of one."""
    at = np.flatnonzero(row["segment_ids"] == k)
    tokens = np.zeros(T + 1, np.int32)
    n = len(at) + 1  # its inputs and its last target
    tokens[:n] = row["tokens"][at[0]:at[0] + n]
    mask = np.zeros(T, bool)
    mask[:n - 1] = row["loss_mask"][at]
    return {"tokens": tokens[None], "loss_mask": mask[None]}


def only(row, k, drop=()):
    """The packed row, its loss counting example k only (and without the fields in `drop`)."""
    out = {key: v[None] for key, v in row.items() if key not in drop}
    out["loss_mask"] = (row["loss_mask"] & (row["segment_ids"] == k))[None]
    return out


@pytest.fixture(scope="module")
def packed_row():
    corpus = packed_source.data.load_corpus("stdlib", 0.1, T)
    rng = np.random.default_rng(3)
    while True:
        row = packed_source.pack_row(corpus.train, T, rng)
        if row["segment_ids"].max() >= 3 and row["loss_mask"].sum() > 6:
            return row


@pytest.mark.parametrize("family", FAMILIES)
def test_each_packed_example_has_its_loss_alone(family, packed_row):
    model, _ = tiny_model(family, FAMILIES[family])
    for k in range(1, packed_row["segment_ids"].max() + 1):
        if not packed_row["loss_mask"][packed_row["segment_ids"] == k].any():
            continue
        packed, weight = loss_of(model, only(packed_row, k))
        single, single_weight = loss_of(model, alone(packed_row, k))
        assert weight == single_weight > 0
        np.testing.assert_allclose(packed, single, rtol=1e-5, atol=1e-6)
    # The control: without segment ids and positions, a later example sees the ones before it.
    last = packed_row["segment_ids"].max()
    crossing, _ = loss_of(model, only(packed_row, last, drop=("segment_ids", "positions")))
    assert abs(crossing - loss_of(model, alone(packed_row, last))[0]) > 1e-4


def test_the_mask_is_causal_within_segments_and_both_ways_in_the_prefix():
    seg = jnp.array([[1, 1, 1, 2, 2, 0]])
    prefix = jnp.array([[True, True, False, True, False, False]])
    mask = np.asarray(protocol.attention_mask({"segment_ids": seg, "prefix": prefix}, 6))[0]
    expected = np.array([[1, 1, 0, 0, 0, 0],   # prefix of segment 1: both ways with its prefix
                         [1, 1, 0, 0, 0, 0],
                         [1, 1, 1, 0, 0, 0],   # suffix: causal
                         [0, 0, 0, 1, 0, 0],   # segment 2 sees nothing of segment 1
                         [0, 0, 0, 1, 1, 0],
                         [0, 0, 0, 0, 0, 1]], bool)  # padding: only itself
    np.testing.assert_array_equal(mask, expected)


PACKED = ["data.source=packed_source:build", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
          "model.d_ff=64", f"model.seq_len={T}", "train.global_batch=16", "zero.min_shard_size=64",
          "train.steps=3", "train.log_every=1", "train.eval_every=3", "train.sample_tokens=0", "train.eval_batches=1", "train.ckpt_every=0"]


@pytest.mark.parametrize("family, extra", [
    ("llama", ["zero.stage=3", "train.grad_accum=2"]),
    ("gpt", ["zero.stage=2", "zero.schedule=gspmd", "mesh.replica=2", "mesh.data=4"]),
])
def test_a_packed_masked_run_on_8_devices_is_one_devices_run(family, extra, tmp_path):
    # Each device's rows hold different numbers of unmasked targets: only the weighted mean of
    # the protocol (Σ w·l / Σ w) makes 8 devices and 2 microbatches equal one device.
    common = PACKED + [f"model.family={family}", *FAMILIES[family]]
    ref, _ = run(common + ["mesh.data=1", "zero.stage=0", "zero.schedule=gspmd", f"train.out_dir={tmp_path / 'one'}"])
    losses, result = run(common + extra + [f"train.out_dir={tmp_path / 'many'}"])
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    assert np.isfinite(result.history[-1]["eval_loss"])


@pytest.mark.parametrize("source, message", [
    ("nowhere_module:build", "data.source=nowhere_module:build: cannot import nowhere_module"),
    ("packed_source:missing", "data.source=packed_source:missing: module packed_source has no callable 'missing'"),
    ("packed_source:not_a_source", "the factory returned a object without vocab_size, spec, rows"),
])
def test_a_bad_source_of_your_own_is_one_line_and_exit_2(source, message, tmp_path, capsys):
    code = cli.main(["train", f"data.source={source}", f"train.out_dir={tmp_path}", "train.steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("zerojax: error:") and message in err[0], err
    assert not any(tmp_path.iterdir())


def test_analyze_compiles_a_packed_batch_and_estimates_its_transients():
    # The structure fields travel with the activations as integer leaves: the compiled step and
    # the per-block estimate (a vjp with x as its own cotangent) must take them.
    cfg = config.load(overrides=PACKED + ["model.family=llama", "zero.stage=3"])
    from zerojax.analysis import measure

    stage = measure.analyze(cfg, (3,))["stages"]["3"]
    assert stage["temp_bytes"] > 0 and stage["transient_estimate"]["activations"] > 0
