"""Launch configs of the stage kernels.

Each stage module holds one frozen dataclass of its launch parameters as ``CONFIG``, read when a
kernel is launched. Sweeps (scripts/stage_sweep.py), scripts/compile_kernels.py and tests change
fields for a block with the stage's ``override(**fields)``, which calls :func:`override`.
"""

import contextlib
import dataclasses
import sys
from typing import Iterator


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
