"""HT (high-throughput) half of :class:`epmoe.comm.deepep.DeepEPComm`: NVLink / RDMA
``dispatch`` and ``combine`` through ``deep_ep.Buffer``, with their checks and fake.

The contracts (payloads, worst case, handle layout) are in :mod:`epmoe.comm.deepep`'s docstring.
The mixin uses the communicator's shared helpers (``_buffer``, ``_configs``, ``_ids``,
``_check_device``, ``_check_ids_async``, ``_side_stream``); importing it touches neither deep_ep
nor CUDA.
"""

import torch
import torch.distributed as dist

from epmoe import _checks

HT_INTRANODE_WORLD = (2, 4, 8)  # intranode kernels are instantiated for these rank counts
HT_INTERNODE_WORLD = (16, 24, 32, 48, 64, 96, 128, 144, 160)  # deep_ep's default config table
_NVL_CHUNK_TOKENS = 256  # num_max_nvl_chunked_recv_tokens of deep_ep's intranode default configs
# deep_ep's sm90 intranode dispatch stages half a row (whole int4 pairs) plus an 8-byte mbarrier in
# 8 KiB of shared memory per warp: rows are a multiple of 32 bytes and at most 16352 bytes.
_HT_ROW_ALIGN, _HT_MAX_ROW_BYTES = 32, 2 * (8192 - 8) // 32 * 32


def _nvl_bytes_needed(world: int, num_sms: int, h_bytes: int, k: int, s: int, hidden: int) -> int:
    """NVL bytes deep_ep's intranode dispatch and (bf16, unweighted) combine assert on."""
    ch = num_sms // 2
    meta = world * world * 4 + ch * world * 4 * 4  # prefix matrix, channel offsets, head/tail
    per_token = max(h_bytes, 2 * hidden) + 4 + k * 12 + s * 4  # row, src idx, ids+weights, scales
    return meta + ch * world * _NVL_CHUNK_TOKENS * per_token


