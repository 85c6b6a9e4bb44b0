"""zero.offload: Adam's moments (and the fp32 master) in pinned host memory, the update streamed
unit by unit; the same losses as on the device, the bytes where the plan puts them, checkpoints
across the two placements."""

import json
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, SMALL, TINY, sigterm_during
from zerojax import config, train
from zerojax.optim import offload
from zerojax.errors import ConfigError
from zerojax.analysis import formulas
from zerojax.analysis import measure
from zerojax.parallel import plan as plan_lib
from zerojax.parallel import trees
from zerojax.schedules import storage
from zerojax.train import state as state_lib
from zerojax.train import step as step_lib

MODES = ("none", "optimizer", "optimizer+master")
HOST = "pinned_host"


def kind(x) -> str:
    return x.sharding.memory_kind


def four_steps(overrides):
    """Losses and states of four steps, the second one poisoned (loss scale inf: skipped)."""
    setup = train.prepare(config.load(overrides=overrides))
    step = step_lib.make_train_step(setup.engine)
    state, losses = state_lib.init_state(setup.engine), []
    for i in range(4):
        batch = train.global_batch(setup, 0, i)
        if i == 1:
            before = jax.device_get(state)
            poisoned = state._replace(loss_scale=state.loss_scale._replace(scale=jnp.float32(jnp.inf)))
            state, metrics = step(poisoned, batch)
            assert bool(metrics["skipped"]) and int(state.step) == 1
            after = jax.device_get(state)  # bit-identical: master, moments, Adam's count, the weights
            jax.tree.map(np.testing.assert_array_equal, (after.params, after.opt_state, after.weights, after.ema),
                         (before.params, before.opt_state, before.weights, before.ema))
            state = state._replace(loss_scale=before.loss_scale)
            continue
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), state, setup.engine


# Stage 3 without LoRA: test_a_checkpoint_moves_between_placements (both values, grad_accum 2).
@pytest.mark.parametrize("stage,extra", [
    (1, []), (3, ["optim.lora.rank=4", "mesh.replica=2", "mesh.data=4"]),  # frozen base, hybrid mesh
    (2, []),
], ids=["stage1", "stage3-lora-2x4", "stage2"])
def test_offloaded_runs_match_the_device_run(stage, extra, tmp_path):
    base = TINY + SMALL + ["model.n_layers=3", "train.grad_accum=2", f"zero.stage={stage}",
                           f"train.out_dir={tmp_path}", *extra]
    reference, ref_state, _ = four_steps(base + ["zero.offload=none"])
    assert all(kind(x) == "device" for x in jax.tree.leaves(ref_state))
    for mode in MODES[1:]:
        losses, state, step = four_steps(base + [f"zero.offload={mode}"])
        np.testing.assert_allclose(losses, reference, rtol=1e-6)
        for a, b in zip(jax.tree.leaves((state.params, state.opt_state)),
                        jax.tree.leaves((ref_state.params, ref_state.opt_state))):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-7)
        plan = step.plan
        # Every optimizer-state copy of a parameter lives on the host; counts stay on the device.
        copies = plan_lib.map_like_params(state.opt_state, plan, lambda _, x: kind(x), lambda x: None)
        assert set(jax.tree.leaves(copies)) == {HOST}
        assert len(jax.tree.leaves(copies)) == 2 * len(jax.tree.leaves(plan.trained_leaves))
        master = plan.map(lambda leaf, x: (leaf.frozen, kind(x)), state.params)
        want = {(True, "device"), (False, HOST if mode == "optimizer+master" else "device")}
        assert set(jax.tree.leaves(master, is_leaf=lambda x: isinstance(x, tuple))) <= want
        if mode == "optimizer+master":  # the weights forward/backward read: the new master, in the gather dtype
            trained = trees.trained(state.params, plan.frozen)
            weights = storage.read_weights(state.weights, step.weights_dtype)
            jax.tree.map(lambda w, m: np.testing.assert_array_equal(w, np.asarray(m, w.dtype)), weights, trained)
            assert {kind(w) for w in jax.tree.leaves(state.weights)} == {"device"}
        else:
            assert state.weights is None


# optim.ema with the master on the host: the EMA lives there too, streamed with it unit by unit.
EMA_RUN = TINY + SMALL + ["model.n_layers=3", "zero.stage=3", "optim.ema=0.9", "optim.warmup_steps=0",
                          "optim.schedule=constant"]


