"""Hugging Face checkpoints in and out, checked against transformers itself: the fixtures in
tests/fixtures/hf were written by scripts/fixtures/make_hf_fixtures.py (torch + transformers, in a venv of
their own), with transformers' fp32 logits for fixed tokens. No torch is needed here."""

import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import ROOT, run
from zerojax import cli, config, train
from zerojax.models.protocol import cross_entropy
from zerojax.interop import hf
from zerojax.train import checkpoint

FIXTURES = ROOT / "tests" / "fixtures" / "hf"
NAMES = ["llama-gqa", "llama-tied", "gpt2"]
STEPS = ["train.global_batch=16", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "optim.warmup_steps=0",
         "optim.lr=1e-3", "zero.min_shard_size=64"]


def hf_tensors(directory):
    """Every tensor of an HF directory (all shards), by name."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_transformers(name):
    cfg, model = hf.load(str(FIXTURES / name))
    reference = load_file(FIXTURES / f"{name}.logits.safetensors")
    logits = np.asarray(model.logits(reference["tokens"].astype(np.int32)))
    np.testing.assert_allclose(logits, reference["logits"], atol=1e-4, rtol=0)
    assert cfg.family == ("gpt" if name == "gpt2" else "llama")


def test_the_config_comes_from_config_json():
    cfg = config.load(overrides=[f"model.init_from={FIXTURES / 'llama-gqa'}"])
    m = cfg.model
    assert (m.family, m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff) == \
        ("llama", 256, 32, 2, 4, 2, 64)
    assert m.tie_embeddings is False
    tied = config.load(overrides=[f"model.init_from={FIXTURES / 'llama-tied'}"]).model
    assert tied.tie_embeddings is True and tied.rope_theta == 500000.0 and tied.norm_eps == 1e-6
    gpt2 = config.load(overrides=[f"model.init_from={FIXTURES / 'gpt2'}", "model.seq_len=16"]).model
    assert (gpt2.family, gpt2.seq_len, gpt2.d_ff) == ("gpt", 16, 128)  # a shorter context is allowed


@pytest.mark.parametrize("name", NAMES)
def test_import_on_8_devices_stage_3_and_export_give_the_same_tensors(name, tmp_path):
    source = FIXTURES / name
    # no step taken: what is exported is exactly what was imported into the sharded layout
    overrides = STEPS + ["zero.stage=3", f"model.init_from={source}", f"train.out_dir={tmp_path / 'run'}",
                         "train.steps=1", "train.ckpt_every=0"]
    setup = train.prepare(config.load(overrides=overrides))
    state = train.start_state(setup, None, None, None)
    specs = jax.tree.leaves(setup.engine.plan.master_specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    assert [x.sharding.spec for x in jax.tree.leaves(state.params)] == specs  # built in the plan's layout
    sharded = sum(x.nbytes for x in jax.tree.leaves(state.params) if x.sharding.spec != jax.sharding.PartitionSpec())
    assert sharded > 0.9 * sum(x.nbytes for x in jax.tree.leaves(state.params))
    mgr = checkpoint.manager(tmp_path / "run", 1)
    checkpoint.save(mgr, setup.engine.plan, setup.engine.mesh, state, 0, config.to_dict(setup.cfg))
    mgr.wait_until_finished()
    mgr.close()
    out = tmp_path / "export"
    assert cli.main(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(out),
                     "--max-shard-size", "30KB"]) == 0
    original, exported = hf_tensors(source), hf_tensors(out)
    assert set(exported) == set(original), set(exported) ^ set(original)
    for key, value in original.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)  # bit for bit, fp32
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original) and len(set(index["weight_map"].values())) > 1
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == json.loads((source / "config.json").read_text())["architectures"]
    _, reloaded = hf.load(str(out))  # and the export reads back as the same model
    reference = load_file(FIXTURES / f"{name}.logits.safetensors")
    np.testing.assert_allclose(reloaded.logits(reference["tokens"].astype(np.int32)), reference["logits"], atol=1e-4)


@pytest.mark.parametrize("name", ["llama-gqa", "gpt2"])
def test_a_fine_tune_on_8_devices_equals_one_device(name, tmp_path):
    common = STEPS + [f"model.init_from={FIXTURES / name}", "train.steps=3", "train.ckpt_every=0",
                      "model.seq_len=32"]
    one, _ = run(common + ["mesh.replica=1", "mesh.data=1", "zero.stage=0", f"train.out_dir={tmp_path / 'one'}"])
    eight, _ = run(common + ["zero.stage=3", f"train.out_dir={tmp_path / 'eight'}"])
    np.testing.assert_allclose(eight, one, rtol=1e-5)
    # and it started from the checkpoint: step 1's loss is the HF model's loss on step 1's batch
    setup = train.prepare(config.load(overrides=common + [f"train.out_dir={tmp_path / 'x'}"]))
    batch = np.asarray(train.global_batch(setup, 0, 0))
    _, model = hf.load(str(FIXTURES / name))
    expected = cross_entropy(model.logits(batch[:, :-1]), batch[:, 1:])
    np.testing.assert_allclose(one[0], expected, rtol=1e-5)


def bad(tmp_path, what):
    """A copy of the gqa fixture, broken by `what`."""
    d = tmp_path / "model"
    shutil.copytree(FIXTURES / "llama-gqa", d)
    what(d)
    return d


def rewrite_config(d, **changes):
    c = json.loads((d / "config.json").read_text())
    c.update(changes)
    (d / "config.json").write_text(json.dumps(c))


def truncate_a_shard(d):
    shard = sorted(d.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])


@pytest.mark.parametrize("breaking, message", [
    (lambda d: (d / "config.json").unlink(), "is a directory without config.json"),
    (lambda d: [f.unlink() for f in d.glob("*.safetensors*")], "has no model.safetensors nor model.safetensors.index.json"),
    (lambda d: rewrite_config(d, architectures=["BertForMaskedLM"]), "architecture 'BertForMaskedLM' is not supported; "
                                                                     "zerojax reads GPT2LMHeadModel, LlamaForCausalLM, "
                                                                     "MistralForCausalLM"),
    (lambda d: rewrite_config(d, intermediate_size=96), "tensor 'model.layers.0.mlp.down_proj.weight' has shape [32, 64], the model needs [32, 96]"),
    (lambda d: rewrite_config(d, num_hidden_layers=3), "no tensor 'model.layers.2.input_layernorm.weight'"),
    (truncate_a_shard, "is not a readable safetensors file"),
], ids=["no config", "no weights", "architecture", "shape", "missing tensor", "truncated"])
def test_a_bad_checkpoint_exits_2_and_writes_nothing(breaking, message, tmp_path, capsys):
    d = bad(tmp_path, breaking)
    assert cli.main(["train", f"model.init_from={d}", "train.steps=1", f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax: error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_an_override_that_contradicts_the_checkpoint_names_both(tmp_path, capsys):
    assert cli.main(["train", f"model.init_from={FIXTURES / 'llama-gqa'}", "model.d_model=64",
                     f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "model.d_model=64 contradicts" in err and "which says 32" in err, err
    assert cli.main(["train", f"model.init_from={FIXTURES / 'llama-gqa'}", "model.family=gpt",
                     f"train.out_dir={tmp_path / 'run'}"]) == 2
    assert "model.family='gpt' contradicts" in capsys.readouterr().err


def test_the_fine_tuning_recipe_runs(tmp_path):
    cfg = config.load(ROOT / "configs" / "finetune-llama.yaml",
                      [f"model.init_from={FIXTURES / 'llama-gqa'}", "train.steps=2", "train.eval_every=0", "train.sample_tokens=0",
                       "train.ckpt_every=0", "train.global_batch=16", "train.log_every=1", f"train.out_dir={tmp_path}"])
    assert (cfg.model.family, cfg.model.d_model, cfg.zero.stage, cfg.optim.lr) == ("llama", 32, 3, 2e-5)
    result = train.run(cfg, show_progress=False)
    assert len(result.history) == 2 and np.isfinite(result.history[-1]["loss"])


@pytest.mark.parametrize("name, tied", [("llama-gqa", False), ("gpt2", True)])
def test_an_omitted_tie_word_embeddings_takes_transformers_default(name, tied, tmp_path):
    d = tmp_path / name
    d.mkdir()
    hf_config = json.loads((FIXTURES / name / "config.json").read_text())
    hf_config.pop("tie_word_embeddings", None)
    (d / "config.json").write_text(json.dumps(hf_config))
    assert config.hf_model_keys(str(d))["tie_embeddings"] is tied  # LlamaConfig: False, GPT2Config: True


def test_the_engine_names_no_family_and_no_architecture():
    """interop is driven by the families' own tables (models/gpt.py, models/llama.py, via the
    registry): adding a family touches its module and the registry, not the engine."""
    from zerojax.models import registry

    names = set(registry.FAMILIES) | set(registry.hf_architectures()) | {"gpt2", "mistral"}
    for module in ("hf", "peft", "safetensors"):
        text = (ROOT / "zerojax" / "interop" / f"{module}.py").read_text().lower()
        assert not [name for name in sorted(names) if name.lower() in text], module
