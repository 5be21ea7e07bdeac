"""Dispatch/combine through ``deep_ep.Buffer`` (legacy API): NVLink HT and NVSHMEM LL kernels.

Shape legend: ``T`` tokens on this rank, ``K`` top-k, ``H`` hidden, ``S`` scale columns, ``P`` world
size, ``E`` local experts, ``Et`` global experts, ``N`` received rows, ``C`` = P *
max_tokens_per_rank, ``ch`` = num_sms / 2 (deep_ep channels).

Importing this module neither imports ``deep_ep`` nor touches CUDA: the library loads on the first
real dispatch/combine; fakes and validation never need it.

Buffers
    One ``deep_ep.Buffer`` per (ranks of the group, kind) lives in a module-level registry, so every
    layer over the same ranks shares it. Kinds:

    - ``"ht"``: intranode NVLink buffer of ``num_nvl_bytes`` (default 1 GiB), no RDMA.
    - ``"ll"``: NVSHMEM buffer of ``get_low_latency_rdma_size_hint(max_tokens_per_rank, H, P, Et)``
      bytes, ``low_latency_mode=True``, ``num_qps_per_rank=E``, NVLink allowed.
    - ``"shared"``: one buffer for both modes; always so when the group spans nodes (P > 8, RDMA
      bytes pass through), or on request (``share_buffer=True``).

    A buffer is created on its first use, sized for every communicator registered on it by then;
    creation is collective, and all ranks reach that first use at the same point of the program.
    :meth:`DeepEPComm.prepare` creates them eagerly; nothing is created while a CUDA graph is being
    captured. :func:`release_buffers` frees them (collective). The LL region is re-zeroed with
    ``clean_low_latency_buffer`` when an LL call follows an HT call on a shared buffer, or uses
    another (max_tokens_per_rank, H, Et) layout than the previous LL call.

HT dispatch (``get_dispatch_layout`` + ``dispatch``)
    Payloads: bf16 ``x``; fp8 ``(x, scales [T, H/128])``; int8 ``(x, scales [T, 1])``. deep_ep's
    intranode dispatch moves ``H * element_size`` bytes per row and takes float32 scales with any
    1-byte payload (it asserts ``x.element_size() == 1`` and has no dtype check on ``x``), so int8
    rows travel as they are, with no byte view. Received ``topk_ids`` are already local (-1 for
    experts on other ranks) and deep_ep zeroes the weights of those -1 entries.

    ``worst_case=True`` passes ``num_worst_tokens = N = P * ht_capacity(T)`` (max_tokens_per_rank
    when set, else T): no host sync, CUDA-graph capturable; rows past the received count have ids -1
    and unspecified data and weights. Without max_tokens_per_rank every rank must pass the same T
    (only then does P * T bound the received rows; deep_ep does not check it - with
    ``EPMOE_DEBUG=1`` we do, with one all-reduce). deep_ep supports it intranode only, and reads
    ``num_worst_tokens = 0`` (T = 0 and no max_tokens_per_rank) as "exact": that call syncs. The
    exact variant waits on the host for the received count; its ``expert_counts`` come from
    deep_ep's host list, the worst-case ones are counted on the device.

    Handle (tensors only): ``[is_token_in_rank bool [T, P], rank_prefix_matrix int32 [P, P],
    channel_prefix_matrix int32 [P, ch], recv_channel_prefix_matrix int32 [P, ch],
    recv_src_idx int32 [N], send_head int32 [T, P]]``; internode it is deep_ep's own 10-tensor
    handle (is_token_in_rank first; eager only, no fake). HT combine: bf16, unweighted -> `[T, H]`;
    deep_ep rewrites the send heads of its handle in place, so combine passes it copies of them.

LL dispatch (``low_latency_dispatch``) and combine (``low_latency_combine``)
    ``use_fp8`` for fp8 layers, with float32 scales (``round_scale=False, use_ue8m0=False``: the
    sm90 layout): recv_x `[E, C, H]`; recv_scales float32 `[E, C, H/128]` stored column-major
    (strides ``(C * H/128, 1, C)``, the TMA layout deep_gemm reads; the fake declares the same
    strides); masked_m int32 `[E]`; handle ``[src_info int32 [E, C], layout_range int64 [E, P]]``
    (the static ints of deep_ep's handle come from the communicator). Combine is weighted;
    ``out=`` is honoured in place (``ll_combine_out``).

    deep_ep's LL kernels alternate between two internal buffers: every dispatch and every combine
    flips a host-side index and cleans the other buffer for the next call. A captured CUDA graph
    freezes the buffers it was captured with, so keep the call pattern: dispatch then combine in
    every step, in graph replays and in eager steps alike (an eager step between replays must also
    be a dispatch+combine pair), and never hold more than two LL results at once.

Input ids are range-checked on a side stream (a device-side assert that overlaps the deep_ep
kernels; joined before the op returns), or on the host with ``EPMOE_DEBUG=1``.
"""