def test_the_ema_lives_with_the_master_on_the_host_and_equals_the_device_run(tmp_path):
    _, ref, _ = four_steps(EMA_RUN + ["zero.offload=none", f"train.out_dir={tmp_path}"])
    losses, host, engine = four_steps(EMA_RUN + ["zero.offload=optimizer+master", f"train.out_dir={tmp_path}"])
    assert {kind(x) for x in jax.tree.leaves(host.ema)} == {HOST}  # where its master is
    assert {kind(x) for x in jax.tree.leaves(ref.ema)} == {"device"}
    for a, b, m in zip(jax.tree.leaves(host.ema), jax.tree.leaves(ref.ema), jax.tree.leaves(host.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    moved = [not np.array_equal(a, m) for a, m in zip(jax.tree.leaves(host.ema), jax.tree.leaves(host.params))]
    assert sum(moved) > len(moved) // 2  # an average, not the master (a few norms' scales barely move)
    # The host holds the master, m, v and the EMA (4 fp32 copies); the device the weights only.
    _, compiled = measure.compile_step(config.load(overrides=EMA_RUN + ["zero.offload=optimizer+master"]))
    memory = measure.measure_memory(compiled)
    assert memory["host_argument_bytes"] == pytest.approx(offloaded_bytes(engine, 4), rel=0.02)
    assert memory["host_output_bytes"] == memory["host_argument_bytes"]  # updated in place, on the host


def test_an_offloaded_ema_resumes_bit_for_bit(tmp_path):
    common = EMA_RUN + ["zero.offload=optimizer+master", "train.global_batch=32"]
    whole = train.run(config.load(overrides=common + [f"train.out_dir={tmp_path / 'whole'}"]), show_progress=False)
    out = tmp_path / "resumed"
    run_to = lambda steps: train.run(config.load(overrides=common + [f"train.steps={steps}", f"train.ckpt_every={steps}",
                                                                     f"train.out_dir={out}"]), show_progress=False)
    run_to(3)
    resumed = run_to(5)
    assert resumed.resumed_from == 3 and {kind(x) for x in jax.tree.leaves(resumed.state.ema)} == {HOST}
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state.ema), jax.device_get(whole.state.ema))


def test_memory_puts_the_ema_on_the_host_with_the_master():
    # 7.5B on 64 devices, stage 3: optimizer+master moves 12·Ψ/N, with optim.ema 4·Ψ/N more (the
    # EMA lives where the master does); the device keeps its 4·Ψ/N of weights and gradients.
    plain, ema = (formulas.memory_report(7.5e9, 64, offload="optimizer+master", ema=e) for e in (False, True))
    assert ema["stages"]["3"] == plain["stages"]["3"] == 0.46875e9
    assert ema["host_stages"]["3"] == 1.40625e9 + 4 * 7.5e9 / 64 == 1.875e9
    # with the master on the device, so is the EMA
    device = formulas.memory_report(7.5e9, 64, offload="optimizer", ema=True)
    assert device["stages"]["3"] == 0.9375e9 + 4 * 7.5e9 / 64 and device["host_stages"]["3"] == 0.9375e9


def unit_offloaded_bytes(step, per_param: int) -> int:
    """Per-device bytes of the largest unit's offloaded state (one layer of a stack, or the outer
    unit), `per_param` fp32 copies per trained element."""
    plan, units = step.plan, step.units

    def size(leaf, layer):
        stored = math.prod(leaf.stored[1:] if layer else leaf.stored)
        return stored // plan.data_size if leaf.dim is not None else stored

    trained = plan.trained_leaves
    outer = sum(size(leaf, False) for leaf in jax.tree.leaves(units.outer_of(trained)))
    layers = [sum(size(leaf, True) for leaf in jax.tree.leaves(trained[name])) for name in units.names if name in trained]
    return 4 * per_param * max([outer, *layers])


def offloaded_bytes(step, per_param: int) -> int:
    """Per-device bytes of `per_param` fp32 copies of every trained leaf, as the plan stores them."""
    plan = step.plan
    return 4 * per_param * sum(math.prod(leaf.stored) // (plan.data_size if leaf.dim is not None else 1)
                               for leaf in jax.tree.leaves(plan.trained_leaves))


@pytest.mark.parametrize("path,extra", [(None, []), (str(ROOT / "configs/llama-tiny.yaml"), []),
                                        (None, ["precision.compute=bfloat16"])],
                         ids=["gpt", "llama-tiny", "gpt-bf16"])
