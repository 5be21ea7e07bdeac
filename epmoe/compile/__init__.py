"""torch.compile integration: dynamic token counts, graph-break checks, Inductor settings.

Import as ``import epmoe.compile`` or ``from epmoe.compile import ...`` (never ``from epmoe import
compile``: it would shadow the builtin).
"""

import contextlib
from typing import Iterator, Optional

import torch
import torch._dynamo


def mark_dynamic_tokens(*tensors: torch.Tensor, min: int = 1, max: Optional[int] = None) -> None:
    """Mark dim 0 (tokens) of each tensor dynamic so one compiled graph serves every batch size.

    Args:
        *tensors: x bf16 `[T, H]`, topk_ids int64 `[T, K]`, topk_weights float32 `[T, K]`, ...
        min, max: the range of T the graph must serve (max: e.g. max_tokens_per_rank).
    """
    for t in tensors:
        if max is None:
            torch._dynamo.mark_dynamic(t, 0, min=min)
        else:
            torch._dynamo.mark_dynamic(t, 0, min=min, max=max)


def graph_breaks(fn, *args, **kwargs):
    """Trace ``fn(*args, **kwargs)`` with dynamo and return its ``ExplainOutput``."""
    return torch._dynamo.explain(fn)(*args, **kwargs)


def assert_no_graph_breaks(fn, *args, **kwargs) -> None:
    """Raise AssertionError (with dynamo's reasons) if ``fn(*args, **kwargs)`` breaks the graph."""
    explain = graph_breaks(fn, *args, **kwargs)
    if explain.graph_break_count or explain.graph_count != 1:
        reasons = "\n".join(str(r) for r in explain.break_reasons)
        raise AssertionError(
            f"{explain.graph_break_count} graph break(s), "
            f"{explain.graph_count} graph(s):\n{reasons}"
        )


@contextlib.contextmanager
def graph_partition(enabled: bool = True) -> Iterator[None]:
    """Inductor graph partitioning: ops tagged ``torch.Tag.cudagraph_unsafe`` (exact-size HT
    dispatch)
    are split out, so ``mode="reduce-overhead"`` graphs the rest."""
    import torch._inductor.config as cfg

    old = cfg.graph_partition
    cfg.graph_partition = enabled
    try:
        yield
    finally:
        cfg.graph_partition = old


__all__ = ["assert_no_graph_breaks", "graph_breaks", "graph_partition", "mark_dynamic_tokens"]
