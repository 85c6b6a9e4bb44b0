"""Chat data (zerojax.data.chat, zerojax.data.template) against transformers' apply_chat_template
(tests/fixtures/chat, made by scripts/fixtures/make_chat_fixtures.py), its packed rows, and its bad input."""

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import run
from zerojax import cli, config, data
from zerojax.data import chat
from zerojax.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures" / "chat"
REFERENCE = json.loads((FIXTURES / "chats.json").read_text())
TEMPLATES = ("llama3", "chatml", "gemma")
WORDS = "the shards of a prime gradient seven eleven answer devices stage optimizer café".split()


def conversations(n, seed=0):
    """n small conversations of one or two exchanges, from a seeded generator."""
    rng = np.random.default_rng(seed)
    say = lambda k: " ".join(rng.choice(WORDS, k))  # noqa: E731
    rows = []
    for _ in range(n):
        turns = [{"role": "user", "content": say(3)}, {"role": "assistant", "content": say(int(rng.integers(2, 6)))}]
        if rng.random() < 0.5:
            turns += [{"role": "user", "content": say(2)}, {"role": "assistant", "content": say(2)}]
        rows.append({"messages": turns})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def chat_cfg(source, *extra, tokenizer="llama3", seq_len=64):
    return config.load(overrides=[f"data.source={source}", f"data.tokenizer={FIXTURES / tokenizer}",
                                  "model.family=llama", "model.vocab_size=512", f"model.seq_len={seq_len}",
                                  "train.global_batch=8", *extra])


@pytest.mark.parametrize("name", TEMPLATES)
def test_ids_and_assistant_masks_are_transformers(name):
    encoder = chat.Encoder.of(str(FIXTURES / name), "assistant")
    assert encoder.template.has_generation == (name == "chatml")  # the others: turn by turn
    for ref in REFERENCE[name]["chats"]:
        ids, mask = encoder.conversation(ref["messages"], "row")
        assert ids == ref["ids"]
        assert [int(m) for m in mask] == ref["assistant_mask"] and any(mask)
        text, _ = encoder.template.render(ref["messages"], add_generation_prompt=True)
        assert encoder.tokenizer.encode(text, add_special_tokens=False).ids == ref["ids_generation_prompt"]


def test_rows_pack_several_examples_with_restarting_positions_and_the_assistants_loss(tmp_path):
    rows = conversations(40)
    cfg = chat_cfg(write_jsonl(tmp_path / "chats.jsonl", rows), seq_len=128)
    source = data.open_source(cfg)
    batch = source.rows(data.TRAIN, 0, slice(None))
    assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
        k: (f.shape, f.dtype) for k, f in data.batch_spec(cfg).items()}
    assert batch["segment_ids"].max(axis=1).mean() >= 2  # several examples to a row
    encoder = chat.Encoder.of(cfg.data.tokenizer, "assistant")
    examples = {tuple(e.ids): e for e in (encoder.encode(r, "") for r in rows)}
    for r in range(len(batch["tokens"])):
        seg = batch["segment_ids"][r]
        for k in range(1, seg.max() + 1):
            at = np.flatnonzero(seg == k)
            ids = tuple(batch["tokens"][r, at[0]:at[-1] + 1])
            ids = ids if ids in examples else tuple(batch["tokens"][r, at[0]:at[-1] + 2])  # it ends the row
            np.testing.assert_array_equal(batch["positions"][r, at], np.arange(len(at)))
            # the example, whole, and its targets counted where the assistant wrote them
            expected = np.append(examples[ids].counts[1:], False)[:len(at)]  # its last input's target is the next's
            np.testing.assert_array_equal(batch["loss_mask"][r, at], expected)
        assert not batch["loss_mask"][r, seg == 0].any()
    assert data.open_source(cfg).rows(data.TRAIN, 3, slice(2, 5))["tokens"].tolist() == \
        source.rows(data.TRAIN, 3, slice(None))["tokens"][2:5].tolist()  # a pure function of the step