class _HTMixin:
    """HT dispatch / combine of DeepEPComm (see the module docstring)."""

    def _check_ht(self, x, topk_ids, x_scales, worst_case: bool) -> None:
        op, P = "dispatch", self.world_size
        allowed = HT_INTERNODE_WORLD if self.internode else HT_INTRANODE_WORLD
        if P not in allowed:
            raise _checks.fail(op, "world_size", f"one of {allowed} for deepep HT", P)
        if worst_case and self.internode:
            raise _checks.fail(
                op,
                "worst_case",
                "False across nodes (deep_ep's num_worst_tokens is intranode only)",
                True,
            )
        h_bytes = x.shape[1] * x.element_size()
        align = 16 if self.internode else _HT_ROW_ALIGN  # deep_ep copies int4s (pairs intranode)
        if h_bytes % align or (not self.internode and h_bytes > _HT_MAX_ROW_BYTES):
            limit = "" if self.internode else f", at most {_HT_MAX_ROW_BYTES},"
            raise _checks.fail(
                op,
                "x",
                f"rows of a multiple of {align} bytes{limit} for deep_ep",
                f"{h_bytes} bytes",
            )
        if x_scales is not None and x.element_size() != 1:
            raise _checks.fail(
                op,
                "x_scales",
                f"None with a {x.dtype} payload (deep_ep carries scales with 1-byte payloads)",
                "a tensor",
            )
        if not self.internode:
            S = 0 if x_scales is None else x_scales.shape[1]
            need = _nvl_bytes_needed(P, self.num_sms, h_bytes, topk_ids.shape[1], S, x.shape[1])
            if need > self.num_nvl_bytes:
                raise _checks.fail(
                    op,
                    "num_nvl_bytes",
                    f"at least {need} for H={x.shape[1]}, "
                    f"K={topk_ids.shape[1]}, num_sms={self.num_sms}",
                    self.num_nvl_bytes,
                )

    def _check_same_tokens(self, T: int, device) -> None:
        """Debug only (one all-reduce): worst-case HT without max_tokens_per_rank needs the same T
        on every rank."""
        t = torch.tensor([T, -T], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        hi, lo = int(t[0]), -int(t[1])
        if hi != T or lo != T:
            raise _checks.fail(
                "dispatch",
                "x",
                f"the same token count on every rank for worst_case=True (ranks hold {lo}..{hi})",
                T,
            )

    def ht_dispatch(self, x, topk_ids, topk_weights, x_scales, worst_case):
        self._check_ht(x, topk_ids, x_scales, worst_case)
        self._check_device("dispatch", x)
        T, P, dev = x.shape[0], self.world_size, x.device
        cap = self.ht_capacity(T) if worst_case else 0
        if (
            worst_case
            and not self.max_tokens_per_rank
            and _checks.debug_enabled()
            and not torch.cuda.is_current_stream_capturing()
        ):
            self._check_same_tokens(T, dev)
        side = self._check_ids_async(topk_ids, "dispatch")
        buf = self._buffer("ht")
        dispatch_cfg, _ = self._configs()
        ids = self._ids(topk_ids)
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, self.num_experts)
        payload = x.contiguous() if x_scales is None else (x.contiguous(), x_scales.contiguous())
        recv, rids, rw, counts_list, handle, _ = buf.dispatch(
            payload,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=ids,
            topk_weights=topk_weights.contiguous(),
            num_worst_tokens=P * cap,
            config=dispatch_cfg,
        )
        if x_scales is None:
            rx, rs = recv, recv.new_empty((recv.shape[0], 0), dtype=torch.float32)
        else:
            rx, rs = recv
        rids = rids.to(torch.int64)
        if counts_list:  # exact mode: deep_ep already synced the per-expert counts to the host
            counts = torch.empty((self.num_local_experts,), dtype=torch.int32, device=dev)
            host = torch.tensor(counts_list, dtype=torch.int32, pin_memory=True)
            side = side if side is not None else self._side_stream(dev)
            with torch.cuda.stream(side):  # overlaps the dispatch kernel
                counts.copy_(host, non_blocking=True)
        else:
            counts = self._local_counts(rids)
        if side is not None:
            torch.cuda.current_stream(dev).wait_stream(side)
        if self.internode:
            handle = list(handle)  # is_token_in_rank is already first
        else:
            prefix, chan_prefix, recv_chan_prefix, src_idx, in_rank_h, send_head = handle
            handle = [in_rank_h, prefix, chan_prefix, recv_chan_prefix, src_idx, send_head]
        return [rx, rs, rids, rw, counts] + handle

    def _local_counts(self, ids: torch.Tensor) -> torch.Tensor:
        """int32 `[E]` (token, k) entries per local expert; -1 lands in a dropped bin E."""
        E = self.num_local_experts
        bucket = ids.remainder(E + 1).reshape(-1)  # -1 -> E, local ids unchanged
        one = self._ones.get(ids.device)
        if one is None:
            one = self._ones[ids.device] = torch.ones(1, dtype=torch.int32, device=ids.device)
        c = torch.zeros(E + 1, dtype=torch.int32, device=ids.device)
        return c.scatter_add_(0, bucket, one.expand(bucket.numel()))[:E]

    def ht_dispatch_fake(self, x, topk_ids, topk_weights, x_scales, worst_case):
        self._check_ht(x, topk_ids, x_scales, worst_case)
        if self.internode:
            raise NotImplementedError(
                "deepep: tracing internode HT dispatch is not supported (its 10-tensor handle has "
                "no fake here); run it eagerly"
            )
        P, (T, K), H = self.world_size, topk_ids.shape, x.shape[1]
        n = P * self.ht_capacity(T) if worst_case else torch.library.get_ctx().new_dynamic_size()
        S = 0 if x_scales is None else x_scales.shape[1]
        ch, i32 = self.num_sms // 2, torch.int32
        return [
            x.new_empty((n, H)),
            x.new_empty((n, S), dtype=torch.float32),
            x.new_empty((n, K), dtype=torch.int64),
            x.new_empty((n, K), dtype=torch.float32),
            x.new_empty((self.num_local_experts,), dtype=i32),
            x.new_empty((T, P), dtype=torch.bool),
            x.new_empty((P, P), dtype=i32),
            x.new_empty((P, ch), dtype=i32),
            x.new_empty((P, ch), dtype=i32),
            x.new_empty((n,), dtype=i32),
            x.new_empty((T, P), dtype=i32),
        ]

    def ht_combine(self, y, handle):
        # deep_ep's combine rewrites the -1 entries of its send heads in place (idempotently);
        # the op declares no handle mutation, so it works on copies ([T, P] int32: negligible).
        if self.internode:
            dhandle = tuple(h.clone() if i in (8, 9) else h for i, h in enumerate(handle))
        else:
            if len(handle) != 6:
                raise _checks.fail(
                    "combine",
                    "handle",
                    "the 6 tensors of a deepep HT dispatch",
                    f"{len(handle)} tensors",
                )
            in_rank, prefix, chan_prefix, recv_chan_prefix, src_idx, send_head = handle
            if y.shape[0] != src_idx.shape[0]:
                raise _checks.fail(
                    "combine", "y", f"{src_idx.shape[0]} rows (the dispatch's N)", y.shape[0]
                )
            dhandle = (prefix, chan_prefix, recv_chan_prefix, src_idx, in_rank, send_head.clone())
        self._check_device("combine", y)
        buf = self._buffer("ht")
        _, combine_cfg = self._configs()
        out, _, _ = buf.combine(y.contiguous(), dhandle, topk_weights=None, config=combine_cfg)
        return out
