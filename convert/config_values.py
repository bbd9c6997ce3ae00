"""Type checks for the values glm-pack reads from a checkpoint's config.json: :func:`config_value` returns a
value of the wanted type or raises an error naming the key and the value (never a traceback from ``int()``,
``len()`` or ``re``, never a silent misread such as 1.5 layers taken as 1)."""

from __future__ import annotations

import json

from glm_pack.packing.errors import CheckpointError, GlmPackError

_KINDS = {int: "integer", str: "string", list: "list", dict: "object"}
_REQUIRED = object()


def _fits(value, want: type, minimum: int | None) -> bool:
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)
    return isinstance(value, want)


def config_value(
    value,
    key: str,
    want: type,
    *,
    item: type | None = None,
    minimum: int | None = None,
    default=_REQUIRED,
    error: type[GlmPackError] = CheckpointError,
):
    """``value``, config.json's ``key`` (None when absent), if it is a ``want`` (an int: never a bool, at least
    ``minimum``; with ``item``: a list or object whose every item is one); None gives ``default`` when one is
    given. Otherwise ``error`` naming the key and the value, with ``file="config.json"``."""
    if value is None and default is not _REQUIRED:
        return default
    if item is None:
        ok = _fits(value, want, minimum)
    else:
        ok = _fits(value, want, None) and all(
            _fits(v, item, minimum) for v in (value.values() if want is dict else value)
        )
    if ok:
        return value
    kind = f"{_KINDS[want]} of {_KINDS[item]}s" if item else _KINDS[want]
    what = f"{'an' if kind[0] in 'aeio' else 'a'} {kind}" + (f" >= {minimum}" if minimum is not None else "")
    got = "null (or missing)" if value is None else json.dumps(value)
    got = got if len(got) <= 80 else got[:77] + "..."
    raise error(f"{key} must be {what}, got {got}", file="config.json")
