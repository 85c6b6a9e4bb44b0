"""Hugging Face tokenizers for text: `zerojax tokenizer train`, data.tokenizer (tokenized once,
cached by the hashes of the text and the tokenizer), decoded samples, and the export."""

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from zerojax import cli, config, data, train

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64", "model.seq_len=32",
        "train.global_batch=16", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "model.vocab_size=320"]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A megabyte of Python source as a .txt corpus."""
    root = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp("text") / "source.txt"
    path.write_bytes(b"".join(f.read_bytes() for f in sorted(root.glob("*.py"))[:40]))
    return path


@pytest.fixture(scope="module")
def tokenizer(text, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    assert cli.main(["tokenizer", "train", str(text), "--vocab-size", "320", "--out", str(out)]) == 0
    return out


def test_a_trained_tokenizer_round_trips_text(tokenizer, text):
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    assert tok.get_vocab_size() == 320
    sample = text.read_text()[:2000]
    ids = tok.encode(sample).ids
    assert tok.decode(ids) == sample and len(ids) < 0.8 * len(sample.encode())  # byte-level: lossless, shorter


def test_a_run_trains_on_tokens_cached_once(tokenizer, text, tmp_path, monkeypatch):
    overrides = TINY + [f"data.source={text}", f"data.tokenizer={tokenizer}", "train.steps=3", "train.sample_tokens=20"]
    first = train.run(config.load(overrides=overrides + [f"train.out_dir={tmp_path / 'a'}"]), show_progress=False)
    assert all(np.isfinite(line["loss"]) for line in first.history)
    assert isinstance(first.sample, str) and first.sample.startswith("def ")  # decoded by the tokenizer
    cached = list((data.cache_dir() / "tokens").glob("*.npy"))
    tokens, vocab = data.read_tokens(str(text), str(tokenizer))
    expected = Tokenizer.from_file(str(tokenizer / "tokenizer.json")).encode(text.read_text()[:5000]).ids[:100]
    assert vocab == 320 and list(tokens[:100]) == expected

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the cached tokens should have been reused")

    monkeypatch.setattr(Tokenizer, "encode_batch", no_tokenizing)
    data.read_tokens(str(text), str(tokenizer))  # the same text and tokenizer: the cache
    assert list((data.cache_dir() / "tokens").glob("*.npy")) == cached
    monkeypatch.undo()
    other = tmp_path / "other.txt"
    other.write_bytes(text.read_bytes()[:200_000])  # another text: tokenized anew
    data.read_tokens(str(other), str(tokenizer))
    assert len(list((data.cache_dir() / "tokens").glob("*.npy"))) == len(cached) + 1


def test_a_tokenizer_larger_than_the_model_exits_2(tokenizer, text, tmp_path, capsys):
    args = ["train", *TINY, f"data.source={text}", f"data.tokenizer={tokenizer}", "model.vocab_size=300",
            f"train.out_dir={tmp_path / 'run'}"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "model.vocab_size=300 is smaller than the corpus needs (320 from data.tokenizer=" in err, err
    assert not (tmp_path / "run").exists()
    assert cli.main(["train", "data.tokenizer=nowhere/tokenizer.json", f"train.out_dir={tmp_path / 'run'}"]) == 2
    assert "data.tokenizer='nowhere/tokenizer.json': no such tokenizer.json" in capsys.readouterr().err


def test_the_hf_export_carries_the_tokenizer(tokenizer, text, tmp_path):
    overrides = TINY + [f"data.source={text}", f"data.tokenizer={tokenizer}", "train.steps=2", "model.family=llama",
                        f"train.out_dir={tmp_path / 'run'}"]
    train.run(config.load(overrides=overrides), show_progress=False)
    assert cli.main(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 320
