"""The `zerojax` command line (docs/design.md §4).

Bad input (a `ConfigError` from anywhere in zerojax, or an argparse error) prints one
`zerojax: error: ...` line on stderr and exits 2 before anything is written; a run that cannot
form its mesh or go on (`DistributedError`, `TrainingError`) prints one line and exits 1; any
other failure, including a bug in a user's model, exits 1 with its traceback.

The choices of the options are the config's enumerations (`config.rules`). Only the commands
that build a model import jax (train, analyze, export, generate, serve, report's analysis,
memory --config), in their own bodies: `zerojax memory --params` and `zerojax formats` answer
without it; only `serve` and `rollout` import their extras (websockets, msgpack; metaworld, mujoco).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from zerojax import config, data, formats, report
from zerojax.config import devices as devices_lib
from zerojax.analysis import formulas
from zerojax.config import rules
from zerojax.errors import ConfigError, DistributedError, TrainingError


DEVICE_KINDS = tuple(devices_lib.DEVICES)


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + error; the contract wants one line
        raise UsageError(message)


def build_parser() -> Parser:
    parser = Parser(prog="zerojax", description="ZeRO / FSDP training in JAX")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    _train_arguments(sub.add_parser("train", help="train a model (default: the tiny GPT on the stdlib corpus)"))
    _memory_arguments(sub.add_parser("memory", help="the ZeRO memory calculator: model-state bytes per device"))
    _analyze_arguments(sub.add_parser("analyze", help="compile each stage's train step; measured bytes vs the formulas"))
    _plan_arguments(sub.add_parser("plan", help="choose stage, offload, remat, accumulation, gather dtype and "
                                                "prefetch for N devices of M GB, from compiled steps"))
    _export_arguments(sub.add_parser("export", help="a run's (sharded) checkpoint as one safetensors file or a "
                                                    "Hugging Face directory"))
    _generate_arguments(sub.add_parser("generate", help="text from a run's checkpoint or a Hugging Face directory "
                                                        "(a prompt, or a conversation on stdin), with a KV cache"))
    _serve_arguments(sub.add_parser("serve", help="a π0 run's policy over openpi's websocket protocol "
                                                  "(openpi's WebsocketClientPolicy connects to it)"))
    _rollout_arguments(sub.add_parser("rollout", help="a π0 run (or the scripted expert) in closed loop on simulated "
                                                      "tasks: success rate per task (the sim extra: Meta-World)"))
    _tokenizer_arguments(sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer (Hugging Face tokenizers)"))
    _report_arguments(sub.add_parser("report", help="one self-contained HTML page: format explorer, memory "
                                                    "calculator, the stages measured and the curves of runs"))
    _formats_arguments(sub.add_parser("formats", help="how FP32, BF16, FP16 and FP8 store a number"))
    return parser


def _train_arguments(train: Parser) -> None:
    train.add_argument("--config", help="YAML config file (see configs/)")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="override a config field by dotted name, e.g. zero.stage=1 train.steps=50")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--xla-preset", choices=rules.XLA_PRESETS, help="XLA flags that overlap collectives with compute")
    train.add_argument("--coordinator", metavar="HOST:PORT", help="multi-process run: process 0's address")
    train.add_argument("--num-processes", type=positive_int, metavar="P", help="processes in the run")
    train.add_argument("--process-id", type=int, metavar="I", help="this process, 0..P-1")


def _memory_arguments(memory: Parser) -> None:
    memory.add_argument("--params", type=parse_count, help="parameters Ψ (7.5e9, 124M, 3B)")
    memory.add_argument("--config", help="take Ψ from this config's model (abstract shapes)")
    memory.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (with --config)")
    memory.add_argument("--devices", type=positive_int, help="devices N on the data axis")
    memory.add_argument("--k", type=float, default=12, help="optimizer bytes per parameter (Adam: 12)")
    memory.add_argument("--trainable", type=parse_count,
                        help="parameters trained (LoRA adapters, unfrozen leaves); the rest are frozen")
    memory.add_argument("--frozen-bytes", type=float, default=2,
                        help="bytes per frozen parameter (precision.frozen: bfloat16 2, float32 4)")
    memory.add_argument("--offload", choices=rules.OFFLOADS, default=None,
                        help="zero.offload: the bill with m and v (optimizer), or the master too, in host memory "
                             "(default: the config's, else none)")
    memory.add_argument("--json", action="store_true", help="print one JSON document")


def _analyze_arguments(analyze: Parser) -> None:
    analyze.add_argument("--config", help="YAML config file (see configs/)")
    analyze.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    analyze.add_argument("--stages", type=stage_list, help="e.g. 0,3 (default 0,1,2,3; with precision.gather=int8 "
                         "or float8_e4m3fn 1,2,3)")
    analyze.add_argument("--schedule", choices=rules.SCHEDULES, help="same as zero.schedule=...")
    analyze.add_argument("--budget-gb", type=parse_count, help="also find the largest depth x width scaling "
                         "of the model whose compiled peak fits this many GB per device")
    analyze.add_argument("--xla-preset", choices=rules.XLA_PRESETS, help="XLA flags that overlap collectives with compute")
    analyze.add_argument("--json", action="store_true", help="print one JSON document")


def _plan_arguments(plan: Parser) -> None:
    plan.add_argument("--config", help="YAML config file (see configs/)")
    plan.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (kept fixed by the search)")
    plan.add_argument("--devices", type=positive_int, required=True, metavar="N", help="devices in the run")
    plan.add_argument("--device", default="h100", metavar="KIND",
                      help=f"the device kind the step time is estimated for: {', '.join(DEVICE_KINDS)} (default h100)")
    plan.add_argument("--device-memory", metavar="SIZE", help="memory per device, e.g. 24GB, 24GiB (default: the kind's)")
    plan.add_argument("--hosts", type=positive_int, default=1, metavar="H",
                      help="hosts the devices are spread over: collectives then cross the network")
    plan.add_argument("--margin", default="1GB", metavar="SIZE",
                      help="kept free of the budget for what the compiled train step does not count: the batches "
                           "in flight, the eval step, the allocator's fragmentation (default 1GB)")
    plan.add_argument("--json", action="store_true", help="print one JSON document")


def _export_arguments(export: Parser) -> None:
    export.add_argument("run_dir", metavar="RUN_DIR")
    export.add_argument("--out", required=True,
                        help="FILE.safetensors (--format safetensors) or a new DIR (hf, peft, lerobot)")
    export.add_argument("--format", choices=rules.EXPORT_FORMATS, default="safetensors",
                        help="safetensors: zerojax's parameter paths; hf: what transformers loads; "
                             "peft: a LoRA run's adapters, as peft.PeftModel.from_pretrained loads them; "
                             "lerobot: a pi0 run as LeRobot's PI0Policy.from_pretrained loads it (0.3.x layout)")
    export.add_argument("--merge", action="store_true",
                        help="hf or lerobot, of a LoRA run: the adapters merged into the weights")
    export.add_argument("--max-shard-size", type=parse_count, default=5e9, metavar="SIZE",
                        help="hf: the largest safetensors shard, e.g. 5GB (default), 500M")
    export.add_argument("--dtype", choices=rules.EXPORT_DTYPES, default="float32")
    export.add_argument("--step", type=int, help="a checkpoint step (default: the newest)")
    export.add_argument("--weights", choices=rules.EXPORT_WEIGHTS,
                        help="ema: the optim.ema average of the trained weights, raw: the weights themselves "
                             "(default: ema when the checkpoint holds one)")
    export.add_argument("--json", action="store_true", help="print one JSON document")


def _generate_arguments(generate: Parser) -> None:
    generate.add_argument("source", metavar="RUN_DIR|HF_DIR")
    what = generate.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", metavar="TEXT", help="continue TEXT")
    what.add_argument("--chat", action="store_true", help="a conversation through the chat template: each line of "
                      "stdin a user turn, each reply printed, until EOF")
    what.add_argument("--held-out", action="store_true", help="a vision-language run (model.family=paligemma): "
                      "greedy answers to its data's held-out examples and their exact match")
    generate.add_argument("--blank-images", action="store_true", help="--held-out: every image white (the "
                          "text-only baseline)")
    generate.add_argument("--limit", type=positive_int, metavar="N", help="--held-out: the first N examples")
    generate.add_argument("--json", action="store_true", help="--held-out: one JSON document")
    generate.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N")
    generate.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0: greedy (default 0.8)")
    generate.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (default 1: off)")
    generate.add_argument("--seed", type=int, default=0, metavar="S")
    generate.add_argument("--step", type=int, help="RUN_DIR: a checkpoint step (default: the newest)")


def _serve_arguments(serve: Parser) -> None:
    serve.add_argument("run_dir", metavar="RUN_DIR", help="a π0 run trained on data.source=lerobot:DIR, the "
                       "FILE.safetensors `zerojax export` wrote of one, or a LeRobot π0 checkpoint directory")
    serve.add_argument("--step", type=int, help="RUN_DIR: a checkpoint step (default: the newest)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="the address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface)")
    serve.add_argument("--port", type=port_number, default=8000, help="default 8000 (openpi's); 0: any free port")
    serve.add_argument("--num-steps", type=positive_int, default=10, metavar="N",
                       help="Euler steps of the flow from noise to actions (default 10, as π0's)")
    serve.add_argument("--seed", type=int, default=0, metavar="S", help="the noise's seed (request n draws from "
                       "fold_in(key(S), n))")
    serve.add_argument("--api-key", metavar="KEY", help="refuse connections without the header "
                       "Authorization: Api-Key KEY (default: $ZEROJAX_API_KEY, else none)")
    serve.add_argument("--tokenizer", metavar="PATH", help="a LeRobot checkpoint: the tokenizer.json of its prompts "
                       "(LeRobot's π0 fetches PaliGemma's from the Hub; its directory holds none)")
    serve.add_argument("--vision-heads", type=positive_int, metavar="N", help="a LeRobot checkpoint: the tower's "
                       "attention heads, which its config.json does not name (default 16, So400m's)")


def _rollout_arguments(rollout: Parser) -> None:
    rollout.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="a π0 run trained on a dataset "
                         "scripts/collect_metaworld.py wrote (or its export); none with --policy expert")
    rollout.add_argument("--env", required=True, metavar="KIND:TASKS", help="metaworld:TASK[,TASK...] (e.g. "
                         "metaworld:reach-v3,drawer-close-v3)")
    rollout.add_argument("--episodes", type=positive_int, default=50, metavar="N", help="seeded episodes per task "
                         "(default 50)")
    rollout.add_argument("--seed", type=int, default=100000, metavar="S", help="episode e starts from the env's "
                         "reset(S + e) (default 100000: past the seeds collect_metaworld.py records from)")
    rollout.add_argument("--policy", choices=["run", "expert"], default="run", help="run: RUN_DIR's π0 (default); "
                         "expert: Meta-World's scripted expert, through the same loop")
    rollout.add_argument("--n-action-steps", type=positive_int, metavar="N", help="actions executed from each chunk "
                         "before the next is sampled (LeRobot's n_action_steps; default: the chunk's length)")
    rollout.add_argument("--num-steps", type=positive_int, default=10, metavar="N",
                         help="Euler steps of the flow from noise to actions (default 10, as π0's)")
    rollout.add_argument("--max-steps", type=positive_int, metavar="N", help="cut episodes at N steps (default: the "
                         "task's max_path_length, 500)")
    rollout.add_argument("--size", type=positive_int, default=64, metavar="S", help="--policy expert: the camera's "
                         "size for --video (a run uses its dataset's)")
    rollout.add_argument("--video", metavar="DIR", help="write MP4s of the first --videos episodes of each task here")
    rollout.add_argument("--videos", type=positive_int, default=2, metavar="K", help="episodes filmed per task "
                         "(default 2)")
    rollout.add_argument("--step", type=int, help="RUN_DIR: a checkpoint step (default: the newest)")
    rollout.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    rollout.add_argument("--json", action="store_true", help="stdout: one JSON document")


def _tokenizer_arguments(tokenizer: Parser) -> None:
    tokenizer.add_argument("action", choices=["train"])
    tokenizer.add_argument("source", nargs="?", default="stdlib", metavar="SOURCE",
                           help="stdlib (default: Python's own sources) or a .txt file")
    tokenizer.add_argument("--vocab-size", type=positive_int, required=True, metavar="N")
    tokenizer.add_argument("--out", required=True, metavar="DIR", help="writes DIR/tokenizer.json")


def _report_arguments(report: Parser) -> None:
    report.add_argument("run_dirs", nargs="*", metavar="RUN_DIR", help="run directories to show, overlaid")
    report.add_argument("--out", default="report.html", help="the HTML file to write (default report.html)")
    report.add_argument("--no-analyze", action="store_true", help="do not compile the stages of a run that has "
                        "no RUN_DIR/analyze.json yet (its measured bars are then left out)")


def _formats_arguments(formats: Parser) -> None:
    formats.add_argument("values", nargs="*", metavar="VALUE", help="numbers to store, e.g. 0.1 70000 1e-8")
    formats.add_argument("--table", action="store_true", help="range and precision of each format")
    formats.add_argument("--json", action="store_true", help="print one JSON document")


SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """7.5e9, 7500000000, 124M, 3B, 1.5T (and sizes: 5GB, 500MB)."""
    text = text[:-1] if text[-2:].lower() in ("kb", "mb", "gb", "tb") else text
    scale = SUFFIXES.get(text[-1:].lower(), 1)
    try:
        value = float(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count; use e.g. 7.5e9, 124M or 3B") from None
    if not 0 < value < math.inf:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def stage_list(text: str) -> tuple[int, ...]:
    try:
        stages = tuple(int(s) for s in text.split(","))
    except ValueError:
        stages = ()
    if not stages or any(s not in rules.STAGES for s in stages):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of stages; use e.g. 0,1,2,3 or 3")
    return stages


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; use 0-65535 (0: any free port)")
    return value


def xla_preset(args) -> None:
    if getattr(args, "xla_preset", None):
        from zerojax.parallel.mesh import apply_xla_preset

        print(f"zerojax: XLA preset {args.xla_preset}: {apply_xla_preset(args.xla_preset)}", file=sys.stderr)


def jax_process_index() -> int:
    import jax

    return jax.process_index()


def cmd_train(args) -> int:
    from zerojax import train
    from zerojax.parallel import mesh

    xla_preset(args)
    cfg = config.load(args.config, args.overrides)
    mesh.init_distributed(cfg.mesh, args.coordinator, args.num_processes, args.process_id)
    setup = train.prepare(cfg)
    if jax_process_index() != 0:  # process 0 speaks for the run
        sys.stdout = open(os.devnull, "w")
    print(f"zerojax: training {cfg.name} ({cfg.model.family}): {setup.mesh.devices.size} "
          f"{setup.mesh.devices.flat[0].platform} devices, mesh {dict(setup.mesh.shape)}{mesh.shape_note(cfg.mesh)}, "
          f"stage {cfg.zero.stage}, compute {setup.engine.policy.compute.name}")
    if setup.resume_step:
        print(f"zerojax: resuming from the checkpoint at step {setup.resume_step} in {cfg.run_dir}/checkpoints")
    result = train.run(cfg, show_progress=not args.no_progress, setup=setup)
    if cfg.train.report and jax_process_index() == 0:
        report.write_page([report.read_run(cfg.run_dir)], cfg.run_dir / "report.html")
        print(f"zerojax: report {cfg.run_dir / 'report.html'}")
    stopped = result.stopped
    if stopped:
        print(f"zerojax: stopped by {stopped.signal} after step {stopped.step}; "
              f"checkpoint saved in {cfg.run_dir}/checkpoints/{stopped.step}; rerun the same command "
              "to continue")
        return 0
    last = result.history[-1] if result.history else {}
    summary = ", ".join(f"{k} {last[k]:.4f}" for k in ("loss", "eval_loss") if k in last)
    print(f"zerojax: done: {summary}; run directory {result.run_dir}")
    if result.sample:
        print("sample:\n" + result.sample)
    return 0


def cmd_memory(args) -> int:
    params, devices = args.params, args.devices
    if args.config is None and args.overrides:
        raise UsageError("KEY=VALUE overrides need --config")
    if (params is None) == (args.config is None):
        raise UsageError("give exactly one of --params P or --config PATH")
    if not 0 <= args.k < math.inf:
        raise UsageError(f"--k {args.k} must be a finite number >= 0 (Adam with fp32 master: 12)")
    trained, frozen_bytes, offload, ema = args.trainable, args.frozen_bytes, args.offload or "none", False
    if args.config is not None:
        from zerojax.analysis import measure  # jax: Ψ from the abstract model

        cfg = config.load(args.config, args.overrides)
        offload = args.offload or cfg.zero.offload
        params, trained = measure.param_counts(cfg)
        frozen_bytes = formats.dtype(cfg.precision.frozen).itemsize
        ema = cfg.optim.ema > 0
        devices = devices or (cfg.mesh.data if cfg.mesh.data > 0 else None)
    if devices is None:
        raise UsageError("give --devices N (the devices on the data axis)")
    if trained is not None and not 0 < trained <= params:
        raise UsageError(f"--trainable {trained:g} must be in (0, --params {params:g}]")
    if not 0 < frozen_bytes < math.inf:
        raise UsageError(f"--frozen-bytes {frozen_bytes:g} must be a finite number > 0")
    params = int(params) if float(params).is_integer() else params
    doc = formulas.memory_report(params, devices, args.k, trained, frozen_bytes, offload, ema)
    report.emit(doc, args.json, report.memory_table)
    return 0


def cmd_analyze(args) -> int:
    from zerojax.analysis import measure

    xla_preset(args)
    overrides = args.overrides + ([f"zero.schedule={args.schedule}"] if args.schedule else [])
    cfg = config.load(args.config, overrides)  # bad input surfaces here and in make_engine, before compiling
    report.emit(measure.analyze(cfg, args.stages, args.budget_gb), args.json, report.analyze_table)
    return 0


def cmd_plan(args) -> int:
    dev = devices_lib.device(args.device)
    memory = devices_lib.parse_size(args.device_memory) if args.device_memory else dev.memory_bytes
    margin = devices_lib.parse_size(args.margin, "--margin", zero=True)
    if args.devices % args.hosts:
        raise UsageError(f"--devices {args.devices} must be divisible by --hosts {args.hosts}")
    cfg = config.load(args.config, args.overrides)  # bad input surfaces here, before compiling
    from zerojax.analysis import plan  # jax: the steps are compiled

    plan.simulate_on_cpu()
    target = plan.Target(dev, args.devices, devices_lib.budget_bytes(memory, margin), args.hosts)
    start = time.perf_counter()
    doc = plan.search(cfg, target, log=lambda message: print(f"zerojax: {message}", file=sys.stderr))
    doc["search_s"] = round(time.perf_counter() - start, 1)
    report.emit(doc, args.json, report.plan_tables)
    return 0 if doc["winner"] else 2


def cmd_export(args) -> int:
    from zerojax.train import export as export_lib

    out = Path(args.out)
    if args.format == "safetensors" and out.suffix != ".safetensors":
        raise UsageError(f"--out {args.out!r} must end in .safetensors (or use --format hf for a directory)")
    done = export_lib.export(Path(args.run_dir), out, args.dtype, args.step, args.format, int(args.max_shard_size),
                             merge=args.merge, weights=args.weights)
    print(json.dumps(done) if args.json else
          f"zerojax: wrote {done['out']} ({args.format}): {done['tensors']} tensors, {done['params']:,} parameters "
          f"({args.dtype}, {done['weights']} weights) from step {done['step']}")
    return 0


def cmd_generate(args) -> int:
    if not (0 <= args.temperature < math.inf):
        raise UsageError(f"--temperature {args.temperature} must be a finite number >= 0 (0: greedy)")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p {args.top_p} must be in (0, 1]")
    if not args.held_out and (args.blank_images or args.limit or args.json):
        raise UsageError("--blank-images, --limit and --json go with --held-out")
    if args.held_out:
        return _held_out(args)
    from flax import nnx

    from zerojax.train import sample

    loaded = sample.load_for_generation(args.source, args.step)
    graphdef, params = nnx.split(loaded.model)
    generator = sample.Generator(lambda p: nnx.merge(graphdef, p), params, loaded.seq_len,
                                 callable(getattr(loaded.model, "decode", None)), args.temperature, args.top_p)
    print(f"zerojax: generating from {loaded.where}", file=sys.stderr)
    if args.chat:
        for reply, stats in sample.chat_turns(generator, loaded.tokenizer, sys.stdin, args.max_new_tokens, args.seed):
            print(reply, flush=True)
            _speed(stats)
    else:
        text, stats = sample.continuation(generator, loaded.tokenizer, args.prompt, args.max_new_tokens, args.seed)
        print(text)
        _speed(stats)
    return 0


def _held_out(args) -> int:
    from zerojax.train import answer

    answers = answer.held_out(args.source, args.step, args.blank_images, args.limit or 0, args.max_new_tokens)
    exact = sum(a.exact for a in answers)
    if args.json:
        print(json.dumps({"examples": len(answers), "exact": exact, "exact_match": exact / len(answers),
                          "blank_images": args.blank_images,
                          "answers": [{"prefix": a.prefix, "expected": a.expected, "answer": a.answer}
                                      for a in answers]}))
        return 0
    for a in [a for a in answers if not a.exact][:5]:
        print(f"  {a.prefix!r}: answered {a.answer!r}, expected {a.expected!r}")
    print(f"exact match {exact}/{len(answers)} = {exact / len(answers):.1%} on the held-out examples"
          f"{' with every image blank' if args.blank_images else ''} (greedy)")
    return 0


def _speed(stats) -> None:
    print(f"zerojax: {stats.new_tokens} new tokens after {stats.prompt_tokens}: prefill and first token "
          f"{stats.first_s:.2f} s, then {stats.tokens_per_s:,.1f} tokens/s (after the second token)",
          file=sys.stderr, flush=True)


def cmd_serve(args) -> int:
    from zerojax import serve

    serve.require()  # the extra, before a model is loaded
    from zerojax.serve import policy, server

    served = policy.load(Path(args.run_dir), args.step, args.num_steps, args.seed, args.tokenizer, args.vision_heads)
    print(f"zerojax: serving {served.where}: sample_actions compiled in {served.compile_s:.1f} s, "
          f"then {served.call_ms:.1f} ms a call ({args.num_steps} steps)", file=sys.stderr)
    api_key = args.api_key or os.environ.get("ZEROJAX_API_KEY") or None

    def listening(port: int) -> None:
        print(f"zerojax: listening on ws://{args.host}:{port} (openpi's websocket policy protocol"
              f"{', API key required' if api_key else ''}; GET /healthz)", flush=True)

    try:
        server.PolicyServer(served, args.host, args.port, api_key).serve_forever(listening)
    except OSError as err:  # the address is taken, or not this machine's
        raise ConfigError(f"cannot listen on {args.host}:{args.port} ({err.strerror or err}); "
                          "choose another --port or --host") from None
    return 0


ENV_KINDS = ("metaworld",)


def cmd_rollout(args) -> int:
    kind, _, names = args.env.partition(":")
    if kind not in ENV_KINDS or not names:
        raise UsageError(f"--env {args.env!r}: give KIND:TASK[,TASK...] with KIND one of {', '.join(ENV_KINDS)} "
                         "(e.g. metaworld:reach-v3,drawer-close-v3)")
    if (args.policy == "run") != (args.run_dir is not None):
        raise UsageError("give RUN_DIR (a π0 run) or --policy expert, not both" if args.run_dir else
                         "give RUN_DIR (a π0 run), or --policy expert for Meta-World's scripted expert")
    video_dir = Path(args.video) if args.video else None
    if video_dir is not None and video_dir.exists() and not video_dir.is_dir():
        raise UsageError(f"--video {args.video!r}: not a directory")
    from zerojax import sim

    sim.require()
    from zerojax.sim import metaworld, rollout

    tasks = [t for t in names.split(",") if t]
    metaworld.check_tasks(tasks)
    if args.policy == "expert":
        policy, size, n_action_steps, where = rollout.expert, args.size, 1, "Meta-World's scripted expert"
    else:
        from zerojax.serve import policy as served_lib

        served = served_lib.load(Path(args.run_dir), args.step, args.num_steps, args.seed)
        size = metaworld.check_features(served.features, served.where)
        n_action_steps = args.n_action_steps or served.action["horizon"]
        if n_action_steps > served.action["horizon"]:
            raise UsageError(f"--n-action-steps {n_action_steps}: the run's chunks hold {served.action['horizon']} "
                             "actions (model.action.horizon)")

        def policy(obs, request, env):
            return served.infer({k: v for k, v in obs.items() if k in served.expected_keys}, request)["actions"]

        where = served.where
    print(f"zerojax: rollout of {where} on {', '.join(tasks)}: {args.episodes} episodes each from seed {args.seed}, "
          f"{n_action_steps} actions a chunk", file=sys.stderr)
    start = time.perf_counter()
    results = rollout.run(policy, tasks, args.episodes, args.seed, n_action_steps, size, video_dir, args.videos,
                          args.max_steps, progress=not args.no_progress)
    doc = rollout.summary(results)
    print(f"zerojax: {len(tasks) * args.episodes} episodes in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if args.json:
        print(json.dumps(doc))
    else:
        for task, r in doc["tasks"].items():
            print(f"{task:32s} {r['successes']:4d}/{r['episodes']:<4d} {100 * r['success_rate']:6.1f}%")
        print(f"{'mean success rate':32s} {'':9s} {100 * doc['mean_success_rate']:6.1f}%")
        if video_dir is not None:
            print(f"videos: {video_dir}")
    return 0


def cmd_report(args) -> int:
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UsageError(f"--out {args.out!r}: directory {str(out.parent)!r} does not exist")
    runs = [report.read_run(Path(d)) for d in args.run_dirs]  # every RUN_DIR checked before anything is written
    for i, run in enumerate(runs):
        if run.analysis is None and not args.no_analyze:
            print(f"zerojax: analyzing {run.path}: compiling the step of stages 0-3 (kept in "
                  f"{run.path / report.ANALYSIS})", file=sys.stderr)
            start = time.perf_counter()
            try:
                runs[i] = report.analyze_run(run)
            except ConfigError as err:  # e.g. its data file is not where the run found it: the curves still show
                print(f"zerojax: warning: no measured bars for {run.path}: {err}", file=sys.stderr)
                continue
            print(f"zerojax: analyzed {run.path} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    size = report.write_page(runs, out)
    print(f"zerojax: wrote {out} ({size / 1e3:.0f} kB)")
    return 0


def cmd_formats(args) -> int:
    if not args.values and not args.table:
        raise UsageError("give values to store (e.g. zerojax formats 0.1 70000 1e-8) or --table")
    doc = formats.explain(args.values)
    if args.table:
        doc = {**({"values": doc["values"]} if args.values else {}), "formats": formats.table()}
    report.emit(doc, args.json, report.formats_tables)
    return 0


def cmd_tokenizer(args) -> int:
    if args.source != "stdlib" and Path(args.source).suffix != ".txt":
        raise UsageError(f"SOURCE {args.source!r} must be stdlib or a .txt file")
    path = data.train_tokenizer(args.source, args.vocab_size, Path(args.out))
    print(f"zerojax: wrote {path}: byte-level BPE, vocab {args.vocab_size}, trained on {args.source}; "
          f"use data.tokenizer={path} model.vocab_size={args.vocab_size}")
    return 0


COMMANDS = {"train": cmd_train, "generate": cmd_generate, "tokenizer": cmd_tokenizer, "memory": cmd_memory,
            "analyze": cmd_analyze, "plan": cmd_plan, "export": cmd_export,
            "serve": cmd_serve, "rollout": cmd_rollout, "formats": cmd_formats, "report": cmd_report}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="zerojax: %(levelname)s: %(message)s", level=logging.WARNING)
    logging.addLevelName(logging.WARNING, "warning")
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except (UsageError, ConfigError) as err:
        print(f"zerojax: error: {err}", file=sys.stderr)
        return 2
    except (DistributedError, TrainingError) as err:
        print(f"zerojax: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("zerojax: interrupted", file=sys.stderr)
        return 130
