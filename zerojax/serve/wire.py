"""The messages of openpi's policy protocol: msgpack with numpy arrays, as openpi's
`openpi_client.msgpack_numpy` writes them (its own small variant of lebedov's msgpack-numpy,
which never falls back to pickle).

A numpy array is a msgpack map with bytes keys, its data raw in C order:

    {b"__ndarray__": True, b"data": <bytes>, b"dtype": "<f4", b"shape": [H, W, 3]}

and a numpy scalar `{b"__npgeneric__": True, b"data": <the value>, b"dtype": "<f4"}`; everything
else is plain msgpack (maps, lists, str, bytes, numbers). Arrays of objects, void records and
complex numbers are refused both ways: nothing a peer sends can make this code build Python
objects, and nothing is unpickled. Written here so that zerojax serves openpi's clients without
depending on `openpi_client` (which pins numpy < 2).
"""

from __future__ import annotations

import msgpack
import numpy as np

REFUSED_KINDS = "VOc"  # void (records), objects, complex: openpi's pack_array refuses the same


class WireError(ValueError):
    """A message that is not msgpack-numpy (malformed, or an array that cannot be rebuilt)."""


def _encode(obj):
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in REFUSED_KINDS:
        raise WireError(f"numpy dtype {obj.dtype} cannot be sent (object, void and complex arrays are refused)")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send a {type(obj).__name__} (msgpack, numpy arrays and scalars only)")


def _decode(obj: dict):
    if b"__ndarray__" not in obj and b"__npgeneric__" not in obj:
        return obj
    try:
        dtype = np.dtype(obj[b"dtype"])
        if dtype.kind in REFUSED_KINDS:
            raise WireError(f"numpy dtype {dtype} is refused (object, void and complex arrays)")
        if b"__ndarray__" in obj:
            return np.ndarray(buffer=obj[b"data"], dtype=dtype, shape=tuple(obj[b"shape"]))
        return dtype.type(obj[b"data"])
    except WireError:
        raise
    except (KeyError, TypeError, ValueError) as err:  # no dtype, an unknown dtype, data of the wrong size
        raise WireError(f"a numpy array that cannot be rebuilt ({type(err).__name__}: {err})") from None


def pack(obj) -> bytes:
    """`obj` (dicts, lists, str, numbers, numpy arrays and scalars) as one msgpack-numpy message."""
    return msgpack.packb(obj, default=_encode)


def unpack(message: bytes):
    """One msgpack-numpy message back (arrays read-only, over the message's bytes); WireError
    where it is not one."""
    if not isinstance(message, (bytes, bytearray, memoryview)):
        raise WireError(f"expected a binary msgpack frame, got a {type(message).__name__} frame")
    try:
        return msgpack.unpackb(message, object_hook=_decode)
    except WireError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as err:  # ExtraData, FormatError, StackError...
        raise WireError(f"not a msgpack message ({type(err).__name__}: {err})") from None
