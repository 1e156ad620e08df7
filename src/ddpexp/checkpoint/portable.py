"""Callback state as a checkpoint holds it: only what ``torch.load(weights_only=True)`` reads.

A callback's ``state_dict()`` may hold tensors, plain Python data (``dict``, ``OrderedDict``,
``list``, ``tuple``, ``set``, ``str``, ``bytes``, ``int``, ``float``, ``complex``, ``bool``,
``None``, torch's dtypes, devices and sizes) and numpy arrays and scalars. torch's safe
loader builds no numpy object, so each array or scalar is saved as a tagged dict around a
tensor, which any ``torch.load(path, weights_only=True)`` reads::

    {"__ddpexp_numpy__": "array" or "scalar", "dtype": "<f4", "shape": [2, 3], "data": tensor}

``data`` has the array's own dtype where torch has one (bool, integers, floats, complex),
else it holds the array's bytes (``uint8``: strings, datetimes). :func:`encode` refuses
anything else with the key that holds it, when the checkpoint is gathered (so the first save
of a run fails, not its end); :func:`decode` gives the arrays and scalars back on resume.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np  # torch imports it already
import torch

from ddpexp.errors import ConfigError

TAG = "__ddpexp_numpy__"
# What torch's safe loader builds as it is (exact types: a subclass, such as an IntEnum or
# numpy's float64, pickles as its own class, which the loader refuses).
_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype,
           torch.device, torch.Size)
# numpy dtype kinds torch has a tensor dtype for: bool, signed, unsigned, float, complex.
_TENSOR_KINDS = "biufc"
_ALLOWED = ("tensors, numpy arrays and scalars, and plain Python data (dict, list, tuple, "
            "set, str, bytes, int, float, bool, None)")


def encode(value: Any, where: str) -> Any:
    """``value`` (a callback's ``state_dict()``) with every numpy array and scalar tagged as
    a tensor. Anything a safe load could not read back is a :class:`ConfigError` naming
    ``where`` (``callbacks.NAME``) and the key that holds it."""
    return _encode(value, where, "")


def _encode(value: Any, where: str, path: str) -> Any:
    kind = type(value)
    if isinstance(value, torch.Tensor) or kind in _LEAVES:
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        return _tag(value, where, path)
    if kind in (dict, OrderedDict):
        return kind((_key(k, where, path), _encode(v, where, f"{path}[{k!r}]"))
                    for k, v in value.items())
    if kind in (list, tuple):
        return kind(_encode(v, where, f"{path}[{i}]") for i, v in enumerate(value))
    if kind is set:
        for v in value:
            _key(v, where, path)
        return value
    raise _refused(where, path, f"a {_name(kind)}")


def _key(key: Any, where: str, path: str) -> Any:
    """A dict key or set member: a leaf (or a tuple of them) as it is."""
    parts = key if type(key) is tuple else (key,)
    for part in parts:
        if type(part) not in _LEAVES:
            hint = " (as a key: convert it, e.g. int(k))" if isinstance(part, np.generic) else ""
            raise _refused(where, path, f"the key {part!r}, a {_name(type(part))}{hint}")
    return key


def _tag(value: Any, where: str, path: str) -> dict:
    array = np.asarray(value)
    dtype = array.dtype
    if dtype.hasobject or dtype.fields is not None:
        raise _refused(where, path, f"a numpy array of dtype {dtype}")
    array = array.copy(order="C")  # (np.ascontiguousarray would make a scalar 1-d)
    if dtype.kind in _TENSOR_KINDS:
        data = torch.from_numpy(array.astype(dtype.newbyteorder("="), copy=False))
    else:  # strings, datetimes: their bytes
        data = torch.frombuffer(bytearray(array.tobytes()), dtype=torch.uint8)
    return {TAG: "array" if isinstance(value, np.ndarray) else "scalar", "dtype": dtype.str,
            "shape": list(array.shape), "data": data}


def decode(value: Any) -> Any:
    """What :func:`encode` tagged, as numpy arrays and scalars again; the rest as it is."""
    kind = type(value)
    if kind in (dict, OrderedDict):
        if TAG in value:
            return _untag(value)
        return kind((k, decode(v)) for k, v in value.items())
    if kind in (list, tuple):
        return kind(decode(v) for v in value)
    return value


def _untag(tagged: dict) -> Any:
    dtype = np.dtype(tagged["dtype"])
    data = tagged["data"].cpu()
    if dtype.kind in _TENSOR_KINDS:
        array = data.numpy().astype(dtype, copy=False)
    else:
        array = np.frombuffer(data.numpy().tobytes(), dtype=dtype)
    array = array.reshape(tagged["shape"])
    return array[()] if tagged[TAG] == "scalar" else array.copy()


def _refused(where: str, path: str, what: str) -> ConfigError:
    key = f"state_dict(){path}" if path else "state_dict()"
    return ConfigError(
        f"{where}: {key} holds {what}, which a checkpoint cannot hold (checkpoints are read "
        f"with torch.load(weights_only=True)). Keep {_ALLOWED} in a callback's state")


def _name(kind: type) -> str:
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"
