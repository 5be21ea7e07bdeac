"""Dispatch/combine over torch.distributed ``all_to_all_single`` (gloo on CPU, NCCL on GPU).

With no process group (or a group of one) no collective runs (the ``"local"`` backend is
:class:`epmoe.comm.local.LocalComm`, which uses this class for HT). Every collective moves raw
bytes, so any payload dtype (bf16, fp8, int8) works on any backend.

HT dispatch treats each destination rank as an "expert" of the masked layout:
the ll_scatter kernel (a raw copy, one kernel each) puts token t into slot
`[p, c]` of every rank p holding one of its experts (slots in t order), once for the payload
(`[P, cap, H]`) and once for an int32 metadata row (scales | weights | bitwise-NOT global ids, so
all-zero padding reads as ids -1). Worst case: cap = ht_capacity(T) (static N = P*cap, padding
metadata zeroed: ids -1, weights 0; padding payload rows unspecified on CUDA), two equal-split
all-to-alls; handle = [is_token_in_rank bool `[T, P]`, rows int32 `[T, P]` = p*cap + slot or -1].
Exact: cap = T, then only each peer's first count rows are sent (one host sync for the counts);
handle = [is_token_in_rank, rows int32 `[T, P]` into the compacted send order or -1, splits int64
`[2, P]` (CPU)]. The receiver turns global ids into local ids and counts them (a few torch ops on
`[N, K]`). HT combine returns the rows with one all-to-all and sums each token's rows in rank order
with the ll_gather kernel (unweighted, float32, rounded once).

LL dispatch all-gathers the (padded) tokens and ids and scatters them into the `[E, C, H]`
layout locally (the ll_scatter kernel, one kernel, fp8 quantization fused;
handle = [slots int32 `[P*maxT, K]` of every gathered entry, or -1]); LL combine gathers each
gathered (token, k) row into a send buffer (one kernel), returns them to their sources with one
all-to-all and takes the weighted sum there (one kernel).
"""

import torch
import torch.distributed as dist

from epmoe import _checks
from epmoe.comm._masked import gather, scatter
from epmoe.comm.base import Communicator

_U8 = torch.uint8


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """`[R, ...]` any dtype -> uint8 `[R, bytes per row]`."""
    t = t.contiguous()
    cols = 1
    for d in t.shape[1:]:
        cols *= d
    return t.reshape(t.shape[0], cols).view(_U8)


