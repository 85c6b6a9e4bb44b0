"""`stages`: every stage and schedule in one process (BENCHMARKS.md's CPU table)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from zerojax import config as config_lib
from zerojax.analysis import measure as measure_lib

from benchlib import write_json
from benchlib.measure import device_info, throughput


def stages_main(opts) -> int:
    cfg = config_lib.load(opts.config, opts.overrides)
    rows = []
    for schedule in opts.schedules.split(","):
        for stage in (int(s) for s in opts.stages.split(",")):
            zero = dataclasses.replace(cfg.zero, stage=stage, schedule=schedule)
            row = throughput(dataclasses.replace(cfg, zero=zero), opts)
            row.pop("peak_bytes_in_use")  # the process's peak so far, not this configuration's
            rows.append({"schedule": schedule, "stage": stage, **row})
            print(json.dumps(rows[-1]), flush=True)
    doc = {"rows": rows, "summary": stages_summary(cfg, rows), "overrides": opts.overrides, **device_info()}
    print(json.dumps(doc["summary"], indent=1))
    if opts.out:
        write_json(Path(opts.out), doc)
    return 0


def stages_summary(cfg, rows: list[dict]) -> dict:
    by = {(r["schedule"], r["stage"]): r for r in rows}
    ratio = lambda a, b, key: by[a][key] / by[b][key] if a in by and b in by else None
    compile_s = {}
    for n in (2, 16):  # the blocks are a lax.scan: compile time should not grow with depth
        start = time.perf_counter()
        measure_lib.compile_step(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=n)))
        compile_s[n] = time.perf_counter() - start
    return {"compile_s_2_layers": compile_s[2], "compile_s_16_layers": compile_s[16],
            "compile_16_over_2": compile_s[16] / compile_s[2],
            **{f"{s}_stage3_over_stage0_tokens_per_sec": ratio((s, 3), (s, 0), "tokens_per_sec")
               for s in ("shard_map", "gspmd")},
            "shard_map_over_gspmd_stage3_bytes": ratio(("shard_map", 3), ("gspmd", 3), "comm_bytes"),
            "shard_map_over_gspmd_stage3_temp": ratio(("shard_map", 3), ("gspmd", 3), "temp_bytes")}
