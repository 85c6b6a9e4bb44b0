"""Host memory and time of Hugging Face import and export (issue: bounded by the largest tensor).

    python scripts/bench/bench_hf_memory.py import HF_DIR [KEY=VALUE ...]   # onto 8 simulated devices, stage 3
    python scripts/bench/bench_hf_memory.py save HF_DIR RUN_DIR            # a zerojax checkpoint of HF_DIR (setup)
    python scripts/bench/bench_hf_memory.py export RUN_DIR OUT --format hf|safetensors

Each prints one JSON line: the process's resident memory before the measured call (the fixed
baseline: Python, jax, zerojax and the backend), its peak during the call (`ru_maxrss`), the
bytes the call leaves on the devices (on a CPU backend, device memory is host memory, so it is
subtracted: what is left is the host memory the conversion itself needed), the largest tensor,
and the wall time. Make a 124M GPT-2-shaped checkpoint with scripts/fixtures/make_hf_fixtures.py
--gpt2-small DIR (torch venv).
"""

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from zerojax.interop import hf
from zerojax.interop import safetensors as safetensors_io
from zerojax.train import checkpoint
from zerojax.train import export as export_lib

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def largest(hf_dir: str) -> int:
    """Bytes of the checkpoint's largest tensor, in fp32."""

    return 4 * max(math.prod(s) for s in safetensors_io.Checkpoint.of_directory(hf_dir).shapes.values())


def setup_for(hf_dir: str, overrides: list[str], out_dir: str):
    from zerojax import config, train

    cfg = config.load(overrides=[f"model.init_from={hf_dir}", "train.global_batch=8", "model.seq_len=128",
                                 f"train.out_dir={out_dir}", *overrides])
    return train.prepare(cfg)


def cmd_import(hf_dir: str, *overrides: str):
    import jax


    setup = setup_for(hf_dir, list(overrides), "/tmp/bench_hf_unused")
    step = setup.engine
    before, start = rss(), time.perf_counter()
    params = hf.init_params(hf_dir, step.plan, step.mesh, setup.cfg.model.family, step.units.names)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    on_devices = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
    report("import", before, on_devices, largest(hf_dir), seconds)


def cmd_save(hf_dir: str, run_dir: str):
    from zerojax import config, train

    setup = setup_for(hf_dir, [], run_dir)
    state = train.start_state(setup, None, None, None)
    mgr = checkpoint.manager(Path(run_dir), 1)
    checkpoint.save(mgr, setup.engine.plan, setup.engine.mesh, state, 0, config.to_dict(setup.cfg))
    mgr.wait_until_finished()
    mgr.close()


def cmd_export(run_dir: str, out: str, _flag: str, fmt: str):

    before, start = rss(), time.perf_counter()
    done = export_lib.export(Path(run_dir), Path(out), "float32", None, fmt)
    seconds = time.perf_counter() - start
    report(f"export --format {fmt}", before, 0, done["largest_leaf_bytes"], seconds)


def report(what: str, before: int, on_devices: int, largest_bytes: int, seconds: float):
    added = peak() - before - on_devices
    print(json.dumps({"what": what, "baseline_rss_bytes": before, "peak_rss_bytes": peak(),
                      "left_on_devices_bytes": on_devices, "added_host_bytes": added,
                      "largest_tensor_bytes": largest_bytes,
                      "added_over_largest": round(added / largest_bytes, 3) if largest_bytes else None,
                      "seconds": round(seconds, 2)}))


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    {"import": cmd_import, "save": cmd_save, "export": cmd_export}[sys.argv[1]](*sys.argv[2:])
