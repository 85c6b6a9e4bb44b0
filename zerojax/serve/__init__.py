"""`zerojax serve`: a policy run (π0, π0.5, SmolVLA) behind openpi's websocket protocol, so that openpi's
`WebsocketClientPolicy` (and the robot runtimes built on it) can drive it.

    wire.py         msgpack with numpy arrays, as openpi_client.msgpack_numpy encodes them
    observation.py  an observation checked, normalized and tokenized through training's own row
                    functions, and the actions back in the robot's units (openpi's transforms)
    policy.py       the model between them: sample_actions jitted, real-time chunking, batches
                    padded to a few compiled sizes, the warm-up (openpi's `Policy`)
    mixture.py      a mixture run's observations: each request names its dataset, read and
                    answered with that dataset's statistics, cameras and widths
    loaders.py      a run directory, an export or a LeRobot policy directory, served
                    (openpi's `create_trained_policy`)
    server.py       the websocket server (the `websockets` library's asyncio server)
    client.py       `zerojax client`: one observation sent as openpi's client sends it, the chunk timed

Serving needs the `serve` extra (websockets, msgpack): `require` checks it, so that nothing
here is imported by `import zerojax`.
"""

from zerojax.errors import ConfigError

EXTRA = ("websockets", "msgpack")


def require() -> None:
    """ConfigError naming the install command where the serve extra is missing."""
    import importlib

    for name in EXTRA:
        try:
            importlib.import_module(name)
        except ImportError:
            raise ConfigError(f"zerojax serve needs the {name} package (the serve extra): "
                              "pip install 'zerojax[serve]'") from None
