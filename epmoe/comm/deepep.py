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

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from epmoe import _checks, _deps

# HT and LL halves of DeepEPComm (mixins); their constants by name, as this module exported them
from epmoe.comm._deepep_ht import (  # noqa: F401 - re-exported
    _HT_MAX_ROW_BYTES,
    _HT_ROW_ALIGN,
    _NVL_CHUNK_TOKENS,
    HT_INTERNODE_WORLD,
    HT_INTRANODE_WORLD,
    _HTMixin,
    _nvl_bytes_needed,
)
from epmoe.comm._deepep_ll import _LL_TOKEN_ALIGN, LL_HIDDEN_SIZES, _LLMixin, _qp_depth  # noqa: F401
from epmoe.comm.base import Communicator

OP = "deepep"
NVL_PEERS = 8  # deep_ep puts ranks [8k, 8k + 8) on one node; a larger group spans nodes
DEFAULT_NUM_NVL_BYTES = 1 << 30
DEFAULT_NUM_RDMA_BYTES = 1 << 30  # internode HT only; LL sizes come from deep_ep's hint
DEFAULT_NUM_SMS = 20  # deep_ep.Buffer.num_sms default
_BUFFER_ALIGN = 128  # deep_ep NUM_BUFFER_ALIGNMENT_BYTES
_INT_MAX = 2**31 - 1  # deep_ep keeps the NVL size in an int when RDMA bytes are also allocated


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


class DeepEPComm(_HTMixin, _LLMixin, Communicator):
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

    def _side_stream(self, dev) -> torch.cuda.Stream:
        """This communicator's side stream on ``dev``, ordered after the current stream's work."""
        side = self._side.get(dev)
        if side is None:
            side = self._side[dev] = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        return side


__all__ = ["DeepEPComm", "LL_HIDDEN_SIZES", "release_buffers"]
