"""`zerojax serve`: a policy (π0, π0.5 or SmolVLA) over openpi's websocket protocol. Needs the serve extra
(websockets, msgpack), checked before a model is loaded."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from zerojax.cli.args import Parser, port_number, positive_int
from zerojax.errors import ConfigError

HELP = "a policy run's (π0, π0.5, SmolVLA) actions over openpi's websocket protocol (openpi's WebsocketClientPolicy connects to it)"


def arguments(serve: Parser) -> None:
    serve.add_argument("run_dir", metavar="RUN_DIR", help="a policy run (π0, π0.5 or SmolVLA) trained on "
                       "data.source=lerobot:DIR, the FILE.safetensors `zerojax export` wrote of one, or a LeRobot "
                       "checkpoint directory of one of those families")
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
    serve.add_argument("--max-connections", type=positive_int, default=64, metavar="N",
                       help="connections served at once; more are refused with 503 until one closes (default 64)")
    serve.add_argument("--max-batch", type=positive_int, default=1, metavar="N",
                       help="requests from different connections sampled in one call when they wait together "
                            "(default 1: one at a time, as openpi's server; the batch sizes 1, 2, 4 .. N are "
                            "compiled at start)")
    serve.add_argument("--rtc-jacobian", action="store_true", help="real-time chunking's correction pulled back "
                     "through the denoiser (the paper's, one vector-Jacobian product a step) instead of LeRobot's")
    serve.add_argument("--tokenizer", metavar="PATH", help="a LeRobot checkpoint: the tokenizer.json of its prompts "
                       "(default: the one its processors or config name, where that is a local directory; "
                       "LeRobot's π0 fetches PaliGemma's from the Hub, and its directory holds none)")
    serve.add_argument("--vision-heads", type=positive_int, metavar="N", help="a LeRobot checkpoint: the tower's "
                       "attention heads, which its config.json does not name (a zerojax export records them in "
                       "zerojax.json; otherwise default 16, So400m's)")


def run(args) -> int:
    from zerojax import serve

    serve.require()  # the extra, before a model is loaded
    from zerojax.serve import loaders, server

    try:  # the cheap check first: a port in use is said before the model is loaded and compiled
        sock = server.bind(args.host, args.port)
    except OSError as err:  # the address is taken, or not this machine's
        raise ConfigError(f"cannot listen on {args.host}:{args.port} ({err.strerror or err}); "
                          "choose another --port or --host") from None
    with sock:
        served = loaders.load(Path(args.run_dir), args.step, args.num_steps, args.seed, args.tokenizer,
                             args.vision_heads, args.max_batch, args.rtc_jacobian)
        print(f"zerojax: serving {served.where}: sample_actions compiled in {served.compile_s:.1f} s, "
              f"then {served.call_ms:.1f} ms a call ({args.num_steps} steps)", file=sys.stderr)
        return serve_on(served, sock, args)


def serve_on(served, sock, args) -> int:
    from zerojax.serve import server

    api_key = args.api_key or os.environ.get("ZEROJAX_API_KEY") or None

    def listening(port: int) -> None:
        print(f"zerojax: listening on ws://{args.host}:{port} (openpi's websocket policy protocol"
              f"{', API key required' if api_key else ''}; GET /healthz)", flush=True)

    limits = server.Limits(max_connections=args.max_connections)
    server.PolicyServer(served, args.host, args.port, api_key, sock=sock, limits=limits).serve_forever(listening)
    return 0
