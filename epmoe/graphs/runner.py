"""CUDA-graph capture of the EPMoE layer with static input/output buffers.

A batch of T tokens is padded to the next captured size: padding tokens have ids -1 (they route
nowhere) and zero weights; the output's first T rows are returned. Everything that compiles lazily
(deep_gemm JIT, Triton autotune, torch.compile) runs in warm-up, outside capture.

Every rank of the group must capture the same sizes in the same order and replay the same size at
each step (collectives inside the graphs pair up across ranks): pick the size from a batch size that
all ranks agree on (e.g. the max over ranks, which engines already know for decode).

DeepEP LL alternates two internal buffers on every dispatch and combine call; a captured graph holds
one dispatch + combine pair, so the parity is the same at every replay and between replays and eager
calls.
"""

from typing import Callable, Dict, Optional, Sequence

import torch

from epmoe import _checks

DEFAULT_DECODE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


class _GraphRunner:
    def __init__(self, layer, sizes: Sequence[int], fn: Optional[Callable], warmup_iters: int):
        op = type(self).__name__
        if not torch.cuda.is_available() or layer.device.type != "cuda":
            raise _checks.fail(op, "layer", "a layer on a CUDA device", layer.device)
        sizes = sorted({_checks.check_positive_int(op, "capture_sizes", int(s)) for s in sizes})
        if not sizes:
            raise _checks.fail(op, "capture_sizes", "at least one size", "none")
        self.layer = layer
        self.fn = fn if fn is not None else layer
        self.sizes = tuple(sizes)
        self.max_size = sizes[-1]
        H, K, dev = layer.hidden_size, layer.top_k, layer.device
        self.x = torch.zeros((self.max_size, H), dtype=torch.bfloat16, device=dev)
        self.ids = torch.full((self.max_size, K), -1, dtype=torch.int64, device=dev)
        self.w = torch.zeros((self.max_size, K), dtype=torch.float32, device=dev)
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: Dict[int, torch.Tensor] = {}
        self.pool = None
        self._capture(warmup_iters)

    def _args(self, n):
        return self.x[:n], self.ids[:n], self.w[:n]

    @torch.no_grad()
    def _capture(self, warmup_iters: int) -> None:
        if hasattr(self.layer, "warmup"):
            self.layer.warmup(self.sizes)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for n in self.sizes:
                for _ in range(warmup_iters):
                    self.fn(*self._args(n))
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for n in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.outputs[n] = self.fn(*self._args(n))
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[n] = g
        torch.cuda.synchronize()

    def padded_size(self, num_tokens: int) -> Optional[int]:
        """The captured size a batch of ``num_tokens`` replays at (None: above the largest)."""
        for n in self.sizes:
            if n >= num_tokens:
                return n
        return None

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """x bf16 `[T, H]`, topk_ids int64 `[T, K]`, topk_weights float32 `[T, K]` -> bf16 `[T, H]`
        (a fresh tensor; the graph's static output is reused by the next replay)."""
        T = x.shape[0]
        n = self.padded_size(T)
        if n is None:
            return self._eager(x, topk_ids, topk_weights)
        self.x[:T].copy_(x)
        self.ids[:T].copy_(topk_ids)
        self.w[:T].copy_(topk_weights)
        if n > T:
            self.x[T:n].zero_()
            self.ids[T:n].fill_(-1)
            self.w[T:n].zero_()
        self.graphs[n].replay()
        return self.outputs[n][:T].clone()

    def _eager(self, x, topk_ids, topk_weights):
        raise _checks.fail(
            type(self).__name__,
            "x",
            f"at most {self.max_size} tokens (the largest captured size)",
            x.shape[0],
        )


class DecodeGraphRunner(_GraphRunner):
    """LL decode: one CUDA graph per size in ``capture_sizes``; eager above the largest.

    Args:
        layer: an ``EPMoE`` in mode "ll" (or "auto": its LL sizes) on CUDA, with an LL capacity
            (max_tokens_per_rank, or ll_max_tokens for "auto") >= the largest size.
        capture_sizes: batch sizes to capture (default 1..128 by powers of two, capped at
            the LL capacity).
        fn: the callable to capture instead of ``layer`` (e.g. ``torch.compile(layer)``).
        warmup_iters: eager iterations per size before capture.
    """

    def __init__(
        self, layer, capture_sizes: Optional[Sequence[int]] = None, fn=None, warmup_iters: int = 2
    ):
        if layer.mode not in ("ll", "auto"):
            raise _checks.fail(
                "DecodeGraphRunner", "layer", "an EPMoE in mode 'll' or 'auto'", layer.mode
            )
        cap = layer.ll_max_tokens
        if capture_sizes is None:
            capture_sizes = [s for s in DEFAULT_DECODE_SIZES if s <= cap] or [cap]
        if max(capture_sizes) > cap:
            raise _checks.fail(
                "DecodeGraphRunner",
                "capture_sizes",
                f"sizes <= max_tokens_per_rank={cap}",
                max(capture_sizes),
            )
        super().__init__(layer, capture_sizes, fn, warmup_iters)

    def _eager(self, x, topk_ids, topk_weights):
        return self.fn(x, topk_ids, topk_weights)


class PrefillGraphRunner(_GraphRunner):
    """HT prefill with worst-case dispatch, captured at a static token count per rank.

    Args:
        layer: an ``EPMoE`` in mode "ht" with worst_case=True on CUDA.
        num_tokens: tokens per rank the graph is captured at (batches are padded up to it);
            several sizes may be given as a sequence.
        fn: the callable to capture instead of ``layer``.
    """

    def __init__(self, layer, num_tokens, fn=None, warmup_iters: int = 2):
        if layer.mode != "ht" or not layer.worst_case:
            raise _checks.fail(
                "PrefillGraphRunner",
                "layer",
                "an EPMoE in mode 'ht' with worst_case=True",
                f"mode={layer.mode!r}, worst_case={layer.worst_case}",
            )
        sizes = [num_tokens] if isinstance(num_tokens, int) else list(num_tokens)
        cap = layer.max_tokens_per_rank
        if cap and max(sizes) > cap:
            raise _checks.fail(
                "PrefillGraphRunner", "num_tokens", f"at most max_tokens_per_rank={cap}", max(sizes)
            )
        super().__init__(layer, sizes, fn, warmup_iters)
