"""Image data (zerojax.data.images) against transformers' PaliGemmaProcessor, whose input_ids,
token_type_ids and pixel_values for two images and prompts scripts/fixtures/make_processor_fixtures.py
recorded (tests/fixtures/processor/); the batch as a pure function of (seed, split, step); and
each kind of bad input as one error line naming the file, raised when the source opens."""

import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open
from tokenizers import Tokenizer

from zerojax import data
from zerojax.data import images, sources
from zerojax.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures" / "processor"
TOKENIZER = FIXTURES / "bytelevel"  # its <image> is id 320


def fixture(name):
    with safe_open(str(FIXTURES / name / "expected.safetensors"), "numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, {k: int(v) for k, v in f.metadata().items()}


def config(source, *, tokenizer=TOKENIZER, seq_len=24, image_size=28, patch_size=14, image_token_id=320,
           batch=4, seed=0, val_fraction=0.25, family="paligemma"):
    """The keys of a run that image data reads (a stand-in for a paligemma Config)."""
    return SimpleNamespace(
        model=SimpleNamespace(family=family, seq_len=seq_len, image_token_id=image_token_id,
                              vision=SimpleNamespace(image_size=image_size, patch_size=patch_size)),
        data=SimpleNamespace(source=str(source), tokenizer=str(tokenizer), val_fraction=val_fraction),
        train=SimpleNamespace(seed=seed, global_batch=batch))


@pytest.mark.parametrize("name", ["bytelevel", "metaspace"])
def test_processing_equals_paligemma_processors(name):
    expected, meta = fixture(name)
    T = 24
    cfg = config(FIXTURES / name / "examples.jsonl", tokenizer=FIXTURES / name, seq_len=T, val_fraction=0.5,
                 image_size=meta["image_size"], patch_size=meta["patch_size"], image_token_id=meta["image_token_id"])
    source = sources.open_source(cfg)
    v = source.vision
    for i in range(2):
        ids, types = expected[f"input_ids_{i}"], expected[f"token_type_ids_{i}"]
        row = images.text_row(*source.ids[i], v.n_image_tokens, v.image_token_id, source.text.pad_id, T)
        n = len(ids)
        np.testing.assert_array_equal(row["tokens"][:n], ids)
        np.testing.assert_array_equal(row["prefix"][:n], types == 0)  # inputs; pads are not prefix
        np.testing.assert_array_equal(row["loss_mask"][: n - 1], types[1:] == 1)  # the suffix and EOS as targets
        assert not row["prefix"][n:].any() and not row["loss_mask"][n - 1:].any()
        assert (row["tokens"][n:] == source.text.pad_id).all()
        pixels = images.decode(source.examples.image(i), "x", v.image_size)
        assert pixels.dtype == np.float32 and pixels.shape == expected[f"pixel_values_{i}"].shape
        np.testing.assert_allclose(pixels, expected[f"pixel_values_{i}"], rtol=0, atol=1e-6)


def write_examples(root: Path, n=10, size=(9, 7)):
    """n examples: random images of `size` (PNG) and prompts / answers that differ."""
    rng = np.random.default_rng(0)
    (root / "img").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (*size[::-1], 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")
        lines.append({"image": f"img/{i}.png", "prefix": f"what is {i}?", "suffix": "red" * (i % 3 + 1)})
    (root / "data.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return lines


def test_rows_are_a_pure_function_of_seed_split_and_step(tmp_path):
    write_examples(tmp_path)
    source = sources.open_source(config(tmp_path / "data.jsonl", batch=4, val_fraction=0.2))
    assert sources.kind_of(config(tmp_path / "data.jsonl")) == "images"
    assert source.spec() == images.spec(config(tmp_path / "data.jsonl"))  # the spec from the config alone
    assert source.n_train == 8
    batch = source.rows(data.TRAIN, 3, slice(None))
    for key, field in source.spec().items():
        assert batch[key].shape == field.shape and batch[key].dtype == np.dtype(field.dtype), key
    again = sources.open_source(config(tmp_path / "data.jsonl", batch=4, val_fraction=0.2)).rows(data.TRAIN, 3, slice(None))
    for part in (slice(0, 1), slice(1, 3), slice(3, 4)):  # a process's rows are its rows of the same batch
        got = source.rows(data.TRAIN, 3, part)
        for key in batch:
            np.testing.assert_array_equal(got[key], batch[key][part])
            np.testing.assert_array_equal(again[key], batch[key])
    other = {"step": source.rows(data.TRAIN, 4, slice(None)), "split": source.rows(data.EVAL, 3, slice(None)),
             "seed": sources.open_source(config(tmp_path / "data.jsonl", seed=1, val_fraction=0.2)).rows(data.TRAIN, 3, slice(None))}
    for what, b in other.items():
        assert not np.array_equal(b["tokens"], batch["tokens"]), what


def test_an_epoch_visits_each_training_example_once_and_validation_is_held_out(tmp_path):
    lines = write_examples(tmp_path)
    source = sources.open_source(config(tmp_path / "data.jsonl", batch=4, val_fraction=0.2))
    prompts = [source.text.tokenizer.decode(b["tokens"][r].tolist(), skip_special_tokens=True).split("\n")[0]
               for b in (source.rows(data.TRAIN, s, slice(None)) for s in range(2)) for r in range(4)]
    assert sorted(prompts) == sorted(e["prefix"] for e in lines[:8])
    val = source.rows(data.EVAL, 0, slice(None))
    held_out = {source.text.tokenizer.decode(t.tolist(), skip_special_tokens=True).split("\n")[0] for t in val["tokens"]}
    assert held_out == {lines[8]["prefix"], lines[9]["prefix"]}


def test_each_process_decodes_only_its_own_rows(tmp_path):
    write_examples(tmp_path)
    source = sources.open_source(config(tmp_path / "data.jsonl", batch=4, val_fraction=0.2))
    mine, theirs = images.example_indices(8, 0, data.TRAIN, 0, 4, slice(0, 2)), images.example_indices(8, 0, data.TRAIN, 0, 4, slice(2, 4))
    for i in theirs:  # the other process's images, gone after the source was opened
        (tmp_path / "img" / f"{i}.png").write_bytes(b"gone")
    assert source.rows(data.TRAIN, 0, slice(0, 2))["pixel_values"].shape[0] == len(mine)
    with pytest.raises(ConfigError, match="cannot decode the image"):
        source.rows(data.TRAIN, 0, slice(2, 4))


def test_parquet_gives_the_jsonl_batch(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = write_examples(tmp_path)
    png = [(tmp_path / e["image"]).read_bytes() for e in lines]
    texts = {"prefix": [e["prefix"] for e in lines], "suffix": [e["suffix"] for e in lines]}
    pq.write_table(pa.table({"image": png, **texts}), tmp_path / "bytes.parquet")
    structs = [{"bytes": b, "path": None} for b in png]  # Hugging Face datasets' Image feature
    pq.write_table(pa.table({"image": structs, **texts}), tmp_path / "hf.parquet")
    want = sources.open_source(config(tmp_path / "data.jsonl", val_fraction=0.2)).rows(data.TRAIN, 2, slice(None))
    for name in ("bytes.parquet", "hf.parquet"):
        got = sources.open_source(config(tmp_path / name, val_fraction=0.2)).rows(data.TRAIN, 2, slice(None))
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name} {key}")


def long_prompt(root):
    lines = write_examples(root)
    lines[2]["prefix"] = "what is " * 12
    (root / "data.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return lines[2]


def long_answer(root):
    lines = write_examples(root)
    lines[4]["suffix"] = "red, green and blue " * 3
    (root / "data.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return lines[4]


def lengths(example):
    """{a}: BOS, the prompt and the newline in tokens; {b}: the answer and EOS; {need}: the
    model.seq_len that holds them after the 4 image tokens (a row is seq_len + 1 tokens)."""
    if not isinstance(example, dict):
        return {}
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    a = len(tok.encode("<bos>" + example["prefix"] + "\n", add_special_tokens=False).ids)
    b = len(tok.encode(example["suffix"] + "<eos>", add_special_tokens=False).ids)
    return {"a": a, "b": b, "need": 4 + a + b - 1}


def without(key):
    def make(root):
        lines = write_examples(root)
        del lines[1][key]
        (root / "data.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return make


def huge_png(width: int, height: int) -> bytes:
    """A PNG header claiming width x height pixels (1-bit grey): what Pillow opens before decoding."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


@pytest.mark.parametrize("make, message", [
    (lambda root: write_examples(root) and (root / "img" / "2.png").write_bytes(huge_png(30000, 30000)),
     "data.source='{root}/data.jsonl' line 3: the image '{root}/img/2.png' too large for Pillow to decode (Image size "
     "(900000000 pixels) exceeds limit"),
    (lambda root: write_examples(root) and (root / "img" / "3.png").write_bytes(b"not a png"),
     "data.source='{root}/data.jsonl' line 4: cannot decode the image '{root}/img/3.png' (UnidentifiedImageError"),
    (lambda root: write_examples(root) and (root / "img" / "5.png").unlink(),
     "data.source='{root}/data.jsonl' line 6: no image file '{root}/img/5.png'; expected a path relative to '{root}'"),
    (without("image"), "data.source='{root}/data.jsonl' line 2 has no 'image'; expected an object of {{\"image\""),
    (without("prefix"), "line 2 has no 'prefix'; expected"),
    (without("suffix"), "line 2 has no 'suffix'; expected"),
    (long_prompt, "data.source='{root}/data.jsonl' line 3: the prompt takes {a} tokens with BOS and the newline, but "
                  "model.seq_len=24 leaves 20 once the 4 image tokens (and the answer's EOS) are counted; "
                  "shorten the prompt or raise model.seq_len to {need}"),
    (long_answer, "data.source='{root}/data.jsonl' line 5: the prompt and the answer take {a} + {b} tokens with BOS, "
                  "the newline and EOS, but model.seq_len=24 leaves 21 once the 4 image tokens are counted; "
                  "raise model.seq_len to {need}"),
    (lambda root: write_examples(root, n=3), "has 3 examples, and data.val_fraction=0.25 leaves 3 to train on and 0"),
], ids=["too large", "undecodable", "missing image", "no image", "no prefix", "no suffix", "long prompt", "long answer", "too few"])
def test_each_bad_input_is_one_line_naming_the_file_and_writes_nothing(make, message, tmp_path):
    example = make(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(ConfigError) as err:
        sources.open_source(config(tmp_path / "data.jsonl"))
    assert message.format(root=tmp_path, **lengths(example)) in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
    assert sorted(tmp_path.rglob("*")) == before


def test_a_parquet_without_a_column_or_a_line_that_is_not_json_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = write_examples(tmp_path)
    pq.write_table(pa.table({"image": [b"x"] * 10, "question": [e["prefix"] for e in lines]}), tmp_path / "q.parquet")
    with pytest.raises(ConfigError, match=r"q.parquet' has no column 'prefix', 'suffix' \(it has image, question\); "
                                          r"expected image \(bytes\), prefix and suffix"):
        sources.open_source(config(tmp_path / "q.parquet"))
    (tmp_path / "data.jsonl").write_text((tmp_path / "data.jsonl").read_text() + "{'image': 1}\n")
    with pytest.raises(ConfigError, match=r"data.jsonl' line 11 is not JSON .*; expected one object per line"):
        sources.open_source(config(tmp_path / "data.jsonl"))


def test_a_tokenizer_without_bos_or_eos_or_with_another_image_id_is_refused(tmp_path):
    write_examples(tmp_path)
    with pytest.raises(ConfigError, match=r"holds <image> as id 320, but model.image_token_id=5; set model.image_token_id=320"):
        sources.open_source(config(tmp_path / "data.jsonl", image_token_id=5))
    from tokenizers import models, pre_tokenizers
    bare = Tokenizer(models.BPE())
    bare.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bare.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"no BOS token \(PaliGemma's format needs one\)"):
        sources.open_source(config(tmp_path / "data.jsonl", tokenizer=tmp_path))


def test_jsonl_and_parquet_of_a_text_family_are_not_image_data(tmp_path):
    cfg = config(tmp_path / "data.jsonl", family="gemma")
    if "chat" in sources.KINDS:
        assert sources.kind_of(cfg) == "chat"
    else:
        with pytest.raises(ConfigError, match="chat data for model.family=gemma, which this zerojax cannot read"):
            sources.kind_of(cfg)
    assert sources.kind_of(config("corpus.txt")) == "tokens"
    assert sources.kind_of(config(tmp_path / "x.parquet")) == "images"


def test_pixels_follow_siglip_on_a_known_image():
    # one white and one black pixel, with a transparent one that transformers composites onto white
    rgba = np.array([[[255, 255, 255, 255], [0, 0, 0, 255], [0, 0, 0, 0]]], np.uint8)
    out = images.pixels(Image.fromarray(rgba, "RGBA"), 3)
    assert out.shape == (3, 3, 3)
    with io.BytesIO() as f:
        Image.fromarray(rgba[..., :3], "RGB").save(f, "PNG")
        opaque = images.decode(f.getvalue(), "x", 3)
    np.testing.assert_array_equal(out[:, :, 1], opaque[:, :, 1])  # the middle column is the black pixel's
    assert out[:, 0, 2].tolist() == [1.0, 1.0, 1.0] and opaque[:, 0, 2].tolist() == [-1.0, -1.0, -1.0]


def shapes_vqa():
    import importlib.util

    spec = importlib.util.spec_from_file_location("shapes_vqa", Path(__file__).parent.parent / "scripts" / "fixtures" / "shapes_vqa.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shape_of(image, rgb):
    """The shape the pixels of colour `rgb` draw, from how much of their bounding box they fill
    (a square all of it, a circle pi/4, a triangle half)."""
    ys, xs = np.nonzero((image == rgb).all(axis=-1))
    fill = len(ys) / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    return "square" if fill > 0.95 else "circle" if fill > 0.68 else "triangle"


def test_shapes_vqa_is_deterministic_answerable_from_the_image_and_loads(tmp_path, capsys):
    vqa = shapes_vqa()
    for name, seed, shapes in (("a", 0, 2), ("b", 0, 2), ("c", 1, 2), ("one", 0, 1)):
        assert vqa.main(["--out", str(tmp_path / name), "--n", "12", "--size", "32", "--seed", str(seed),
                         "--shapes", str(shapes)]) == 0
    files = {name: {p.relative_to(tmp_path / name): p.read_bytes() for p in sorted((tmp_path / name).rglob("*.*"))}
             for name in ("a", "b", "c")}
    assert files["a"] == files["b"] and files["a"] != files["c"]
    for name in ("a", "one"):
        for line in (tmp_path / name / "data.jsonl").read_text().splitlines():
            e = json.loads(line)
            words = e["prefix"].rstrip("?").split()
            shape, colour = (words[-1], e["suffix"]) if words[1] == "colour" else (e["suffix"], words[-1])
            image = np.asarray(Image.open(tmp_path / name / e["image"]))
            assert shape_of(image, vqa.COLOURS[colour]) == shape, e
            drawn = {c for c, rgb in vqa.COLOURS.items() if (image == rgb).all(axis=-1).any()}
            assert len(drawn) == (2 if name == "a" else 1), (e, drawn)
    keys = dict(kv.split("=") for kv in capsys.readouterr().out.splitlines()[0].split())
    cfg = config(keys["data.source"], tokenizer=keys["data.tokenizer"], image_token_id=int(keys["model.image_token_id"]),
                 image_size=32, patch_size=8, seq_len=40, val_fraction=0.25)
    source = sources.open_source(cfg)
    assert source.vocab_size == int(keys["model.vocab_size>"]) and source.n_train == 9
    batch = source.rows(data.EVAL, 0, slice(None))
    answers = [source.text.tokenizer.decode(t[1:][m].tolist(), skip_special_tokens=True) for t, m in
               zip(batch["tokens"], batch["loss_mask"])]
    assert all(a in vqa.COLOURS or a in vqa.SHAPES for a in answers), answers  # the loss is on the answer alone


def paligemma_family() -> bool:
    from zerojax.models import registry

    return "paligemma" in registry.FAMILIES


TINY_VLM = ["model.family=paligemma", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
            "model.head_dim=16", "model.d_ff=64", "model.vision.image_size=28", "model.vision.patch_size=14",
            "model.vision.d_model=32", "model.vision.n_layers=1", "model.vision.n_heads=2", "model.vision.d_ff=64",
            "model.image_token_id=320", "model.vocab_size=1473", "model.seq_len=24", "train.steps=1",
            "train.global_batch=8", "train.ckpt_every=0"]


@pytest.mark.skipif(not paligemma_family(), reason="needs model.family=paligemma (the model half of issue 23)")
@pytest.mark.parametrize("make, message", [
    (lambda root: write_examples(root) and (root / "img" / "5.png").unlink(), "line 6: no image file"),
    (long_prompt, "line 3: the prompt takes"),
], ids=["missing image", "long prompt"])
def test_zerojax_train_on_bad_image_data_exits_2_with_one_line_and_writes_nothing(make, message, tmp_path, capsys):
    from zerojax import cli

    make(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    args = ["train", *TINY_VLM, f"data.source={tmp_path / 'data.jsonl'}", f"data.tokenizer={TOKENIZER}",
            f"train.out_dir={tmp_path / 'run'}"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax: error: ") and err.count("\n") == 1 and message in err, err
    assert sorted(tmp_path.rglob("*")) == before


def test_the_blank_shapes_set_asks_the_same_questions_of_white_images(tmp_path):
    vqa = shapes_vqa()
    for name, blank in (("seen", []), ("blank", ["--blank"])):
        assert vqa.main(["--out", str(tmp_path / name), "--n", "6", "--size", "16", *blank]) == 0
    assert (tmp_path / "blank" / "data.jsonl").read_text() == (tmp_path / "seen" / "data.jsonl").read_text()
    for i in range(6):
        seen, blank = (np.asarray(Image.open(tmp_path / name / "images" / f"{i:05d}.png")) for name in ("seen", "blank"))
        assert (blank == 255).all() and (seen != 255).any()
