"""LeRobot datasets (data.source=lerobot:DIR) against LeRobot itself: tests/fixtures/lerobot/ holds
a tiny dataset written by LeRobot 0.4's own LeRobotDataset (codebase v3.0), and what LeRobot's
__getitem__, NormalizerProcessorStep and pi0's resize_with_pad made of it
(scripts/fixtures/make_lerobot_dataset.py, run in LeRobot's venv); tests/fixtures/lerobot/v21/ the same
dataset written by LeRobot 0.3.3 (codebase v2.1), its __getitem__ and its aggregated statistics
(scripts/fixtures/make_lerobot_v21_dataset.py). No torch here."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from zerojax import cli, config, data
from zerojax.data import lerobot, sources
from zerojax.errors import ConfigError
from zerojax.models.vla import batch as vla_batch

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "lerobot"
REF = dict(np.load(FIXTURE / "reference.npz"))
INDICES = [int(i) for i in REF["indices"]]
CAMERAS = ("observation.images.front", "observation.images.wrist")  # video (AV1), images (PNG in the Parquet)
V21 = FIXTURE / "v21"
REF21 = dict(np.load(V21 / "reference.npz"))


def source(*overrides, root=FIXTURE / "tiny"):
    cfg = config.load(overrides=[f"data.source=lerobot:{root}", f"data.action_horizon={int(REF['horizon'])}",
                                 f"data.image_size={int(REF['size'])}", "train.global_batch=8", *overrides])
    return data.open_source(cfg)


def test_a_lerobot_source_is_its_own_kind_not_a_module_factory():
    cfg = config.load(overrides=["data.source=lerobot:mydir"])
    assert sources.kind_of(cfg) == "lerobot"
    assert sources.kind_of(config.load(overrides=["data.source=packed_source:build"])) == "custom"


@pytest.mark.parametrize("root, ref", [(FIXTURE / "tiny", REF), (V21 / "tiny", REF21)], ids=["v3.0", "v2.1"])
def test_items_equal_lerobots_getitem(root, ref):
    assert ref["indices"].tolist() == INDICES and int(ref["horizon"]) == int(REF["horizon"])
    src = source("data.norm_state=identity", "data.norm_action=identity", root=root)
    items = [src.raw_item(i) for i in INDICES]
    for key in ("observation.state", "action", "action_is_pad"):
        np.testing.assert_array_equal(np.stack([it[key] for it in items]), ref[key], err_msg=key)
    assert [it["task"] for it in items] == ref["task"].tolist()
    assert ref["action_is_pad"].any() and not ref["action_is_pad"].all()  # the fixture has chunks past an end
    wrist = np.stack([it["observation.images.wrist"] for it in items])
    np.testing.assert_array_equal(wrist, ref["observation.images.wrist"])  # PNG: lossless
    front = np.stack([it["observation.images.front"] for it in items])
    assert front.shape == ref["observation.images.front"].shape and front.dtype == np.float32
    np.testing.assert_allclose(front, ref["observation.images.front"], atol=1 / 255)  # the same AV1 stream


def test_v21_episodes_past_the_first_chunk_are_read_from_their_chunks_files(tmp_path):
    root = copy_fixture(tmp_path, V21 / "tiny")  # 2 episodes a chunk: episode 2 in chunk-001, as LeRobot places it
    edit_json(root / "meta" / "info.json", lambda d: d.update(chunks_size=2))
    for name in ("data/chunk-{:03d}/episode_000002.parquet",
                 "videos/chunk-{:03d}/observation.images.front/episode_000002.mp4"):
        (root / name.format(1)).parent.mkdir(parents=True)
        (root / name.format(0)).rename(root / name.format(1))
    src = source("data.norm_state=identity", "data.norm_action=identity", root=root)
    assert src.dataset.episodes[2].videos[CAMERAS[0]][0].endswith("chunk-001/observation.images.front/episode_000002.mp4")
    last = [k for k, i in enumerate(INDICES) if i >= 15]  # episode 2's frames
    items = [src.raw_item(INDICES[k]) for k in last]
    np.testing.assert_array_equal(np.stack([it["action"] for it in items]), REF21["action"][last])
    np.testing.assert_allclose(np.stack([it[CAMERAS[0]] for it in items]), REF21[CAMERAS[0]][last], atol=1 / 255)


def test_v21_statistics_are_lerobot_03s_aggregate_of_the_episodes():
    stats = source(root=V21 / "tiny").dataset.stats  # meta/episodes_stats.jsonl, combined
    for key in ("observation.state", "action"):
        assert set(stats[key]) == {"min", "max", "mean", "std", "count"}, key
        for name in stats[key]:
            np.testing.assert_array_equal(stats[key][name], REF21[f"stats/{key}/{name}"], err_msg=f"{key} {name}")
    assert stats["action"]["count"] == [19]  # the episodes' 6 + 9 + 4 frames


@pytest.mark.parametrize("mode", ["mean_std", "min_max", "quantiles", "quantile10"])
def test_normalization_equals_lerobots_processor(mode):
    src = source(f"data.norm_state={mode}", f"data.norm_action={mode}")
    items = [src.item(i) for i in INDICES]
    for key in ("observation.state", "action"):
        np.testing.assert_array_equal(np.stack([it[key] for it in items]), REF[f"{mode}/{key}"], err_msg=key)


@pytest.mark.parametrize("mode", ["mean_std", "min_max", "quantiles", "quantile10"])
def test_actions_come_back_as_lerobots_unnormalizer_gives_them(mode):
    stats = json.loads((FIXTURE / "tiny" / "meta" / "stats.json").read_text())
    back = lerobot.unnormalize(REF[f"{mode}/action"], stats["action"], mode)
    np.testing.assert_array_equal(back, REF[f"{mode}/unnormalized/action"])
    assert not np.array_equal(back, REF[f"{mode}/action"])


@pytest.mark.parametrize("mode", ["mean_std", "min_max", "quantiles", "quantile10"])
def test_a_constant_feature_is_normalized_as_lerobot_does(mode, tmp_path, monkeypatch):
    root = copy_fixture(tmp_path)  # the gripper constant: std 0, min = max, ... (LeRobot's eps paths)
    # these statistics call a varying column constant, which a training source refuses for the
    # quantile modes (the test below); here only the arithmetic is compared with LeRobot's
    monkeypatch.setattr(lerobot.source, "NORMALIZED_LIMIT", np.inf)
    shutil.copy(FIXTURE / "degenerate_stats.json", root / "meta" / "stats.json")
    src = source(f"data.norm_state={mode}", "data.norm_action=identity", root=root)
    state = np.stack([src.item(i)["observation.state"] for i in INDICES])
    np.testing.assert_array_equal(state, REF[f"degenerate/{mode}/observation.state"])


def test_images_are_resized_with_padding_as_pi0_in_minus_one_to_one():
    src = source()
    size = int(REF["size"])
    for camera in CAMERAS:
        images = np.stack([src.item(i)[camera] for i in INDICES])
        assert images.shape == (len(INDICES), 3, size, size)
        ours_from_theirs = np.stack([lerobot.frames.resize_with_pad(x * 2 - 1, size)
                                     for x in REF[camera]])  # our resize of LeRobot's pixels
        np.testing.assert_allclose(ours_from_theirs, REF[f"resized/{camera}"], atol=2e-6, err_msg=camera)  # float32 rounding
        np.testing.assert_allclose(images, REF[f"resized/{camera}"], atol=2 / 255 + 1e-6, err_msg=camera)
        assert images.min() >= -1 and images.max() <= 1
    front = np.stack([src.item(i)[CAMERAS[0]] for i in INDICES])  # 24x32 -> 15x20 inside 20x20
    assert (front[:, :, :2] == -1).all() and (front[:, :, -3:] == -1).all() and (front[:, :, 2:-3] > -1).any()


def prompt_of(src, index: int, length: int) -> dict:
    """π0's prompt (its adapter's, `vla.batch.prompts`) of the source's row `index`: the reader
    gives the task's text, the family's adapter tokenizes it with the source's tokenizer."""
    out = vla_batch.prompts({"task": src.item(index)["task"][None]}, length, src.tokenizer)
    return {k: v[0] for k, v in out.items()}


