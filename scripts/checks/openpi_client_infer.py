"""Drive a policy server with openpi's own client: `openpi_client.websocket_client_policy.
WebsocketClientPolicy` from the `openpi-client` package on PyPI (tests/test_serve.py runs it
against `zerojax serve`).

openpi-client 0.1.2 pins numpy < 2, which zerojax's jax cannot share, so this runs in a venv of
its own, never zerojax's (tests/test_serve.py builds and caches it):

    python3 -m venv VENV && VENV/bin/pip install 'openpi-client==0.1.2' typing_extensions
    VENV/bin/python scripts/checks/openpi_client_infer.py --port PORT OBSERVATIONS.npz

OBSERVATIONS.npz holds observation i's arrays as "i/KEY" and its prompt as "i/prompt" (a str
array). The client connects, reads the server's metadata, sends the observations in order, then
one it builds from the metadata alone (zeros of each key's shape and dtype, an empty prompt),
then, on a connection of its own, observation 0 without its first key (the server must answer
it with an error, which openpi's client raises as a RuntimeError). Prints one JSON document:
{"openpi_client", "numpy", "metadata", "actions": [[H, D] as lists, ...], "from_metadata":
{"shape", "dtype"}, "error": the RuntimeError's text}.
"""

import argparse
import json
from importlib import metadata as package_metadata

import numpy as np
from openpi_client import websocket_client_policy


def observations(path: str) -> list[dict]:
    with np.load(path, allow_pickle=False) as npz:
        out: dict = {}
        for name in npz.files:
            i, key = name.split("/", 1)
            value = npz[name]
            out.setdefault(int(i), {})[key] = str(value) if key == "prompt" else value
    return [out[i] for i in sorted(out)]


def jsonable(x):
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    return x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("observations")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--api-key")
    a = p.parse_args()
    obs = observations(a.observations)
    policy = websocket_client_policy.WebsocketClientPolicy(host=a.host, port=a.port, api_key=a.api_key)
    meta = policy.get_server_metadata()
    actions = [policy.infer(o)["actions"] for o in obs]
    blank = {key: np.zeros(spec["shape"], spec["dtype"]) for key, spec in meta["observation"].items()
             if spec["dtype"] != "str"}
    blank["prompt"] = ""
    from_meta = policy.infer(blank)["actions"]
    broken = dict(obs[0])
    broken.pop(next(iter(broken)))
    try:
        websocket_client_policy.WebsocketClientPolicy(host=a.host, port=a.port, api_key=a.api_key).infer(broken)
        error = None
    except RuntimeError as err:
        error = str(err)
    print(json.dumps({"openpi_client": package_metadata.version("openpi-client"), "numpy": np.__version__,
                      "metadata": jsonable(meta), "actions": [x.tolist() for x in actions],
                      "actions_dtype": str(actions[0].dtype),
                      "from_metadata": {"shape": list(from_meta.shape), "dtype": str(from_meta.dtype)},
                      "error": error}))


if __name__ == "__main__":
    main()
