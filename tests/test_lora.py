"""LoRA on a frozen, sharded base, and frozen leaves that cost what a frozen weight should.

The base is the tiny Llama fixture (tests/fixtures/hf/llama-gqa, from transformers); the PEFT
adapter fixture beside it (llama-gqa-lora, with PEFT's own logits) was written by
scripts/fixtures/make_peft_fixture.py with torch + transformers + peft. No torch is needed here."""

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import ROOT, run, sigterm_during
from zerojax import cli, config, train
from zerojax.optim.lora import is_adapter
from zerojax.parallel.trees import path_name
from zerojax.analysis import measure
from zerojax.interop import hf
from zerojax.interop import peft

FIXTURES = ROOT / "tests" / "fixtures" / "hf"
BASE = FIXTURES / "llama-gqa"
ADAPTER = FIXTURES / "llama-gqa-lora"
LORA = ["train.global_batch=16", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "optim.warmup_steps=0",
        "zero.min_shard_size=64", f"model.init_from={BASE}", "model.seq_len=32", "optim.lora.rank=4",
        "optim.lora.alpha=8", "optim.lora.targets=*proj/kernel", "train.ckpt_every=0", "train.steps=3",
        "optim.lr=1e-2"]
ONE_DEVICE = ["mesh.replica=1", "mesh.data=1", "zero.stage=0"]
# PEFT's per-module ranks and alphas: the adapter scripts/fixtures/make_peft_fixture.py --mixed wrote with
# rank_pattern {q_proj: 2, down_proj: 8}, alpha_pattern {down_proj: 4}, and the same as our keys
MIXED = FIXTURES / "llama-gqa-lora-mixed"
PATTERNS = ["optim.lora.rank_pattern=*q_proj*:2,*down_proj*:8", "optim.lora.alpha_pattern=*down_proj*:4"]


