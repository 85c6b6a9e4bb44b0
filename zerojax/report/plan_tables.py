"""`zerojax plan`'s terminal output: the ranked candidates, the winner's overrides, and why
each faster candidate did not fit."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from zerojax.report.tables import human_bytes

__all__ = ["plan_tables"]
SHOWN = 20  # rows and reasons shown; --json lists every candidate


def plan_tables(doc: dict):
    yield _ranked(doc)
    winner = doc["winner"]
    if winner is None:
        yield from _nothing_fits(doc)
        return
    yield Text(f"winner: {_key(winner)}: peak {human_bytes(winner['peak_bytes'])} of a {human_bytes(doc['budget_bytes'])}"
               f" budget, about {winner['step_s']:.3g} s a step, {winner['tokens_per_sec']:,.0f} tokens/s, "
               f"MFU {winner['mfu']:.0%} (estimated for {doc['devices']} x {doc['device']})")
    yield Text(f"train with: {doc['train_command']}")
    faster = [c for c in doc["candidates"] if c["step_s"] < winner["step_s"] and not c["fits"]]
    if faster:
        yield Text(f"why the {len(faster)} faster candidates do not fit:")
        for c in faster[:SHOWN]:
            yield Text(f"  {_key(c)} ({c['step_s']:.3g} s): {c['why']}")
        if len(faster) > SHOWN:
            yield Text(f"  ... and {len(faster) - SHOWN} more (--json lists every candidate)")


def _ranked(doc: dict) -> Table:
    hosts = f" over {doc['hosts']} hosts" if doc["hosts"] > 1 else ""
    table = Table(title=f"zerojax plan: {doc['config']} on {doc['devices']} x {doc['device']}{hosts}, budget "
                        f"{human_bytes(doc['budget_bytes'])} per device; {doc['compiles']} steps compiled")
    for column in ("candidate", "fits", "peak/device", "step (est.)", "tokens/s", "MFU"):
        table.add_column(column, justify="left" if column == "candidate" else "right", no_wrap=column != "candidate")
    compiled = [c for c in doc["candidates"] if c["compiled"]]
    for c in sorted(compiled, key=lambda c: c["step_s"])[:SHOWN]:
        table.add_row(_key(c), "yes" if c["fits"] else "no", human_bytes(c["peak_bytes"]), f"{c['step_s']:.3g} s",
                      f"{c['tokens_per_sec']:,.0f}", f"{c['mfu']:.0%}")
    return table


def _key(c: dict) -> str:
    """The six keys, short: stage 3, offload optimizer, remat full, accum 8, gather int8, prefetch 1."""
    return ", ".join(o.split(".", 1)[1].replace("grad_accum", "accum") for o in c["overrides"])


def _nothing_fits(doc: dict):
    why = doc["nothing_fits"]
    least = why["smallest_peak_bytes"]
    yield Text(f"nothing fits in {human_bytes(doc['budget_bytes'])} per device. "
               + (f"The smallest compiled peak is {human_bytes(least)} ({' '.join(why['overrides'])})"
                  if least is not None else
                  f"Even the smallest model states are {human_bytes(why['smallest_state_bytes'])} (formula)"))
    if why.get("devices"):
        yield Text(f"about {why['devices']} x {doc['device']} would fit it (its sharded model states scaled, "
                   f"formula); check with zerojax plan --devices {why['devices']}")
    elif least is not None:
        yield Text("more devices would not fit it: what stays is not sharded model state (activations, "
                   "the step's temporaries); shorten model.seq_len or the microbatch")
    if why.get("lora"):
        yield Text(f"LoRA fits: {' '.join(why['lora']['overrides'])} (compiled peak "
                   f"{human_bytes(why['lora']['peak_bytes'])})")
    elif why.get("lora_why"):
        yield Text(f"LoRA would not fit either: {why['lora_why']}")