def test_every_packed_row_comes_once_an_epoch_and_validation_holds_out_rows(tmp_path):
    cfg = chat_cfg(write_jsonl(tmp_path / "chats.jsonl", conversations(60)), "data.val_fraction=0.25")
    source = data.open_source(cfg)
    n = len(source.train)
    seen = np.concatenate([chat.row_indices(n, 0, data.TRAIN, s, 8) for s in range(n)])  # 8 epochs
    assert np.bincount(seen, minlength=n).tolist() == [8] * n
    train = {tuple(t) for t in source.train.tokens.tolist()}
    assert not train & {tuple(t) for t in source.val.tokens.tolist()}
    assert int((source.val.segment_ids.max(axis=1)).sum()) == 15  # the last quarter of 60 rows


def test_val_source_holds_the_evaluation_rows(tmp_path):
    train, held = write_jsonl(tmp_path / "t.jsonl", conversations(30)), write_jsonl(tmp_path / "v.jsonl", conversations(5, 9))
    source = data.open_source(chat_cfg(train, f"data.val_source={held}"))
    assert source.train.segment_ids.max(axis=1).sum() == 30 and source.val.segment_ids.max(axis=1).sum() == 5
    with pytest.raises(ConfigError, match="data.val_source='v.jsonl' applies to rows"):
        config.load(overrides=["data.val_source=v.jsonl"])  # data.source=stdlib
    with pytest.raises(ConfigError, match=r"data.val_source='.*nowhere.jsonl': no such file"):
        data.open_source(chat_cfg(train, f"data.val_source={tmp_path / 'nowhere.jsonl'}"))


def test_unpacked_rows_hold_one_example_and_train_on_all_counts_every_target(tmp_path):
    rows = conversations(20)
    source = data.open_source(chat_cfg(write_jsonl(tmp_path / "c.jsonl", rows), "data.pack=false", "data.train_on=all"))
    seg = source.train.segment_ids
    assert seg.max() == 1 and len(source.train) == 18
    lengths = (seg == 1).sum(axis=1)
    np.testing.assert_array_equal(source.train.loss_mask.sum(axis=1), lengths - 1)  # every target of the example
    assert source.train.pad_fraction > 0.3


def test_prompt_completion_and_text_rows(tmp_path):
    encoder = chat.Encoder.of(str(FIXTURES / "llama3"), "assistant")
    tok, eos = encoder.tokenizer, encoder.eos_id
    e = encoder.encode({"prompt": "Name a prime.", "completion": " Seven."}, "row 1")
    head = tok.encode("Name a prime.").ids
    assert head[0] == tok.token_to_id("<|begin_of_text|>")  # the tokenizer's own BOS
    assert e.ids.tolist() == head + tok.encode(" Seven.", add_special_tokens=False).ids + [eos]
    assert e.counts.tolist() == [False] * len(head) + [True] * (len(e.ids) - len(head))
    t = encoder.encode({"text": "seven eleven"}, "row 2")
    assert t.ids.tolist() == tok.encode("seven eleven").ids + [eos] and t.counts.all()
    b = chat.Encoder.of("", "assistant").encode({"prompt": "ab", "completion": "c"}, "row 3")  # bytes
    assert b.ids.tolist() == [97, 98, 99] and b.counts.tolist() == [False, False, True]


def test_parquet_rows_are_the_jsonl_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"{w} and", "completion": f" {w} again"} for w in WORDS * 2]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    a = data.open_source(chat_cfg(str(tmp_path / "rows.parquet")))
    b = data.open_source(chat_cfg(write_jsonl(tmp_path / "rows.jsonl", rows)))
    np.testing.assert_array_equal(a.rows(data.TRAIN, 1, slice(None))["tokens"], b.rows(data.TRAIN, 1, slice(None))["tokens"])


