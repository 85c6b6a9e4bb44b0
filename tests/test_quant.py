"""Block-quantized weight gathers (`precision.gather=int8 | float8_e4m3fn`, zerojax/quant.py):
every block within half a step of the master, gradients straight through, the train step at the
master equal to an unquantized one at the dequantized weights, bytes on the wire, bad input."""

import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import ROOT
from zerojax import cli, config, train
from zerojax.config import rules
from zerojax.schedules import quant
from zerojax import data as data_lib
from zerojax.parallel.mesh import DATA
from zerojax.precision import Policy
from zerojax.parallel.plan import LeafPlan
from zerojax.analysis import hlo as hlo_lib
from zerojax.analysis import measure
from zerojax.schedules import explicit
from zerojax.schedules.flat import UnitLayout
from zerojax.train import state as state_lib
from zerojax.train import step as step_lib

N = 8
FORMATS = ("int8", "float8_e4m3fn")


def data_mesh():
    return jax.make_mesh((N,), (DATA,), axis_types=(jax.sharding.AxisType.Auto,))


# ---------------------------------------------------------------------------------------------
# One unit: two sharded leaves and a small one, gathered through UnitLayout.

# Each device's flat buffer holds its rows of `a` [64, 40] (320 elements) then of `b` [16, 8]
# (16): 336 elements, cut into 4 blocks of 84, the last one straddling the two leaves.
PLANS = {"a": LeafPlan("a", (64, 40), (64, 40), 0, 4), "b": LeafPlan("b", (16, 8), (16, 8), 0, 4),
         "norm": LeafPlan("norm", (8,), (8,), None, 4)}
BLOCK, LOCAL = 100, 336


