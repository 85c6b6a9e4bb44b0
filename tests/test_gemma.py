"""The Gemma family: HF GemmaForCausalLM's layout checked against transformers (the fixture in
tests/fixtures/hf/gemma, written by scripts/fixtures/make_hf_fixtures.py --only gemma), stage 3 on 8
devices equal to one device, Gemma-2's keys refused, and the export read back."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from conftest import ROOT, export_initial_state, run
from zerojax import cli, config, train
from zerojax.errors import ConfigError
from zerojax.interop import hf
from zerojax.models import gemma

FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "gemma"
TINY = ["model.family=gemma", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=1",
        "model.head_dim=16", "model.d_ff=48", "model.seq_len=16", "train.global_batch=32", "zero.min_shard_size=64",
        "train.steps=3", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "train.ckpt_every=0"]


def reference():
    ref = load_file(FIXTURE.parent / "gemma.logits.safetensors")
    return ref["tokens"].astype(np.int32), ref["logits"]


def test_logits_equal_transformers():
    cfg, model = hf.load(str(FIXTURE))
    assert (cfg.family, cfg.n_kv_heads, cfg.head_dim, cfg.tie_embeddings, cfg.norm_eps) == ("gemma", 1, 16, True, 1e-6)
    tokens, logits = reference()
    np.testing.assert_allclose(np.asarray(model.logits(tokens)), logits, atol=1e-4, rtol=0)


def test_stage_3_on_8_devices_equals_one_device(tmp_path):
    one, _ = run(TINY + ["mesh.replica=1", "mesh.data=1", "zero.stage=0", f"train.out_dir={tmp_path / 'one'}"])
    eight, _ = run(TINY + ["zero.stage=3", "zero.schedule=shard_map", f"train.out_dir={tmp_path / 'eight'}"])
    np.testing.assert_allclose(eight, one, rtol=1e-5)  # fp32: only the order of sums differs
    assert one[-1] < one[0]


def test_layout_has_its_own_head_dim_and_a_tied_head():
    m = gemma.Gemma(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=16, d_ff=48,
                    rngs=nnx.Rngs(0))
    shapes = jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(m, nnx.Param)))
    attn = shapes["layers"]["self_attn"]
    assert attn["q_proj"]["kernel"] == (2, 32, 64) and attn["o_proj"]["kernel"] == (2, 64, 32)  # 4 heads of 16
    assert attn["k_proj"]["kernel"] == (2, 32, 16) and attn["v_proj"]["kernel"] == (2, 32, 16)  # one kv head
    assert set(shapes) == {"embed_tokens", "layers", "norm"}  # no lm_head: the embedding is the head
    assert not np.any(np.asarray(m.norm.scale[...]))  # HF's GemmaRMSNorm starts at w = 0, scale 1 + w
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    assert m.flops_per_token(16) == 6 * n_params + 12 * 2 * 16 * 64  # D = H·K = 64, not d_model


@pytest.mark.parametrize("key, value", [("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                                        ("sliding_window", 4096), ("hidden_act", "gelu_new")])
def test_a_config_json_beyond_gemma_1_exits_2_with_one_line(key, value, tmp_path, capsys):
    d = tmp_path / "model"
    shutil.copytree(FIXTURE, d)
    hf_config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**hf_config, key: value}))
    with pytest.raises(ConfigError, match=key):
        config.load(overrides=[f"model.init_from={d}"])
    assert cli.main(["train", f"model.init_from={d}", "train.steps=1", f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax: error: ") and err.count("\n") == 1 and f"{key}={value!r}" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, message", [
    (["model.family=llama", "model.head_dim=16"], "llama's heads are model.d_model / model.n_heads = 8 wide"),
    (["model.family=gpt", "model.head_dim=16"], "gpt's heads are model.d_model / model.n_heads = 8 wide"),
    (["model.family=gemma", "model.head_dim=15"], "gemma's rotary embedding needs an even head dimension"),
    (["model.family=gemma", "model.tie_embeddings=false"], "gemma's LM head is its token embedding"),
    (["model.head_dim=-1"], "model.head_dim=-1 is not valid; it must be >= 0"),
])
def test_head_dim_and_tie_rules(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.load(overrides=["model.d_model=32", "model.n_heads=4"] + overrides)
    for family in ("llama", "gpt"):  # the quotient itself, or 0, leaves them as they were
        config.load(overrides=["model.d_model=32", "model.n_heads=4", f"model.family={family}", "model.head_dim=8"])


def test_export_as_hf_gives_back_the_checkpoint(tmp_path):
    # Imported on 8 devices at stage 3, saved, exported: the same tensors and a config.json that
    # transformers reads as the same model (architectures and the free head_dim).
    overrides = ["zero.stage=3", "zero.min_shard_size=64", "train.global_batch=16", f"model.init_from={FIXTURE}",
                 f"train.out_dir={tmp_path / 'run'}", "train.steps=1", "train.ckpt_every=0"]
    setup = train.prepare(config.load(overrides=overrides))
    state = train.start_state(setup, None, None, None)
    out = export_initial_state(setup, state, tmp_path / "run", tmp_path / "export")
    original = load_file(FIXTURE / "model.safetensors")
    exported = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert set(exported) == set(original), set(exported) ^ set(original)
    for key, value in original.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["GemmaForCausalLM"] and written["head_dim"] == 16
    assert (written["num_key_value_heads"], written["tie_word_embeddings"]) == (1, True)
    _, reloaded = hf.load(str(out))
    tokens, logits = reference()
    np.testing.assert_allclose(np.asarray(reloaded.logits(tokens)), logits, atol=1e-4, rtol=0)
