"""Communicators cannot be op arguments: ops receive an int key into this registry."""

import itertools
from typing import Dict

_COMMS: Dict[int, object] = {}
_NEXT = itertools.count(1)


def register(comm) -> int:
    key = next(_NEXT)
    _COMMS[key] = comm
    return key


def get(key: int):
    try:
        return _COMMS[key]
    except KeyError:
        raise ValueError(f"comm: key expected a registered communicator id, got {key}") from None


def unregister(key: int) -> None:
    _COMMS.pop(key, None)
