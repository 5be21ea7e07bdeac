"""LL (low-latency) half of :class:`epmoe.comm.deepep.DeepEPComm`: NVSHMEM
``low_latency_dispatch`` and ``low_latency_combine`` through ``deep_ep.Buffer``, with their checks
and fake.

The contracts (fp8 scales' layout, handle, the two alternating internal buffers) are in
:mod:`epmoe.comm.deepep`'s docstring. The mixin uses the communicator's shared helpers
(``_buffer``, ``_ids``, ``_check_device``, ``_check_ids_async``); importing it touches neither
deep_ep nor CUDA.
"""

import os

import torch

from epmoe import _checks

LL_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)  # compiled LL kernel variants
_LL_TOKEN_ALIGN = 4  # LL scales are TMA-stored: P * max_tokens_per_rank must be a multiple of 4


def _qp_depth() -> int:
    # deep_ep asserts NVSHMEM_QP_DEPTH >= 2 * (max_tokens_per_rank + 1) on every LL call.
    return int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))


class _LLMixin:
    """LL dispatch / combine of DeepEPComm (see the module docstring)."""

    def _check_ll(self, x, x_scales) -> None:
        op, H, mt = "ll_dispatch", x.shape[1], self.max_tokens_per_rank
        if H not in LL_HIDDEN_SIZES:
            raise _checks.fail(op, "hidden_size", f"one of {LL_HIDDEN_SIZES} for deepep LL", H)
        if x_scales is not None:
            raise _checks.fail(
                op, "x_scales", "None (deepep LL sends bf16 and casts to fp8 itself)", "a tensor"
            )
        if not mt:
            raise _checks.fail(op, "max_tokens_per_rank", "a positive int for LL mode", mt)
        if x.shape[0] > mt:
            raise _checks.fail(op, "x", f"at most max_tokens_per_rank={mt} tokens", x.shape[0])
        if (self.world_size * mt) % _LL_TOKEN_ALIGN:
            raise _checks.fail(
                op,
                "max_tokens_per_rank",
                f"world_size * max_tokens_per_rank a multiple of "
                f"{_LL_TOKEN_ALIGN} (deep_ep stores LL scales with TMA)",
                f"{self.world_size} * {mt}",
            )
        if 2 * (mt + 1) > _qp_depth():
            raise _checks.fail(
                op,
                "max_tokens_per_rank",
                f"at most {_qp_depth() // 2 - 1} (deep_ep needs "
                f"NVSHMEM_QP_DEPTH={_qp_depth()} >= 2 * (max_tokens_per_rank + 1))",
                mt,
            )

    def ll_dispatch(self, x, topk_ids, x_scales, use_fp8):
        self._check_ll(x, x_scales)
        self._check_device("ll_dispatch", x)
        side = self._check_ids_async(topk_ids, "ll_dispatch")
        buf = self._buffer("ll")
        E, C = self.num_local_experts, self.ll_capacity
        recv, count, handle, _, _ = buf.low_latency_dispatch(
            x.contiguous(),
            self._ids(topk_ids),
            self.max_tokens_per_rank,
            self.num_experts,
            use_fp8=use_fp8,
            round_scale=False,
            use_ue8m0=False,
            async_finish=False,
            return_recv_hook=False,
        )
        if side is not None:
            torch.cuda.current_stream(x.device).wait_stream(side)
        if use_fp8:
            rx, rs = recv
        else:
            rx, rs = recv, x.new_empty((E, C, 0), dtype=torch.float32)
        return [rx, rs, count, handle[0], handle[1]]

    def ll_dispatch_fake(self, x, topk_ids, x_scales, use_fp8):
        self._check_ll(x, x_scales)
        E, C, H, P = self.num_local_experts, self.ll_capacity, x.shape[1], self.world_size
        if use_fp8:
            S = H // 128
            rx = x.new_empty((E, C, H), dtype=torch.float8_e4m3fn)
            rs = x.new_empty_strided((E, C, S), (S * C, 1, C), dtype=torch.float32)
        else:
            rx, rs = x.new_empty((E, C, H)), x.new_empty((E, C, 0), dtype=torch.float32)
        return [
            rx,
            rs,
            x.new_empty((E,), dtype=torch.int32),
            x.new_empty((E, C), dtype=torch.int32),
            x.new_empty((E, P), dtype=torch.int64),
        ]

    def _ll_combine(self, y, topk_ids, topk_weights, handle, out):
        mt = self.max_tokens_per_rank
        if len(handle) != 2:
            raise _checks.fail(
                "ll_combine",
                "handle",
                "the 2 tensors of a deepep LL dispatch",
                f"{len(handle)} tensors",
            )
        if topk_ids.shape[0] > mt:
            raise _checks.fail(
                "ll_combine",
                "topk_ids",
                f"at most max_tokens_per_rank={mt} rows",
                topk_ids.shape[0],
            )
        self._check_device("ll_combine", y)
        buf = self._buffer("ll")
        dhandle = (handle[0], handle[1], mt, self.hidden_size, self.num_experts)
        combined, _, _ = buf.low_latency_combine(
            y.contiguous(),
            self._ids(topk_ids),
            topk_weights.contiguous(),
            dhandle,
            zero_copy=False,
            async_finish=False,
            return_recv_hook=False,
            out=out,
        )
        return combined

    def ll_combine(self, y, topk_ids, topk_weights, handle):
        return self._ll_combine(y, topk_ids, topk_weights, handle, None)

    def ll_combine_out(self, out, y, topk_ids, topk_weights, handle) -> None:
        """deep_ep writes straight into ``out`` (bf16 `[T, H]`, contiguous)."""
        self._ll_combine(y, topk_ids, topk_weights, handle, out)
