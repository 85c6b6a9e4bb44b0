"""π0.5 (`model.family=pi05`): its flow-matching losses and sampled actions equal LeRobot 0.6.1's
own PyTorch π0.5 on a tiny random checkpoint (tests/fixtures/lerobot06/pi05, made by
scripts/fixtures/make_lerobot06_fixtures.py in fp32, its adaRMS projections random), its prompt
equals LeRobot's state-tokenizer step's, and its joint-layer units train on 8 devices as on one."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from conftest import ROOT, run
from zerojax.interop import lerobot
from zerojax.models.pi05 import batch as pi05_batch
from zerojax.models.vla import batch as vla_batch

FIXTURE = ROOT / "tests" / "fixtures" / "lerobot06"
OBSERVATION = ("images", "image_masks", "tokens", "token_mask", "actions")
TINY = ["model.family=pi05", "model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
        "model.n_kv_heads=1", "model.head_dim=8", "model.d_ff=32", "model.expert.d_model=16", "model.expert.d_ff=32",
        "model.vision.image_size=8", "model.vision.patch_size=4", "model.vision.d_model=16", "model.vision.n_layers=1",
        "model.vision.n_heads=2", "model.vision.d_ff=32", "model.action.horizon=2", "model.action.prompt_len=64",
        "model.action.max_state_dim=8", "model.action.max_action_dim=4", "model.action.action_dim=2",
        "model.action.cameras=2", "data.image_size=8", "data.action_horizon=2", "data.prompt_len=64",
        f"data.source=lerobot:{ROOT / 'tests' / 'fixtures' / 'lerobot' / 'tiny'}", "train.global_batch=16", "data.norm_state=quantiles",
        "zero.min_shard_size=64", "train.steps=2", "train.log_every=1", "train.eval_every=0",
        "train.sample_tokens=0", "train.ckpt_every=0", "optim.warmup_steps=0", "model.remat=none"]


@pytest.fixture(scope="module")
def reference():
    return load_file(FIXTURE / "pi05.reference.safetensors")


@pytest.fixture(scope="module")
def loaded():
    return lerobot.load(FIXTURE / "pi05", vision_heads=2)


def test_losses_and_sampled_actions_equal_lerobots(loaded, reference):
    cfg, model = loaded
    assert cfg.family == "pi05" and (cfg.expert.d_model, cfg.action.horizon, cfg.action.action_dim) == (16, 4, 3)
    batch = {k: jnp.asarray(reference[k]) for k in OBSERVATION}
    losses = model.flow_loss(batch, jnp.asarray(reference["noise"]), jnp.asarray(reference["time"]))
    assert losses.shape == reference["losses"].shape == (2, 4, 32)
    np.testing.assert_allclose(losses, reference["losses"], atol=1e-4, rtol=1e-4)
    sampled = model.sample_actions(batch, jnp.asarray(reference["sample_noise"]))
    np.testing.assert_allclose(sampled, reference["actions_sampled"], atol=1e-4, rtol=1e-4)


def test_the_prompt_holds_the_state_as_lerobot_writes_it(reference):
    """The prompt's text and tokens equal LeRobot's preprocessor's, from the normalized state."""
    with safe_open(FIXTURE / "pi05.reference.safetensors", "np") as f:
        meta = f.metadata()
    tasks, prompts = json.loads(meta["tasks"]), json.loads(meta["prompts"])
    width = reference["raw_state"].shape[1]
    assert [pi05_batch.prompt_text(t, s[:width]) for t, s in zip(tasks, reference["state"])] == prompts
    tokenizer = Tokenizer.from_file(str(FIXTURE / "tokenizer" / "tokenizer.json"))
    for row, text in enumerate(prompts):
        tokens, mask = vla_batch.tokenize(text, reference["tokens"].shape[1], tokenizer)
        np.testing.assert_array_equal(tokens[mask], reference["tokens"][row][reference["token_mask"][row]])
        np.testing.assert_array_equal(mask, reference["token_mask"][row])


