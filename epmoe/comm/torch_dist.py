"""Dispatch/combine over torch.distributed ``all_to_all_single`` (gloo on CPU, NCCL on GPU).

With no process group (or a group of one) no collective runs (the ``"local"`` backend is
:class:`epmoe.comm.local.LocalComm`, which uses this class for HT). Every row travels as raw bytes
(payload, scales, ids, weights packed into one uint8 row), so any payload dtype (bf16, fp8, int8)
works on any backend and each dispatch is one collective.

Worst-case HT dispatch sends T slots to every peer (static: N = P*T, unused slots have ids -1);
exact HT dispatch exchanges counts first (one host sync) and sends only rows that have an expert on
the peer. LL dispatch all-gathers the (padded) tokens and ids and scatters them into the `[E, C, H]`
layout locally (:func:`epmoe.comm.masked_layout.ll_scatter`, one kernel, fp8 quantization fused;
handle = [slots int32 `[P*maxT, K]` of every gathered entry, or -1]); LL combine gathers each
gathered (token, k) row into a send buffer (one kernel), returns them to their sources with one
all-to-all and takes the weighted sum there (one kernel).
"""

import torch
import torch.distributed as dist

from epmoe import _checks
from epmoe.comm.base import Communicator
from epmoe.comm.masked_layout import ll_gather, ll_scatter