class TorchComm(Communicator):
    name = "torch"

    def __init__(self, group, num_experts, hidden_size, max_tokens_per_rank=None):
        if group is not None and dist.is_initialized():
            rank, world = dist.get_rank(group), dist.get_world_size(group)
        else:
            rank, world = 0, 1
        super().__init__(rank, world, num_experts, hidden_size, max_tokens_per_rank)
        # a group of one still runs its collectives (the torch backend's cost, measured on one GPU)
        self.group = group if group is not None and dist.is_initialized() else None
        if self.group is None:
            self.name = "local"

    # --------------------------------------------------------------------------------- primitives
    def _all_to_all(self, out, inp, out_splits=None, in_splits=None):
        if self.group is None:
            out.copy_(inp)
        else:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        return out

    def _all_gather(self, inp: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return inp.unsqueeze(0).clone()
        out = [torch.empty_like(inp) for _ in range(self.world_size)]
        dist.all_gather(out, inp, group=self.group)
        return torch.stack(out)

    def _exchange(self, send: torch.Tensor) -> torch.Tensor:
        """Equal-split all-to-all of a contiguous tensor (as bytes: any dtype on any backend);
        without a group the send buffer itself (a fresh tensor of ours) comes back."""
        if self.group is None:
            return send
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv.view(_U8), send.view(_U8), group=self.group)
        return recv

    # ------------------------------------------------------------------------------------------ HT
    def _scatter_for_peers(self, x, topk_ids, topk_weights, x_scales, cap):
        """Every destination rank is an "expert" of ll_scatter: token t goes to slot `[p, c]` of
        each rank p that holds one of its experts (slots in t order).

        Returns (payload `[P, cap, H]` of x's dtype, meta int32 `[P, cap, S + 2K]` = scales f32 |
        weights f32 | ~global ids (so all-zero padding reads as ids -1), rows int32 `[T, P]` =
        p*cap + slot or -1, per-peer counts int32 `[P]`, is_token_in_rank bool `[T, P]`); slots
        at or past the count are unspecified."""
        P, E = self.world_size, self.num_local_experts
        T, K = topk_ids.shape
        S = 0 if x_scales is None else x_scales.shape[1]
        peers = torch.arange(P, device=x.device)
        dest = topk_ids.div(E, rounding_mode="floor")  # -1 stays -1
        in_rank = (dest.unsqueeze(2) == peers).any(dim=1).contiguous()  # [T, P]
        peer_ids = torch.where(in_rank, peers, -1)
        meta = torch.empty((T, S + 2 * K), dtype=torch.int32, device=x.device)
        if S:
            meta[:, :S] = x_scales.view(torch.int32)
        meta[:, S : S + K] = topk_weights.view(torch.int32)
        meta[:, S + K :] = topk_ids
        meta[:, S + K :].bitwise_not_()
        c = max(cap, 1)  # ll_scatter wants a positive capacity (cap = 0 only when T = 0)
        xo, _, counts, rows = scatter(x, peer_ids, P, c)
        mo = scatter(meta, peer_ids, P, c)[0]
        return xo[:, :cap], mo[:, :cap], rows, counts, in_rank

    def _unpack(self, rx, rmeta, S, K):
        """Received rows -> the dispatch list's first five: x, scales, local ids int64 (-1
        elsewhere and on zeroed padding), weights, expert_counts."""
        E, lo = self.num_local_experts, self.rank * self.num_local_experts
        rs = rmeta[:, :S].view(torch.float32).clone()
        rw = rmeta[:, S : S + K].view(torch.float32).clone()
        d = (-1 - lo) - rmeta[:, S + K :].long()  # ~g - lo
        live = (d >= 0) & (d < E)
        rids = torch.where(live, d, -1)
        bucket = torch.where(live, d, E).reshape(-1)  # bucket E: entries elsewhere
        c = torch.zeros(E + 1, dtype=torch.int32, device=rx.device)
        c.scatter_add_(0, bucket, torch.ones_like(bucket, dtype=torch.int32))
        return [rx, rs, rids, rw, c[:E]]

    def ht_dispatch(self, x, topk_ids, topk_weights, x_scales, worst_case):
        _checks.check_ids(topk_ids, self.num_experts, "dispatch", "topk_ids")
        P, (T, K) = self.world_size, topk_ids.shape
        H, S = x.shape[1], 0 if x_scales is None else x_scales.shape[1]
        if worst_case or P == 1:  # with one rank both variants are static: N = T
            cap = self.ht_capacity(T) if worst_case else T
            xo, mo, rows, counts, in_rank = self._scatter_for_peers(
                x, topk_ids, topk_weights, x_scales, cap
            )
            # padding slots: all-zero metadata (weights and scales 0, ids -1)
            live = torch.arange(cap, device=x.device) < counts.unsqueeze(1)  # [P, cap]
            mo = mo.mul_(live.unsqueeze(2))
            rx = self._exchange(xo.reshape(P * cap, H))
            rmeta = self._exchange(mo.reshape(P * cap, S + 2 * K))
            return self._unpack(rx, rmeta, S, K) + [in_rank, rows]
        # exact: the same per-peer layout at cap = T, then only each peer's first counts[p] rows
        xo, mo, rows, counts, in_rank = self._scatter_for_peers(
            x, topk_ids, topk_weights, x_scales, T
        )
        recv_counts = self._all_to_all(torch.empty_like(counts), counts)
        splits = torch.stack([counts, recv_counts]).to("cpu", torch.int64)  # the one host sync
        in_s, out_s = splits[0].tolist(), splits[1].tolist()
        send_x = torch.cat([xo[p, :n] for p, n in enumerate(in_s)])
        send_m = torch.cat([mo[p, :n] for p, n in enumerate(in_s)])
        rx = send_x.new_empty((sum(out_s), H))
        self._all_to_all(rx.view(_U8), send_x.view(_U8), out_s, in_s)
        rmeta = send_m.new_empty((sum(out_s), S + 2 * K))
        self._all_to_all(rmeta.view(_U8), send_m.view(_U8), out_s, in_s)
        # rows of the compacted send order: offset of peer p's block + slot
        offset = torch.cumsum(counts, 0) - counts - torch.arange(P, device=x.device) * T
        sent = torch.where(rows >= 0, rows + offset, -1).to(torch.int32)
        return self._unpack(rx, rmeta, S, K) + [in_rank, sent, splits]

    def ht_dispatch_fake(self, x, topk_ids, topk_weights, x_scales, worst_case):
        P, (T, K) = self.world_size, topk_ids.shape
        if worst_case or P == 1:
            n = P * (self.ht_capacity(T) if worst_case else T)
        else:
            n = torch.library.get_ctx().new_dynamic_size()
        S = 0 if x_scales is None else x_scales.shape[1]
        out = [
            x.new_empty((n, x.shape[1])),
            x.new_empty((n, S), dtype=torch.float32),
            x.new_empty((n, K), dtype=torch.int64),
            x.new_empty((n, K), dtype=torch.float32),
            x.new_empty((self.num_local_experts,), dtype=torch.int32),
            x.new_empty((T, P), dtype=torch.bool),
            x.new_empty((T, P), dtype=torch.int32),
        ]
        if worst_case or P == 1:
            return out
        return out + [torch.empty((2, P), dtype=torch.int64, device="cpu")]

    def ht_combine(self, y, handle):
        """Each token's rows home, summed unweighted in rank order (float32, rounded once):
        handle = [is_token_in_rank, rows int32 `[T, P]` into the returned rows or -1, (splits)]."""
        rows = handle[1]
        H = y.shape[1]
        y = y.contiguous()
        if len(handle) == 2:  # worst case: P * capacity static slots
            back = self._exchange(y)
        else:
            in_s, out_s = handle[2][0].tolist(), handle[2][1].tolist()
            back = y.new_empty((sum(in_s), H))
            self._all_to_all(back.view(_U8), y.view(_U8), in_s, out_s)
        return gather(back.view(1, back.shape[0], H), rows)

    # ------------------------------------------------------------------------------------------ LL
    def ll_dispatch(self, x, topk_ids, x_scales, use_fp8):
        if x_scales is not None:
            raise _checks.fail("ll_dispatch", "x_scales", "None (LL quantizes itself)", "a tensor")
        P, E, maxT = self.world_size, self.num_local_experts, self.max_tokens_per_rank
        T, K = topk_ids.shape
        H = x.shape[1]
        # one all_gather of packed rows: ids int32 | x bf16, 16-byte rows (the views below need
        # widths divisible by 4); padding tokens carry ids -1 and are never read
        ib, xb = 4 * K, 2 * H
        width = -(-(ib + xb) // 16) * 16
        rows = torch.empty((maxT, width), dtype=_U8, device=x.device)
        rows[:T, :ib] = _as_bytes(topk_ids.to(torch.int32))
        rows[T:, :ib] = 255
        rows[:T, ib : ib + xb] = _as_bytes(x)
        allrows = self._all_gather(rows).reshape(P * maxT, width)  # [C, width]
        xo, s, masked_m, slots = scatter(
            allrows[:, ib : ib + xb].view(torch.bfloat16),
            allrows[:, :ib].view(torch.int32),
            E,
            P * maxT,
            "fp8" if use_fp8 else "bf16",
            expert_lo=self.rank * E,
            num_global_experts=self.num_experts,
        )
        return [xo, s, masked_m, slots]

    def ll_dispatch_fake(self, x, topk_ids, x_scales, use_fp8):
        E, C, H = self.num_local_experts, self.ll_capacity, x.shape[1]
        dtype = torch.float8_e4m3fn if use_fp8 else x.dtype
        S = H // 128 if use_fp8 else 0
        return [
            x.new_empty((E, C, H), dtype=dtype),
            x.new_empty((E, C, S), dtype=torch.float32),
            x.new_empty((E,), dtype=torch.int32),
            x.new_empty((C, topk_ids.shape[1]), dtype=torch.int32),  # every gathered entry's slot
        ]

    def _ll_send_back(self, y, topk_ids, handle):
        """-> (y' bf16 `[P, maxT*K, H]`: each of this rank's (token, k) rows from every rank, 0
        where that rank holds none of it; rows int64 `[T, K]` of each (t, k) in y', or -1)."""
        P, E, maxT = self.world_size, self.num_local_experts, self.max_tokens_per_rank
        T, K = topk_ids.shape
        H = y.shape[2]
        # each gathered (token, k) entry's row, unweighted (0 where its expert is elsewhere)
        send = gather(y, handle[0].reshape(-1, 1))  # [P * maxT * K, H]
        recv = torch.empty((P * maxT * K, 2 * H), dtype=_U8, device=y.device)
        self._all_to_all(recv, send.view(_U8))
        base = torch.arange(T * K, device=y.device).view(T, K)
        owner = topk_ids.div(E, rounding_mode="floor")
        rows = torch.where(topk_ids >= 0, owner * (maxT * K) + base, -1)
        return recv.view(torch.bfloat16).view(P, maxT * K, H), rows

    def ll_combine(self, y, topk_ids, topk_weights, handle):
        back, rows = self._ll_send_back(y, topk_ids, handle)
        return gather(back, rows, topk_weights)

    def ll_combine_out(self, out, y, topk_ids, topk_weights, handle):
        back, rows = self._ll_send_back(y, topk_ids, handle)
        gather(back, rows, topk_weights, out=out)