def test_the_batch_reads_the_state_into_the_prompt():
    from zerojax import config
    from zerojax.data import sources

    cfg = config.load(overrides=TINY)
    src = sources.open_source(cfg)
    batch = src.rows(0, 0, slice(None))
    assert "state" not in batch
    assert {k: v.shape for k, v in batch.items()} == {k: f.shape for k, f in src.spec().items()}
    raw = src.source.rows(0, 0, slice(None))
    for row in range(len(batch["tokens"])):
        text = bytes(batch["tokens"][row][batch["token_mask"][row]].tolist()).decode()
        task = str(raw["task"][row])  # the dataset's own text, as meta/tasks.parquet holds it
        assert text == pi05_batch.prompt_text(task, raw["observation.state"][row])
        assert text.startswith(f"Task: {task.strip()}, State: ") and text.endswith(";\nAction: ")
        # the bins, independently: bin i holds [-1 + i/128, -1 + (i+1)/128), below -1 is -1, the last open
        state = raw["observation.state"][row].astype(np.float64)
        bins = np.clip(np.floor((state + 1) * 128), -1, 255).astype(int)
        assert text.split("State: ")[1].split(";")[0] == " ".join(map(str, bins))


def test_the_prompt_is_written_from_the_tasks_text_not_read_back_from_its_tokens():
    """A word-level tokenizer maps a word it does not know to [UNK]: decoding the data layer's
    tokens back would lose it. π0.5's prompt is written from the task's own text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["Task", ":", "pick", "the", "cube", ",", "State", ";", "Action"] + [str(i) for i in range(256)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    task, state = "pick the red_cube", np.array([[0.25, -0.5]], np.float32)
    ids = tokenizer.encode(task + "\n").ids  # π0's prompt of the task: "red_cube" is [UNK]
    raw = {"task": np.array([task]), "observation.state": state, "tokens": np.array([ids], np.int32),
           "token_mask": np.ones((1, len(ids)), bool)}
    out = pi05_batch.prompts(raw, 32, tokenizer)
    want, mask = vla_batch.tokenize(pi05_batch.prompt_text(task, state[0]), 32, tokenizer)
    np.testing.assert_array_equal(out["tokens"][0], want)
    np.testing.assert_array_equal(out["token_mask"][0], mask)
    read_back = tokenizer.decode(ids)  # "pick the [UNK]": what decoding the tokens would have given
    assert "red" not in read_back and not np.array_equal(
        vla_batch.tokenize(pi05_batch.prompt_text(read_back, state[0]), 32, tokenizer)[0], out["tokens"][0])
    with pytest.raises(ValueError, match="rows carry no 'task'"):
        pi05_batch.prompts({k: v for k, v in raw.items() if k != "task"}, 32, tokenizer)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return run(TINY + ["mesh.data=1", "zero.stage=0", "zero.schedule=gspmd",
                       f"train.out_dir={tmp_path_factory.mktemp('one')}"])[0]


@pytest.mark.parametrize("extra", [["zero.stage=3"], ["zero.stage=3", "train.grad_accum=2", "optim.ema=0.99"]],
                         ids=lambda e: " ".join(e))
def test_stage_3_on_8_devices_gives_one_devices_losses(extra, one_device, tmp_path):
    losses, result = run(TINY + extra + [f"train.out_dir={tmp_path}"])
    np.testing.assert_allclose(losses, one_device, rtol=1e-5)
    params = result.state.params
    assert {"time_mlp_in", "time_mlp_out", "action_in_proj"} <= set(params) and "state_proj" not in params
    # the adaRMS projections are the joint layer's: gathered with it
    assert set(params["layers"]["expert"]["input_layernorm"]) == {"dense"}


def test_serve_builds_the_batch_training_builds(tmp_path):
    """`zerojax serve`'s batch of a frame (the state put in the prompt by the same adapter, with the
    run's tokenizer) equals the training row of that frame."""
    from zerojax import cli, config
    from zerojax.data import sources
    from zerojax.serve import loaders

    overrides = TINY + ["train.steps=1", "train.ckpt_every=1", "train.report=false", "mesh.data=1", "zero.stage=0",
                        "zero.schedule=gspmd"]
    assert cli.main(["train", "--no-progress", *overrides, f"train.out_dir={tmp_path / 'run'}"]) == 0
    served = loaders.load(tmp_path / "run", num_steps=2)
    src = sources.open_source(config.load(overrides=overrides))
    ds, batch = src.source.dataset, src.rows(0, 0, slice(None))
    for row, index in enumerate(src.source.frames_of(0, 0)[:3]):
        numbers = ds.numbers(int(index), 2)
        obs = {"observation.state": numbers["observation.state"].astype(np.float64), "prompt": numbers["task"],
               **{c: ds.image(c, int(index), src.source.video) for c in src.cameras}}
        got = served.batch(obs)
        assert set(got) == {"images", "image_masks", "tokens", "token_mask", "rtc_leftover", "rtc_weights"}
        assert not got["rtc_weights"].any()  # no leftover sent: real-time chunking weighs nothing
        for key in ("tokens", "token_mask", "image_masks"):
            np.testing.assert_array_equal(got[key][0], batch[key][row])
        np.testing.assert_allclose(got["images"][0], batch["images"][row], atol=1e-6)
        assert served.actions(got, served.noise(0)).shape == (2, 2)