def test_device_and_host_bytes_from_the_compiled_step(path, extra):
    """What `zerojax analyze` reports (device_argument_bytes, host_argument_bytes: the memory
    spaces of the compiled program's parameters) against the plan, at stage 3."""
    measured, steps = {}, {}
    for mode in MODES:
        cfg = config.load(path, extra + ["zero.stage=3", f"zero.offload={mode}"])
        steps[mode], compiled = measure.compile_step(cfg)
        measured[mode] = measure.measure_memory(compiled)
    step = steps["none"]
    psi_n = measure.count_params(cfg) / step.plan.data_size
    small = step.plan.unsharded_bytes()  # replicated norms and biases (fp32)
    none, opt, full = measured["none"], measured["optimizer"], measured["optimizer+master"]
    assert none["host_argument_bytes"] == 0
    assert none["device_argument_bytes"] + none["host_argument_bytes"] == none["argument_bytes"]
    # optimizer: the master alone stays (4 bytes per parameter, /N)
    assert opt["device_argument_bytes"] <= (4 + 0.1) * psi_n + small
    assert opt["host_argument_bytes"] == pytest.approx(offloaded_bytes(step, 2), rel=0.02)
    # optimizer+master: the weights in the gather dtype only
    b_g = steps["optimizer+master"].weights_dtype.itemsize
    assert full["device_argument_bytes"] <= (b_g + 0.1) * psi_n + small * b_g / 4
    assert full["host_argument_bytes"] == pytest.approx(offloaded_bytes(step, 3), rel=0.02)
    assert opt["device_argument_bytes"] + opt["host_argument_bytes"] == none["argument_bytes"]
    for m in (opt, full):  # the donated host state comes back in place, on the host
        assert m["host_output_bytes"] == m["host_argument_bytes"] and formulas.peak_bytes(m) < formulas.peak_bytes(none)
    if b_g == 2:
        assert full["device_argument_bytes"] < 0.55 * opt["device_argument_bytes"]
    # Transient: at most one unit's offloaded state more than on the device. (With bf16 weights
    # stored as bf16 rather than as their bits, XLA's CPU backend held one more whole stack of
    # them upcast to f32: 440 KB over this bound on the default model.)
    for mode, per_param in (("optimizer", 2), ("optimizer+master", 3)):
        assert measured[mode]["temp_bytes"] <= none["temp_bytes"] + unit_offloaded_bytes(step, per_param), mode


def test_a_checkpoint_moves_between_placements(tmp_path):
    """Stage 3, two microbatches: saved with the master on the host, resumed on the device, saved,
    resumed with m and v on the host; the losses continue as one uninterrupted run's on the device
    (rtol 1e-6; padded leaves: vocab 300, d 36)."""
    base = ["model.d_model=36", "model.vocab_size=300", "model.n_layers=3", "model.n_heads=2", "model.d_ff=72",
            "model.seq_len=16", "train.global_batch=16", "train.grad_accum=2", "train.log_every=1",
            "train.eval_every=0", "train.sample_tokens=0", "zero.min_shard_size=64", "train.steps=6", "train.ckpt_every=2", "zero.stage=3"]

    def run(out, *extra):
        return train.run(config.load(overrides=base + [f"train.out_dir={out}", *extra]), show_progress=False)

    def losses(out):
        return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    run(tmp_path / "ref")
    out = tmp_path / "moved"
    with sigterm_during(2):
        assert run(out, "zero.offload=optimizer+master").stopped == train.Stopped("SIGTERM", 2)
    with sigterm_during(4):
        resumed = run(out)
    assert resumed.resumed_from == 2 and resumed.stopped == train.Stopped("SIGTERM", 4)
    last = run(out, "zero.offload=optimizer")
    assert last.resumed_from == 4
    mu = last.state.opt_state[1][0].mu  # (clip's, adamw's (scale_by_adam's, ...)) state
    assert {kind(x) for x in jax.tree.leaves(mu)} == {HOST}
    np.testing.assert_allclose(losses(out), losses(tmp_path / "ref"), rtol=1e-6)


def test_memory_calculator_bills_both_placements():
    # 7.5B parameters on 64 devices, stage 3 (the paper's 1.9 GB): 16·Ψ/N = 1.875e9 bytes.
    # optimizer: m and v (8·Ψ/N = 0.9375e9) to the host; the device keeps 8·Ψ/N.
    # optimizer+master: all 12·Ψ/N = 1.40625e9 to the host; the device keeps 4·Ψ/N = 0.46875e9.
    opt = formulas.memory_report(7.5e9, 64, offload="optimizer")
    assert opt["stages"]["3"] == 0.9375e9 and opt["host_stages"]["3"] == 0.9375e9
    full = formulas.memory_report(7.5e9, 64, offload="optimizer+master")
    assert full["stages"]["3"] == 0.46875e9 and full["host_stages"]["3"] == 1.40625e9
    # stage 1 keeps the 2 + 2 bytes of weights and gradients whole: 4·Ψ = 30e9 on the device.
    assert full["stages"]["1"] == 30e9 and "host_stages" not in formulas.memory_report(7.5e9, 64)


def test_offload_needs_the_shard_map_schedule_and_a_known_value():
    with pytest.raises(ConfigError, match="zero.schedule=shard_map"):
        config.load(overrides=["zero.offload=optimizer", "zero.schedule=gspmd"])
    with pytest.raises(ConfigError, match="none.*optimizer.*optimizer\\+master"):
        config.load(overrides=["zero.offload=cpu"])


def test_a_backend_without_pinned_host_memory_is_refused():
    device = SimpleNamespace(platform="tpu", addressable_memories=lambda: [SimpleNamespace(kind="device")])
    mesh = SimpleNamespace(devices=np.array([device]))
    with pytest.raises(ConfigError, match="pinned_host.*tpu backend.*device.*zero.offload=none"):
        offload.check_backend(mesh, "optimizer")
    offload.check_backend(mesh, "none")  # nothing asked of it
    offload.check_backend(jax.make_mesh((8,), ("data",)), "optimizer+master")  # the CPU backend has it
