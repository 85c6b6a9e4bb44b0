import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import FAST_COMPILE
from zerojax import cli
from zerojax.checkpoints import format as checkpoints
from zerojax.config import rules
from zerojax.parallel import mesh
from zerojax.train import checkpoint
from zerojax.train import state as state_lib
from zerojax.train import step as step_lib


def zerojax(*args, cwd):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = FAST_COMPILE  # no device count: the CLI must simulate its 8 CPU devices by itself
    return subprocess.run([sys.executable, "-m", "zerojax", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_train_writes_the_run_directory(tiny_overrides, tmp_path):
    proc = zerojax("train", "--no-progress", *tiny_overrides, "train.ckpt_every=100", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "8 cpu devices" in proc.stdout and "sample:" not in proc.stdout  # train.sample_tokens=0: none
    run = tmp_path / "run"
    names = sorted(p.name for p in run.iterdir())
    events = [n for n in names if n.startswith("events.out.tfevents.")]  # train.tensorboard=true (the default)
    assert len(events) == 1 and [n for n in names if n not in events] == ["checkpoints", "config.yaml",
                                                                          "metrics.jsonl", "report.html", "sample.txt"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["5"]  # the end of the run
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 5
    assert f"zerojax: report {run / 'report.html'}" in proc.stdout
    page = (run / "report.html").read_text()  # the curves; tests/test_report_page.py opens one in a browser
    assert all(f'<figure data-plot="{key}">' in page for key in ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_sec"))


def test_bad_input_from_the_console_exits_2_without_traceback(tmp_path):
    proc = zerojax("train", "zero.stag=1", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == "zerojax: error: unknown config key 'zero.stag'; did you mean 'zero.stage'?\n"
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args, message", [
    (["train", "train.stepz=3"], "unknown config key 'train.stepz'; did you mean 'train.steps'?"),
    (["train", "train.steps=many"], "train.steps expects an integer, got 'many'"),
    (["train", "zero.schedule=magic"], "zero.schedule='magic' is not valid; choose one of shard_map, gspmd"),
    (["train", "--config", "missing.yaml"], "config file 'missing.yaml' does not exist"),
    (["train", "data.source=missing.txt"], "data.source='missing.txt': no such file"),
    (["train", "train.global_batch=12"], "must be divisible by the data-parallel size mesh.replica x mesh.data = 8"),
    (["train", "mesh.data=16"], "mesh.data=16 needs 16 devices but only 8 cpu devices exist; choose mesh.data from 1, 2, 4, 8"),
    (["train", "mesh.data=3"], "mesh.data=3 does not divide the 8 cpu devices; choose mesh.data from 1, 2, 4, 8"),
    (["train", "mesh.replica=3"], "mesh.replica=3 does not divide the 8 cpu devices; choose mesh.replica from 1, 2, 4, 8"),
    (["train", "mesh.replica=2", "mesh.data=8"], "mesh.replica=2 x mesh.data=8 needs 16 devices but only 8 cpu"),
    (["train", "zero.schedule=gspmd", "precision.reduce=bf16"], "precision.reduce='bfloat16': choosing the reduce dtype under gspmd is not implemented"),
    (["train", "optim.freeze=hed"], "optim.freeze pattern 'hed' matches no parameter"),
    (["analyze", "--stages", "0,4"], "'0,4' is not a list of stages"),
    (["analyze", "model.d_mdoel=8"], "did you mean 'model.d_model'?"),
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["report", "nowhere"], "RUN_DIR 'nowhere' does not exist; give a directory `zerojax train` wrote"),
    (["report", "/"], "RUN_DIR '/' holds no metrics.jsonl"),
    (["report", "--out", "no/such/dir/r.html"], "--out 'no/such/dir/r.html': directory 'no/such/dir' does not exist"),
    (["fly"], "invalid choice: 'fly'"),
    # sizes
    (["train", "model.d_model=30"], "model.d_model=30 must be divisible by model.n_heads=4; try model.n_heads=3"),
    (["train", "model.family=llama", "model.n_kv_heads=3"], "model.n_heads=4 must be divisible by model.n_kv_heads=3; try model.n_kv_heads=2"),
    (["train", "model.n_kv_heads=2"], "model.n_kv_heads=2: grouped-query attention is llama's"),
    (["train", "model.family=llama", "model.d_model=24", "model.n_heads=8"], "= 3: llama's rotary embedding needs an even head dimension; try model.n_heads=6"),
    (["train", "model.vocab_size=100"], "model.vocab_size=100 is too small for the byte corpus data.source=stdlib"),
    (["train", "model.d_model=0"], "model.d_model=0 is not valid; it must be >= 1"),
    (["train", "train.global_batch=8", "train.grad_accum=2"], "= 4 rows per microbatch must be divisible by the data-parallel size"),
    (["train", "mesh.data=0"], "mesh.data=0 is not valid; it must be >= 1, or -1 to fill the devices the other axis leaves"),
    (["train", "mesh.replica=-2"], "mesh.replica=-2 is not valid; it must be >= 1, or -1"),
    (["train", "mesh.cpu_devices=0"], "mesh.cpu_devices=0 is not valid; it must be >= 1"),
    (["train", "zero.min_shard_size=-1"], "zero.min_shard_size=-1 is not valid; it must be >= 0"),
    (["train", "zero.prefetch=-1"], "zero.prefetch=-1 is not valid; it must be >= 0"),
    (["train", "zero.offload=cpu"], "zero.offload='cpu' is not valid; choose one of none, optimizer, optimizer+master"),
    (["train", "zero.offload=optimizer", "zero.schedule=gspmd"], "zero.offload=optimizer (the update streamed unit by unit from host memory) is supported with zero.schedule=shard_map"),
    (["memory", "--params", "1e9", "--devices", "8", "--offload", "cpu"], "argument --offload: invalid choice: 'cpu'"),
    (["train", "train.steps=0"], "train.steps=0 is not valid; it must be >= 1"),
    (["train", "train.keep=0"], "train.keep=0 is not valid; it must be >= 1"),
    (["train", "name="], "name='' is not valid; give the run a name"),
    # numbers: YAML and the command line accept nan and inf as floats
    (["train", "optim.lr=nan"], "optim.lr=nan is not valid; it must be a finite number >= 0"),
    (["train", "optim.lr=inf"], "optim.lr=inf is not valid; it must be a finite number >= 0"),
    (["train", "optim.lr=-1"], "optim.lr=-1.0 is not valid; it must be a finite number >= 0"),
    (["train", "optim.b1=1"], "optim.b1=1.0 must be in [0, 1)"),
    (["train", "optim.b2=nan"], "optim.b2=nan must be in [0, 1)"),
    (["train", "optim.eps=0"], "optim.eps=0.0 is not valid; it must be a finite number > 0"),
    (["train", "optim.eps=nan"], "optim.eps=nan is not valid"),
    (["train", "optim.weight_decay=inf"], "optim.weight_decay=inf is not valid; it must be a finite number >= 0"),
    (["train", "optim.clip_norm=nan"], "optim.clip_norm=nan is not valid; it must be a finite number >= 0"),
    (["train", "optim.lora.alpha=inf"], "optim.lora.alpha=inf is not valid; it must be a finite number > 0"),
    (["train", "optim.lora.rank=-1"], "optim.lora.rank=-1 is not valid; it must be >= 0"),
    (["train", "model.rope_theta=nan"], "model.rope_theta=nan is not valid; it must be a finite number > 0"),
    (["train", "model.norm_eps=inf"], "model.norm_eps=inf is not valid"),
    (["train", "data.val_fraction=nan"], "data.val_fraction=nan must be between 0 and 1, both excluded"),
    (["train", "precision.loss_scale=inf"], "precision.loss_scale=inf must be 'dynamic', 'none' or a static scale > 0"),
    (["train", "precision.loss_scale=nan"], "precision.loss_scale=nan must be 'dynamic', 'none' or a static scale > 0"),
    (["train", "precision.loss_scale=1e39"], "that float32 holds (<= 3.4e+38)"),
    (["train", "precision.min_loss_scale=0"], "precision.min_loss_scale=0.0 is not valid; it must be a finite number > 0"),
    (["train", "precision.initial_scale_power=200"], "2**200 overflows float32; choose a power <= 127"),
    (["train", "precision.initial_scale_power=-5"], "starts the dynamic scale at 2**-5, below precision.min_loss_scale=1.0"),
    (["memory", "--params", "nan", "--devices", "8"], "argument --params: 'nan' must be a finite number > 0"),
    (["memory", "--params", "1e9", "--devices", "8", "--k", "inf"], "--k inf must be a finite number >= 0"),
    (["memory", "--params", "1e9", "--devices", "8", "--frozen-bytes", "nan"], "--frozen-bytes nan must be a finite number > 0"),
    (["analyze", "--budget-gb", "nan"], "argument --budget-gb: 'nan' must be a finite number > 0"),
    (["export", "run", "--out", "x.safetensors", "--max-shard-size", "inf"], "'inf' must be a finite number > 0"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_each_bad_input_exits_2_with_one_line_and_writes_nothing(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(args[:1] + ["train.steps=1"] + args[1:] if args[0] == "train" else args) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax: error: ") and err.count("\n") == 1, err
    assert message in err
    assert list(tmp_path.iterdir()) == []


def option(command: str, flag: str) -> argparse.Action:
    """The argparse action of `zerojax COMMAND FLAG`."""
    commands = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return next(a for a in commands.choices[command]._actions if flag in a.option_strings)


@pytest.mark.parametrize("command, flag, valid", [
    ("memory", "--offload", rules.OFFLOADS),
    ("analyze", "--schedule", rules.SCHEDULES),
    ("export", "--format", checkpoints.writable()),
    ("export", "--dtype", rules.EXPORT_DTYPES),
    ("train", "--xla-preset", rules.XLA_PRESETS),
    ("analyze", "--xla-preset", rules.XLA_PRESETS),
], ids=["memory --offload", "analyze --schedule", "export --format", "export --dtype", "train --xla-preset",
        "analyze --xla-preset"])
def test_the_cli_offers_the_configs_choices(command, flag, valid):
    assert option(command, flag).choices == valid  # the formats: the registry's writers, asked when the parser is built


def test_the_xla_presets_the_cli_offers_are_the_meshs():
    assert rules.XLA_PRESETS == tuple(mesh.XLA_PRESETS)


def test_the_stages_the_cli_accepts_are_the_configs():
    assert cli.stage_list(",".join(map(str, rules.STAGES))) == rules.STAGES
    with pytest.raises(argparse.ArgumentTypeError):
        cli.stage_list(str(max(rules.STAGES) + 1))


# Bad files: each case writes its inputs under the test's directory (`{tmp}` in the arguments),
# then the command must exit 2 with one line and leave every file there as it was.

def inputs(files: dict | None = None):
    """Files to write: path -> bytes, text, a numpy array (.npy), a JSON value (config.json), or
    None for an empty directory."""
    def make(tmp, saved_run):
        for name, content in (files or {}).items():
            path = tmp / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if content is None:
                path.mkdir()
            elif isinstance(content, np.ndarray):
                np.save(path, content)
            elif isinstance(content, bytes):
                path.write_bytes(content)
            elif isinstance(content, str):
                path.write_text(content)
            else:
                path.write_text(json.dumps(content))
    return make


def a_run(change=lambda run: None):
    """The saved run (one checkpoint, at step 3) copied to {tmp}/run, then changed."""
    def make(tmp, saved_run):
        shutil.copytree(saved_run(), tmp / "run")
        change(tmp / "run")
    return make


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run directory of TINY's model with a checkpoint at step 3 of its initial state (saved
    without compiling a train step) and its metrics."""
    from conftest import TINY
    from zerojax import config
    from zerojax.parallel import mesh

    out = tmp_path_factory.mktemp("saved") / "run"
    cfg = config.load(overrides=TINY + [f"train.out_dir={out}"])
    step = step_lib.make_engine(cfg, mesh.make_mesh(cfg.mesh))
    mgr = checkpoint.manager(out, keep=1)
    checkpoint.save(mgr, step.plan, step.mesh, state_lib.init_state(step), 3, config.to_dict(cfg))
    mgr.wait_until_finished()
    mgr.close()
    config.dump(cfg, out / "config.yaml")
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 5.0}) + "\n" for i in (1, 2, 3)))
    return out


HF = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2,
      "num_attention_heads": 2, "intermediate_size": 64, "rms_norm_eps": 1e-6}  # TINY's shape
TEXT = "".join(f"line {i} of a small corpus\n" for i in range(200))  # 5 KB of bytes


BAD_FILES = [
    # data.source and data.tokenizer
    (inputs({"e/empty.txt": ""}), ["train", "data.source={tmp}/e/empty.txt"], "the training split has 0 tokens, fewer than model.seq_len+2=18"),
    (inputs(), ["train", "model.seq_len=8192"], "tokens, fewer than model.seq_len+2=8194; use a bigger corpus or a shorter model.seq_len"),
    (inputs({"odd.bin": b"\x01\x00\x02"}), ["train", "data.source={tmp}/odd.bin"], "data.source='{tmp}/odd.bin' has 3 bytes, an odd number: a .bin holds raw uint16 tokens"),
    (inputs({"empty.bin": b""}), ["train", "data.source={tmp}/empty.bin"], "the training split has 0 tokens"),
    (inputs({"f.npy": np.ones(5000, np.float32)}), ["train", "data.source={tmp}/f.npy"], "must hold a 1-D integer token array, got float32[5000]"),
    (inputs({"t.npy": np.zeros((100, 100), np.uint16)}), ["train", "data.source={tmp}/t.npy"], "must hold a 1-D integer token array, got uint16[100, 100]"),
    (inputs({"n.npy": np.arange(5000, dtype=np.int32) % 200 - 5}), ["train", "data.source={tmp}/n.npy"], "holds negative token ids (down to -5); token ids count from 0"),
    (inputs({"g.npy": b"not numpy" * 20}), ["train", "data.source={tmp}/g.npy"], "data.source='{tmp}/g.npy' is not a .npy array numpy can map"),
    (inputs({"ids.npy": np.arange(5000, dtype=np.uint16) % 1000}), ["train", "data.source={tmp}/ids.npy"], "model.vocab_size=256 is smaller than the corpus needs (1000 from data.source="),
    (inputs({"d.txt": None}), ["train", "data.source={tmp}/d.txt"], "data.source='{tmp}/d.txt': a directory, not a file"),
    (inputs({"tok": None}), ["train", "data.tokenizer={tmp}/tok"], "data.tokenizer='{tmp}/tok': no such tokenizer.json"),
    (inputs({"tok.json": "{not json"}), ["train", "data.tokenizer={tmp}/tok.json"], "tok.json is not a tokenizer.json"),
    # model.init_from and optim.lora.init_from
    (inputs({"w.safetensors": "plain text, not weights"}), ["train", "model.init_from={tmp}/w.safetensors"], "w.safetensors is not a readable safetensors file (ValueError: its first 8 bytes give a header of"),
    (inputs({"hf": None}), ["train", "model.init_from={tmp}/hf"], "model.init_from='{tmp}/hf' is a directory without config.json"),
    (inputs({"hf/config.json": [1, 2]}), ["train", "model.init_from={tmp}/hf"], "hf/config.json holds a JSON list, not a Hugging Face or LeRobot config"),
    (inputs({"hf/config.json": {**HF, "architectures": "LlamaForCausalLM"}}), ["train", "model.init_from={tmp}/hf"], "architectures='LlamaForCausalLM' is not a list of model classes"),
    (inputs({"hf/config.json": {"architectures": ["GPT2LMHeadModel"], "n_embd": 32}}), ["train", "model.init_from={tmp}/hf"], "hf/config.json has no vocab_size, n_layer, n_head, layer_norm_epsilon, n_positions"),
    (inputs({"hf/config.json": {**HF, "num_attention_heads": 0}}), ["train", "model.init_from={tmp}/hf"], "hf/config.json: model.n_heads=0 is not valid; it must be >= 1"),
    (inputs({"hf/config.json": HF}), ["train", "model.init_from={tmp}/hf"], "has no model.safetensors nor model.safetensors.index.json"),
    (inputs({"peft/adapter_config.json": [1], "peft/adapter_model.safetensors": b""}), ["train", "optim.lora.rank=4", "optim.lora.init_from={tmp}/peft"], "adapter_config.json holds a JSON list, not a PEFT config"),
    (inputs({"peft": "x"}), ["train", "optim.lora.rank=4", "optim.lora.init_from={tmp}/peft"], "not a PEFT adapter directory"),
    # the YAML config
    (inputs({"c.yaml": "- model\n- train\n"}), ["train", "--config", "{tmp}/c.yaml"], "c.yaml: expected a mapping of config sections, got list"),
    (inputs({"c.yaml": "model: 5\n"}), ["train", "--config", "{tmp}/c.yaml"], "c.yaml: section 'model' must be a mapping of keys"),
    (inputs({"c.yaml": b"name: caf\xe9\n"}), ["train", "--config", "{tmp}/c.yaml"], "c.yaml' is not UTF-8 text"),
    (inputs({"c.yaml": None}), ["train", "--config", "{tmp}/c.yaml"], "c.yaml' is a directory, not a YAML file"),
    (inputs({"c.yaml": "name: ''\n"}), ["train", "--config", "{tmp}/c.yaml"], "name='' is not valid"),
    # train.out_dir and the run directory
    (inputs({"afile": "x"}), ["train", "train.out_dir={tmp}/afile"], "train.out_dir='{tmp}/afile': {tmp}/afile is a file, not a directory"),
    (inputs({"afile": "x"}), ["train", "train.out_dir={tmp}/afile/run"], "{tmp}/afile is a file, not a directory"),
    (inputs({"run/checkpoints": "x"}), ["train", "train.ckpt_every=1"], "{tmp}/run/checkpoints is a file; the run keeps its checkpoints in that directory"),
    (inputs({"run/metrics.jsonl": None}), ["train"], "{tmp}/run/metrics.jsonl is a directory; the run writes its metrics.jsonl there"),
    (a_run(), ["train", "model.d_model=64"], "checkpoints/3 holds a different model than the config asks for: blocks/attn/out/bias is [2, 32] there, [2, 64] in the config's model"),
    (a_run(), ["train", "model.family=llama"], "holds a different model than the config asks for: blocks/attn/out/bias is [2, 32] there, not in the config's model"),
    (a_run(), ["train", "optim.lora.rank=4"], "holds a different model than the config asks for: it has no blocks/attn/out/lora_a, [2, 32, 4] in the config's model"),
    (a_run(), ["train", "optim.freeze=embed"], "checkpoints/3 trained embed/wpe, which the config freezes (the saved run had optim.freeze=[]"),
    (a_run(), ["train", "train.steps=2"], "has a checkpoint at step 3, past train.steps=2"),
    (a_run(), ["train", "train.resume=never"], "train.resume=never but {tmp}/run already holds a run"),
    (a_run(lambda run: (run / "metrics.jsonl").write_text('{"step": 1}\ngarbage\n')), ["train"], "run/metrics.jsonl, line 2: 'garbage' is not a metrics line"),
    (a_run(lambda run: shutil.rmtree(run / "checkpoints" / "3" / "state")), ["train"], "checkpoints/3 cannot be restored"),
    # zerojax export
    (inputs(), ["export", "{tmp}/nowhere", "--out", "{tmp}/x.safetensors"], "{tmp}/nowhere holds no checkpoints/ directory"),
    (a_run(), ["export", "{tmp}/run", "--out", "{tmp}/x.safetensors", "--step", "7"], "run/checkpoints has no step 7 (complete steps: [3])"),
    (a_run(lambda run: (run.parent / "x.safetensors").write_text("keep")), ["export", "{tmp}/run", "--out", "{tmp}/x.safetensors"], "--out '{tmp}/x.safetensors' already exists; give a new path"),
    (a_run(lambda run: (run.parent / "hf").mkdir()), ["export", "{tmp}/run", "--format", "hf", "--out", "{tmp}/hf"], "--out '{tmp}/hf' already exists"),
    (a_run(lambda run: (run.parent / "afile").write_text("x")), ["export", "{tmp}/run", "--out", "{tmp}/afile/x.safetensors"], "{tmp}/afile is a file, not a directory"),
    # zerojax tokenizer train
    (inputs(), ["tokenizer", "train", "{tmp}/missing.txt", "--vocab-size", "300", "--out", "{tmp}/tok"], "SOURCE='{tmp}/missing.txt': no such file"),
    (inputs({"empty.txt": ""}), ["tokenizer", "train", "{tmp}/empty.txt", "--vocab-size", "300", "--out", "{tmp}/tok"], "SOURCE '{tmp}/empty.txt' is empty"),
    (inputs({"tok": "x"}), ["tokenizer", "train", "{tmp}/text.txt", "--vocab-size", "300", "--out", "{tmp}/tok"], "--out '{tmp}/tok': {tmp}/tok already exists and is not a directory"),
    (inputs({"tok/tokenizer.json": "{}"}), ["tokenizer", "train", "{tmp}/text.txt", "--vocab-size", "300", "--out", "{tmp}/tok"], "{tmp}/tok/tokenizer.json already exists; give a new directory"),
]


@pytest.mark.parametrize("make, args, message", BAD_FILES, ids=[" ".join(a).replace("{tmp}/", "") for _, a, _ in BAD_FILES])
def test_each_bad_file_exits_2_with_one_line_and_leaves_the_disk_alone(make, args, message, tmp_path, request, capsys):
    from conftest import TINY

    (tmp_path / "text.txt").write_text(TEXT)
    make(tmp_path, lambda: request.getfixturevalue("saved_run"))
    before = snapshot(tmp_path)
    args = [a.format(tmp=tmp_path) for a in args]
    if args[0] == "train":  # small and fast: the TINY model on the text, writing to {tmp}/run
        args = args[:1] + TINY + [f"data.source={tmp_path / 'text.txt'}", f"train.out_dir={tmp_path / 'run'}"] + args[1:]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax: error: ") and err.count("\n") == 1, err
    assert message.format(tmp=tmp_path) in err, err
    assert snapshot(tmp_path) == before


def snapshot(root: Path) -> dict:
    """Every file and directory under `root`, with its size and modification time."""
    return {str(p.relative_to(root)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.mark.parametrize("args", [
    ["formats", "0.1", "70000", "--json"],
    ["memory", "--params", "7.5e9", "--devices", "64"],
    ["formats", "abc"],  # bad input: exit 2, one line
    ["formats", "1", "--bogus"],
    ["train", "--help"],  # the usage line names the program
], ids=" ".join)
def test_module_and_console_script_agree(args, tmp_path):
    script = Path(sys.executable).parent / "zerojax"  # pip puts console scripts next to the interpreter
    if not script.is_file():
        pytest.skip(f"no console script at {script}: zerojax is not installed into this environment")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    module, console = [subprocess.run(command + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
                       for command in ([sys.executable, "-m", "zerojax"], [str(script)])]
    assert (console.returncode, console.stdout, console.stderr) == (module.returncode, module.stdout, module.stderr)
    assert module.returncode == (2 if "abc" in args or "--bogus" in args else 0), module.stderr
    assert module.stdout if module.returncode == 0 else module.stderr.startswith("zerojax: error: ")


def test_importing_every_zerojax_module_leaves_xla_flags_alone(tmp_path):
    """XLA_FLAGS is set only by `--xla-preset` (mesh.apply_xla_preset), never as an import side
    effect: a fresh interpreter without it imports every module and still has none."""
    code = ("import importlib, os, pkgutil, zerojax\n"
            "for m in pkgutil.walk_packages(zerojax.__path__, 'zerojax.'):\n"
            "    if m.name != 'zerojax.__main__':\n"
            "        importlib.import_module(m.name)\n"
            "print(repr(os.environ.get('XLA_FLAGS')))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "None"


def test_gpu_xla_preset_only_when_asked(tiny_overrides, tmp_path):
    assert "xla_gpu" not in os.environ.get("XLA_FLAGS", "")  # importing zerojax.cli (above) set nothing
    proc = zerojax("train", "--no-progress", "--xla-preset", "gpu", *tiny_overrides, cwd=tmp_path)
    # the flags are known to this jaxlib's XLA (an unknown flag aborts the process at start-up)
    assert proc.returncode == 0, proc.stderr
    assert "XLA preset gpu: --xla_gpu_enable_latency_hiding_scheduler=true" in proc.stderr


def test_analyze_json_is_the_contract_document(capsys):
    assert cli.main(["analyze", "--stages", "0,3", "--json", "model.n_layers=2", "train.global_batch=16"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"params", "devices", "stages"} <= set(doc) and doc["devices"] == 8
    sharded = [row for row in doc["plan"] if row["dim"] is not None]
    assert sharded and sum(math.prod(row["shape"]) for row in doc["plan"]) == doc["params"]
    for row in sharded:  # the plan's dim is the one its spec splits over `data`
        assert row["spec"].count("'data'") == 1 and row["spec"].split(",")[row["dim"]].strip(" P()") == "'data'"
    for stage in ("0", "3"):
        m = doc["stages"][stage]
        assert {"argument_bytes", "temp_bytes", "output_bytes", "formula_bytes", "comm_bytes",
                "comm_theory_bytes", "comm"} <= set(m)
        assert {"all-gather", "reduce-scatter", "all-reduce"} <= set(m["comm"])