def test_prompts_are_the_task_and_a_newline_tokenized_and_padded(tmp_path):
    src = source("data.prompt_len=24")
    for i, task in zip(INDICES, REF["task"]):
        item = prompt_of(src, i, 24)
        ids = list((task + "\n").encode())
        np.testing.assert_array_equal(item["tokens"], ids[:24] + [0] * (24 - len(ids[:24])))
        np.testing.assert_array_equal(item["token_mask"], np.arange(24) < len(ids))
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for t in REF["task"] for w in t.split()})
    tok = Tokenizer(models.WordLevel({w: k + 1 for k, w in enumerate(words)} | {"[UNK]": len(words) + 1}, "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    src = source("data.prompt_len=3", f"data.tokenizer={tmp_path}")
    assert src.vocab_size == len(words) + 1  # the words and [UNK]
    item = prompt_of(src, INDICES[0], 3)
    np.testing.assert_array_equal(item["tokens"], tok.encode(REF["task"][0]).ids[:3])  # truncated
    assert item["token_mask"].all()


def test_rows_are_a_pure_function_of_seed_split_and_step_and_of_no_slice():
    src = source()
    batch = src.rows(data.TRAIN, 3, slice(None))
    spec = src.spec()
    assert set(spec) == {"observation.state", *CAMERAS, "action", "action_is_pad"}
    assert set(batch) == {*spec, "task"}  # the task's text: the family's adapter writes its prompt from it
    assert [str(t) for t in batch["task"]] == [src.dataset.numbers(int(i), 1)["task"] for i in src.frames_of(data.TRAIN, 3)]
    for key, field in spec.items():
        assert batch[key].shape == field.shape and batch[key].dtype == np.dtype(field.dtype), key
    again = source()  # a fresh source, asked out of order (the background thread guessed step 4)
    for step, rows in ((5, slice(None)), (3, slice(2, 6)), (3, slice(None))):
        part = again.rows(data.TRAIN, step, rows)
        want = batch if step == 3 else src.rows(data.TRAIN, 5, slice(None))
        for key in spec:
            np.testing.assert_array_equal(part[key], want[key][rows], err_msg=f"{key} step {step} rows {rows}")
    other = source("train.seed=1").rows(data.TRAIN, 3, slice(None))
    assert not np.array_equal(other["observation.state"], batch["observation.state"])
    assert not np.array_equal(src.rows(data.TRAIN, 4, slice(None))["observation.state"], batch["observation.state"])


def test_the_last_episodes_are_held_out_for_evaluation():
    src = source("data.val_fraction=0.34")  # 3 episodes: the last one held out
    ds = src.dataset
    train, held = src.split_frames
    assert set(ds.episode[np.searchsorted(ds.index, held)]) == {2}
    assert set(ds.episode[np.searchsorted(ds.index, train)]) == {0, 1}
    train_all, eval_all = source("data.val_fraction=0").split_frames
    np.testing.assert_array_equal(train_all, eval_all)


def copy_fixture(tmp_path, dataset=FIXTURE / "tiny"):
    root = tmp_path / "dataset"
    shutil.copytree(dataset, root)
    return root


def edit_json(path, edit):
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def edit_episode(root, episode, name, change):
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    path = next((root / "meta" / "episodes").glob("*/*.parquet"))
    table = pq.read_table(path)
    column = table.column(name)
    edited = pc.if_else(pc.equal(table.column("episode_index"), episode), pc.add(column, change), column)
    pq.write_table(table.set_column(table.column_names.index(name), name, edited), path)


def cut_short(path, size):
    path.write_bytes(path.read_bytes()[:size])  # its headers still claim every frame


BAD = {
    "no info.json": (lambda root: (root / "meta" / "info.json").unlink(), [], "no meta/info.json in it"),
    "a codebase version": (lambda root: edit_json(root / "meta" / "info.json", lambda d: d.update(codebase_version="v3.1")),
                           [], "codebase_version 'v3.1' is not supported; zerojax reads v2.1, v3.0"),
    "a missing feature": (lambda root: None, ["data.cameras=top"],
                          "no feature 'observation.images.top', which data.source=lerobot needs (data.cameras); its "
                          "features: observation.state, action, observation.images.front, observation.images.wrist"),
    "missing statistics": (lambda root: edit_json(root / "meta" / "stats.json", lambda d: d["action"].pop("q01")),
                           ["data.norm_action=quantiles"], "no q01 statistics for 'action' (data.norm_action=quantiles"),
    "an undecodable time": (lambda root: edit_episode(root, 2, "videos/observation.images.front/from_timestamp", 30.0), [],
                            "episode 2 needs its observation.images.front frame at t=31.5"),
    "a feature's shape": (lambda root: edit_json(root / "meta" / "info.json",
                                                 lambda d: d["features"]["action"].update(shape=[3])), [],
                          "the data files' 'action' holds 2 numbers a frame; meta/info.json says shape [3]"),
    "an episode's frames": (lambda root: edit_episode(root, 0, "dataset_to_index", 1), [],
                            "episode 0 spans dataset indices [0, 7) in meta/episodes, but the data files hold 6 of its 7"),
    "a cut-short video": (lambda root: cut_short(next((root / "videos").rglob("*.mp4")), 1500), [],
                          ("observation.images.front, episode 2: ", "has no frame at t=1.8000 s")),
    "not a video": (lambda root: next((root / "videos").rglob("*.mp4")).write_bytes(b"\0" * 100), [],
                    "file-000.mp4: not a video PyAV can open"),
    "no fps": (lambda root: edit_json(root / "meta" / "info.json", lambda d: d.pop("fps")), [],
               "info.json: no 'fps', which a LeRobot v3.0 info.json holds (fps, features, data_path, video_path)"),
    "a damaged Parquet": (lambda root: cut_short(root / "data" / "chunk-000" / "file-000.parquet", 300), [],
                          ("file-000.parquet: not a Parquet file pyarrow can read (the dataset's frames;",
                           "copy the dataset again")),
    "damaged episodes": (lambda root: next((root / "meta" / "episodes").rglob("*.parquet")).write_bytes(b"PAR1"), [],
                         "file-000.parquet: not a Parquet file pyarrow can read (the dataset's episodes;"),
    "no episodes": (lambda root: no_episodes(root), [], "meta/episodes: the dataset has no episodes"),
    "statistics too short": (lambda root: edit_json(root / "meta" / "stats.json", lambda d: d["action"].update(q01=[0.0])),
                             ["data.norm_action=quantiles"], "stats.json: action's q01 holds 1 number(s); meta/info.json "
                                                             "gives the feature 2"),
    "a NaN statistic": (lambda root: edit_json(root / "meta" / "stats.json",
                                               lambda d: d["observation.state"].update(std=[1.0, float("nan"), 1.0])),
                        [], "observation.state's std holds 3 number(s), not all finite"),
}


def no_episodes(root):
    import pyarrow.parquet as pq

    path = next((root / "meta" / "episodes").rglob("*.parquet"))
    pq.write_table(pq.read_table(path).slice(0, 0), path)


def edit_jsonl(path, episode, edit):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(edit(row) if row["episode_index"] == episode else row) + "\n" for row in rows))