def leaves(tree):
    return {path_name(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_a_peft_adapter_gives_the_logits_peft_gives(tmp_path):
    cfg = config.load(overrides=LORA + ONE_DEVICE + ["precision.frozen=float32", f"optim.lora.init_from={ADAPTER}",
                                                     f"train.out_dir={tmp_path}"])
    setup = train.prepare(cfg)
    model = setup.engine.view(train.start_state(setup, None, None, None).params)
    reference = load_file(FIXTURES / "llama-gqa-lora.logits.safetensors")
    logits = np.asarray(model.logits(reference["tokens"]))
    np.testing.assert_allclose(logits, reference["logits"], atol=1e-4, rtol=0)
    base = load_file(FIXTURES / "llama-gqa.logits.safetensors")["logits"]  # the adapter changes them a lot
    assert np.abs(base - reference["logits"]).max() > 100 * np.abs(logits - reference["logits"]).max()


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    """One step on one device from PEFT's mixed-rank adapter (fp32 base), checkpointed."""
    out = tmp_path_factory.mktemp("mixed")
    cfg = config.load(overrides=LORA + ONE_DEVICE + PATTERNS + ["precision.frozen=float32", f"optim.lora.init_from={MIXED}",
                                                                "train.steps=1", "train.ckpt_every=1", f"train.out_dir={out}"])
    setup = train.prepare(cfg)
    start = setup.engine.view(train.start_state(setup, None, None, None).params)
    return out, setup, start, train.run(cfg, show_progress=False, setup=setup)


def test_rank_and_alpha_patterns_load_peft_s_mixed_adapter_and_give_its_logits(mixed_run):
    _, _, model, _ = mixed_run
    shapes = {p: tuple(x.shape) for p, x in leaves(nnx_params(model)).items() if is_adapter(p)}
    assert shapes["layers/self_attn/q_proj/lora_a"][-1] == 2 and shapes["layers/mlp/down_proj/lora_b"][-2] == 8
    assert shapes["layers/self_attn/k_proj/lora_a"][-1] == 4  # optim.lora.rank for the rest
    reference = load_file(FIXTURES / "llama-gqa-lora-mixed.logits.safetensors")
    logits = np.asarray(model.logits(reference["tokens"]))
    np.testing.assert_allclose(logits, reference["logits"], atol=1e-4, rtol=0)


def test_a_mixed_rank_export_is_peft_s_layout_and_merges_with_each_kernel_s_scale(mixed_run, tmp_path):
    out, setup, _, result = mixed_run
    peft_dir = tmp_path / "adapter"
    assert cli.main(["export", str(out), "--format", "peft", "--out", str(peft_dir)]) == 0
    ours, theirs = load_file(peft_dir / "adapter_model.safetensors"), load_file(MIXED / "adapter_model.safetensors")
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    written, peft_cfg = (json.loads((d / "adapter_config.json").read_text()) for d in (peft_dir, MIXED))
    modules = {k.removeprefix("base_model.model.").removesuffix(".lora_A.weight") for k in ours if ".lora_A." in k}
    for module in modules:  # PEFT's own rule resolves each module to what PEFT's adapter gives it
        got = [peft.pattern_value(written[key], module, written[default]) for key, default in PEFT_KEYS]
        want = [peft.pattern_value(peft_cfg[key], module, peft_cfg[default]) for key, default in PEFT_KEYS]
        assert got == want, module
    assert written["rank_pattern"]["model.layers.1.self_attn.q_proj"] == 2
    assert "model.layers.0.self_attn.k_proj" not in written["rank_pattern"]  # r for the rest
    merged = tmp_path / "merged"
    assert cli.main(["export", str(out), "--format", "hf", "--merge", "--out", str(merged)]) == 0
    tokens = load_file(FIXTURES / "llama-gqa.logits.safetensors")["tokens"]
    _, reloaded = hf.load(str(merged))
    np.testing.assert_allclose(reloaded.logits(tokens), setup.engine.view(result.state.params).logits(tokens),
                               atol=2e-4, rtol=0)


PEFT_KEYS = (("rank_pattern", "r"), ("alpha_pattern", "lora_alpha"))


def nnx_params(model):
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return run(LORA + ["precision.frozen=float32"] + ONE_DEVICE + [f"train.out_dir={tmp_path_factory.mktemp('one')}"])[0]


@pytest.mark.parametrize("extra", [
    ["zero.stage=3"], ["zero.stage=3", "zero.schedule=gspmd"],
    ["zero.stage=2", "train.grad_accum=2", "mesh.replica=2", "mesh.data=4"], ["zero.stage=1"],
], ids=" ".join)
def test_lora_on_8_devices_equals_one_device(extra, one_device, tmp_path):
    eight, _ = run(LORA + ["precision.frozen=float32"] + extra + [f"train.out_dir={tmp_path}"])
    np.testing.assert_allclose(eight, one_device, rtol=1e-5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """20 LoRA steps from the HF base on 8 devices at stage 3 (bf16 base), checkpointed."""
    out = tmp_path_factory.mktemp("lora")
    cfg = config.load(overrides=LORA + ["zero.stage=3", "train.steps=20", "train.ckpt_every=20",
                                        f"train.out_dir={out}"])
    setup = train.prepare(cfg)
    start = leaves(train.start_state(setup, None, None, None).params)
    result = train.run(cfg, show_progress=False)
    return out, setup, start, result


def test_the_base_stays_bit_identical_and_the_loss_falls(trained):
    _, setup, start, result = trained
    end = leaves(result.state.params)
    frozen = {p for p in end if not is_adapter(p)}
    assert frozen and all(end[p].dtype == np.dtype("bfloat16") for p in frozen)  # stored bf16, no master
    for p in frozen:
        np.testing.assert_array_equal(end[p].view(np.uint16), start[p].view(np.uint16), err_msg=p)
    assert any(np.abs(end[p] - start[p]).max() > 0 for p in end if p.endswith("lora_b"))  # the adapters trained
    losses = [line["loss"] for line in result.history]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.1, losses
    moments = [p for p, x in leaves(result.state.opt_state).items() if x.ndim > 0]
    assert moments and all(p.endswith(("lora_a", "lora_b")) for p in moments), moments  # none for the base


def test_export_peft_names_match_peft_and_merge_matches_the_adapted_model(trained, tmp_path):
    out, setup, _, result = trained
    peft = tmp_path / "adapter"
    assert cli.main(["export", str(out), "--format", "peft", "--out", str(peft)]) == 0
    ours, theirs = load_file(peft / "adapter_model.safetensors"), load_file(ADAPTER / "adapter_model.safetensors")
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    written = json.loads((peft / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"], written["peft_type"]) == (4, 8.0, "LORA")
    assert sorted(written["target_modules"]) == sorted(json.loads((ADAPTER / "adapter_config.json").read_text())
                                                       ["target_modules"])
    state = leaves(result.state.params)
    np.testing.assert_array_equal(ours["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"],
                                  state["layers/self_attn/k_proj/lora_a"][1].T)
    # The merged export is the adapted model: transformers' layout, adapters folded in.
    merged = tmp_path / "merged"
    assert cli.main(["export", str(out), "--format", "hf", "--merge", "--out", str(merged)]) == 0
    assert not [k for k in hf_keys(merged) if "lora" in k]
    tokens = load_file(FIXTURES / "llama-gqa.logits.safetensors")["tokens"]
    adapted = setup.engine.view(result.state.params).logits(tokens)
    _, reloaded = hf.load(str(merged))
    np.testing.assert_allclose(reloaded.logits(tokens), adapted, atol=2e-4, rtol=0)
    # and the adapter continues a run: optim.lora.init_from reads what was exported
    cfg = config.load(overrides=LORA + ["zero.stage=3", f"optim.lora.init_from={peft}", f"train.out_dir={tmp_path / 'x'}"])
    cont = train.prepare(cfg)
    again = leaves(train.start_state(cont, None, None, None).params)
    np.testing.assert_array_equal(again["layers/mlp/up_proj/lora_b"], state["layers/mlp/up_proj/lora_b"])


def hf_keys(directory):
    return [k for f in directory.glob("*.safetensors") for k in load_file(f)]


def test_a_lora_run_resumes_on_another_mesh(tmp_path):
    common = LORA + ["train.steps=6", "train.ckpt_every=3"]
    reference, _ = run(common + ["zero.stage=3", f"train.out_dir={tmp_path / 'ref'}"])
    cfg = config.load(overrides=common + ["zero.stage=3", f"train.out_dir={tmp_path / 'run'}"])
    with sigterm_during(4):
        assert train.run(cfg, show_progress=False).stopped == train.Stopped("SIGTERM", 4)
    resumed, _ = run(common + ["zero.stage=1", "mesh.replica=2", "mesh.data=4", f"train.out_dir={tmp_path / 'run'}"])
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    assert len(resumed) == 2  # steps 5 and 6, after the checkpoint at step 4


# Accounting, from the compiled step: llama-tiny with rank-8 adapters on every projection,
# small enough a threshold that the adapters are sharded too; layers 1024 wide (a LoRA's share
# of a layer shrinks with its width: r·(in + out) / (in·out)); three layers, since with one or two
# XLA unrolls the backward's one-iteration scan and merges its gather with the forward's (any model).
TINY_LORA = ["zero.min_shard_size=512", "optim.lora.rank=8", "optim.lora.targets=*attn*kernel,*mlp*kernel"]
WIDE = ["model.d_model=1024", "model.n_heads=8", "model.n_kv_heads=4", "model.d_ff=2048", "model.n_layers=3"]


def compiled(*overrides):
    cfg = config.load(ROOT / "configs" / "llama-tiny.yaml", list(overrides))
    step, program = measure.compile_step(cfg)
    return cfg, step, program, measure.stage_report(cfg, step, program, measure.count_params(cfg))


def test_lora_sends_and_keeps_what_the_formulas_say():
    cfg, step, program, lora = compiled(*TINY_LORA, *WIDE)
    *_, full = compiled("zero.min_shard_size=512", *WIDE)
    n, g = 8, 7 / 8
    trained = [leaf for leaf in jax.tree.leaves(step.plan.leaves) if not leaf.frozen]
    assert trained and all(is_adapter(leaf.path) and leaf.dim is not None for leaf in trained)
    # Only the adapters' gradients are reduce-scattered: g x their fp32 bytes, nothing for the base.
    adapter_bytes = sum(np.prod(leaf.stored) * 4 for leaf in trained)
    assert lora["comm"]["reduce-scatter"] == pytest.approx(g * adapter_bytes, rel=1e-6)
    assert lora["comm"]["reduce-scatter"] <= 0.02 * full["comm"]["reduce-scatter"]
    assert lora["comm_bytes"] == pytest.approx(lora["comm_theory_bytes"], rel=0.01)
    # What the step keeps: the bf16 base and the adapters' master, m and v, all /N, within 5%
    # of b_f·Ψ_base/N + 12·Ψ_lora/N (the replicated norm scales are the difference).
    batch = cfg.train.global_batch * (cfg.model.seq_len + 1) * 4 // n
    persistent = lora["argument_bytes"] - batch
    assert persistent == pytest.approx(lora["state_formula_bytes"], rel=0.05)
    assert abs(persistent - lora["state_bytes"]) < 64  # and exactly the plan's, but the step counters


def test_freezing_alone_stores_frozen_leaves_in_bf16_without_a_master():
    freeze = "optim.freeze=layers/mlp/*"
    *_, before = compiled("zero.min_shard_size=512")
    _, step, _, after = compiled("zero.min_shard_size=512", freeze)
    frozen = [leaf for leaf in jax.tree.leaves(step.plan.leaves) if leaf.frozen]
    psi_f = sum(np.prod(leaf.shape) for leaf in frozen)
    assert frozen and all(leaf.dtype == "bfloat16" and leaf.dim is not None for leaf in frozen)
    # The frozen leaves cost 2·Ψ_f/N instead of their 12·Ψ_f/N of master, m and v.
    assert before["argument_bytes"] - after["argument_bytes"] == pytest.approx((12 - 2) * psi_f / 8, rel=1e-6)
    # and no gradient of theirs is reduce-scattered (fp32: 4 bytes, g = 7/8 of them sent)
    assert before["comm"]["reduce-scatter"] - after["comm"]["reduce-scatter"] == pytest.approx(7 / 8 * 4 * psi_f, rel=1e-6)


@pytest.mark.parametrize("extra, message", [
    (["optim.lora.targets=*wq*"], "optim.lora.targets pattern '*wq*' matches no nnx.Linear kernel"),
    (["optim.lora.rank=17"], "optim.lora.rank=17 is larger than layers/self_attn/k_proj/kernel's smaller dim (16"),
    (["precision.frozen=int8"], "precision.frozen='int8' is not valid; choose one of"),
    (["optim.freeze=*lora*"], "together with LoRA (which trains only the adapters) freezes every parameter"),
    ([f"optim.lora.init_from={ADAPTER}", "optim.lora.rank=2"], "its r=4 differs from optim.lora.rank=2"),
    ([f"optim.lora.init_from={BASE}"], "not a PEFT adapter directory"),
    ([f"optim.lora.init_from={MIXED}", PATTERNS[0]],
     "it gives model.layers.0.mlp.down_proj r=8, lora_alpha=4 (its r, lora_alpha, rank_pattern and alpha_pattern), "
     "the run's optim.lora rank 8, alpha 8"),
    (["optim.lora.rank_pattern=*wq*:2"], "optim.lora.rank_pattern entry '*wq*' names none of the kernels"),
    (["optim.lora.rank_pattern=*q_proj*:0"], "optim.lora.rank_pattern['*q_proj*']=0 is not valid; it must be >= 1"),
    (["optim.lora.rank_pattern=*q_proj*"], "optim.lora.rank_pattern expects a mapping NAME: VALUE, each VALUE an integer"),
    (["optim.lora.rank_pattern=*k_proj*:17"], "optim.lora.rank_pattern's rank 17 is larger than layers/self_attn/k_proj"),
    (["optim.lora.rank_pattern=*proj*:2,*q_proj*:3"], "layers/self_attn/q_proj/kernel is named by '*proj*' (2) and by"),
])
def test_bad_lora_input_exits_2_before_anything_is_written(extra, message, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", "--no-progress", *LORA, *extra, f"train.out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax: error: ") and message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_exports_that_do_not_fit_the_run_exit_2(trained, tmp_path, capsys):
    out = trained[0]
    assert cli.main(["export", str(out), "--format", "hf", "--out", str(tmp_path / "x")]) == 2
    assert "--format peft writes them, --format hf --merge" in capsys.readouterr().err
    plain = tmp_path / "plain"
    run([o for o in LORA if not o.startswith("optim.lora")] + ["train.steps=1", "train.ckpt_every=1",
                                                               f"train.out_dir={plain}"])
    assert cli.main(["export", str(plain), "--format", "peft", "--out", str(tmp_path / "y")]) == 2
    assert "trained without LoRA" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_lora_keys_nest_in_yaml_and_on_the_command_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lora:\n    rank: 8\n    targets: ['*q_proj*']\nprecision:\n  frozen: fp32\n")
    cfg = config.load(path, ["optim.lora.alpha=4"])
    assert cfg.optim.lora == config.LoraConfig(rank=8, alpha=4.0, targets=("*q_proj*",))
    assert cfg.precision.frozen == "float32"
    config.dump(cfg, tmp_path / "again.yaml")
    assert config.load(tmp_path / "again.yaml") == cfg
    # a mapping key: a YAML mapping, or NAME:VALUE,NAME:VALUE on the command line; dumped as a mapping
    path.write_text("optim:\n  lora:\n    rank: 16\n    rank_pattern: {expert: 32, '*q_proj*': 8}\n"
                    "    alpha_pattern:\n      expert: 32\n")
    cfg = config.load(path)
    assert cfg.optim.lora.rank_pattern == (("expert", 32), ("*q_proj*", 8)) and cfg.optim.lora.alpha_pattern == (("expert", 32.0),)
    assert config.load(overrides=["optim.lora.rank=16", "optim.lora.rank_pattern=expert:32,*q_proj*:8",
                                  "optim.lora.alpha_pattern=expert:32"]).optim.lora == cfg.optim.lora
    config.dump(cfg, tmp_path / "again.yaml")
    assert "rank_pattern:\n      expert: 32\n" in (tmp_path / "again.yaml").read_text()
    assert config.load(tmp_path / "again.yaml") == cfg
    for bad, message in (("optim.lora=3", "optim.lora is a section, not a key; set its keys, e.g. optim.lora.rank"),
                         ("optim.lora.rnk=3", "did you mean 'optim.lora.rank'")):
        with pytest.raises(config.ConfigError, match=message.replace(".", r"\.")):
            config.load(overrides=[bad])


def test_memory_bills_frozen_parameters_once(capsys):
    assert cli.main(["memory", "--params", "8B", "--trainable", "20M", "--devices", "8", "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    # By hand: Ψ_t = 20M pay 16 bytes (2 + 2 + 12) at stage 0 and 16/8 at stage 3; the frozen
    # 7.98B pay 2 bytes (bf16), / 8 at stage 3 only.
    assert stages["0"] == 20e6 * 16 + 7.98e9 * 2 == 16.28e9
    assert stages["3"] == pytest.approx(20e6 * 16 / 8 + 7.98e9 * 2 / 8) and stages["3"] == pytest.approx(2.035e9)
    assert stages["1"] == pytest.approx(20e6 * (4 + 12 / 8) + 7.98e9 * 2)
    assert cli.main(["memory", "--params", "8B", "--trainable", "9B", "--devices", "8"]) == 2
