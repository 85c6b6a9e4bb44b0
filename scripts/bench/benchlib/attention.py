"""`attention`: model.attention's implementations side by side in one process, at each sequence
length (BENCHMARKS.md's long-sequence table): tokens/s and the compiled peak of each."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from zerojax import config as config_lib

from benchlib import write_json
from benchlib.measure import device_info, throughput


def attention_main(opts) -> int:
    cfg = config_lib.load(opts.config, opts.overrides)
    rows = []
    for seq_len in (int(s) for s in opts.seqs.split(",")):
        for impl in opts.impls.split(","):  # interleaved: each pair shares the machine's state
            model = dataclasses.replace(cfg.model, seq_len=seq_len, attention=impl)
            row = throughput(dataclasses.replace(cfg, model=model), opts)
            row.pop("peak_bytes_in_use")  # the process's peak so far, not this configuration's
            rows.append({"seq_len": seq_len, "attention": impl, **row})
            print(json.dumps({k: rows[-1][k] for k in ("seq_len", "attention", "tokens_per_sec", "step_s",
                                                       "analyze_peak_bytes", "loss") if k in rows[-1]}), flush=True)
    if opts.out:
        write_json(Path(opts.out), {"rows": rows, "overrides": opts.overrides, **device_info()})
    return 0
