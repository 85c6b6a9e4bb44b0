"""`zerojax plan`: the device table and sizes, the roofline, the search space and its memory
order, loop-aware dot FLOPs, and the search itself on the tiny GPT (budgets taken from the
peaks it compiles: each smaller budget moves the winner down the ladder)."""

import json
import shlex
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import SMALL, TINY
from zerojax import cli, config
from zerojax.analysis import hlo, plan
from zerojax.config import devices
from zerojax.errors import ConfigError

H100 = devices.DEVICES["h100"]


def test_sizes_and_the_budget(monkeypatch):
    assert devices.parse_size("24GB") == 24e9
    assert devices.parse_size("24GiB") == 24 * 2**30
    assert devices.parse_size("512mb") == 512e6
    assert devices.parse_size("0", "--margin", zero=True) == 0
    for bad in ("24 apples", "", "0", "-3GB"):
        with pytest.raises(ConfigError, match="is not a size"):
            devices.parse_size(bad)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert devices.budget_bytes(80e9, 1e9) == 0.75 * 80e9 - 1e9
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert devices.budget_bytes(80e9, 0) == pytest.approx(72e9)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "lots")
    with pytest.raises(ConfigError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
        devices.budget_bytes(80e9, 0)


def test_step_seconds_is_a_roofline():
    flops, sent = H100.peak_flops, H100.link_bw / 2  # 1 s of dots, 0.5 s of collectives
    overlapped = devices.step_seconds(H100, flops, sent, H100.hbm_bw, H100.host_bw, overlap=True)
    assert overlapped["step_s"] == pytest.approx(1 + 1 + 1)  # max(dots, comm) + update + host
    assert devices.step_seconds(H100, flops, sent, 0, 0, overlap=False)["step_s"] == pytest.approx(1.5)
    across = devices.step_seconds(H100, 0, sent, 0, 0, overlap=False, hosts=2)
    assert across["comm_s"] == pytest.approx(sent / H100.network_bw)


def test_the_space_keeps_the_batch_and_the_rules():
    cfg = config.load(overrides=TINY + SMALL)  # 32 rows on 8 devices
    cands = plan.space(cfg, 8)
    assert {c.grad_accum for c in cands} == {1, 2, 4}
    assert not [c for c in cands if c.stage == 0 and c.gather == "int8"]
    assert {c.prefetch for c in cands if c.stage < 3} == {cfg.zero.prefetch}
    assert {c.prefetch for c in cands if c.stage == 3} == {cfg.zero.prefetch, 0}
    for c in cands[:5]:  # a candidate is a valid config
        config.load(overrides=TINY + SMALL + c.overrides())
    gspmd = plan.space(config.load(overrides=TINY + SMALL + ["zero.schedule=gspmd"]), 8)
    assert {c.offload for c in gspmd} == {"none"} and {c.gather for c in gspmd} == {"auto"}
    one = plan.space(cfg, 1)  # one device gathers nothing: the gather dtype and prefetch are the user's
    assert {(c.gather, c.prefetch) for c in one} == {(cfg.precision.gather, cfg.zero.prefetch)}
    assert {(c.stage, c.offload, c.remat) for c in one} == {(c.stage, c.offload, c.remat) for c in cands}


def test_the_memory_order():
    base = plan.Candidate(2, "none", "none", 1, "auto", 1)
    saves_more = plan.Candidate(3, "optimizer", "full", 4, "int8", 0)
    assert base.needs_no_less_than(saves_more) and not saves_more.needs_no_less_than(base)
    mixed = plan.Candidate(3, "none", "none", 1, "auto", 1)  # more sharding, less accumulation
    assert not mixed.needs_no_less_than(plan.Candidate(2, "none", "none", 2, "auto", 1))


def test_dot_flops_multiply_loop_bodies_by_their_trip_counts():
    def f(x, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    x, ws = jnp.ones((8, 16)), jnp.ones((5, 16, 16))
    text = jax.jit(f).lower(x, ws).compile().as_text()
    assert hlo.dot_flops(text) == 5 * 2 * 8 * 16 * 16


def search(budget: float, max_compiles: int = plan.MAX_COMPILES) -> dict:
    return plan.search(config.load(overrides=TINY + SMALL), plan.Target(H100, 8, budget), max_compiles=max_compiles)


def test_smaller_budgets_move_the_plan_down_the_ladder(capsys):
    roomy = search(1e9)
    first = roomy["winner"]
    assert first["fits"] and first["peak_bytes"] <= 1e9 and "zero.stage=3" not in first["overrides"]
    assert set(first) >= {"overrides", "peak_bytes", "step_s", "tokens_per_sec", "mfu"}

    tight = search(first["peak_bytes"] - 1, max_compiles=3)  # the roomy winner no longer fits (3: the test's time)
    second = tight["winner"]
    assert second["peak_bytes"] <= tight["budget_bytes"] and second["step_s"] >= first["step_s"]
    assert "zero.stage=3" in second["overrides"]
    for c in tight["candidates"]:  # no compiled candidate with a lower estimate fits
        if c["compiled"] and c["step_s"] < second["step_s"]:
            assert not c["fits"] and c["peak_bytes"] > tight["budget_bytes"] and c["why"]
    assert not [c for c in tight["candidates"] if c["fits"] and c["step_s"] < second["step_s"]]

    # Less than the most saving candidate's peak, and than its LoRA's (130,201 bytes compiled by
    # jax 0.12; more by 0.10): nothing fits, exit 2, with what would.
    rc = cli.main(["plan", "--devices", "8", "--device-memory", "0.0001GB", "--margin", "0", "--json",
                   *TINY, *SMALL])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 2 and doc["winner"] is None and doc["budget_bytes"] == pytest.approx(0.75 * 0.0001e9)
    why = doc["nothing_fits"]
    assert why["smallest_peak_bytes"] > doc["budget_bytes"] and "zero.offload=optimizer+master" in why["overrides"]
    assert doc["compiles"] == 1  # the floor did not fit: nothing else compiled
    assert why["lora"] is None and why["lora_why"].startswith("with optim.lora.rank=4 it peaks at")


def test_when_a_full_fine_tune_fits_nowhere_the_plan_names_the_lora_rank_that_fits(capsys, monkeypatch):
    # The tiny GPT's most saving candidate peaks at 280,441 B in full, 244,785 B with LoRA r16
    # and 205,617 B with r4 (compiled, 2026-12-01): a budget between two of them names the rank.
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    target = plan.Target(H100, 8, 1.0)
    cfg = plan.for_target(config.load(overrides=TINY + SMALL), target)
    floor = max(plan.space(cfg, 8), key=lambda c: c.saving())
    peaks = {}
    for rank in (0, 4, 16):
        lora = config.load(overrides=TINY + SMALL + [f"optim.lora.rank={rank}"])
        peaks[rank] = plan.peak_bytes(plan.measured(floor.apply(plan.for_target(lora, target)), 8)[0])
    assert peaks[0] > peaks[16] > peaks[4]
    for budget, rank in ((peaks[16] + 1, 16), (peaks[16] - 1, 4)):
        rc = cli.main(["plan", "--devices", "8", "--device-memory", f"{budget / 0.75 / 1e9!r}GB", "--margin", "0",
                       "--json", *TINY, *SMALL])
        doc = json.loads(capsys.readouterr().out)
        assert rc == 2 and doc["winner"] is None and doc["budget_bytes"] == pytest.approx(budget, abs=1e-3)
        lora = doc["nothing_fits"]["lora"]
        assert lora["overrides"] == [f"optim.lora.rank={rank}", *floor.overrides()] and lora["peak_bytes"] == peaks[rank]
    assert cli.main(["plan", "--devices", "8", "--device-memory", f"{(peaks[16] + 1) / 0.75 / 1e9!r}GB", "--margin",
                     "0", *TINY, *SMALL]) == 2
    assert "LoRA fits: optim.lora.rank=16 zero.stage=3" in capsys.readouterr().out.replace("\n", " ")
    # a run that is LoRA already (or freezes leaves) gets no suggestion
    rows = [{"compiled": True, "peak_bytes": peaks[4], "candidate": floor}]
    assert plan.lora_that_fits(config.load(overrides=TINY + ["optim.lora.rank=4"]), target, rows) == {}



def test_the_printed_command_runs_as_printed(capsys):
    """`train with:` is one line, longer than the console and not broken: `zerojax train` with the
    user's config file and overrides, then the winner's keys (never a literal `--config ...`),
    which parses to the config the plan chose and trains, split as a shell splits it."""
    overrides = [*TINY, *SMALL, "train.out_dir=runs/my run"]  # a space: the line must quote it
    Path("configs").mkdir()
    shutil.copy(Path(__file__).parents[1] / "configs" / "tiny.yaml", "configs/tiny.yaml")
    assert cli.main(["plan", "--config", "configs/tiny.yaml", "--devices", "8", "--device-memory", "1GB", "--margin", "0",
                     "--max-compiles", "1", *overrides]) == 0  # 1: the test's time
    printed = [x for x in capsys.readouterr().out.splitlines() if x.startswith("train with:")]
    assert len(printed) == 1 and len(printed[0]) > 120, printed
    words = shlex.split(printed[0].removeprefix("train with: "))
    assert words[:4] == ["zerojax", "train", "--config", "configs/tiny.yaml"] and "..." not in words
    train = cli.build_parser().parse_args(words[1:])
    chosen = words[4 + len(overrides):]
    assert words[4:4 + len(overrides)] == overrides and any(key.startswith("zero.stage=") for key in chosen), chosen
    cfg = config.load(train.config, train.overrides)
    assert cfg == config.load("configs/tiny.yaml", [*overrides, *chosen]) and str(cfg.run_dir) == "runs/my run"
    assert cfg != config.load("configs/tiny.yaml", overrides)  # the winner's keys reach the run
    assert json.loads(capsys.readouterr().out or "{}") == {}
    assert cli.main(["plan", "--config", "configs/tiny.yaml", "--devices", "8", "--device-memory", "1GB", "--margin",
                     "0", "--max-compiles", "1", "--json", *overrides]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["compiles"] == 1 and doc["train_command"] == printed[0].removeprefix("train with: ")
    assert cli.main(words[1:]) == 0
    assert len((Path("runs/my run") / "metrics.jsonl").read_text().splitlines()) >= cfg.train.steps