import os
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from epmoe import _checks, _deps
from epmoe.comm.base import Communicator

OP = "deepep"
LL_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)  # compiled LL kernel variants
HT_INTRANODE_WORLD = (2, 4, 8)  # intranode kernels are instantiated for these rank counts
HT_INTERNODE_WORLD = (16, 24, 32, 48, 64, 96, 128, 144, 160)  # deep_ep's default config table
NVL_PEERS = 8  # deep_ep puts ranks [8k, 8k + 8) on one node; a larger group spans nodes
DEFAULT_NUM_NVL_BYTES = 1 << 30
DEFAULT_NUM_RDMA_BYTES = 1 << 30  # internode HT only; LL sizes come from deep_ep's hint
DEFAULT_NUM_SMS = 20  # deep_ep.Buffer.num_sms default
_NVL_CHUNK_TOKENS = 256  # num_max_nvl_chunked_recv_tokens of deep_ep's intranode default configs
_BUFFER_ALIGN = 128  # deep_ep NUM_BUFFER_ALIGNMENT_BYTES
_INT_MAX = 2**31 - 1  # deep_ep keeps the NVL size in an int when RDMA bytes are also allocated
_LL_TOKEN_ALIGN = 4  # LL scales are TMA-stored: P * max_tokens_per_rank must be a multiple of 4
# deep_ep's sm90 intranode dispatch stages half a row (whole int4 pairs) plus an 8-byte mbarrier in
# 8 KiB of shared memory per warp: rows are a multiple of 32 bytes and at most 16352 bytes.
_HT_ROW_ALIGN, _HT_MAX_ROW_BYTES = 32, 2 * (8192 - 8) // 32 * 32


def _qp_depth() -> int:
    # deep_ep asserts NVSHMEM_QP_DEPTH >= 2 * (max_tokens_per_rank + 1) on every LL call.
    return int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))


