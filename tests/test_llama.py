"""The Llama family: HF LlamaForCausalLM's layout, and every stage and schedule equal to one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, run
from zerojax import config
from zerojax.models import decoder
from zerojax.models.llama import Llama
from zerojax.analysis import measure

TINY = ["model.family=llama", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.d_ff=48", "model.seq_len=16", "train.global_batch=32", "zero.min_shard_size=64", "train.steps=5",
        "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "train.ckpt_every=0"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(TINY + ["mesh.replica=1", "mesh.data=1", "zero.stage=0", "zero.schedule=gspmd",
                       f"train.out_dir={tmp_path_factory.mktemp('ref')}"])[0]


@pytest.mark.parametrize("extra", [
    ["zero.stage=0"], ["zero.stage=1"], ["zero.stage=2"], ["zero.stage=3"],
    ["zero.stage=3", "train.grad_accum=2", "mesh.replica=2", "mesh.data=4"],
], ids=lambda e: " ".join(e))
@pytest.mark.parametrize("schedule", ["shard_map", "gspmd"])
def test_every_stage_matches_one_device(extra, schedule, reference, tmp_path):
    losses, _ = run(TINY + extra + [f"zero.schedule={schedule}", f"train.out_dir={tmp_path}"])
    np.testing.assert_allclose(losses, reference, rtol=1e-5)  # fp32: only the order of sums differs


def test_remat_and_tied_head_under_the_explicit_schedule(tmp_path):
    common = TINY + ["model.tie_embeddings=true"]
    one, _ = run(common + ["mesh.replica=1", "mesh.data=1", "zero.stage=0", f"train.out_dir={tmp_path / 'a'}"])
    for remat in ("none", "dots"):
        got, _ = run(common + [f"model.remat={remat}", "zero.prefetch=2", f"train.out_dir={tmp_path / remat}"])
        np.testing.assert_allclose(got, one, rtol=1e-5)


def small(**kw):
    shapes = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
    return Llama(**{**shapes, **kw}, rngs=nnx.Rngs(0))


def test_layout_follows_hugging_face():
    m = small()
    params = nnx.to_pure_dict(nnx.state(m, nnx.Param))
    shapes = jax.tree.map(jnp.shape, params)
    layer = shapes["layers"]
    assert layer["self_attn"]["q_proj"]["kernel"] == (2, 32, 32)  # [L, in, out]: HF's [out, in] transposed
    assert layer["self_attn"]["k_proj"]["kernel"] == (2, 32, 16)  # 2 key/value heads of 8
    assert layer["mlp"]["gate_proj"]["kernel"] == (2, 32, 48) and layer["mlp"]["down_proj"]["kernel"] == (2, 48, 32)
    assert layer["input_layernorm"] == {"scale": (2, 32)} and layer["post_attention_layernorm"] == {"scale": (2, 32)}
    assert shapes["lm_head"] == {"kernel": (32, 64)} and shapes["norm"] == {"scale": (32,)}
    assert not [p for p, _ in jax.tree_util.tree_leaves_with_path(params) if "bias" in str(p)]  # no biases
    assert small(tie_embeddings=True).lm_head is None


def test_rope_rotates_half_pairs_by_position():
    # HF's rotate-half: dims i and i + K/2 form a pair rotated by t * theta^(-2i/K).
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, 1, 8)), jnp.float32)
    y = decoder.rope(x, theta=100.0)
    for t in range(5):
        for i in range(4):
            angle = t * 100.0 ** (-2 * i / 8)
            a, b = x[0, t, 0, i], x[0, t, 0, i + 4]
            np.testing.assert_allclose(y[0, t, 0, i], a * np.cos(angle) - b * np.sin(angle), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(y[0, t, 0, i + 4], b * np.cos(angle) + a * np.sin(angle), rtol=1e-5, atol=1e-6)


def test_grouped_query_attention_shares_key_value_heads():
    # With 2 key/value heads for 4 query heads, copying each kv head into 4 full heads (query
    # heads 0, 1 read kv head 0; 2, 3 read kv head 1, as HF's repeat_kv) gives the same logits.
    gqa = small()
    mha = small(n_kv_heads=4)
    params = nnx.to_pure_dict(nnx.state(gqa, nnx.Param))
    full = jax.tree.map(lambda x: x, params)
    for name in ("k_proj", "v_proj"):
        k = params["layers"]["self_attn"][name]["kernel"].reshape(2, 32, 2, 8)
        full["layers"]["self_attn"][name]["kernel"] = jnp.repeat(k, 2, axis=2).reshape(2, 32, 32)
    nnx.update(mha, full)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 12)), jnp.int32)
    np.testing.assert_allclose(gqa.logits(tokens), mha.logits(tokens), rtol=1e-5, atol=1e-5)
    changed = tokens.at[0, 7].set((tokens[0, 7] + 1) % 64)
    a, b = gqa.logits(tokens), gqa.logits(changed)
    np.testing.assert_array_equal(a[0, :7], b[0, :7])  # causal
    assert not np.allclose(a[0, 7:], b[0, 7:])


@pytest.mark.parametrize("name, params", [("llama-1b", 1_235_814_400), ("llama3-8b", 8_030_261_248)])
def test_planning_configs_have_the_published_parameter_counts(name, params):
    # Llama-3.2-1B and Llama-3-8B as Hugging Face counts them (tied / untied head).
    assert measure.count_params(config.load(ROOT / "configs" / f"{name}.yaml")) == params


def test_analyze_counts_llamas_own_parameters_and_bytes():
    # As shipped: configs/llama-tiny.yaml shards every matrix (only the norms' scales stay whole).
    cfg = config.load(ROOT / "configs" / "llama-tiny.yaml", ["train.global_batch=16"])
    doc = measure.analyze(cfg, (0, 3))
    assert doc["params"] == measure.count_params(config.load(ROOT / "configs" / "llama-tiny.yaml"))
    for stage in ("0", "3"):
        m = doc["stages"][stage]
        assert abs(m["comm_bytes"] / m["comm_theory_bytes"] - 1) <= 0.02, (stage, m)  # DESIGN §2 for its own Ψ
    persistent = doc["stages"]["0"]["argument_bytes"] / doc["stages"]["3"]["argument_bytes"]
    assert 0.8 * doc["devices"] <= persistent <= doc["devices"], persistent  # about N (small leaves stay whole)
