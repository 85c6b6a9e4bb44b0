"""Benchmark the train step per ZeRO stage and schedule: tokens/s, step time, compile time
(2 vs 16 layers), bytes sent vs DESIGN §2, and peak memory per device.

    python scripts/bench.py [--steps 20] [--stages 0,3] [--schedules shard_map,gspmd]
                            [--peak-tflops 989] [--xla-preset gpu] [--out bench.json] [KEY=VALUE ...]

On CPU (8 simulated devices on a few cores) absolute times are noise; compare the ratios
(stage 3 / stage 0 tokens/s, compile 16 / 2 layers). BENCHMARKS.md records runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax


from zerojax import accounting, config, data, mesh, train  # noqa: E402  (after the argparse docs)


def timed_compile(cfg):
    setup = train.prepare(cfg)
    state = train.init_state(setup, abstract=True)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), "int32",
                                 sharding=mesh.batch_sharding(setup.mesh))
    start = time.perf_counter()
    compiled = train.make_train_step(setup, state).lower(state, batch).compile()
    return setup, compiled, time.perf_counter() - start


def throughput(setup, compiled, steps: int) -> dict:
    state = train.init_state(setup)
    batches = [train.global_batch(setup, setup.corpus.train, data.TRAIN, i) for i in range(steps + 2)]
    for b in batches[:2]:  # warm-up
        state, metrics = compiled(state, b)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for b in batches[2:]:
        state, metrics = compiled(state, b)
    jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - start) / steps
    tokens = setup.cfg.train.global_batch * setup.cfg.model.seq_len
    return {"step_s": step_s, "tokens_per_sec": tokens / step_s}


def with_zero(cfg, **zero):
    return dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, **zero))


def with_layers(cfg, n_layers: int):
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=n_layers))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--schedules", default="shard_map,gspmd")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense peak, for MFU (H200 bf16: 989)")
    parser.add_argument("--xla-preset", help="e.g. gpu (zerojax.mesh.XLA_PRESETS)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.xla_preset:
        mesh.apply_xla_preset(args.xla_preset)
    cfg = config.load(args.config, args.overrides)
    params = accounting.count_params(cfg)
    flops = accounting.flops_per_token(params, cfg.model.n_layers, cfg.model.seq_len, cfg.model.d_model)
    schedules, stages = args.schedules.split(","), [int(s) for s in args.stages.split(",")]
    rows = []
    for schedule in schedules:
        for stage in stages:
            setup, compiled, compile_s = timed_compile(with_zero(cfg, stage=stage, schedule=schedule))
            report = accounting.stage_report(setup, compiled, params)
            rows.append({"schedule": schedule, "stage": stage, "compile_s": compile_s,
                         **throughput(setup, compiled, args.steps),
                         "comm_bytes": report["comm_bytes"], "comm_theory_bytes": report["comm_theory_bytes"],
                         "peak_bytes": accounting.peak_bytes(report), "temp_bytes": report["temp_bytes"],
                         "argument_bytes": report["argument_bytes"]})
            if args.peak_tflops:  # model FLOPs utilisation, summed over the devices
                rows[-1]["mfu"] = rows[-1]["tokens_per_sec"] * flops / (args.peak_tflops * 1e12 * jax.device_count())
            print(json.dumps(rows[-1]), flush=True)
    compile_s = {n: timed_compile(with_layers(cfg, n))[2] for n in (2, 16)}
    by = {(r["schedule"], r["stage"]): r for r in rows}
    ratio = lambda a, b, key: by[a][key] / by[b][key] if a in by and b in by else None
    summary = {
        "params": params, "flops_per_token": flops, "devices": jax.device_count(),
        "platform": jax.devices()[0].platform, "jax": jax.__version__,
        "compile_s_2_layers": compile_s[2], "compile_s_16_layers": compile_s[16],
        "compile_16_over_2": compile_s[16] / compile_s[2],
        "stage3_over_stage0_tokens_per_sec": {s: ratio((s, 3), (s, 0), "tokens_per_sec") for s in schedules},
        "shard_map_over_gspmd_stage3_bytes": ratio(("shard_map", 3), ("gspmd", 3), "comm_bytes"),
        "shard_map_over_gspmd_stage3_temp": ratio(("shard_map", 3), ("gspmd", 3), "temp_bytes"),
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "summary": summary, "overrides": args.overrides}, f, indent=1)


if __name__ == "__main__":
    main()