def flat_buffers() -> np.ndarray:
    """[N, 336] per-device buffers, with the blocks a test should have: zeros, outliers, and
    values across many magnitudes."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((N, LOCAL)) * 0.02).astype(np.float32)
    x[2, :84] = 0  # an all-zero block
    x[3, 100] = 1e3  # an outlier: the rest of its block rounds to (almost) nothing
    x[6, 200] = -7e-3 * 2**-30  # a tiny value among normal ones
    x[7, 252:336] *= np.logspace(-6, 2, 84, dtype=np.float32)  # the straddling block: eight decades
    x[1, 10] = -0.5  # a negative absmax
    return x


def leaves_of(flat: np.ndarray) -> dict:
    """Whole leaves from per-device buffers (the inverse of packing each device's rows)."""
    return {"a": flat[:, :320].reshape(64, 40), "b": flat[:, 320:].reshape(16, 8),
            "norm": np.linspace(1, 2, 8, dtype=np.float32)}


def gather(flat: np.ndarray, fmt: str, block: int = BLOCK) -> np.ndarray:
    """The unit gathered by UnitLayout under the quantized policy, back as [N, 336]."""
    policy = Policy(gather=jnp.dtype(fmt), quant_block=block)
    layout = UnitLayout(PLANS, False, N)
    specs = {"a": P(DATA), "b": P(DATA), "norm": P()}
    run = jax.jit(jax.shard_map(lambda shards: layout.gather(shards, policy), mesh=data_mesh(),
                                in_specs=(specs,), out_specs=P(), check_vma=False))
    whole = jax.device_get(run(leaves_of(flat)))
    assert whole["norm"].dtype == np.float32 and np.array_equal(whole["norm"], leaves_of(flat)["norm"])
    return np.concatenate([whole["a"].reshape(N, 320), whole["b"].reshape(N, 16)], axis=1)


def half_step(v: np.ndarray, fmt: str) -> np.ndarray:
    """Half the spacing of the format's grid at v (v in units of the block's scale)."""
    if fmt == "int8":
        return np.full_like(v, 0.5)
    finfo = ml_dtypes.finfo(ml_dtypes.float8_e4m3fn)  # 3 mantissa bits; subnormals below 2^-6
    exponent = np.floor(np.log2(np.maximum(np.abs(v), finfo.smallest_normal)))
    return 2.0 ** (exponent - finfo.nmant) / 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_block_is_within_half_a_step_of_the_master(fmt):
    flat = flat_buffers()
    got = gather(flat, fmt)
    count, length = quant.blocks(LOCAL, BLOCK)
    assert (count, length) == (4, 84)
    pad = count * length - LOCAL
    x = np.pad(flat, ((0, 0), (0, pad))).reshape(N, count, length)
    y = np.pad(got, ((0, 0), (0, pad))).reshape(N, count, length)
    scale = np.abs(x).max(axis=2, keepdims=True) / quant.QUANT_FORMATS[fmt].largest
    for d in range(N):
        for b in range(count):
            s, xs, ys = scale[d, b, 0], x[d, b], y[d, b]
            if s == 0:
                assert not ys.any(), (d, b)  # an all-zero block comes back as zeros
                continue
            error = np.abs(ys - xs) / s  # in steps of this block's own scale
            bound = half_step(xs / s, fmt) * (1 + 1e-6) + 1e-6  # fp32 rounding of q · scale
            assert (error <= bound).all(), (fmt, d, b, error.max(), xs[np.argmax(error - bound)])
            top = np.argmax(np.abs(xs))
            np.testing.assert_allclose(ys[top], xs[top], rtol=1e-6)  # the absmax is on the grid
    assert got[3, 100] == pytest.approx(1e3, rel=1e-6)
    # The outlier's block pays for it (its 0.02-sized values are below half its int8 step),
    # while every other block kept its own fine step (the loop above).
    if fmt == "int8":
        assert not got[3, 84:100].any()


def test_gradient_is_straight_through():
    """d/dx L(quantized gather of x) is dL/dw at the dequantized w, reduce-scattered: the same
    as an unquantized gather's of the dequantized shards, and not round's zero."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((N, 300)).astype(np.float32))
    loss = lambda w: jnp.sum(jnp.sin(3 * w) * jnp.arange(w.size, dtype=w.dtype).reshape(w.shape))

    def local(x):
        q = lambda x: quant.all_gather(x[0], DATA, 64, jnp.int8, jnp.float32)
        deq = quant.dequantize(*quant.quantize(x[0], 64, jnp.int8), x.shape[1], jnp.float32)  # this device's
        plain = lambda y: jax.lax.all_gather(y, DATA)
        return jax.grad(lambda x: loss(q(x)))(x), jax.grad(lambda y: loss(plain(y)))(deq)[None], q(x)[None]

    run = jax.shard_map(local, mesh=data_mesh(), in_specs=P(DATA), out_specs=P(DATA), check_vma=False)
    straight, reference, gathered = jax.device_get(jax.jit(run)(x))
    np.testing.assert_allclose(straight, reference, rtol=1e-6, atol=1e-5)
    assert np.abs(straight).min() > 0 or np.count_nonzero(straight) > 0.99 * straight.size
    assert not np.array_equal(gathered[0], np.asarray(x))  # the weights were rounded


def test_cpu_moves_an_fp8_typed_gather_as_f16_so_the_payload_travels_as_bytes():
    """DESIGN §8: XLA's CPU backend moves an fp8 all-gather as f16 (2 bytes); quant moves s8."""
    def typed(x):
        return jax.lax.all_gather(x.astype(jnp.float8_e4m3fn), DATA).astype(jnp.float32)

    def quantized(x):
        return quant.all_gather(x, DATA, 2048, jnp.float8_e4m3fn, jnp.float32)

    x = jax.ShapeDtypeStruct((N * 4096,), jnp.float32)
    for fn, moved, per_element in ((typed, "f16", 2), (quantized, "s8", 1 + 4 / 2048)):
        hlo = jax.jit(jax.shard_map(fn, mesh=data_mesh(), in_specs=P(DATA), out_specs=P(), check_vma=False)
                      ).lower(x).compile().as_text()
        comm = hlo_lib.collective_bytes(hlo, N)
        assert comm["dtypes"]["all-gather"] == moved and comm["counts"]["all-gather"] == 1
        assert comm["bytes"]["all-gather"] == pytest.approx((N - 1) * 4096 * per_element)


# ---------------------------------------------------------------------------------------------
# The train step: quantized at the master = unquantized at the dequantized weights.

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64", "model.seq_len=16",
        "train.global_batch=32", "zero.min_shard_size=64"]
STEPS = 3


@functools.lru_cache(maxsize=None)
def compiled(overrides: tuple):
    """A run's setup and its jitted train step, shared by the tests that start from other states."""
    setup = train.prepare(config.load(overrides=list(overrides)))
    return setup, step_lib.make_train_step(setup.engine)


def run_steps(overrides, loaded=None):
    """(loss, grad norm) of each of STEPS train steps from `loaded` (or the init)."""
    setup, train_step = compiled(tuple(overrides))
    state, out = state_lib.init_state(setup.engine, loaded=loaded), []
    for i in range(STEPS):
        state, metrics = train_step(state, train.global_batch(setup, data_lib.TRAIN, i))
        out.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    return np.array(out)


# quant_block=64 cuts the outer unit (1024 + 64 local elements) at the same places whichever
# order its leaves are packed in, so the weights the step sees are exactly gathered_weights'.
# Both formats and both gather paths (per unit and pass; whole stacks once per step) in two runs.
@pytest.mark.parametrize("gather, stage", [("int8", 3), ("float8_e4m3fn", 1)])
def test_step_at_the_master_is_the_unquantized_step_at_the_dequantized_weights(gather, stage):
    quantized = TINY + [f"precision.gather={gather}", f"zero.stage={stage}", "zero.quant_block=64"]
    exact = TINY + [f"zero.stage={stage}"]
    step = compiled(tuple(quantized))[0].engine
    master = state_lib.init_state(step).params
    seen = explicit.gathered_weights(step.mesh, step.plan, step.policy, step.units)(master)
    got, reference = run_steps(quantized), run_steps(exact, loaded=jax.device_get(seen))
    # First step: the same weights in the forward and the same (straight-through) gradient.
    np.testing.assert_allclose(got[0], reference[0], rtol=2e-6)
    # The loss stays close to the unquantized run's from the same master.
    unquantized = run_steps(exact)
    assert not np.array_equal(got[:, 0], unquantized[:, 0])  # the gathers did round
    np.testing.assert_allclose(got[:, 0], unquantized[:, 0], rtol=2e-3 if gather == "int8" else 5e-3)


