"""Launch configs of the stage kernels.

Each stage module holds one frozen dataclass of its launch parameters as ``CONFIG``, read when a
kernel is launched. Sweeps (scripts/stage_sweep.py), scripts/compile_kernels.py and tests change
fields for a block with the stage's ``override(**fields)``, which calls :func:`override`.
The classes are :func:`frozen`: launch plans are cached on the config in force
(:func:`epmoe._launch.memo`), so hashing one must be cheap.
"""

import contextlib
import dataclasses
import sys
from typing import Iterator


def frozen(cls):
    """``dataclasses.dataclass(frozen=True)`` whose hash is computed once per instance."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    field_hash = cls.__hash__

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = field_hash(self)  # (not a field: eq and repr ignore it)
        return h

    cls.__hash__ = __hash__
    return cls


@contextlib.contextmanager
def override(module: str, **fields) -> Iterator[object]:
    """Inside the block, ``sys.modules[module].CONFIG`` has ``fields`` replaced (restored after;
    an unknown field is a TypeError). Yields the config in force."""
    mod = sys.modules[module]
    saved = mod.CONFIG
    mod.CONFIG = dataclasses.replace(saved, **fields)
    try:
        yield mod.CONFIG
    finally:
        mod.CONFIG = saved
