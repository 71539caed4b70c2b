"""Pickle-free encoding of nested training state.

State dicts are trees of dicts, lists and tuples whose leaves are tensors or
plain Python scalars.  :func:`flatten` splits such a tree into a JSON-able
*skeleton* (tensors replaced by ``{"__tensor__": i}``) and a list of tensors;
:func:`unflatten` puts it back together.  Only the node types below exist,
so loading never executes or unpickles anything.  Python's ``json`` writes
floats with ``repr`` and reads them back exactly, so scalars round-trip bit
for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.errors import SerializationError

MAX_DEPTH = 240
"""Deepest JSON nesting a skeleton may have.  Saving refuses deeper state and
loading rejects a deeper header before parsing it, so a hostile file cannot
exhaust the recursion limit (a dict level costs 3, a tuple 2, a list 1)."""

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_DICT = "__dict__"


def flatten(obj: Any, path: str = "state") -> tuple[Any, list[torch.Tensor]]:
    """Return ``(skeleton, tensors)`` for a nested state tree.

    Raises :class:`SerializationError` naming the key path of any leaf that
    is not a tensor, ``None``, bool, int, float or str.
    """
    tensors: list[torch.Tensor] = []
    skeleton = _flatten(obj, path, tensors, 0)
    return skeleton, tensors


def _flatten(obj: Any, path: str, tensors: list[torch.Tensor], depth: int) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if depth + 3 > MAX_DEPTH:
        raise SerializationError(
            f"cannot save {path}: the state nests deeper than a checkpoint allows ({MAX_DEPTH} JSON levels, "
            "about 80 nested dicts); flatten it in your state_dict()"
        )
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {_TENSOR: len(tensors) - 1}
    if isinstance(obj, dict):
        items = []
        for key, value in obj.items():
            items.append([_flatten_key(key, path), _flatten(value, f"{path}.{key}", tensors, depth + 3)])
        return {_DICT: items}
    if isinstance(obj, tuple):
        return {_TUPLE: [_flatten(v, f"{path}[{i}]", tensors, depth + 2) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_flatten(v, f"{path}[{i}]", tensors, depth + 1) for i, v in enumerate(obj)]
    item = getattr(obj, "item", None)
    if callable(item) and type(obj).__module__ == "numpy" and getattr(obj, "shape", None) == ():
        return _flatten(item(), path, tensors, depth)
    if type(obj).__module__ == "numpy" and hasattr(obj, "dtype"):
        return _flatten(torch.from_numpy(obj.copy()), path, tensors, depth)
    raise SerializationError(
        f"cannot save {path}: objects of type {type(obj).__qualname__} are not supported "
        "(checkpoints hold only tensors, numbers, strings, None, lists, tuples and dicts, "
        "so that loading never unpickles code). Convert it in your state_dict() to one of those."
    )


def _flatten_key(key: Any, path: str) -> Any:
    if key is None or isinstance(key, (bool, int, float, str)):
        return key
    if isinstance(key, tuple):
        return {_TUPLE: [_flatten_key(k, path) for k in key]}
    raise SerializationError(
        f"cannot save {path}: dict key {key!r} of type {type(key).__qualname__} is not supported; "
        "use str, int, float, bool, None or tuples of those as keys"
    )


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`flatten`; raises ``ValueError`` on a malformed skeleton."""
    if skeleton is None or isinstance(skeleton, (bool, int, float, str)):
        return skeleton
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict) and len(skeleton) == 1:
        ((tag, value),) = skeleton.items()
        if tag == _TENSOR:
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < len(tensors):
                raise ValueError(f"tensor reference {value!r} out of range")
            return tensors[value]
        if tag == _TUPLE:
            if not isinstance(value, list):
                raise ValueError("malformed tuple node")
            return tuple(unflatten(v, tensors) for v in value)
        if tag == _DICT:
            if not isinstance(value, list) or any(not isinstance(p, list) or len(p) != 2 for p in value):
                raise ValueError("malformed dict node")
            return {_unflatten_key(k): unflatten(v, tensors) for k, v in value}
    raise ValueError(f"malformed state node {str(skeleton)[:80]!r}")


def _unflatten_key(key: Any) -> Any:
    if isinstance(key, dict):
        if list(key) != [_TUPLE] or not isinstance(key[_TUPLE], list):
            raise ValueError("malformed dict key")
        return tuple(_unflatten_key(k) for k in key[_TUPLE])
    if key is None or isinstance(key, (bool, int, float, str)):
        return key
    raise ValueError(f"malformed dict key {key!r}")
