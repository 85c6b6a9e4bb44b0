"""Greedy answers of a vision-language run to its held-out examples (zerojax.train.answer,
`zerojax generate RUN_DIR --held-out`): a row's answer does not depend on its padding or its
neighbours, it is the argmax decoding of the model's own logits, and the command reports the
exact match of what it decoded."""

import contextlib
import io
import json

import jax.numpy as jnp
import numpy as np
import pytest

from test_images import TINY_VLM, shapes_vqa
from zerojax import cli
from zerojax import config as config_lib
from zerojax.data import images
from zerojax.train import answer, export


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny PaliGemma run (one step at lr 0: its random initial weights, which answer more than EOS) on a 24-example shapes set (6 held out), on 8 devices."""
    root = tmp_path_factory.mktemp("answer")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert shapes_vqa().main(["--out", str(root / "set"), "--n", "24", "--size", "28", "--seed", "3"]) == 0
    image_token = next(k for k in printed.getvalue().split() if k.startswith("model.image_token_id="))
    dropped = ("train.steps", "model.vocab_size", "model.image_token_id", "train.ckpt_every")
    keys = [k for k in TINY_VLM if not k.startswith(dropped)]
    args = ["train", *keys, image_token, "model.vocab_size=384", "train.steps=1", "train.sample_tokens=0", "train.report=false",
            "train.tensorboard=false", "optim.lr=0", "optim.warmup_steps=0", "data.val_fraction=0.25",
            f"data.source={root / 'set' / 'data.jsonl'}", f"data.tokenizer={root / 'set'}",
            f"train.out_dir={root / 'run'}"]
    assert cli.main(args) == 0
    return root / "run"


def by_hand(model, source, i, max_new, pixels=None):
    """Example i's greedy tokens, the row never padded: the prefix, then one argmax at a time."""
    v = source.vision
    row = [v.image_token_id] * v.n_image_tokens + source.ids[i][0].tolist()
    n_prefix = len(row)
    if pixels is None:
        pixels = images.decode(source.examples.image(i), source.examples.where(i), v.image_size)
    pixels = pixels[None]
    eos = source.text.tokenizer.token_to_id(source.text.eos)
    out = []
    while len(out) < max_new and len(row) < source.seq_len:
        types = (np.arange(len(row)) >= n_prefix).astype(np.int32)[None]
        token = int(jnp.argmax(model.logits(jnp.asarray([row]), jnp.asarray(pixels), jnp.asarray(types))[0, -1]))
        if token == eos:
            break
        out.append(token)
        row.append(token)
    return source.text.tokenizer.decode(out, skip_special_tokens=True)


def test_greedy_answers_are_each_rows_own_argmax_decoding_whatever_the_batch(run):
    cfg = config_lib.load(run / "config.yaml")
    source = images.open(cfg)
    _, _, model = export.load_model(run)
    held = np.arange(source.n_train, len(source.ids))
    assert len(held) == 6
    together = answer.greedy(model, source, held, max_new=3)
    assert answer.greedy(model, source, held[::-1], max_new=3, batch=4) == together[::-1]
    assert together == [by_hand(model, source, int(i), 3) for i in held]
    assert any(together), together  # the checks above compared tokens, not only EOS
    white = np.ones((3, source.vision.image_size, source.vision.image_size), np.float32)  # (1 - 0.5) / 0.5
    assert answer.greedy(model, source, held[:2], max_new=3, blank=True) == [
        by_hand(model, source, int(i), 3, white) for i in held[:2]]


def test_held_out_reports_the_exact_match_of_its_answers(run, capsys):
    assert cli.main(["generate", str(run), "--held-out", "--json", "--max-new-tokens", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    got = report["answers"]
    assert report["examples"] == len(got) == 6
    assert report["exact"] == sum(a["answer"] == a["expected"] for a in got)
    assert report["exact_match"] == report["exact"] / 6
    lines = (run.parent / "set" / "data.jsonl").read_text().splitlines()[-6:]
    assert [a["prefix"] for a in got] == [json.loads(line)["prefix"] for line in lines]
    assert cli.main(["generate", str(run), "--held-out", "--limit", "2", "--max-new-tokens", "3"]) == 0
    assert "on the held-out examples (greedy)" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--prompt", "x", "--json"], "go with --held-out"),
    (["--held-out"], "not a zerojax run directory"),
], ids=["json without held-out", "not a run"])
def test_bad_held_out_requests_exit_2_with_one_line(args, message, tmp_path, capsys):
    assert cli.main(["generate", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax: error: ") and err.count("\n") == 1 and message in err, err
