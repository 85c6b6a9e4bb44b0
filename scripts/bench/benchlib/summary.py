"""What a plan's JSON says, as ratios and as Markdown for BENCHMARKS.md (`bench.py summary FILE`)."""

from __future__ import annotations


def summary(doc: dict, plan) -> dict:
    """The ratios BENCHMARKS.md quotes (None where a side did not run); `plan`: the measurements
    whose baselines and quantized gathers are compared."""
    res = doc["results"]
    ok = lambda name: res.get(name, {}).get("status") == "ok" and "step_s" in res[name]
    ratio = lambda a, b, key: res[a][key] / res[b][key] if ok(a) and ok(b) else None
    out = {f"{s}_stage3_over_stage0_tokens_per_sec": ratio(f"gpt1b_s3_{s}", f"gpt1b_s0_{s}", "tokens_per_sec")
           for s in ("shard_map", "gspmd")}
    out["shard_map_over_gspmd_stage3_tokens_per_sec"] = ratio("gpt1b_s3_shard_map", "gpt1b_s3_gspmd", "tokens_per_sec")
    if ok("plan_check"):  # the plan's estimates against what its winner did
        out["plan_check_step_s_over_estimate"] = res["plan_check"]["step_s_over_plan"]
        out["plan_check_peak_over_compiled_peak"] = res["plan_check"]["peak_over_plan"]
    for m in plan:
        if m.baseline:
            out[f"{m.name}_step_s_over_{m.baseline}"] = ratio(m.name, m.baseline, "step_s")
        if m.quant_overhead:
            out[f"{m.name}_quant_overhead_of_step"] = res[m.name].get("quant_overhead_of_step") if ok(m.name) else None
    return out


def markdown(doc: dict) -> str:
    meta, res = doc["meta"], doc["results"]
    device = next((f"{e['devices']} x {e['device_kind']}, jax {e['jax']}" for e in res.values() if "jax" in e), "?")
    dry = " (dry run: CPU, tiny shapes; a rehearsal, not results)" if meta["dry_run"] else ""
    lines = [f"{meta['date']}, {device}, commit {meta['commit']}, {meta.get('elapsed_s', 0)} s{dry}",
             f"`{meta['command']}`", "",
             "| measurement | tokens/s | step | MFU | peak (memory_stats) | analyze peak | compile | wall |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [table_row(name, e) for name, e in res.items()]
    ratios = [f"- {k}: {v:.3f}" for k, v in doc.get("summary", {}).items() if v is not None]
    return "\n".join(lines + ([""] + ratios if ratios else []))


def human(n: float, unit: str = "B") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}"


def cell(value, form) -> str:
    return "-" if value is None else form(value) if callable(form) else form.format(value)


def table_row(name: str, e: dict) -> str:
    if e["status"] != "ok":
        return f"| {name} | {e['status']}: {e.get('reason') or e.get('error')} |" + " |" * 6
    found = e.get("found") or {}
    if found:
        name += (f" (fits: d_model {found['d_model']}, {found['n_layers']} layers, "
                 f"{found['params']:,} parameters; real step {'ran' if e.get('confirmed') else 'failed'})")
    cells = [name, cell(e.get("tokens_per_sec"), "{:,.0f}"), cell(e.get("step_s"), "{:.3f} s"),
             cell(e.get("mfu"), "{:.1%}"), cell(e.get("peak_bytes_in_use"), human),
             cell(e.get("analyze_peak_bytes", found.get("peak_bytes")), human),
             cell(e.get("compile_s"), "{:.1f} s"), cell(e.get("wall_s"), "{:.0f} s")]
    return "| " + " | ".join(cells) + " |"
