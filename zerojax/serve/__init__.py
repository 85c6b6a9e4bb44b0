"""`zerojax serve`: a policy run (π0's today) behind openpi's websocket protocol, so that openpi's
`WebsocketClientPolicy` (and the robot runtimes built on it) can drive it.

    wire.py    msgpack with numpy arrays, as openpi_client.msgpack_numpy encodes them
    policy.py  an observation in, an action chunk out, through training's own row functions
    server.py  the websocket server (the `websockets` library's asyncio server)
    client.py  `zerojax client`: one observation sent as openpi's client sends it, the chunk timed

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