_U8 = torch.uint8


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """`[R, ...]` any dtype -> uint8 `[R, bytes per row]`."""
    t = t.contiguous()
    cols = 1
    for d in t.shape[1:]:
        cols *= d
    return t.reshape(t.shape[0], cols).view(_U8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
    """uint8 `[R, cols * itemsize]` (any strides) -> a fresh dtype `[R, cols]` (never a view: op
    outputs must not alias each other)."""
    out = torch.empty((b.shape[0], cols), dtype=dtype, device=b.device)
    if cols:
        out.view(_U8).copy_(b)
    return out


class _Layout:
    """Byte layout of a packed row: payload | scales (f32) | ids (i32) | weights (f32)."""

    def __init__(self, h: int, dtype: torch.dtype, s: int, k: int, with_weights: bool):
        self.h, self.dtype, self.s, self.k = h, dtype, s, k
        self.x_end = h * dtype.itemsize
        self.s_end = self.x_end + 4 * s
        self.id_end = self.s_end + 4 * k
        self.width = self.id_end + (4 * k if with_weights else 0)

    def unpack(self, rows: torch.Tensor):
        x = _from_bytes(rows[:, : self.x_end], self.dtype, self.h)
        s = _from_bytes(rows[:, self.x_end : self.s_end], torch.float32, self.s)
        ids = _from_bytes(rows[:, self.s_end : self.id_end], torch.int32, self.k).long()
        w = (
            _from_bytes(rows[:, self.id_end :], torch.float32, self.k)
            if self.width > self.id_end
            else None
        )
        return x, s, ids, w


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

    def _local_counts(self, ids: torch.Tensor) -> torch.Tensor:
        E = self.num_local_experts
        bucket = torch.where(ids >= 0, ids, E).reshape(-1)
        c = torch.zeros(E + 1, dtype=torch.int32, device=ids.device)
        return c.scatter_add_(0, bucket, torch.ones_like(bucket, dtype=torch.int32))[:E]

    # ------------------------------------------------------------------------------------------ HT
    def _pack_for_peers(self, x, topk_ids, topk_weights, x_scales):
        """-> packed uint8 `[P, T, B]` (ids remapped to each peer's local ids), is_in_rank
        bool `[T, P]`."""
        P, E = self.world_size, self.num_local_experts
        T, K = topk_ids.shape
        s = x_scales if x_scales is not None else x.new_empty((T, 0), dtype=torch.float32)
        lay = _Layout(x.shape[1], x.dtype, s.shape[1], K, with_weights=True)
        dest = torch.where(topk_ids >= 0, topk_ids // E, -1)  # [T, K]
        peers = torch.arange(P, device=x.device)
        hit = dest.unsqueeze(0) == peers.view(P, 1, 1)  # [P, T, K]
        local_ids = torch.where(hit, topk_ids.unsqueeze(0) - peers.view(P, 1, 1) * E, -1)
        common = torch.cat([_as_bytes(x), _as_bytes(s)], dim=1)  # [T, x_end + 4S]
        packed = torch.cat(
            [
                common.unsqueeze(0).expand(P, -1, -1),
                _as_bytes(local_ids.to(torch.int32).reshape(P * T, K)).reshape(P, T, 4 * K),
                _as_bytes(topk_weights.float()).unsqueeze(0).expand(P, -1, -1),
            ],
            dim=2,
        )
        return packed, hit.any(dim=2).t().contiguous(), lay

    def ht_dispatch(self, x, topk_ids, topk_weights, x_scales, worst_case):
        _checks.check_ids(topk_ids, self.num_experts, "dispatch", "topk_ids")
        P = self.world_size
        T = x.shape[0]
        packed, in_rank, lay = self._pack_for_peers(x, topk_ids, topk_weights, x_scales)
        if worst_case or P == 1:  # with one rank both variants are static: N = T
            cap = self.ht_capacity(T) if worst_case else T
            slot = torch.cumsum(in_rank.long(), dim=0) - 1  # [T, P]
            slot = torch.where(in_rank, slot, -1)
            send = torch.zeros((P, cap + 1, lay.width), dtype=_U8, device=x.device)
            send[:, :, lay.s_end : lay.id_end] = 255  # padding slots carry ids -1
            p_idx = torch.arange(P, device=x.device).view(1, P).expand(T, P)
            dst = torch.where(in_rank, slot, cap)  # rows not sent go to a dump slot
            send[p_idx, dst] = packed.permute(1, 0, 2)
            send = send[:, :cap].reshape(P * cap, lay.width)
            recv = self._all_to_all(torch.empty_like(send), send)
            handle = [in_rank, slot]
        else:
            counts = in_rank.sum(dim=0)  # [P]
            pt = in_rank.t().nonzero()  # exact mode: data-dependent by design (one host sync)
            send = packed[pt[:, 0], pt[:, 1]]
            recv_counts = self._all_to_all(torch.empty_like(counts), counts)
            splits = torch.stack([counts, recv_counts]).cpu()
            in_s, out_s = splits[0].tolist(), splits[1].tolist()
            recv = send.new_empty((sum(out_s), lay.width))
            self._all_to_all(recv, send, out_s, in_s)
            handle = [in_rank, pt[:, 1].contiguous(), splits]
        rx, rs, rids, rw = lay.unpack(recv)
        return [rx, rs, rids, rw, self._local_counts(rids)] + handle

    def ht_dispatch_fake(self, x, topk_ids, topk_weights, x_scales, worst_case):
        P, (T, K) = self.world_size, topk_ids.shape
        if worst_case or P == 1:
            n = P * (self.ht_capacity(T) if worst_case else T)
        else:
            n = torch.library.get_ctx().new_dynamic_size()
        S = 0 if x_scales is None else x_scales.shape[1]
        in_rank = x.new_empty((T, P), dtype=torch.bool)
        out = [
            x.new_empty((n, x.shape[1])),
            x.new_empty((n, S), dtype=torch.float32),
            x.new_empty((n, K), dtype=torch.int64),
            x.new_empty((n, K), dtype=torch.float32),
            x.new_empty((self.num_local_experts,), dtype=torch.int32),
        ]
        if worst_case or P == 1:
            return out + [in_rank, x.new_empty((T, P), dtype=torch.int64)]
        sent = torch.library.get_ctx().new_dynamic_size()
        return out + [
            in_rank,
            x.new_empty((sent,), dtype=torch.int64),
            torch.empty((2, P), dtype=torch.int64, device="cpu"),
        ]

    def ht_combine(self, y, handle):
        in_rank = handle[0]
        T, P = in_rank.shape
        H = y.shape[1]
        if len(handle) == 2:  # worst case: P * capacity static slots
            back = self._all_to_all(torch.empty_like(_as_bytes(y)), _as_bytes(y))
            back = _from_bytes(back, y.dtype, H).view(P, y.shape[0] // P, H)
            slot = handle[1]
            p_idx = torch.arange(P, device=y.device).view(1, P).expand(T, P)
            rows = back[p_idx, slot.clamp(min=0)].float()  # [T, P, H]
            out = (rows * in_rank.unsqueeze(-1)).sum(dim=1)
        else:
            token, splits = handle[1], handle[2]
            in_s, out_s = splits[0].tolist(), splits[1].tolist()
            yb = _as_bytes(y)
            back = yb.new_empty((sum(in_s), yb.shape[1]))
            self._all_to_all(back, yb, in_s, out_s)
            out = torch.zeros((T, H), dtype=torch.float32, device=y.device)
            out.index_add_(0, token, _from_bytes(back, y.dtype, H).float())
        return out.to(y.dtype)

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
        xo, s, masked_m, slots = ll_scatter(
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
        send = ll_gather(y, handle[0].reshape(-1, 1))  # [P * maxT * K, H]
        recv = torch.empty((P * maxT * K, 2 * H), dtype=_U8, device=y.device)
        self._all_to_all(recv, send.view(_U8))
        base = torch.arange(T * K, device=y.device).view(T, K)
        owner = topk_ids.div(E, rounding_mode="floor")
        rows = torch.where(topk_ids >= 0, owner * (maxT * K) + base, -1)
        return recv.view(torch.bfloat16).view(P, maxT * K, H), rows

    def ll_combine(self, y, topk_ids, topk_weights, handle):
        back, rows = self._ll_send_back(y, topk_ids, handle)
        return ll_gather(back, rows, topk_weights)

    def ll_combine_out(self, out, y, topk_ids, topk_weights, handle):
        back, rows = self._ll_send_back(y, topk_ids, handle)
        ll_gather(back, rows, topk_weights, out=out)