# ---------------------------------------------------------------------------------------------
# Bytes on the wire: DESIGN §2 with b_g = 1 + 4 / quant_block, half of an fp32 gather's.

SHAPE_3M = ["model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.d_ff=1024", "model.seq_len=128",
            "train.global_batch=32", "precision.compute=bf16", "model.remat=full"]


@pytest.mark.parametrize("shape", [[], SHAPE_3M], ids=["default", "3.3M"])
def test_stage3_int8_bytes_match_the_formula_and_halve_fp32s(shape):
    def stage3(gather):
        return measure.analyze(config.load(overrides=shape + [f"precision.gather={gather}"]), (3,))["stages"]["3"]

    int8, fp32 = stage3("int8"), stage3("float32")
    assert int8["comm_dtypes"]["all-gather"] == "s8" and fp32["comm_dtypes"]["all-gather"] == "f32"
    assert int8["gather_bytes_per_element"] == 1 + 4 / 2048
    assert abs(int8["comm_bytes"] / int8["comm_theory_bytes"] - 1) <= 0.02, int8
    assert int8["comm_bytes"] <= 0.55 * fp32["comm_bytes"], (int8["comm_bytes"], fp32["comm_bytes"])
    assert int8["comm"]["reduce-scatter"] == fp32["comm"]["reduce-scatter"]  # precision.reduce: unchanged
    assert int8["comm_counts"]["all-gather"] == fp32["comm_counts"]["all-gather"]  # one gather per unit and pass


# ---------------------------------------------------------------------------------------------
# Bad input, and the commands that accept a quantized gather.


@pytest.mark.parametrize("overrides, message", [
    (["precision.gather=int8", "zero.schedule=gspmd"],
     "supported with zero.schedule=shard_map at zero.stage 1, 2 or 3"),
    (["precision.gather=int8", "zero.stage=0"], "not with zero.schedule=shard_map at zero.stage 0"),
    (["precision.gather=float8_e4m3fn", "zero.schedule=gspmd", "zero.stage=2"], "not with zero.schedule=gspmd"),
    (["precision.gather=int8", "zero.quant_block=0"], "zero.quant_block=0 is not valid; it must be >= 1"),
    (["zero.quant_block=-5"], "zero.quant_block=-5 is not valid"),
    (["precision.gather=int4"], "choose one of auto, float32, bfloat16, float16, int8, float8_e4m3fn"),
])
def test_bad_input_exits_2_naming_what_is_supported(overrides, message, capsys):
    with pytest.raises(config.ConfigError, match=message):
        config.load(overrides=overrides)
    assert cli.main(["train", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax: error:") and message in err and len(err.strip().splitlines()) == 1


def test_memory_and_analyze_accept_a_quantized_gather(capsys):
    tiny = str(ROOT / "configs" / "tiny.yaml")
    assert cli.main(["memory", "--config", tiny, "precision.gather=int8", "--devices", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params"] == 842_496
    cfg = config.load(overrides=["precision.gather=int8"])
    assert measure.supported_stages(cfg) == (1, 2, 3)  # analyze's default: stage 0 gathers nothing
    assert cli.main(["analyze", "precision.gather=int8", "--stages", "0", "--json"]) == 2
    assert "zero.stage 0" in capsys.readouterr().err


def test_the_quantized_formats_are_the_configs():
    assert tuple(quant.QUANT_FORMATS) == rules.QUANTIZED_GATHERS


@pytest.mark.parametrize("gather", ["auto", "bf16", "int8", "float8_e4m3fn"])
@pytest.mark.parametrize("schedule", rules.SCHEDULES)
def test_analyze_compiles_by_default_the_stages_the_config_accepts(gather, schedule):
    """One rule: the stages `analyze` compiles when none are asked for are those at which the
    config itself loads."""
    def loads(stage):
        try:
            return config.load(overrides=[f"precision.gather={gather}", f"zero.schedule={schedule}",
                                          f"zero.stage={stage}"])
        except config.ConfigError:
            return None

    accepted = tuple(s for s in rules.STAGES if loads(s))
    assert accepted == ((1, 2, 3) if gather in ("int8", "float8_e4m3fn") and schedule == "shard_map" else
                        () if gather in ("int8", "float8_e4m3fn") else (0, 1, 2, 3))
    if accepted:
        assert measure.supported_stages(loads(accepted[0])) == accepted