def test_each_joint_layer_with_its_adaptive_norms_is_gathered_once_per_pass():
    """Stage 3's HLO: the joint layers' loops (3 layers; the tower has 1) gather one unit per
    iteration forward and backward and reduce-scatter one backward: the adaRMS projections travel
    with their joint layer, not apart from it."""
    from zerojax import config
    from zerojax.analysis import hlo, measure

    cfg = config.load(overrides=TINY + ["model.n_layers=3", "zero.stage=3", "zero.schedule=shard_map",
                                        "zero.prefetch=0"])
    engine, compiled = measure.compile_step(cfg, measured_only=True)
    assert {"input_layernorm", "post_attention_layernorm"} <= set(engine.plan.leaves["layers"]["expert"])
    loops = [x for x in hlo.loop_collectives(compiled.as_text(), 8) if x["per_iteration"]["all-gather"]]
    joint = sorted((x for x in loops if x["trip_count"] == 3), key=lambda x: x["per_iteration"]["reduce-scatter"])
    assert len(joint) == 2, loops  # the forward's loop and the backward's
    forward, backward = joint
    assert forward["per_iteration"]["all-gather"] == backward["per_iteration"]["all-gather"] == 1
    assert forward["per_iteration"]["reduce-scatter"] == 0 and backward["per_iteration"]["reduce-scatter"] == 1


def test_with_no_dataset_named_analyze_and_plan_compile_the_widest_batch(capsys):
    """`zerojax plan --config configs/pi05.yaml --devices N --device-memory 24GB` names no dataset:
    the batch is the model's widest (state and action at their padded widths, every camera slot),
    which is the batch of any dataset that fits; the plan answers on 8 devices. Training refuses."""
    import jax
    from zerojax import cli, config
    from zerojax.train import step as step_lib

    shapes = lambda cfg: jax.tree.map(lambda x: (x.shape, x.dtype), step_lib.batch_shape(cfg))  # noqa: E731
    bare = [o for o in TINY if not o.startswith("data.source=")]
    assert shapes(config.load(overrides=bare)) == shapes(config.load(overrides=TINY))
    assert cli.main(["train", *bare]) == 2
    assert "model.family=pi05 is a robot policy" in capsys.readouterr().err
    rc = cli.main(["plan", "--devices", "8", "--device-memory", "4GB", "--json", *bare])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["winner"]["fits"] and doc["winner"]["peak_bytes"] <= doc["budget_bytes"], doc
