"""`zerojax client`: ask a running `zerojax serve` (or any server of openpi's websocket policy
protocol) for one action chunk, from a LeRobot dataset's frame or a saved observation, and print
the actions beside the dataset's own and the round trip's latency (zerojax.serve.client). Needs
the serve extra's websockets and msgpack, and no jax."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from zerojax.cli.args import Parser, UsageError, port_number

HELP = ("ask a running `zerojax serve` of a policy (π0, π0.5, SmolVLA) for one action chunk (a LeRobot dataset's "
        "frame, or a saved observation)")


def arguments(client: Parser) -> None:
    client.add_argument("--host", default="127.0.0.1", help="the server's address (default 127.0.0.1)")
    client.add_argument("--port", type=port_number, default=8000, help="the server's port (default 8000, openpi's)")
    client.add_argument("--api-key", metavar="KEY", help="sent as Authorization: Api-Key KEY (default: "
                        "$ZEROJAX_API_KEY, else none)")
    client.add_argument("--from", dest="source", metavar="lerobot:DIR", help="a LeRobot dataset: the observation "
                        "is its frame --frame, with the cameras the server asks for")
    client.add_argument("--frame", type=int, default=0, metavar="N", help="--from: the dataset index (default 0)")
    client.add_argument("--observation", metavar="FILE.npz", help="an observation --save wrote, instead of --from")
    client.add_argument("--dataset", metavar="NAME", help="a mixture run's server: the dataset the observation is "
                        "of (default with --from: the one of the server's datasets lerobot:DIR is)")
    client.add_argument("--save", metavar="FILE.npz", help="also save the observation sent, for --observation")
    client.add_argument("--json", action="store_true", help="print one JSON document")


def run(args) -> int:
    import os

    from zerojax import serve

    if (args.source is None) == (args.observation is None):
        raise UsageError("give --from lerobot:DIR (with --frame N) or --observation FILE.npz, one of the two")
    serve.require()
    from zerojax.serve import client

    api_key = args.api_key or os.environ.get("ZEROJAX_API_KEY") or None
    with client.Connection(args.host, args.port, api_key) as connection:
        if args.source:
            obs, expected = client.dataset_frame(args.source, args.frame, connection.metadata, args.dataset)
        else:
            obs, expected = client.load(Path(args.observation)), None
            obs.update({client.DATASET: args.dataset} if args.dataset else {})
        if args.save:
            client.save(obs, Path(args.save))
        answer = connection.infer(obs)
    doc = {"server": connection.url, "policy": connection.metadata.get("policy"), "prompt": obs.get("prompt"),
           "actions": answer.actions.tolist(), "dataset_actions": None if expected is None else expected.tolist(),
           "latency_s": answer.latency_s}
    print(json.dumps(doc) if args.json else "\n".join(lines(doc, answer.actions, expected)))
    return 0


def lines(doc: dict, actions: np.ndarray, expected: np.ndarray | None) -> list[str]:
    """The chunk, one step a line, served beside the dataset's own where there is one."""
    out = [f"{doc['server']} ({doc['policy']}), prompt {doc['prompt']!r}: {actions.shape[0]} actions of "
           f"{actions.shape[1]}, in {doc['latency_s'] * 1e3:.1f} ms (one round trip)"]
    out.append("step  served" + ("  |  dataset" if expected is not None else ""))
    for t, row in enumerate(actions):
        theirs = f"  |  {_row(expected[t])}" if expected is not None and t < len(expected) else ""
        out.append(f"{t:>4}  {_row(row)}{theirs}")
    if expected is not None:
        steps = min(len(expected), len(actions))
        gap = np.abs(actions[:steps] - expected[:steps]).mean()
        out.append(f"mean |served - dataset| over {steps} steps: {gap:.4g}"
                   + (f" (the dataset's episode ends after {steps})" if steps < len(actions) else ""))
    return out


def _row(values: np.ndarray) -> str:
    return " ".join(f"{v:+9.4f}" for v in values)