def test_a_datasets_directory_holds_the_rows_of_its_jsonl(tmp_path):
    # tests/fixtures/chat/saved: Dataset.save_to_disk of sft.jsonl's first 8 rows (the `datasets` library's own)
    saved = chat.read_rows(str(FIXTURES / "saved"))
    lines = (FIXTURES / "sft.jsonl").read_text().splitlines()[:8]
    assert [row for _, row in saved] == [json.loads(line) for line in lines]
    cfg = chat_cfg(str(FIXTURES / "saved"))
    assert data.sources.kind_of(cfg) == "chat" and data.open_source(cfg).train.segment_ids.max(axis=1).sum() == 7
    (tmp_path / "state.json").write_text('{"_data_files": [{"filename": "missing.arrow"}]}')
    with pytest.raises(ConfigError, match=r"not a `datasets` directory pyarrow can read \(FileNotFoundError"):
        chat.read_rows(str(tmp_path))


def test_too_long_examples_are_an_error_or_dropped(tmp_path):
    rows = conversations(20) + [{"text": "seven " * 80}, {"text": "eleven " * 70}]
    source = write_jsonl(tmp_path / "c.jsonl", rows)
    with pytest.raises(ConfigError, match=r"2 of 22 examples are longer than model.seq_len \+ 1 = 65 tokens "
                                          r"\(the longest, row 2[12], has \d+\)"):
        data.open_source(chat_cfg(source))
    kept = data.open_source(chat_cfg(source, "data.too_long=drop"))
    assert kept.train.segment_ids.max(axis=1).sum() + kept.val.segment_ids.max(axis=1).sum() == 20


BAD = [
    ("not json", '{"messages": [}\n', "line 2: not JSON"),
    ("no field", '{"question": "hi"}\n', "row 2: expected {\"messages\": [...]}, {\"prompt\", \"completion\"} or "
                                         "{\"text\"} (it has 'question')"),
    ("bad message", '{"messages": [{"role": "user"}]}\n', "row 2: message 0 must be"),
    ("refused role", json.dumps({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]})
     + "\n", "row 2: the chat template ({}) refused the conversation: System role not supported"),
]