def as_v20(root):
    """A v2.0 dataset: global statistics (meta/stats.json), no per-episode ones."""
    (root / "meta" / "episodes_stats.jsonl").unlink()
    edit_json(root / "meta" / "info.json", lambda d: d.update(codebase_version="v2.0"))


VIDEO21 = Path("videos", "chunk-000", "observation.images.front")
BAD_V21 = {
    "v2.0": (as_v20, [], "codebase_version 'v2.0' is not supported; zerojax reads v2.1, v3.0 (LeRobot 0.3's and "
                         "0.4's formats; LeRobot 0.3's lerobot.datasets.v21.convert_dataset_v20_to_v21 converts v2.0)"),
    "v1.6": (lambda root: edit_json(root / "meta" / "info.json", lambda d: d.update(codebase_version="v1.6")), [],
             "codebase_version 'v1.6' is not supported; zerojax reads v2.1, v3.0"),
    "no version": (lambda root: edit_json(root / "meta" / "info.json", lambda d: d.pop("codebase_version")), [],
                   "codebase_version None is not supported; zerojax reads v2.1, v3.0"),
    "no episode statistics": (lambda root: (root / "meta" / "episodes_stats.jsonl").unlink(), [],
                              "episodes_stats.jsonl: no mean/std statistics for 'observation.state' "
                              "(data.norm_state=mean_std needs mean and std; the file is missing)"),
    "no quantiles": (lambda root: None, ["data.norm_action=quantiles"],  # LeRobot 0.3 computes none
                     "episodes_stats.jsonl: no q01/q99 statistics for 'action' (data.norm_action=quantiles needs "
                     "q01 and q99; it has min, max, mean, std, count)"),
    "an episode's length": (lambda root: edit_jsonl(root / "meta" / "episodes.jsonl", 0, lambda r: {**r, "length": 7}),
                            [], "episode 0 spans dataset indices [0, 7) in meta/episodes.jsonl, but the data files "
                                "hold 6 of its 7 frames"),
    "an episode's statistics": (lambda root: edit_jsonl(root / "meta" / "episodes_stats.jsonl", 1,
                                                        lambda r: r["stats"]["action"].pop("count") and r), [],
                                "episodes_stats.jsonl: episode 1's 'action' has no count"),
    "a missing Parquet": (lambda root: (root / "data" / "chunk-000" / "episode_000002.parquet").unlink(), [],
                          "episode_000002.parquet: no such file (the dataset's frames)"),
    "a missing video": (lambda root: (root / VIDEO21 / "episode_000001.mp4").unlink(), [],
                        "episode_000001.mp4: no such file (episode 1's observation.images.front video)"),
    "a cut-short video": (lambda root: cut_short(root / VIDEO21 / "episode_000002.mp4", 700), [],  # no index left
                          "episode_000002.mp4: no video stream in it (a file cut short, or not a video?)"),
}
CASES = [(FIXTURE / "tiny", case, BAD[case]) for case in BAD] + [(V21 / "tiny", case, BAD_V21[case]) for case in BAD_V21]


