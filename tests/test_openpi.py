"""openpi checkpoints in and out (`model.init_from=DIR`, `zerojax export --format openpi`) for π0
and π0.5: the tree zerojax writes has the paths and shapes of the one openpi's own code builds
(tests/fixtures/openpi/tree_shapes.json, scripts/fixtures/make_openpi_shapes.py); a run's export
reads back to the same parameters and losses; a tree written here by
hand with openpi's names and shapes (from openpi's `gemma.py`, `siglip.py`, `pi0.py`), every leaf
of distinct values, lands each element where openpi's einsums use it; bad directories are refused
with one line before anything compiles."""

import json
import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from conftest import ROOT, robot_observation, run
from zerojax import cli
from zerojax.errors import ConfigError
from zerojax.interop import openpi
from zerojax.serve import loaders
from zerojax.train.export import export, load_model

DATASET = ROOT / "tests" / "fixtures" / "lerobot" / "tiny"
SIZES = ["model.norm_eps=1e-6", "model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
         "model.head_dim=8", "model.d_ff=32", "model.expert.d_model=16", "model.expert.d_ff=24",
         "model.vision.image_size=8", "model.vision.patch_size=4", "model.vision.d_model=16",
         "model.vision.n_layers=1", "model.vision.n_heads=2", "model.vision.d_ff=32", "model.action.horizon=2",
         "model.action.prompt_len=64", "model.action.max_state_dim=8", "model.action.max_action_dim=4",
         "model.action.action_dim=2", "model.action.cameras=2", "data.image_size=8", "data.action_horizon=2",
         "data.prompt_len=64", f"data.source=lerobot:{DATASET}", "train.global_batch=8", "zero.min_shard_size=64", "train.steps=1",
         "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "optim.warmup_steps=0", "model.remat=none"]
GIVEN = {"action": {"horizon": 2, "prompt_len": 64, "max_state_dim": 8, "action_dim": 2, "cameras": 2}}


def params_of(model) -> dict:
    return {"/".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def batch_of(cfg, family: str, seed: int = 0):
    """A random batch, noise and time of the model's shapes."""
    a, B = cfg.action, 2
    rng = np.random.default_rng(seed)
    batch = {"images": rng.standard_normal((B, a.cameras, 3, cfg.vision.image_size, cfg.vision.image_size)),
             "image_masks": np.array([[True, True], [True, False]]),
             "tokens": rng.integers(0, cfg.vocab_size, (B, a.prompt_len)), "token_mask": np.arange(a.prompt_len) < 40,
             "actions": rng.standard_normal((B, a.horizon, a.max_action_dim))}
    batch["token_mask"] = np.broadcast_to(batch["token_mask"], (B, a.prompt_len))
    if family == "pi0":
        batch["state"] = rng.standard_normal((B, a.max_state_dim))
    batch = {k: jnp.asarray(v, jnp.float32 if v.dtype == np.float64 else None) for k, v in batch.items()}
    noise = jnp.asarray(rng.standard_normal((B, a.horizon, a.max_action_dim)), jnp.float32)
    return batch, noise, jnp.asarray([0.3, 0.8], jnp.float32)


@pytest.fixture(scope="module", params=["pi0", "pi05"])
def exported(request, tmp_path_factory):
    """(family, run dir, its openpi export) of a one-step run on the tiny LeRobot dataset."""
    family, tmp = request.param, tmp_path_factory.mktemp(request.param)
    norm = ["data.norm_state=quantiles", "data.norm_action=quantiles"] if family == "pi05" else []
    run([f"model.family={family}", *SIZES, *norm, f"train.out_dir={tmp / 'run'}"])
    export(tmp / "run", tmp / "openpi", fmt="openpi")
    return family, tmp / "run", tmp / "openpi"


def test_an_export_reads_back_to_the_same_parameters_and_losses(exported):
    family, run_dir, out = exported
    _, _, trained = load_model(run_dir)
    cfg, loaded = openpi.load(out, GIVEN)
    assert cfg.family == family and (cfg.expert.d_model, cfg.vision.n_heads, cfg.action.max_action_dim) == (16, 2, 4)
    want, have = params_of(trained), params_of(loaded)
    assert want.keys() == have.keys()
    for path in want:
        np.testing.assert_array_equal(have[path], want[path], err_msg=path)
    batch, noise, time = batch_of(cfg, family)
    np.testing.assert_array_equal(loaded.flow_loss(batch, noise, time), trained.flow_loss(batch, noise, time))


def test_the_assets_hold_the_datasets_statistics(exported):
    """assets/<dataset>/norm_stats.json as openpi's normalize.save writes it: the run's modes'
    statistics, mean and std (which openpi's NormStats requires) from the dataset beside them."""
    family, run_dir, out = exported
    record = json.loads((run_dir / "lerobot.json").read_text())["normalization"]
    stats = json.loads((out / "assets" / "tiny" / "norm_stats.json").read_text())["norm_stats"]
    dataset = json.loads((DATASET / "meta" / "stats.json").read_text())
    assert set(stats) == {"state", "actions"}
    for key, feature in (("state", "observation.state"), ("actions", "action")):
        kept = {s for s in record[feature] if s != "mode"}
        for stat in {"mean", "std", "q01", "q99"}:
            want = record[feature][stat] if stat in kept else dataset[feature][stat]
            np.testing.assert_allclose(stats[key][stat], want, rtol=1e-6, err_msg=f"{key}.{stat}")
    read = openpi.norm_stats(out)
    np.testing.assert_allclose(read["action"]["q99"], stats["actions"]["q99"])


def test_zerojax_serve_of_the_export_answers_as_the_run(exported):
    """`zerojax serve DIR` of the export (its zerojax.json: the run's config, lerobot.json and
    tokenizer; the statistics from assets/tiny/) answers a robot's observation as the run does."""
    _, run_dir, out = exported
    from_run, from_export = (loaders.load(d, num_steps=3, seed=1) for d in (run_dir, out))
    for request in range(2):
        obs = robot_observation(from_run, seed=request)
        np.testing.assert_allclose(from_export.infer(obs, request)["actions"], from_run.infer(obs, request)["actions"],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("exported", ["pi0"], indirect=True)  # one family: the reading path is the same
def test_a_run_from_an_export_starts_where_it_ended_and_keeps_its_assets(exported, tmp_path):
    """model.init_from=DIR through the CLI's config: the model keys from the tree, the weights in
    the run's first checkpoint (a 0-lr step), assets/ kept in RUN_DIR/openpi_init/."""
    family, run_dir, out = exported
    sizes = [s for s in SIZES if not s.startswith(("model.norm_eps", "model.vocab", "model.d_", "model.n_", "model.head", "model.exp",
                                                   "model.vision.", "model.action.max_a"))]
    run([f"model.init_from={out}", *sizes, "optim.lr=0", "optim.weight_decay=0", f"train.out_dir={tmp_path / 'again'}"])
    _, _, before = load_model(run_dir)
    saved, _, after = load_model(tmp_path / "again")
    assert saved["model"]["family"] == "pi0" and saved["model"]["expert"]["d_model"] == 16
    for path, value in params_of(before).items():
        np.testing.assert_array_equal(params_of(after)[path], value, err_msg=path)
    kept = tmp_path / "again" / "openpi_init" / "assets" / "tiny" / "norm_stats.json"
    assert kept.read_bytes() == (out / "assets" / "tiny" / "norm_stats.json").read_bytes()


def test_an_export_of_norms_openpi_does_not_compute_is_refused(exported, tmp_path):
    """openpi's RMSNorm and LayerNorm fix eps at 1e-6 in code: a run with another would be read
    by openpi to other numbers, so it is not written."""
    family, run_dir, _ = exported
    saved, _, _ = load_model(run_dir)
    model = {**saved["model"], "norm_eps": 1e-5}
    with pytest.raises(ConfigError, match=r"model.norm_eps=1e-05; openpi's Gemma and SigLIP norms compute with eps"):
        openpi.save(tmp_path / "out", run_dir, model, {}, None)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


# ---------------------------------------------------------------------------------------------
# A tree written by hand, by openpi's names and shapes (gemma.py, siglip.py, pi0.py), each leaf's
# elements distinct from every other leaf's: each zerojax element is checked at openpi's index.

V, D, L, N, H, F, W, FE = 256, 12, 2, 2, 4, 20, 8, 14  # vocab, width, depth, heads, head dim, MLP; expert's
P, S, E, LV, NH, HD, FV, A, ST = 4, 8, 6, 1, 2, 3, 10, 5, 7  # tower; max_action_dim, max_state_dim
LLM, BLOCK = "PaliGemma/llm/layers/", "PaliGemma/img/Transformer/encoderblock/"
MHA = BLOCK + "MultiHeadDotProductAttention_0/"


def openpi_shapes(family: str) -> dict:
    out = {"PaliGemma/llm/embedder/input_embedding": (V, D), "PaliGemma/llm/final_norm/scale": (D,),
           "PaliGemma/img/embedding/kernel": (P, P, 3, E), "PaliGemma/img/embedding/bias": (E,),
           "PaliGemma/img/pos_embedding": (1, (S // P) ** 2, E), "PaliGemma/img/head/kernel": (E, D),
           "PaliGemma/img/head/bias": (D,), "PaliGemma/img/Transformer/encoder_norm/scale": (E,),
           "PaliGemma/img/Transformer/encoder_norm/bias": (E,), BLOCK + "MlpBlock_0/Dense_0/kernel": (LV, E, FV),
           BLOCK + "MlpBlock_0/Dense_0/bias": (LV, FV), BLOCK + "MlpBlock_0/Dense_1/kernel": (LV, FV, E),
           BLOCK + "MlpBlock_0/Dense_1/bias": (LV, E), MHA + "out/kernel": (LV, NH, HD, E), MHA + "out/bias": (LV, E),
           "action_in_proj/kernel": (A, W), "action_in_proj/bias": (W,), "action_out_proj/kernel": (W, A),
           "action_out_proj/bias": (A,)}
    for norm in ("LayerNorm_0", "LayerNorm_1"):
        out.update({f"{BLOCK}{norm}/scale": (LV, E), f"{BLOCK}{norm}/bias": (LV, E)})
    for proj in ("query", "key", "value"):
        out.update({f"{MHA}{proj}/kernel": (LV, E, NH, HD), f"{MHA}{proj}/bias": (LV, NH, HD)})
    for sfx, width, ff in (("", D, F), ("_1", W, FE)):
        out.update({f"{LLM}attn/q_einsum{sfx}/w": (L, N, width, H), f"{LLM}attn/kv_einsum{sfx}/w": (L, 2, 1, width, H),
                    f"{LLM}attn/attn_vec_einsum{sfx}/w": (L, N, H, width), f"{LLM}mlp{sfx}/gating_einsum": (L, 2, width, ff),
                    f"{LLM}mlp{sfx}/linear": (L, ff, width)})
    for norm in ("pre_attention_norm", "pre_ffw_norm"):
        out[f"{LLM}{norm}/scale"] = (L, D)
        out.update({f"{LLM}{norm}_1/scale": (L, W)} if family == "pi0" else
                   {f"{LLM}{norm}_1/Dense_0/kernel": (L, W, 3 * W), f"{LLM}{norm}_1/Dense_0/bias": (L, 3 * W)})
    if family == "pi0":
        out.update({"PaliGemma/llm/final_norm_1/scale": (W,), "state_proj/kernel": (ST, W), "state_proj/bias": (W,),
                    "action_time_mlp_in/kernel": (2 * W, W), "action_time_mlp_in/bias": (W,),
                    "action_time_mlp_out/kernel": (W, W), "action_time_mlp_out/bias": (W,)})
    else:
        out.update({"PaliGemma/llm/final_norm_1/Dense_0/kernel": (W, 3 * W), "PaliGemma/llm/final_norm_1/Dense_0/bias":
                    (3 * W,), "time_mlp_in/kernel": (W, W), "time_mlp_in/bias": (W,), "time_mlp_out/kernel": (W, W),
                    "time_mlp_out/bias": (W,)})
    return out


def write_tree(directory, family: str, value_suffix: bool = False) -> dict:
    """DIR/params (orbax, {"params": tree}; training's "value" leaves if `value_suffix`) and
    DIR/assets/<id>/norm_stats.json; returns the flat tree."""
    flat = {name: (1000 * k + np.arange(np.prod(shape), dtype=np.float32)).reshape(shape)
            for k, (name, shape) in enumerate(sorted(openpi_shapes(family).items()))}
    nested: dict = {}
    for name, value in flat.items():
        node, keys = nested, name.split("/") + (["value"] if value_suffix else [])
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save((directory / "params").resolve(), {"params": nested})
    stats = {"state": {"mean": [0.5] * ST, "std": [2.0] * ST, "q01": [-1.0] * ST, "q99": [1.0] * ST},
             "actions": {"mean": [0.1] * A, "std": [3.0] * A, "q01": None, "q99": None}}
    (directory / "assets" / "org" / "robot").mkdir(parents=True)
    (directory / "assets" / "org" / "robot" / "norm_stats.json").write_text(json.dumps({"norm_stats": stats}))
    return flat


def expect(zj: dict, path: str, tree: dict, name: str, where) -> None:
    """Every element of zerojax leaf `path` equals openpi's `name` at `where(index)`."""
    have, src = zj[path], tree[name]
    assert 0 < have.size <= src.size, (path, have.shape, src.shape)
    for index in np.ndindex(have.shape):
        assert have[index] == src[where(*index)], (path, index, name, where(*index))


def stream_places(zj: dict, tree: dict, stream: str, sfx: str) -> None:
    """One stream's attention and MLP at openpi's einsum indices (gemma.py: BTD,NDH->BTNH;
    BSD,2KDH->2BSKH; BTNH,NHD->BTD; the gate dot(x, w[0]), the up dot(x, w[1]))."""
    at = f"layers/{stream}/"
    expect(zj, at + "q_proj/kernel", tree, f"{LLM}attn/q_einsum{sfx}/w", lambda l, d, c: (l, c // H, d, c % H))
    expect(zj, at + "k_proj/kernel", tree, f"{LLM}attn/kv_einsum{sfx}/w", lambda l, d, c: (l, 0, c // H, d, c % H))
    expect(zj, at + "v_proj/kernel", tree, f"{LLM}attn/kv_einsum{sfx}/w", lambda l, d, c: (l, 1, c // H, d, c % H))
    expect(zj, at + "o_proj/kernel", tree, f"{LLM}attn/attn_vec_einsum{sfx}/w", lambda l, c, d: (l, c // H, c % H, d))
    expect(zj, at + "mlp/gate_proj/kernel", tree, f"{LLM}mlp{sfx}/gating_einsum", lambda l, d, f: (l, 0, d, f))
    expect(zj, at + "mlp/up_proj/kernel", tree, f"{LLM}mlp{sfx}/gating_einsum", lambda l, d, f: (l, 1, d, f))
    expect(zj, at + "mlp/down_proj/kernel", tree, f"{LLM}mlp{sfx}/linear", lambda *i: i)


@pytest.mark.parametrize("family", ["pi0", "pi05"])
def test_a_hand_written_tree_lands_where_openpi_uses_each_element(family, tmp_path):
    tree = write_tree(tmp_path / "ckpt", family, value_suffix=family == "pi0")  # π0's as training saves it
    cfg, model = openpi.load(tmp_path / "ckpt", {"action": {"horizon": 3, "prompt_len": 5}})
    assert (cfg.family, cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
            cfg.d_ff) == (family, V, D, L, N, 1, H, F)
    assert (cfg.expert.d_model, cfg.expert.d_ff, cfg.action.max_action_dim) == (W, FE, A)
    v = cfg.vision
    assert (v.image_size, v.patch_size, v.d_model, v.n_layers, v.n_heads, v.d_ff) == (S, P, E, LV, NH, FV)
    assert cfg.action.max_state_dim == (ST if family == "pi0" else 32)  # π0.5's state is in the prompt
    zj = params_of(model)
    stream_places(zj, tree, "vlm", "")
    stream_places(zj, tree, "expert", "_1")
    for zerojax, name in (("embed_tokens/embedding", "PaliGemma/llm/embedder/input_embedding"),
                          ("norm/scale", "PaliGemma/llm/final_norm/scale"),
                          ("layers/vlm/input_layernorm/scale", LLM + "pre_attention_norm/scale"),
                          ("layers/vlm/post_attention_layernorm/scale", LLM + "pre_ffw_norm/scale"),
                          ("multi_modal_projector/kernel", "PaliGemma/img/head/kernel"),
                          ("vision_post_layernorm/scale", "PaliGemma/img/Transformer/encoder_norm/scale"),
                          ("vision/layer_norm1/bias", BLOCK + "LayerNorm_0/bias"),
                          ("vision/layer_norm2/scale", BLOCK + "LayerNorm_1/scale"),
                          ("vision/mlp/fc1/kernel", BLOCK + "MlpBlock_0/Dense_0/kernel"),
                          ("vision/mlp/fc2/kernel", BLOCK + "MlpBlock_0/Dense_1/kernel"),
                          ("action_in_proj/kernel", "action_in_proj/kernel"),
                          ("action_out_proj/bias", "action_out_proj/bias")):
        expect(zj, zerojax, tree, name, lambda *i: i)
    expect(zj, "vision_embeddings/patch_embedding/kernel", tree, "PaliGemma/img/embedding/kernel",  # flax: HWIO
           lambda x, y, c, e: (y, x, c, e))
    expect(zj, "vision_embeddings/position_embedding/embedding", tree, "PaliGemma/img/pos_embedding",
           lambda i, e: (0, i, e))
    for proj, flax in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):  # BTD,DNH->BTNH
        expect(zj, f"vision/self_attn/{proj}/kernel", tree, f"{MHA}{flax}/kernel", lambda l, e, c: (l, e, c // HD, c % HD))
        expect(zj, f"vision/self_attn/{proj}/bias", tree, f"{MHA}{flax}/bias", lambda l, c: (l, c // HD, c % HD))
    expect(zj, "vision/self_attn/out_proj/kernel", tree, MHA + "out/kernel", lambda l, c, e: (l, c // HD, c % HD, e))
    if family == "pi0":
        for zerojax, name in (("layers/expert/input_layernorm/scale", LLM + "pre_attention_norm_1/scale"),
                              ("layers/expert/post_attention_layernorm/scale", LLM + "pre_ffw_norm_1/scale"),
                              ("expert_norm/scale", "PaliGemma/llm/final_norm_1/scale"),
                              ("state_proj/kernel", "state_proj/kernel"),
                              ("action_time_mlp_in/kernel", "action_time_mlp_in/kernel"),
                              ("action_time_mlp_out/bias", "action_time_mlp_out/bias")):
            expect(zj, zerojax, tree, name, lambda *i: i)
    else:  # the adaptive norms' Dense(3W): scale, shift, gate, split as gemma.RMSNorm splits them
        for zerojax, name in (("layers/expert/input_layernorm/dense", LLM + "pre_attention_norm_1/Dense_0"),
                              ("layers/expert/post_attention_layernorm/dense", LLM + "pre_ffw_norm_1/Dense_0"),
                              ("expert_norm/dense", "PaliGemma/llm/final_norm_1/Dense_0"),
                              ("time_mlp_in", "time_mlp_in"), ("time_mlp_out", "time_mlp_out")):
            for leaf in ("kernel", "bias"):
                expect(zj, f"{zerojax}/{leaf}", tree, f"{name}/{leaf}", lambda *i: i)
    stats = openpi.norm_stats(tmp_path / "ckpt")
    assert stats["observation.state"]["q99"].tolist() == [1.0] * ST and set(stats["action"]) == {"mean", "std"}


@pytest.mark.parametrize("family, norm", [("pi0", "mean_std"), ("pi05", "quantiles")])
def test_an_openpi_checkpoint_sets_openpis_recipe_and_the_users_keys_win(family, norm, tmp_path):
    """model.init_from of an openpi checkpoint: the model type's normalization (quantiles for π0.5,
    mean and std for π0), openpi's fine-tuning recipe (TrainConfig's AdamW, CosineDecaySchedule
    and ema_decay) and, for π0.5, its 200 prompt tokens; each said to come from the checkpoint,
    and a key the user sets wins."""
    from zerojax import config

    write_tree(tmp_path / "ckpt", family)
    source = [f"model.init_from={tmp_path / 'ckpt'}", f"data.source=lerobot:{DATASET}"]
    cfg, origins = config.load_with_origins(overrides=source)
    o, d = cfg.optim, cfg.data
    assert (d.norm_state, d.norm_action) == (norm, norm)
    assert (o.lr, o.b1, o.b2, o.eps, o.weight_decay, o.clip_norm) == (2.5e-5, 0.9, 0.95, 1e-8, 1e-10, 1.0)
    assert (o.schedule, o.warmup_steps, o.decay_steps, o.final_lr, o.ema) == ("cosine", 1000, 30000, 2.5e-6, 0.99)
    assert o.decay_mask == "all"  # openpi's scripts/train.py: weight_decay_mask=None
    assert cfg.model.norm_eps == 1e-6 and origins["model.norm_eps"] == "checkpoint"  # the tree's, not the recipe's
    assert cfg.model.action.prompt_len == d.prompt_len == (200 if family == "pi05" else 48)
    assert {origins[k] for k in ("data.norm_state", "data.norm_action", "optim.lr", "optim.ema")} == {"checkpoint"}
    cfg, origins = config.load_with_origins(overrides=[*source, "optim.lr=1e-4", "data.norm_action=min_max",
                                                       "model.action.prompt_len=64"])
    assert (cfg.optim.lr, cfg.data.norm_action, cfg.data.norm_state) == (1e-4, "min_max", norm)
    assert cfg.model.action.prompt_len == 64 and origins["optim.lr"] == origins["data.norm_action"] == "config"


@pytest.fixture(scope="module")
def hand_written(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tree") / "pi0_ckpt"
    write_tree(directory, "pi0")
    return directory


def bad_copy(hand_written, tmp_path, drop: str = "", add_lora: bool = False):
    """A copy of the hand-written π0 checkpoint without `drop` (params or assets), or with an
    openpi LoRA leaf beside the weights."""
    out = tmp_path / "bad"
    if add_lora:
        flat = write_tree(out, "pi0")
        shutil.rmtree(out / "params")
        flat[LLM + "attn/q_einsum/lora_a"] = np.zeros((L, N, D, 2), np.float32)
        nested: dict = {}
        for name, value in flat.items():
            node, keys = nested, name.split("/")
            for key in keys[:-1]:
                node = node.setdefault(key, {})
            node[keys[-1]] = value
        with ocp.PyTreeCheckpointer() as ckptr:
            ckptr.save((out / "params").resolve(), {"params": nested})
        return out
    shutil.copytree(hand_written, out)
    if drop:
        shutil.rmtree(out / drop)
    return out


def cut_in_half(path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


DAMAGE = {  # what a copy that stopped part way, or a disk, leaves of a params/ (orbax 0.12.8's files)
    "empty params": lambda params: [shutil.rmtree(params), params.mkdir()],
    "params cut short": lambda params: (params / "manifest.ocdbt").unlink(),
    "metadata cut short": lambda params: cut_in_half(params / "_METADATA"),
    "metadata unreadable": lambda params: (params / "_METADATA").write_bytes(b"\xff\xfe\x00garbage"),
    "data cut short": lambda params: cut_in_half(max((f for f in params.rglob("*") if f.parent.name == "d"),
                                                     key=lambda f: f.stat().st_size)),  # the arrays' largest file
}


@pytest.mark.parametrize("case, extra, message", [
    ("params", [], "no params/ directory; an openpi checkpoint holds its weights in params/"),
    ("assets", [], "no assets/<asset_id>/norm_stats.json; an openpi checkpoint keeps its normalization statistics"),
    ("family", ["model.family=pi05"], "model.family=pi05, but model.init_from="),
    ("size", ["model.d_model=64"], "model.d_model=64 contradicts {dir}/params, which says 12"),
    ("lora", [], "holds 1 leaves the pi0 model has no place for (e.g. 'PaliGemma/llm/layers/attn/q_einsum/lora_a'"),
    ("empty params", [], "params is empty; an openpi checkpoint's params/ holds orbax's _METADATA"),
    ("params cut short", [], "params has no manifest.ocdbt, the index of the arrays its _METADATA says are in one"),
    ("metadata cut short", [], "params/_METADATA is not orbax's tree metadata (a JSON object with \"tree_metadata\"; "
                               "JSONDecodeError: Unterminated string"),
    ("metadata unreadable", [], "params/_METADATA is not orbax's tree metadata"),
    ("data cut short", [], "params: orbax cannot read its arrays (OUT_OF_RANGE: Error reading"),
])
def test_a_bad_openpi_directory_is_refused_in_one_line(case, extra, message, hand_written, tmp_path, capsys, caplog):
    """One line on stderr, and no log record at WARNING either: the CLI prints each as a
    `zerojax: warning:` line (pytest's log capture holds them here instead)."""
    directory = bad_copy(hand_written, tmp_path, case if case in ("params", "assets") else "", case == "lora") \
        if case not in ("family", "size") else hand_written
    DAMAGE.get(case, lambda params: None)(directory / "params")
    code = cli.main(["train", f"model.init_from={directory}", *extra, "model.action.horizon=2",
                     "model.action.prompt_len=64", "model.action.action_dim=2", "model.action.cameras=2",
                     "data.image_size=8", "data.action_horizon=2", "data.prompt_len=64", f"data.source=lerobot:{DATASET}",
                     "train.global_batch=8", f"train.out_dir={tmp_path / 'run'}", "train.steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    message = message.format(dir=directory)
    assert code == 2 and len(err) == 1 and err[0].startswith("zerojax: error:") and message in err[0], err
    assert not (tmp_path / "run").exists()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    if case == "family":
        assert "is an openpi pi0 tree (it has state_proj, action_time_mlp_in); set model.family=pi0" in err[0]


def test_a_checkpoint_named_relatively_to_the_working_directory_starts_a_run(hand_written, tmp_path, monkeypatch):
    """model.init_from=pi0_ckpt from the directory that holds it (orbax itself takes absolute paths
    only: zerojax hands it one)."""
    shutil.copytree(hand_written, tmp_path / "pi0_ckpt")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--no-progress", "model.init_from=pi0_ckpt", "model.action.horizon=2",
                     "model.action.prompt_len=64", "model.action.action_dim=2", "model.action.cameras=2",
                     f"data.source=lerobot:{DATASET}", "train.global_batch=8", "train.out_dir=run", "train.steps=1",
                     "train.report=false", "train.sample_tokens=0", "train.eval_every=0"]) == 0
    assert (tmp_path / "run" / "openpi_init").is_dir()


@pytest.mark.parametrize("family", ["pi0", "pi05"])
def test_the_tree_has_the_paths_and_shapes_openpi_builds(family):
    """openpi's own Pi0 (gemma "dummy" sizes, So400m/14) gave the fixture's tree: the model keys
    read from it build a zerojax model whose rules write exactly that tree, and read it back to
    the model's shapes; every zerojax parameter is in exactly one rule."""
    from zerojax.config.hf_config import _coerced
    from zerojax.config.sections import ModelConfig
    from zerojax.models import registry
    from zerojax.precision import Policy

    openpi_tree = {k: tuple(v) for k, v in json.loads((ROOT / "tests" / "fixtures" / "openpi" / "tree_shapes.json")
                                                       .read_text())[family].items()}
    layout = registry.openpi_layouts()[family]
    keys = layout.model_keys(openpi_tree, "fixture", {})
    assert (keys["d_model"], keys["n_heads"], keys["head_dim"], keys["expert"]["d_model"], keys["vision"]["n_heads"],
            keys["vision"]["image_size"]) == (64, 8, 16, 64, 16, 224)
    cfg = ModelConfig(**_coerced("model", keys, ModelConfig))
    model = nnx.eval_shape(lambda: registry.build(cfg, Policy(), 0))
    ours = {"/".join(map(str, k)): tuple(v.shape) for k, v in
            jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
            for k in [[getattr(p, "key", p) for p in k]]}
    written, read = {}, {}
    for rule in layout.rules(keys):
        specs = [jax.ShapeDtypeStruct(ours[p], np.float32) for p in rule.zerojax]
        written.update(zip(rule.openpi, (o.shape for o in jax.eval_shape(lambda *a, r=rule: r.to_openpi(jnp, *a), *specs))))
        back = [jax.ShapeDtypeStruct(openpi_tree[n], np.float32) for n in rule.openpi]
        read.update(zip(rule.zerojax, (o.shape for o in jax.eval_shape(lambda *a, r=rule: r.from_openpi(jnp, *a), *back))))
    assert sum(len(r.zerojax) for r in layout.rules(keys)) == len(ours)
    assert written == openpi_tree
    assert read == ours