@pytest.mark.parametrize("what, line, message", BAD, ids=[b[0] for b in BAD])
def test_bad_rows_are_one_line_naming_the_file_and_row_and_exit_2(what, line, message, tmp_path, capsys):
    source = tmp_path / "c.jsonl"
    source.write_text(json.dumps(conversations(1)[0]) + "\n" + line)
    message = message.replace("{}", str(FIXTURES / "gemma" / "chat_template.jinja"))
    code = cli.main(["train", f"data.source={source}", f"data.tokenizer={FIXTURES / 'gemma'}", "model.family=llama",
                     "model.vocab_size=512", f"train.out_dir={tmp_path / 'run'}", "train.steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("zerojax: error:"), err
    assert f"data.source={str(source)!r} " in err[0] and message in err[0], err
    assert not (tmp_path / "run").exists()  # before step 1


def test_a_chat_set_with_nothing_to_learn_is_refused_before_step_1(tmp_path, capsys):
    """train_on=assistant and no assistant turn: every step would be 0/0 (loss NaN), and the run
    would save an untrained model."""
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(6)]
    source = write_jsonl(tmp_path / "c.jsonl", rows)
    code = cli.main(["train", f"data.source={source}", f"data.tokenizer={FIXTURES / 'llama3'}", "model.family=llama",
                     "model.vocab_size=512", f"train.out_dir={tmp_path / 'run'}", "train.steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("zerojax: error:"), err
    assert "none of its 5 example(s) has a token the loss counts (data.train_on=assistant)" in err[0], err
    assert "set data.train_on=all" in err[0] and not (tmp_path / "run").exists()
    data.open_source(chat_cfg(source, "data.train_on=all"))  # every token counts: fine
    held_out = write_jsonl(tmp_path / "v.jsonl", rows[:2])
    with pytest.raises(ConfigError, match=r"data.val_source=.*v.jsonl'?: none of its 2 example"):
        data.open_source(chat_cfg(write_jsonl(tmp_path / "t.jsonl", conversations(6)), f"data.val_source={held_out}"))


def test_messages_need_a_chat_template(tmp_path):
    bare = tmp_path / "tok"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((FIXTURES / "llama3" / "tokenizer.json").read_bytes())
    source = write_jsonl(tmp_path / "c.jsonl", conversations(4))
    with pytest.raises(ConfigError, match=r"row 1: messages need a chat template, and data.tokenizer=.* has none"):
        data.open_source(config.load(overrides=[f"data.source={source}", f"data.tokenizer={bare}"]))
    with pytest.raises(ConfigError, match=r"row 1: messages need a chat template, and data.tokenizer is empty"):
        data.open_source(config.load(overrides=[f"data.source={source}"]))


def test_a_packed_chat_run_on_8_devices_is_one_devices_run(tmp_path):
    # Packed rows, the assistant-only loss, ZeRO-3 and two microbatches against one device.
    source = write_jsonl(tmp_path / "c.jsonl", conversations(48))
    common = [f"data.source={source}", f"data.tokenizer={FIXTURES / 'llama3'}", "model.family=llama",
              "model.vocab_size=512", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
              "model.seq_len=64", "train.global_batch=16", "zero.min_shard_size=64", "train.steps=3",
              "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "train.ckpt_every=0", "train.report=false"]
    ref, _ = run(common + ["mesh.data=1", "zero.stage=0", "zero.schedule=gspmd", f"train.out_dir={tmp_path / 'one'}"])
    losses, _ = run(common + ["zero.stage=3", "train.grad_accum=2", f"train.out_dir={tmp_path / 'many'}"])
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_each_chat_example_packed_has_its_loss_alone(family, tmp_path):
    # The chat source's rows through a model: an example's masked loss in a packed row is its
    # loss alone in a padded row of its own (data.pack=false), to 1e-5. (GPT's learned positions
    # see a position that does not restart; RoPE sees only relative ones.)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from zerojax.models import protocol, registry
    from zerojax.precision import Policy

    rows = conversations(12, seed=1)
    packed = data.open_source(chat_cfg(write_jsonl(tmp_path / "c.jsonl", rows), "data.val_fraction=0.01", seq_len=128))
    alone = data.open_source(chat_cfg(str(tmp_path / "c.jsonl"), "data.pack=false", "data.val_fraction=0.01",
                                      seq_len=128))
    cfg = chat_cfg(str(tmp_path / "c.jsonl"), "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
                   "model.d_ff=64", f"model.family={family}", seq_len=128)
    model = registry.build(cfg.model, Policy(), seed=0)
    units, params = protocol.Units.of(model), nnx.to_pure_dict(nnx.state(model, nnx.Param))
    loss = jax.jit(lambda batch: protocol.forward(units, params, batch))
    lengths = (alone.train.segment_ids == 1).sum(axis=1)

    def alone_row(ids):  # the unpacked row of an example (one that ends a packed row lost its last input)
        return next(r for r in range(len(alone.train)) if lengths[r] in (len(ids), len(ids) + 1)
                    and alone.train.tokens[r, :len(ids)].tolist() == ids.tolist())

    p, checked = packed.train, 0
    for r in range(len(p)):
        for k in range(1, p.segment_ids[r].max() + 1):
            at = p.segment_ids[r] == k
            one = alone_row(p.tokens[r, :-1][at])
            mine = {"tokens": p.tokens[r:r + 1], "loss_mask": (p.loss_mask[r] & at)[None],
                    "segment_ids": p.segment_ids[r:r + 1], "positions": p.positions[r:r + 1]}
            theirs = {f: getattr(alone.train, f)[one:one + 1] for f in ("tokens", "loss_mask", "segment_ids", "positions")}
            (a, wa), (b, wb) = loss(jax.tree.map(jnp.asarray, mine)), loss(jax.tree.map(jnp.asarray, theirs))
            assert float(wa) == float(wb) > 0
            np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
            checked += 1
    assert checked == 11 and p.segment_ids.max() >= 3