# ------------------------------------------------------------------------------------- registry
class _Shared:
    """One deep_ep.Buffer over a set of ranks, plus what its users need from it."""

    def __init__(self, ranks: Tuple[int, ...], kind: str, group):
        self.ranks, self.kind, self.group = ranks, kind, group
        self.needs: Dict[int, dict] = {}  # id(comm) -> requirements
        self.buffer = None
        self.nvl_bytes = self.rdma_bytes = 0
        self.low_latency = False
        # (max_tokens, H, Et) of the last LL call; "clean": zeroed for any layout (fresh buffer);
        # "dirty": an HT call used the shared buffer since.
        self.ll_layout: object = "clean"

    def create(self) -> None:
        deep_ep = _deps.deep_ep()
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "deepep: a deep_ep buffer cannot be created while a CUDA graph is captured; run "
                "one eager step first or call comm.prepare() before capturing"
            )
        needs, world = list(self.needs.values()), len(self.ranks)
        layouts = [n["ll"] for n in needs if n["ll"] is not None]
        nvl = 0 if self.kind == "ll" else max([n["nvl"] for n in needs] or [0])
        rdma = 0
        if self.kind != "ht":
            rdma = max([n["rdma"] for n in needs] or [0])
            for mt, h, et in layouts:
                rdma = max(rdma, deep_ep.Buffer.get_low_latency_rdma_size_hint(mt, h, world, et))
        rdma = -(-rdma // _BUFFER_ALIGN) * _BUFFER_ALIGN
        low_latency = self.kind == "ll" or (self.kind == "shared" and bool(layouts))
        if rdma and nvl > _INT_MAX:
            raise _checks.fail(
                "EPMoE", "num_nvl_bytes", f"at most {_INT_MAX} in a buffer with RDMA bytes", nvl
            )
        qps = 1
        if low_latency or world > NVL_PEERS:
            qps = max([n["qps"] for n in needs] or [1])
        for other in _BUFFERS.values():
            if other is not self and other.rdma_bytes and rdma:
                raise RuntimeError(
                    f"deepep: a second NVSHMEM buffer (ranks {self.ranks}) was requested while one "
                    f"exists (ranks {other.ranks}); deep_ep supports one per process"
                )
        self.buffer = deep_ep.Buffer(
            self.group,
            num_nvl_bytes=nvl,
            num_rdma_bytes=rdma,
            low_latency_mode=low_latency,
            num_qps_per_rank=qps,
            allow_nvlink_for_low_latency_mode=True,
            explicitly_destroy=True,
        )
        self.nvl_bytes, self.rdma_bytes, self.low_latency = nvl, rdma, low_latency
        self.ll_layout = "clean"

    def release(self) -> None:
        if self.buffer is not None:
            self.buffer.destroy()
        self.buffer = None
        self.nvl_bytes = self.rdma_bytes = 0


_BUFFERS: Dict[Tuple[Tuple[int, ...], str], _Shared] = {}


def release_buffers() -> None:
    """Destroy every deep_ep buffer of this process (collective: every rank, same order)."""
    for shared in list(_BUFFERS.values()):
        shared.release()
    _BUFFERS.clear()


def _nvl_bytes_needed(world: int, num_sms: int, h_bytes: int, k: int, s: int, hidden: int) -> int:
    """NVL bytes deep_ep's intranode dispatch and (bf16, unweighted) combine assert on."""
    ch = num_sms // 2
    meta = world * world * 4 + ch * world * 4 * 4  # prefix matrix, channel offsets, head/tail
    per_token = max(h_bytes, 2 * hidden) + 4 + k * 12 + s * 4  # row, src idx, ids+weights, scales
    return meta + ch * world * _NVL_CHUNK_TOKENS * per_token


class DeepEPComm(Communicator):
    """deep_ep backend (``backend="deepep"``); see the module docstring for buffers and contracts.

    Args:
        group: process group of 2 or more ranks, one CUDA device each (the current device); None
            means the default group.
        num_experts: Et, a multiple of the group size. hidden_size: H.
        max_tokens_per_rank: LL capacity per rank; also the worst-case HT bound per rank.
        num_nvl_bytes: NVLink buffer bytes for HT (default 1 GiB; a multiple of 128).
        num_rdma_bytes: RDMA bytes for HT across nodes (default 1 GiB; unused intranode).
        num_sms: SMs of the HT kernels (even; default 20), applied with
            ``deep_ep.Buffer.set_num_sms`` (process-wide in deep_ep); each communicator keeps the
            configs built with its own value.
        share_buffer: one buffer for HT and LL on a single node (always so across nodes).
    """

    name = "deepep"

    def __init__(
        self,
        group,
        num_experts: int,
        hidden_size: int,
        max_tokens_per_rank: Optional[int] = None,
        num_nvl_bytes: int = DEFAULT_NUM_NVL_BYTES,
        num_rdma_bytes: int = DEFAULT_NUM_RDMA_BYTES,
        num_sms: int = DEFAULT_NUM_SMS,
        share_buffer: bool = False,
    ):
        if not dist.is_initialized():
            raise _checks.fail("EPMoE", "group", "an initialized process group for deepep", None)
        if group is None:
            group = dist.group.WORLD
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if world < 2:
            raise _checks.fail("EPMoE", "backend", "'local' for a group of one rank", "'deepep'")
        if world > NVL_PEERS and world % NVL_PEERS:
            raise _checks.fail(
                "EPMoE", "world_size", f"a multiple of {NVL_PEERS} for deepep across nodes", world
            )
        super().__init__(rank, world, num_experts, hidden_size, max_tokens_per_rank)
        if max_tokens_per_rank is not None:
            _checks.check_positive_int("EPMoE", "max_tokens_per_rank", max_tokens_per_rank)
        _checks.check_positive_int("EPMoE", "num_nvl_bytes", num_nvl_bytes)
        _checks.check_multiple("EPMoE", "num_nvl_bytes", num_nvl_bytes, _BUFFER_ALIGN, "(deep_ep)")
        _checks.check_positive_int("EPMoE", "num_rdma_bytes", num_rdma_bytes)
        _checks.check_positive_int("EPMoE", "num_sms", num_sms)
        _checks.check_multiple("EPMoE", "num_sms", num_sms, 2, "(deep_ep pairs SMs per channel)")
        self.group = group
        self.num_nvl_bytes, self.num_sms = num_nvl_bytes, num_sms
        self.internode = world > NVL_PEERS
        shared = self.internode or bool(share_buffer)
        self._kinds = {"ht": "shared" if shared else "ht", "ll": "shared" if shared else "ll"}
        self._ranks = tuple(dist.get_process_group_ranks(group))
        self._ht_configs = None
        self._idx_dtype = None
        self._verified: Dict[str, object] = {}  # mode -> buffer this comm's sizes were checked on
        self._side: Dict[torch.device, torch.cuda.Stream] = {}
        self._ones: Dict[torch.device, torch.Tensor] = {}
        layout = None
        if max_tokens_per_rank is not None:
            layout = (int(max_tokens_per_rank), hidden_size, num_experts)
        self._need = {
            "nvl": num_nvl_bytes,
            "rdma": num_rdma_bytes if self.internode else 0,
            "ll": layout,
            "qps": max(self.num_local_experts if layout else 1, num_sms if self.internode else 1),
        }
        for mode in ("ht", "ll"):
            self._shared(mode)

    # ------------------------------------------------------------------------------- resources
    def _shared(self, mode: str) -> _Shared:
        """The registry entry of ``mode``'s buffer, with this communicator's needs recorded."""
        key = (self._ranks, self._kinds[mode])
        entry = _BUFFERS.get(key)
        if entry is None:
            entry = _BUFFERS[key] = _Shared(self._ranks, self._kinds[mode], self.group)
        entry.needs[id(self)] = self._need
        return entry

    def _buffer(self, mode: str):
        """deep_ep.Buffer for ``mode`` ("ht"/"ll"): created on first use, LL cleaned on a switch."""
        entry = self._shared(mode)
        if entry.buffer is None:
            entry.create()
        if self._verified.get(mode) is not entry.buffer:
            self._verify(mode, entry)
            self._verified[mode] = entry.buffer
        if mode == "ht":
            if entry.kind == "shared":
                entry.ll_layout = "dirty"
            return entry.buffer
        layout = self._need["ll"]
        if entry.ll_layout not in ("clean", layout):
            entry.buffer.clean_low_latency_buffer(*layout)
        entry.ll_layout = layout
        return entry.buffer

    def _verify(self, mode: str, entry: _Shared) -> None:
        """This communicator fits in a buffer that may have been sized before it existed."""
        if mode == "ht":
            if self.num_nvl_bytes > entry.nvl_bytes:
                raise _checks.fail(
                    "EPMoE",
                    "num_nvl_bytes",
                    f"at most the {entry.nvl_bytes} bytes of the deep_ep "
                    "buffer made before this layer (create the largest layer first)",
                    self.num_nvl_bytes,
                )
            return
        if not entry.low_latency:
            raise RuntimeError(
                "deepep: the shared deep_ep buffer was made without LL mode (no layer with "
                "max_tokens_per_rank existed yet); create LL layers before the first HT call"
            )
        mt, h, et = self._need["ll"]
        hint = _deps.deep_ep().Buffer.get_low_latency_rdma_size_hint(mt, h, self.world_size, et)
        if hint > entry.rdma_bytes:
            raise _checks.fail(
                "EPMoE",
                "max_tokens_per_rank",
                f"an LL layout within the {entry.rdma_bytes} RDMA "
                f"bytes of the deep_ep buffer made before this layer (needs {hint}; create the "
                "largest LL layer first)",
                mt,
            )

    def _check_mode(self, mode: str) -> None:
        _checks.check_choice(OP, "mode", mode, ("ht", "ll"))
        if mode == "ll" and not self.max_tokens_per_rank:
            raise _checks.fail(OP, "max_tokens_per_rank", "a positive int for LL mode", None)

    def prepare(self, modes=("ht", "ll")) -> None:
        """Create the deep_ep buffers of ``modes`` now (collective: every rank, same order)."""
        for mode in modes:
            self._check_mode(mode)
            entry = self._shared(mode)
            if entry.buffer is None:
                entry.create()

    def buffer(self, mode: str):
        """The ``deep_ep.Buffer`` used for ``mode`` ("ht"/"ll"), e.g. for raw-library baselines;
        created on first use as in the ops (collective)."""
        self._check_mode(mode)
        return self._buffer(mode)

    def ht_configs(self):
        """(dispatch, combine) ``deep_ep.Config`` used by this communicator's HT calls."""
        return self._configs()

    def close(self) -> None:
        for kind in set(self._kinds.values()):
            entry = _BUFFERS.get((self._ranks, kind))
            if entry is not None:
                entry.needs.pop(id(self), None)

    def _configs(self):
        if self._ht_configs is None:
            buffer_cls = _deps.deep_ep().Buffer
            buffer_cls.set_num_sms(self.num_sms)
            P = self.world_size
            self._ht_configs = (buffer_cls.get_dispatch_config(P), buffer_cls.get_combine_config(P))
        return self._ht_configs

    def _ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        if self._idx_dtype is None:
            dt = getattr(_deps.deep_ep(), "topk_idx_t", torch.int64)
            self._idx_dtype = dt if isinstance(dt, torch.dtype) else torch.int64
        return topk_ids.to(self._idx_dtype).contiguous()

    def _check_device(self, op: str, x: torch.Tensor) -> None:
        here = torch.device("cuda", torch.cuda.current_device())
        if x.device != here:
            raise _checks.fail(op, "x", f"a tensor on the current CUDA device {here}", x.device)

    def _check_ids_async(self, topk_ids: torch.Tensor, op: str):
        """Range-check ids; on a side stream (returned, join it before returning) unless debug."""
        if _checks.debug_enabled() or topk_ids.numel() == 0:
            _checks.check_ids(topk_ids, self.num_experts, op, "topk_ids")
            return None
        side = self._side_stream(topk_ids.device)
        with torch.cuda.stream(side):
            _checks.check_ids(topk_ids, self.num_experts, op, "topk_ids")
        return side

    # ------------------------------------------------------------------------------ validation
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

    # ------------------------------------------------------------------------------------------ HT
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

    def _side_stream(self, dev) -> torch.cuda.Stream:
        """This communicator's side stream on ``dev``, ordered after the current stream's work."""
        side = self._side.get(dev)
        if side is None:
            side = self._side[dev] = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        return side

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

    # ------------------------------------------------------------------------------------------ LL
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


__all__ = ["DeepEPComm", "LL_HIDDEN_SIZES", "release_buffers"]
