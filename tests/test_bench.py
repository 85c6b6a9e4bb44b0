"""The GPU benchmark's rehearsal: `scripts/bench/bench_gpu.sh --dry-run` runs the plan on CPU with tiny
shapes, and every rehearsed measurement leaves its JSON entry or a named skip; every other
measurement's config loads. So the script cannot rot between GPUs."""

import json
import math
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import jax

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts" / "bench"))
from benchlib import peer, plan  # noqa: E402 - scripts/bench/benchlib/, the package behind scripts/bench/bench.py

THROUGHPUT_KEYS = ("step_s", "tokens_per_sec", "mfu", "compile_s", "params", "loss", "analyze_peak_bytes",
                   "temp_bytes", "comm_bytes", "peak_bytes_in_use", "platform", "devices", "wall_s")
FIT_KEYS = ("stage", "budget_bytes", "found", "confirmed", "step_s", "tokens_per_sec", "mfu", "peak_bytes_in_use")


def clean_env(**more):
    """The environment CI gives the script: none of conftest's device flags."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return {**env, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **more}  # this checkout's zerojax


# One measurement of each kind the plan runs (a schedule and its stage, the gspmd peer, offload,
# quantized gathers, the fit search) and EXTRA's plan_check: the others differ from these only
# in their configs, which test_every_measurements_config_loads loads. The whole plan (`bash
# scripts/bench/bench_gpu.sh --dry-run`) takes 136 s on this workplace's 2 cores, these about 100 s.
REHEARSED = ("gpt1b_s3_shard_map", "gpt1b_s3_gspmd", "offload_optimizer_master_s3", "gather_int8_s3", "fit_s3",
             "plan_check", "llama1b_8k_blockwise", "llama1b_8k_cudnn")
CHOSEN = [m for m in plan.PLAN + plan.EXTRA if m.name in REHEARSED]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    start = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "bench" / "bench_gpu.sh"), "--dry-run", "--only", ",".join(REHEARSED)],
                          cwd=ROOT,
                          env=clean_env(OUT=str(out)), capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "bench_gpu.json").read_text()), proc.stdout, seconds


@pytest.mark.slow
def test_dry_run_measures_every_planned_measurement_or_names_its_skip(dry_run):
    doc, stdout, seconds = dry_run
    assert doc["meta"]["dry_run"] and doc["meta"]["finished"] and not doc["meta"]["cut_short"]
    assert [row["name"] for row in doc["plan"]] == [m.name for m in CHOSEN] and len(CHOSEN) == len(REHEARSED)
    assert set(doc["results"]) == set(REHEARSED)
    for m in CHOSEN:
        entry = doc["results"][m.name]
        if entry["status"] == "skipped":  # only a feature that has not landed may be skipped
            assert m.feature and entry["reason"].startswith(m.feature), (m.name, entry)
            continue
        assert entry["status"] == "ok", (m.name, entry)
        keys = FIT_KEYS if m.fit_stage is not None else THROUGHPUT_KEYS
        assert not [k for k in keys if k not in entry], (m.name, entry)
        assert entry["step_s"] > 0 and math.isfinite(entry["loss"]) and 0 < entry["mfu"] < 1
        assert entry["peak_bytes_in_use"] is None and "None on cpu" in entry["memory_stats"]  # CPU: no stats
        assert entry["devices"] == 8  # the package simulates them itself, no XLA_FLAGS
    print(f"dry run: {seconds:.0f} s")
    for m in CHOSEN:  # each row of the summary names its measurement
        assert f"| {m.name}" in stdout


@pytest.mark.slow
def test_dry_run_fit_search_found_a_size_under_its_budget_and_ran_it(dry_run):
    doc, _, _ = dry_run
    for m in (m for m in CHOSEN if m.fit_stage is not None):
        entry = doc["results"][m.name]
        assert entry["found"]["peak_bytes"] <= entry["budget_bytes"], entry
        assert entry["confirmed"] and entry["stage"] == m.fit_stage


@pytest.mark.slow
def test_dry_run_compares_options_and_schedules(dry_run):
    doc, _, _ = dry_run
    summary = doc["summary"]
    assert summary["shard_map_over_gspmd_stage3_tokens_per_sec"] > 0
    for m in (m for m in CHOSEN if m.baseline):  # None where the feature has not landed
        ok = doc["results"][m.name]["status"] == "ok"
        assert (summary[f"{m.name}_step_s_over_{m.baseline}"] is not None) == ok


@pytest.mark.slow
def test_dry_run_plans_then_runs_the_plans_winner(dry_run):
    doc, _, _ = dry_run
    entry = doc["results"]["plan_check"]
    assert entry["status"] == "ok" and entry["winner"]["fits"] and entry["plan_compiles"] >= 1, entry
    assert entry["plan_peak_bytes"] <= entry["budget_bytes"]
    # on the CPU the run compiles what the plan compiled: its analyze peak is the plan's peak
    assert entry["analyze_peak_bytes"] == entry["plan_peak_bytes"]
    assert entry["step_s_over_plan"] == entry["step_s"] / entry["plan_step_s"] > 0
    assert entry["peak_within_budget"] is None  # CPU: no memory_stats to hold against the budget
    assert doc["summary"]["plan_check_step_s_over_estimate"] == entry["step_s_over_plan"]


@pytest.mark.slow
def test_dry_run_times_the_quantized_gathers(dry_run):
    doc, _, _ = dry_run
    assert any(m.quant_overhead for m in CHOSEN)
    for m in (m for m in CHOSEN if m.quant_overhead):
        entry = doc["results"][m.name]
        assert entry["status"] == "ok" and entry["all_gather_dtype"] == "s8", entry  # 8 devices: gathered
        assert entry["quant_s_per_step"] > 0 and entry["cast_s_per_step"] > 0
        assert doc["summary"][f"{m.name}_quant_overhead_of_step"] == entry["quant_overhead_of_step"]


@pytest.mark.parametrize("dry", [True, False], ids=["dry run", "GPU"])
def test_every_measurements_config_loads(dry):
    for m in plan.PLAN + plan.EXTRA:
        assert plan.unavailable(m, dry_run=dry) is None or m.feature, m.name  # raises where a core config breaks


def test_plan_fits_in_eight_minutes_of_an_h200():
    assert plan.SETUP_S + sum(m.h200_s for m in plan.PLAN) <= 8 * 60
    assert len({m.name for m in plan.PLAN}) == len(plan.PLAN)
    assert all(m.baseline in plan.BY_NAME for m in plan.PLAN if m.baseline)


def test_missing_feature_is_a_named_skip_but_a_broken_core_config_is_an_error():
    feature = plan.Measurement("x", "x", 1, ("zero.no_such_key=1",), feature="zero.no_such_key")
    assert plan.unavailable(feature, dry_run=True).startswith("zero.no_such_key: not in zerojax yet")
    with pytest.raises(ValueError, match="no_such_key"):
        plan.unavailable(plan.Measurement("x", "x", 1, ("zero.no_such_key=1",)), dry_run=True)
    assert plan.unavailable(plan.BY_NAME["gpt1b_s3_shard_map"], dry_run=False) is None


def test_without_a_gpu_the_real_run_fails_fast_and_says_why(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "bench" / "bench_gpu.sh")], cwd=ROOT, capture_output=True, text=True,
                          env=clean_env(OUT=str(tmp_path), JAX_PLATFORMS="cpu"), timeout=120)
    assert proc.returncode == 2 and "has no GPU backend" in proc.stderr
    assert not (tmp_path / "bench_gpu.json").exists()


def run_plan(tmp_path, *args):
    """`bench.py plan --dry-run`, its working files (and so its children's command lines) in tmp_path."""
    return subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench" / "bench.py"), "plan", "--dry-run",
                             "--out", str(tmp_path / "b.json"), *args], cwd=ROOT, env=clean_env(TMPDIR=str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_no_time_left_skips_everything_by_name(tmp_path):
    proc = run_plan(tmp_path, "--deadline-s", "0")
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    doc = json.loads((tmp_path / "b.json").read_text())
    assert {e["status"] for e in doc["results"].values()} == {"skipped"}
    assert len(doc["results"]) == len(plan.PLAN)


def test_sigterm_keeps_what_was_measured_and_names_the_rest(tmp_path):
    """What the hard timeout does: the running measurement's process group is killed, the rest
    are recorded as cut short, and the JSON document is complete."""
    proc = run_plan(tmp_path, "--only", "gpt1b_s0_shard_map,gpt1b_s3_shard_map")
    log = tmp_path / "b.log"
    deadline = time.monotonic() + 60
    while "== gpt1b_s0_shard_map" not in (log.read_text() if log.exists() else ""):  # a child is running
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
        time.sleep(0.2)
    assert children_of(tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 124
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["meta"]["cut_short"] and doc["meta"]["finished"]
    assert [e["reason"] for e in doc["results"].values()] == ["cut short by the hard time limit"] * 2
    # SIGKILLed with its group; a forked grandchild (not the plan's to wait for) is torn down by the
    # kernel a moment later, which on a loaded machine takes a while
    deadline = time.monotonic() + 20
    while children_of(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not children_of(tmp_path)


def children_of(tmp_path) -> list[str]:
    """Measurements still running whose command line names this test's directory."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found += [text] if str(tmp_path) in text and "bench.py measure" in text else []
    return found


def test_transient_peer_is_the_same_model_sharded_by_scalax():
    """`bench.py transient`'s peer: scalax's FSDPShardingRule splits every leaf of at least
    zero.min_shard_size elements over the data axis, and its step's loss is the model's."""
    pytest.importorskip("scalax", reason="the peer of `bench.py transient` needs scalax (pip install scalax), which "
                        "zerojax does not depend on; CI installs zerojax[test] only")
    import jax
    import numpy as np
    from flax import nnx

    from zerojax import config
    from zerojax.models import protocol
    from zerojax.parallel.mesh import DATA
    from zerojax.train.model import build_model

    cfg = config.load(None, [*plan.DRY, *peer.LIKE_FOR_LIKE, "optim.warmup_steps=0"])  # lr > 0 at step 0
    step, jitted, state, batch = peer.peer_step(cfg)
    params, opt_state = state
    for leaf in jax.tree.leaves(params) + jax.tree.leaves(opt_state):
        split = DATA in tuple(leaf.sharding.spec)
        assert split == (leaf.size >= cfg.zero.min_shard_size), (leaf.shape, leaf.sharding.spec)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    real = jax.jit(lambda: (lambda p: (p, step.optimizer.init(p)))(
        nnx.to_pure_dict(nnx.state(build_model(step.model, step.policy, step.seed), nnx.Param))),
        out_shardings=shardings)()
    tokens = jax.device_put(np.random.default_rng(0).integers(0, cfg.model.vocab_size, batch.shape, np.int32),
                            batch.sharding)
    expected = jax.jit(lambda p, b: protocol.forward(step.units, p, b)[0])(real[0], tokens)  # unsharded, no remat
    before = [np.asarray(x) for x in jax.tree.leaves(real[0])]  # the step donates `real`
    (new_params, _), loss = jitted(real, tokens)
    assert float(loss) == pytest.approx(float(expected), rel=1e-3)
    assert all(np.any(np.asarray(x) != b) for x, b in zip(jax.tree.leaves(new_params), before))  # AdamW moved each


# (entry, a row's tokens in its dry run: 28² images at patch 14, the prompt, π0's state, H actions)
POLICY_ENTRIES = [("pi0_full_s3", 4 + 6 + 1 + 4), ("pi05_full_s3", 4 + 24 + 4)]  # π0.5: no state token


@pytest.mark.parametrize("name, row_tokens", POLICY_ENTRIES, ids=[n for n, _ in POLICY_ENTRIES])
def test_policies_random_batches_have_their_shapes_real_actions_and_a_flow_time(name, row_tokens, monkeypatch):
    """The π0 and π0.5 entries (`--only pi0_full_s3,pi0_lora_s3` and `pi05_...`, not rehearsed: a
    policy's compile costs the suite a minute) time random batches of the policy's own shapes
    (π0.5's with no dataset named: its widest): every action real (a batch of padding only has no
    loss: NaN), every camera and token present, the time inside (0, 1); a row's tokens are its
    joint sequence."""
    from benchlib import measure
    from zerojax import config
    from zerojax.parallel import mesh as mesh_lib
    from zerojax.train import step as step_lib

    monkeypatch.chdir(ROOT)  # the entry names the tiny LeRobot dataset as bench_gpu.sh runs it, from the checkout
    m = plan.BY_NAME[name]
    cfg = config.load(ROOT / m.config, plan.overrides(m, dry_run=True))
    mesh = mesh_lib.make_mesh(cfg.mesh)
    batch = measure.random_batch(cfg, jax.random.key(0), mesh_lib.batch_sharding(mesh))
    shapes = step_lib.batch_shape(cfg)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), batch) == jax.tree.map(lambda x: (x.shape, x.dtype), shapes)
    assert not batch["action_is_pad"].any() and batch["image_masks"].all() and batch["token_mask"].all()
    assert 0 < float(batch["time"].min()) and float(batch["time"].max()) < 1
    assert 0 <= int(batch["tokens"].min()) and int(batch["tokens"].max()) < cfg.model.vocab_size
    assert float(batch["images"].min()) >= -1 and float(batch["images"].max()) <= 1 and batch["images"].std() > 0.1
    rates = measure.rates(cfg, step_lib.make_engine(cfg, mesh), 0, 0.5, types.SimpleNamespace(peak_tflops=989))
    assert rates["samples_per_sec"] == 16 / 0.5 and rates["tokens_per_sec"] == 16 * row_tokens / 0.5
    assert 0 < rates["mfu"] < 1e-3


def test_policy_memory_tables_pick_the_smallest_device_count_that_fits_each_card():
    import policy_memory  # scripts/bench/policy_memory.py: the README's π0 and π0.5 memory tables

    GB = 1e9
    peaks = {"full": (64.8, 33.9, 20.6, 14.2), "offload_optimizer": (43.7, 23.0, 15.1, 11.2),
             "offload_optimizer_master": (45.4, 22.7, 13.3, 10.3), "lora16": (24.3, 16.0, 10.6, 8.2)}
    row = lambda peak: {"peak_bytes": peak * GB, "formula_bytes": 1.0, "host_argument_bytes": 0}
    doc = {"mem_fraction": 0.75, "recipes": list(policy_memory.PI0_RECIPES), "cards_gb": [24, 48, 80],
           "runs": {policy_memory.key(name, n): {"stages": {"0": row(p), "3": row(p)} if n > 1 and "lora" in name
                                                 else {"3": row(p)}}
                    for name, ps in peaks.items() for n, p in zip(policy_memory.DEVICES, ps)}}
    doc["runs"]["full@1"]["stages"] = {"0": row(64.8)}  # one device: its only compile, stage 0
    for n, p in zip((2, 4, 8), (64.0, 63.0, 62.0)):
        doc["runs"][f"full@{n}"]["stages"]["0"] = row(p)
    budget = lambda card, fraction: fraction * card * GB - GB
    assert policy_memory.smallest(doc, "full", budget(24, 0.75)) == 8  # 17.0 GB: only 8 devices' 14.2
    assert policy_memory.smallest(doc, "full", budget(24, 0.95)) == 4  # 21.8 GB: 4 devices' 20.6
    assert policy_memory.smallest(doc, "full", budget(80, 0.95)) == 1  # 75 GB: one device's 64.8
    assert policy_memory.smallest(doc, "full", budget(16, 0.75)) is None
    assert policy_memory.smallest(doc, "offload_optimizer", budget(80, 0.75)) == 1
    lines = policy_memory.markdown(doc).splitlines()
    assert lines[0].startswith("| devices | full, stage 0: states / peak | full, stage 3: states / peak | LoRA r16, "
                               "stage 0: states / peak |"), lines[0]
    assert lines[3].startswith("| 2 | 0.0 / 64.0 GB | 0.0 / 33.9 GB | 0.0 / 16.0 GB | 0.0 / 16.0 GB | 23.0 GB (+ 0.0 "
                               "GB) |"), lines[3]
    assert "| 24 GB | 17.0 GB (0.75 x card - 1 GB) | 8 devices | 2 devices | 4 devices | 4 devices |" in lines
    assert "| 80 GB | 59.0 GB (0.75 x card - 1 GB) | 2 devices | 1 device | 1 device | 1 device |" in lines


@pytest.mark.parametrize("family,fixture,given", [("pi05", "pi05", {"vision": {"n_heads": 2}}), ("smolvla", "smolvla", {})])
def test_policy_steps_tiny_size_is_the_lerobot_fixtures_model(family, fixture, given, monkeypatch):
    """scripts/bench/policy_step.py's "tiny" size of each family, as zerojax's config, is the model
    of the LeRobot 0.6.1 fixture it names (tests/fixtures/lerobot06/FAMILY, its config read as
    `model.init_from` reads it): the side by side times the same model on both sides."""
    import dataclasses

    import policy_step  # scripts/bench/policy_step.py
    from zerojax import config
    from zerojax.interop import lerobot

    monkeypatch.chdir(ROOT)  # SmolVLA's config.json names its SmolVLM directory from the repository root
    spec = policy_step.FAMILIES[family]
    ours = config.load(overrides=spec["overrides"](spec["sizes"]["tiny"])).model
    theirs = lerobot.hf_model_keys(str(ROOT / "tests" / "fixtures" / "lerobot06" / fixture), given)
    compared = 0
    for key, value in theirs.items():
        mine = getattr(ours, key)
        if dataclasses.is_dataclass(mine):
            for sub, v in value.items():
                assert getattr(mine, sub) == v, (key, sub)
                compared += 1
        elif key not in ("init_from",):
            assert mine == value, key
            compared += 1
    assert compared > 20


def test_largest_batch_finds_adjacent_batches_around_each_budget():
    """scripts/bench/largest_batch.py's search on a made-up peak (flat to batch 8, then 0.166 GB a
    row, as SmolVLA's full fine-tune): the batch that fits and the one that does not are adjacent,
    in a few compiles."""
    import largest_batch  # scripts/bench/largest_batch.py

    compiled = []

    class Made(largest_batch.Points):
        def known(self):
            return dict(self.seen)

        def peak(self, batch):
            compiled.append(batch)
            self.seen[batch] = 8e9 + max(batch - 8, 0) * 0.166e9
            return self.seen[batch]

    points = Made(None, "full", [])
    points.seen = {}
    assert largest_batch.largest(points, 17e9) == 62  # 62: 16.96 GB, 63: 17.13 GB
    assert largest_batch.largest(points, 21.8e9) == 91
    assert largest_batch.largest(points, 7e9) == 0  # not one row
    assert len(set(compiled)) <= 16  # from nothing: batches doubled to a bracket, then secant steps