@pytest.mark.parametrize("dataset, case, bad", CASES, ids=[f"{d.parent.name}-{c}" for d, c, _ in CASES])
def test_bad_input_is_one_line_and_exit_2_before_anything_is_written(dataset, case, bad, tmp_path, capsys):
    root = copy_fixture(tmp_path, dataset)
    damage, overrides, message = bad
    damage(root)
    out = tmp_path / "run"
    code = cli.main(["train", f"data.source=lerobot:{root}", f"train.out_dir={out}", "train.steps=1", *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    messages = message if isinstance(message, tuple) else (message,)
    assert code == 2 and len(err) == 1 and err[0].startswith("zerojax: error:"), err
    assert all(m in err[0] for m in messages), err
    assert not out.exists()


def test_a_file_given_as_the_dataset_says_it_is_a_file(tmp_path, capsys):
    info = FIXTURE / "tiny" / "meta" / "info.json"
    code = cli.main(["train", f"data.source=lerobot:{info}", f"train.out_dir={tmp_path / 'run'}", "train.steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"zerojax: error: data.source=lerobot:{info}: a file, not a directory; a LeRobot "
                                 "dataset directory holds meta/info.json"], err


def test_a_frame_the_video_does_not_have_names_the_episode_and_time():
    src = source()
    ds = src.dataset
    ep = ds.episodes[1]
    path, start = ep.videos[CAMERAS[0]]
    ep.videos[CAMERAS[0]] = (path, start + 0.05)  # half a frame off: no frame within LeRobot's tolerance
    with pytest.raises(ConfigError, match=r"observation.images.front, episode 1: .* has no frame at t=0\.6500 s "
                                          r"\(the nearest frame is at 0\.\d+ s"):
        src.raw_item(int(ep.start))


PI0 = ["model.family=pi0", "model.vocab_size=256", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
       "model.n_kv_heads=1", "model.head_dim=8", "model.d_ff=32", "model.expert.d_model=16", "model.expert.d_ff=32",
       "model.vision.image_size=8", "model.vision.patch_size=4", "model.vision.d_model=16", "model.vision.n_layers=1",
       "model.vision.n_heads=2", "model.vision.d_ff=32", "model.action.horizon=2", "model.action.prompt_len=16",
       "model.action.max_state_dim=8", "model.action.max_action_dim=4", "model.action.action_dim=2",
       "model.action.cameras=3", "data.image_size=8", "data.action_horizon=2", "data.prompt_len=16"]


def test_pi0_reads_the_dataset_as_its_batch():
    """A policy family gets its own batch: the cameras stacked (a third, which the dataset
    lacks, all -1 and masked), state and actions zero-padded, each row's noise and time."""
    from zerojax.data import sources

    cfg = config.load(overrides=[f"data.source=lerobot:{FIXTURE / 'tiny'}", "train.global_batch=4", *PI0])
    src = sources.open_source(cfg)
    batch = src.rows(0, 0, slice(None))
    assert {k: v.shape for k, v in batch.items()} == {k: f.shape for k, f in src.spec().items()}
    assert batch["image_masks"].tolist() == [[True, True, False]] * 4 and (batch["images"][:, 2] == -1).all()
    assert (batch["state"][:, 3:] == 0).all() and (batch["actions"][..., 2:] == 0).all()
    assert batch["state"][:, :3].any() and 0 < batch["time"].min() and batch["time"].max() <= 1
    raw = src.source.rows(0, 0, slice(None))  # the dataset's own features, the same frames
    np.testing.assert_array_equal(batch["images"][:, 0], raw[CAMERAS[0]])
    np.testing.assert_array_equal(batch["actions"][..., :2], raw["action"])


@pytest.mark.parametrize("override, message", [
    ("data.action_horizon=3", "data.action_horizon=3 contradicts model.action.horizon=2 (set in the config)"),
    ("model.action.max_state_dim=2", "observation.state has 3 dimensions, more than model.action.max_state_dim=2"),
    ("model.action.action_dim=1", "action has 2 dimensions, more than model.action.action_dim=1"),
    ("model.action.cameras=1", "has 2 cameras (observation.images.front, observation.images.wrist), more than "
                               "model.action.cameras=1"),
])
def test_a_policy_that_does_not_fit_the_dataset_is_refused(override, message, tmp_path, capsys):
    code = cli.main(["train", f"data.source=lerobot:{FIXTURE / 'tiny'}", *PI0, override,
                     f"train.out_dir={tmp_path / 'run'}", "train.steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()


V30_QUANTILES = json.loads((FIXTURE / "tiny" / "meta" / "stats.json").read_text())["action"]
V21_STATS = {"mean": REF21["stats/action/mean"].tolist(), "std": REF21["stats/action/std"].tolist()}


@pytest.mark.parametrize("dataset, norm, steps, stats", [
    (FIXTURE / "tiny", "quantiles", 1, {"q01": V30_QUANTILES["q01"], "q99": V30_QUANTILES["q99"]}),
    (V21 / "tiny", "mean_std", 2, V21_STATS),  # LeRobot 0.3's statistics, aggregated from the episodes'
], ids=["v3.0", "v2.1"])
def test_a_run_keeps_the_statistics_beside_its_checkpoints(dataset, norm, steps, stats, tmp_path):
    # π0 trained on the dataset through the sharded step on 8 devices, for what the run writes
    # beside its checkpoints; the two datasets' programs are the same (one compile, then the cache).
    out = tmp_path / "run"
    code = cli.main(["train", f"data.source=lerobot:{dataset}", f"data.norm_action={norm}", *PI0,
                     f"train.steps={steps}", "train.log_every=1", "train.global_batch=8", "train.eval_every=0",
                     "train.sample_tokens=0", "train.ckpt_every=0", "zero.min_shard_size=64", f"train.out_dir={out}"])
    assert code == 0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if "loss" in line]
    assert len(losses) == steps and np.isfinite(losses).all(), losses
    doc = json.loads((out / "lerobot.json").read_text())
    assert doc["normalization"]["action"] == {"mode": norm, **stats}
    assert doc["normalization"]["observation.state"]["mode"] == "mean_std"
    assert list(doc["features"]) == ["observation.state", *CAMERAS, "action"] and doc["action_horizon"] == 2


@pytest.mark.parametrize("mode, lo, hi", [("quantiles", "q01", "q99"), ("quantile10", "q10", "q90")])
def test_quantiles_collapsed_on_a_varying_feature_are_refused(mode, lo, hi, tmp_path):
    # LeRobot averages the episodes' quantiles: a feature constant within each episode gets
    # q01 = q99 however much it varies across them, and eps for a denominator (a run would train,
    # finite, on values of 1e7); the state's dimension 1 here, as a goal in Meta-World's state is
    root = copy_fixture(tmp_path)

    def collapse(doc):
        doc["observation.state"][lo][1] = doc["observation.state"][hi][1] = doc["observation.state"]["mean"][1]
    source(f"data.norm_state={mode}", root=root)  # the dataset's own quantiles pass
    edit_json(root / "meta" / "stats.json", collapse)
    with pytest.raises(ConfigError, match=rf"observation.state\[1\] spans .* its {lo} and {hi} are .* "
                                          rf"data.norm_state={mode} would map it to .*set data.norm_state=mean_std"):
        source(f"data.norm_state={mode}", root=root)
    source("data.norm_state=mean_std", root=root)  # the other modes read the same statistics
