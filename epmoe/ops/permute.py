"""Stage: permute (HT). Scatter received rows into expert-contiguous, aligned blocks.

Contract: ``p = permute(x, topk_ids, num_experts=E, alignment=A, x_scales=None,
scale_layout="row")``

- x: any dtype (bf16, fp8, int8) `[M, H]`; topk_ids: int32/int64 `[M, K]` local id in [0, E) or
  -1; x_scales: float32 `[M, S]` or None.
- p.x `[M_sum, H]`, M_sum = round_up(M*K + E*(A-1), A) (static in M); p.x_scales `[M_sum, S]` or
  None; p.m_indices int32 `[M_sum]` expert of each row, -1 on padding and unused rows; p.inv_perm
  int32 `[M, K]` row of (t, k) or -1; p.expert_offsets int32 `[E + 1]` block starts (multiples of
  A), last = used rows; p.src_rows int32 `[M_sum]` the row of x each row holds, -1 where m_indices
  is -1 (what a GEMM that gathers its rows reads: :func:`epmoe.ops.grouped_gemm_contiguous`'s
  ``a_rows``).
- x may have no columns (``x[:, :0]``): then only the index outputs are made, no row is copied.
- scale_layout: "row" (contiguous p.x_scales) or "deepgemm" (MN-major, TMA-aligned: strides
  (1, round_up(M_sum, 4)), read by deep_gemm's fp8 GEMM without a transpose); same values.
- Experts' blocks in ascending order; inside a block rows in (t, k) order (deterministic).
- Rows of p.x / p.x_scales with m_indices == -1 are unspecified (the reference zero-fills them; the
  CUDA kernels write none of them but, with DeepGEMM-layout scales, zero scales on the padding
  rows of a row block that holds a used row: at workload W these rows are over half of M_sum).

CUDA-graph safe: one kernel up to CONFIG.small_entries entries, else three (four with
DeepGEMM-layout scales from CONFIG.scales_by_row_min_entries entries), fixed grids from shapes,
no host sync, no atomics (the row order is deterministic) and no zero fill; on sm90 each kernel
after the first starts early (programmatic dependent launch) and waits only before it reads its
predecessor's output.
Each source row is read once and written to all of its local experts. Programs waiting on the
index chain ask the L2 for rows later programs read (a hint: CONFIG.pf_*).
``alignment`` is the grouped-GEMM row block (128 for deep_gemm), never the quant block. Ids outside
[0, E) other than -1 are an error (ValueError on CPU; on CUDA a device assert inside the kernels,
ValueError in debug mode; under torch.compile an async assert after the kernels).
"""

import functools
from typing import NamedTuple, Optional, Tuple

import torch

from epmoe import _checks, _config, _launch, reference
from epmoe._contract import Choice, Contract, PositiveInt, Tensor
from epmoe._stage import stage
from epmoe.ops._permute_kernels import (
    _count_tokens_kernel,
    _place_copy_kernel,
    _rest_scales_kernel,
    _scan_kernel,
    _small_permute_kernel,
)
from epmoe.ops.quantize import SCALE_LAYOUTS, alloc_scales, as_layout  # host helpers, by name

OP = "permute"


# ------------------------------------------------------------------------------ launch config
@_config.frozen
class PermuteConfig:
    """Launch parameters of the permute kernels (design notes: docs/kernels.md)."""

    # (t, k) entries per rank block (whole tokens: block_n // K_PAD); a token's rank compares
    # its K entries with the block's
    block_n: int = 256
    block_scan: int = 1024  # blocks per step of the per-expert prefix scan (no recompile per M)
    block_rows: int = 1024  # m_indices rows per step of an expert's fill loop
    fill_split: int = 4  # programs per expert filling its m_indices (one expert may own all rows)
    copy_bytes: int = 4096  # payload bytes per copy program: 32 B a thread at 4 warps, 128-bit
    copy_warps: int = 4
    # up to this many (t, k) entries (K padded to a power of 2) one kernel does everything: one
    # launch, nothing waits on another kernel
    small_entries: int = 2048
    small_copy_bytes: int = 8192  # payload bytes per one-kernel program (fp8 at H 7168: a row)
    small_warps: int = 4
    # DeepGEMM-layout scales go per destination row block (coalesced MN-major stores, by the
    # second kernel with the column chunks past the first) from this many (t, k) entries; below
    # it the extra launch costs more than it saves
    scales_by_row_min_entries: int = 8192
    scale_tile: int = 4096  # scale values per program of the row-block scale copy
    # cache hints of the payload copy: each source row is read once, each destination row
    # written once and next read by the GEMM
    load_policy: str = "evict_first"  # tl.load eviction_policy of the source rows
    store_cache: str = ".cs"  # tl.store cache_modifier of the destination rows (streaming)
    # per-token scale stores scatter 4 bytes at a time into the MN-major layout: kept in L2 their
    # sectors fill up before they are written back
    scale_policy: str = "evict_last"
    # L2 prefetch by programs waiting at gdc_wait (direct sm90 launches): the copy kernel's
    # programs below pf_per_sm per multiprocessor ask for the chunks of programs pid + j * that,
    # j in [1, pf_waves], while HBM idles on the index chain; pf_rest_*: the same from the second
    # kernel's chunk programs while the copy kernel ends
    pf_waves: int = 2
    pf_per_sm: int = 20
    pf_rest_waves: int = 2
    pf_rest_per_sm: int = 12


CONFIG = PermuteConfig()


def override(**fields):
    """Context manager: permute launches with these CONFIG fields inside the block (sweeps,
    scripts/compile_kernels.py, tests)."""
    return _config.override(__name__, **fields)


class PermuteResult(NamedTuple):
    x: torch.Tensor
    x_scales: Optional[torch.Tensor]
    m_indices: torch.Tensor
    inv_perm: torch.Tensor
    expert_offsets: torch.Tensor
    src_rows: torch.Tensor


# ----------------------------------------------------------------------------- host-side launch
def _by_row(S: int, scale_layout: str, n, cfg: PermuteConfig) -> bool:
    """DeepGEMM-layout scales go per destination row block from cfg.scales_by_row_min_entries
    entries (an unbacked n under torch.compile takes the per-token path: see _launch.at_least)."""
    if S <= 0 or scale_layout != "deepgemm":  # (no guard on n then)
        return False
    return _launch.at_least(n, cfg.scales_by_row_min_entries)


def _aligned16(t: torch.Tensor) -> bool:
    """t's rows start on 16-byte boundaries and are dense."""
    size = t.element_size()
    return t.stride(1) == 1 and (t.stride(0) * size) % 16 == 0 and t.data_ptr() % 16 == 0


def _launch_rest(x, x_scales, topk_ids, inv_perm, src, x_out, s_out, E: int, block_h: int,
                 n_rest: int, scales: bool, pdl: dict, cfg: PermuteConfig) -> None:  # fmt: skip
    """Launches _rest_scales_kernel: column chunks 1..n_rest of every token's row (block_h
    columns each) to its rows in inv_perm, and with ``scales`` the row-block scale copy from the
    rows' source tokens src, its programs spread among the chunk copies (so that the
    latency-bound gathers overlap payload traffic). (Also used alone, its inputs given, by
    scripts/stage_sweep.py.)"""
    M, K = topk_ids.shape
    H = x.shape[1]
    m_sum, S = s_out.shape
    block_s = _launch.pow2(S)
    block_r = max(1, cfg.scale_tile // block_s)
    n_scale = _launch.cdiv(m_sum, block_r) if scales else 0
    stride = (M * n_rest + n_scale) // n_scale if n_scale else 1
    _launch.kernel(_rest_scales_kernel)[(M * n_rest + n_scale,)](
        x_scales, src, s_out, x, topk_ids, inv_perm, x_out,
        S, m_sum, M, H, E, max(n_rest, 1), n_scale, stride,
        x_scales.stride(0), x_scales.stride(1), s_out.stride(0), s_out.stride(1),
        topk_ids.stride(0), topk_ids.stride(1), x.stride(0), x.stride(1),
        K=K, BLOCK_R=block_r, BLOCK_S=block_s, K_PAD=_launch.pow2(K), BLOCK_H=block_h,
        LOAD_POLICY=cfg.load_policy, STORE_CACHE=cfg.store_cache, num_warps=4, **pdl,
        **_scale_vec(x_scales, s_out),
        **_rest_prefetch(x, pdl.get("PDL", False), block_h, cfg),
    )  # fmt: skip


def _rest_prefetch(x, on: bool, block_h: int, cfg: PermuteConfig) -> dict:
    """The second kernel's L2-prefetch constexprs (cfg.pf_rest_*; as the copy kernel's): on for
    direct launches with PDL (sm90) and 16-byte aligned rows."""
    waves = cfg.pf_rest_waves if on and _pf_ok(x, block_h) else 0
    return dict(PF_WAVES=waves, PF_DIST=_pf_dist(x, cfg.pf_rest_per_sm, waves))


def _scale_vec(x_scales: torch.Tensor, s_out: torch.Tensor) -> dict:
    """The row-block scale copy's VEC / S_C constexprs (see _rest_scales_kernel): 16-byte
    accesses for dense 16-byte aligned scale rows (not under torch.compile, whose fake tensors
    have no address)."""
    on = (
        not _checks._tracing(x_scales)
        and _aligned16(x_scales)
        and s_out.stride(0) == 1
        and s_out.stride(1) % 4 == 0
        and s_out.data_ptr() % 16 == 0
    )
    return dict(VEC=bool(on), S_C=x_scales.shape[1] if on else 0)


def _pf_ok(x, block_h: int) -> bool:
    """The bulk prefetch can take x's column chunks of block_h (16-byte aligned, multiples of
    16 bytes; none for x without columns: no zero-size prefetch)."""
    size = x.element_size()
    row = x.shape[1] * size
    return row > 0 and _aligned16(x) and row % 16 == 0 and (block_h * size) % 16 == 0


def _scales_ok(x_scales) -> bool:
    """The bulk prefetch can take x_scales' rows (16-byte aligned, multiples of 16 bytes)."""
    return _aligned16(x_scales) and (x_scales.shape[1] * 4) % 16 == 0


def _prefetch_meta(x, x_scales, on: bool, by_row: bool, block_h: int, cfg: PermuteConfig) -> dict:
    """The copy kernel's L2-prefetch constexprs: all off unless ``on`` (a direct launch with PDL,
    so sm90) and the bulk prefetch can take the pieces (16-byte aligned, multiples of 16)."""
    # (``on`` first: under torch.compile the tensors are fake and have no address)
    waves = cfg.pf_waves if on and _pf_ok(x, block_h) else 0
    scales_ok = on and x_scales is not None and _scales_ok(x_scales)
    return dict(
        PF_SCALES=bool(on and scales_ok and by_row),  # (each token's scales, for the 2nd kernel)
        PF_WAVES=waves,
        PF_DIST=_pf_dist(x, cfg.pf_per_sm, waves),
    )


def _pf_dist(x, per_sm: int, waves: int) -> int:
    """PF_DIST: per_sm programs per multiprocessor of x's device (1, unused, without waves)."""
    return max(1, per_sm * _sm_count(x.get_device())) if waves else 1


@functools.cache
def _sm_count(index: int) -> int:
    """Multiprocessors of CUDA device ``index``."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def _launch_one_kernel(x, x_scales, topk_ids, outs, ok, E: int, A: int, m_sum, in_kernel: bool,
                       cfg: PermuteConfig) -> None:  # fmt: skip
    """Launches _small_permute_kernel: the whole permute in one kernel (up to cfg.small_entries
    entries, no row-block scales) into ``outs`` (the op's 6 tensors); ``ok``: the id check's
    flag, checked here unless the kernel asserts it (``in_kernel``: then a placeholder)."""
    x_out, s_out, m_indices, inv_perm, offsets, src = outs
    has_s = x_scales is not None
    launch = _one_kernel_launch(
        tuple(topk_ids.shape), x.shape[1], x_scales.shape[1] if has_s else 0, E, A, m_sum,
        x.element_size(), x.stride(), x_scales.stride() if has_s else (0, 0), topk_ids.stride(),
        s_out.stride(), in_kernel, cfg,
    )  # fmt: skip
    launch(x, x_scales if has_s else x, topk_ids, inv_perm, x_out, s_out, m_indices, offsets, src,
           ok)  # fmt: skip
    if not in_kernel:
        _checks.check_values(ok, OP, "topk_ids", f"ids in [0, {E}) or -1")


@_launch.memo
def _one_kernel_launch(ids_shape, H, S, E, A, m_sum, elem, x_strides, s_strides, id_strides,
                       out_s_strides, in_kernel, cfg):  # fmt: skip
    """_small_permute_kernel's launch for these sizes, strides and options."""
    M, K = ids_shape
    block_h = min(_launch.pow2(max(H, 1)), max(16, cfg.small_copy_bytes // elem))
    chunks = max(_launch.cdiv(H, block_h), 1)  # (H = 0: one chunk still writes inv_perm)
    spc = _launch.cdiv(S, chunks)  # scales per column chunk
    return _launch.Prepared(
        _small_permute_kernel,
        (M * chunks + E + 1,),
        (M, H, S, spc, E, A, m_sum, chunks, *id_strides, *x_strides, *s_strides, *out_s_strides),
        dict(
            K=K, K_PAD=_launch.pow2(K), N_PAD=_launch.pow2(max(cfg.small_entries, 1)),
            NUM_BINS=_launch.pow2(E + 1), BLOCK_H=block_h,
            BLOCK_S=_launch.pow2(max(spc, 1)), HAS_SCALES=S > 0,
            BLOCK_ROWS=cfg.block_rows, LOAD_POLICY=cfg.load_policy, STORE_CACHE=cfg.store_cache,
            SCALE_POLICY=cfg.scale_policy, ASSERT=in_kernel, num_warps=cfg.small_warps,
            **_checks.assert_build(in_kernel),
        ),
    )  # fmt: skip


def _launch_chain(x, x_scales, topk_ids, outs, ok, E: int, A: int, m_sum, direct: bool,
                  in_kernel: bool, by_row: bool, cfg: PermuteConfig) -> None:  # fmt: skip
    """Launches the kernel chain (count, scan, place and copy, and with ``by_row`` the row-block
    scale copy) into ``outs`` (the op's 6 tensors); ``ok``: the id check's flag, checked here
    unless the scan kernel asserts it (``in_kernel``: then a placeholder)."""
    x_out, s_out, m_indices, inv_perm, offsets, src = outs
    M, K = topk_ids.shape
    H = x.shape[1]
    dev = x.device
    S = x_scales.shape[1] if x_scales is not None else 0
    k_pad = _launch.pow2(K)
    tb = max(1, cfg.block_n // k_pad)  # whole tokens per block
    nb = _launch.cdiv(M, tb)
    block_h = min(_launch.pow2(max(H, 1)), max(16, cfg.copy_bytes // x.element_size()))
    xs = x_scales if x_scales is not None else x
    ssm, sss = x_scales.stride() if x_scales is not None else (0, 0)
    chunks = max(_launch.cdiv(H, block_h), 1)  # (H = 0: one chunk still writes inv_perm)
    spc = _launch.cdiv(S, chunks)  # scales per column chunk
    sit, sik = topk_ids.stride()
    # counts[e, b]: entries of expert e in block b, then those in blocks < b; bad[b]: invalid ids
    # of block b; totals[e]. imax, and no `if` on sizes below: M may be an unbacked size
    # (exact-size HT dispatch under torch.compile); a launch with an empty grid is a no-op
    nb1 = _launch.imax(nb, 1)
    counts = torch.empty((E, nb1), dtype=torch.int32, device=dev)
    bad = torch.empty((nb1,), dtype=torch.int32, device=dev)
    totals = torch.empty((E,), dtype=torch.int32, device=dev)

    # PDL: the kernels after the first are launched with launch_pdl, only by direct launches (the
    # interpreter and wrap_triton's higher-order op see neither the option nor gdc_wait). The
    # first one is launched in stream order: it may not start before the work ahead of permute
    # (the producer of x and topk_ids, the last user of the memory it is given) is done
    use_pdl = direct
    pdl = _launch._PDL if use_pdl else dict(PDL=False)
    _launch.kernel(_count_tokens_kernel)[(nb,)](
        topk_ids, counts, bad, M, K, sit, sik, E, nb,
        TB=tb, K_PAD=k_pad, NUM_BINS=_launch.pow2(E + 1), PDL=use_pdl, num_warps=4,
    )  # fmt: skip
    # the id check: asserted by the scan kernel itself on direct CUDA launches (else below)
    _launch.kernel(_scan_kernel)[(E + 1,)](
        counts, bad, totals, ok, E, nb, BLOCK=cfg.block_scan, ASSERT=in_kernel, num_warps=4,
        **pdl, **_checks.assert_build(in_kernel),
    )  # fmt: skip
    # with row-block scales split off the column chunks past the first to the scale kernel
    chunks_a = 1 if by_row else chunks
    fills = _launch.cdiv((E + 1) * cfg.fill_split, chunks_a)  # fill programs' rows after tokens'
    _launch.kernel(_place_copy_kernel)[((M + fills) * chunks_a,)](
        x, xs, topk_ids, counts, totals, inv_perm, src, x_out, s_out, m_indices, offsets,
        M, H, S, spc, E, nb, A, m_sum, chunks_a,
        sit, sik, x.stride(0), x.stride(1), ssm, sss, s_out.stride(0), s_out.stride(1),
        K=K, K_PAD=k_pad, TB=tb, BLOCK_H=block_h, BLOCK_S=_launch.pow2(max(spc, 1)),
        HAS_SCALES=S > 0 and not by_row, E_PAD=_launch.pow2(E),
        BLOCK_ROWS=cfg.block_rows, SPLIT=cfg.fill_split, LOAD_POLICY=cfg.load_policy,
        STORE_CACHE=cfg.store_cache, SCALE_POLICY=cfg.scale_policy, num_warps=cfg.copy_warps,
        **pdl, **_prefetch_meta(x, x_scales, use_pdl, by_row, block_h, cfg),
    )  # fmt: skip
    if by_row:
        _launch_rest(x, x_scales, topk_ids, inv_perm, src, x_out, s_out, E, block_h,
                     chunks - chunks_a, True, pdl, cfg)  # fmt: skip
    if not in_kernel:
        _checks.check_values(ok, OP, "topk_ids", f"ids in [0, {E}) or -1")


def _outputs(x, topk_ids, E: int, A: int, x_scales, scale_layout: str):
    """The op's 6 outputs, allocated (the CUDA launch fills them; the fake returns them)."""
    M, K = topk_ids.shape
    dev = x.device
    m_sum = reference.permuted_rows(M, K, E, A)
    S = x_scales.shape[1] if x_scales is not None else 0
    return (
        torch.empty((m_sum, x.shape[1]), dtype=x.dtype, device=dev),
        alloc_scales((m_sum,), S, scale_layout, dev),
        torch.empty((m_sum,), dtype=torch.int32, device=dev),
        torch.empty((M, K), dtype=torch.int32, device=dev),
        torch.empty((E + 1,), dtype=torch.int32, device=dev),
        torch.empty((m_sum,), dtype=torch.int32, device=dev),
    )


def _permute_triton(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    alignment: int,
    x_scales: Optional[torch.Tensor] = None,
    scale_layout: str = "row",
    config: Optional[PermuteConfig] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """permute on CUDA (or CPU tensors under TRITON_INTERPRET=1); returns the op's 6 tensors.

    Rows of x / x_scales that no (t, k) maps to (alignment padding, the unused tail) are left
    unwritten. Invalid ids are dropped by the kernels and reported through _checks.check_values.
    ``config``: the launch parameters (default: CONFIG).
    """
    cfg = CONFIG if config is None else config
    M, K = topk_ids.shape
    E, A = num_experts, alignment
    S = x_scales.shape[1] if x_scales is not None else 0
    outs = _outputs(x, topk_ids, E, A, x_scales, scale_layout)
    m_sum = outs[2].shape[0]  # (permuted_rows(M, K, E, A), as _outputs sized m_indices)
    by_row = _by_row(S, scale_layout, M * K, cfg)
    direct = _checks.direct_launch(x)
    in_kernel = _checks.assert_in_kernel(direct)
    # the id check's flag ([1]: Inductor fills a 0-d empty); asserted in the kernel, none: an
    # input as the placeholder the kernel never writes
    ok = topk_ids if in_kernel else torch.empty((1,), dtype=torch.bool, device=x.device)
    if not by_row and _launch.at_most(M * _launch.pow2(K), cfg.small_entries):
        _launch_one_kernel(x, x_scales, topk_ids, outs, ok, E, A, m_sum, in_kernel, cfg)
    else:
        _launch_chain(x, x_scales, topk_ids, outs, ok, E, A, m_sum, direct, in_kernel, by_row,
                      cfg)  # fmt: skip
    return outs


# ------------------------------------------------------------------------------------------ op
CONTRACT = Contract(
    OP,
    "x topk_ids num_experts alignment x_scales scale_layout",
    Tensor("x", None, ndim=(2,)),
    Choice("scale_layout", SCALE_LAYOUTS),
    Tensor("topk_ids", _checks.INDEX_DTYPES, shape=("x.shape[0]", None)),
    PositiveInt("num_experts"),
    PositiveInt("alignment"),
    Tensor("x_scales", (torch.float32,), shape=("x.shape[0]", None), optional=True),
)


def _reference(x, topk_ids, num_experts, alignment, x_scales=None, scale_layout="row"):
    xp, sp, m_indices, inv_perm, offsets, src = reference.permute(
        x, topk_ids, num_experts, alignment, x_scales
    )
    return xp, as_layout(sp, scale_layout), m_indices, inv_perm, offsets, src


def _result(out, x, topk_ids, num_experts, alignment, x_scales, scale_layout) -> PermuteResult:
    xp, sp, m_indices, inv_perm, offsets, src = out
    return PermuteResult(xp, sp if x_scales is not None else None, m_indices, inv_perm, offsets,
                         src)  # fmt: skip


@stage(contract=CONTRACT, fake=_outputs, reference=_reference, cuda=_permute_triton, result=_result)
def permute(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    alignment: int = 128,
    x_scales: Optional[torch.Tensor] = None,
    scale_layout: str = "row",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Permute received rows into the contiguous grouped-GEMM layout (see module docstring).

    Args:
        x: bf16/fp8/int8 `[M, H]`. topk_ids: int32/int64 `[M, K]` local ids or -1.
        num_experts: E, local experts. alignment: A, row block of the grouped GEMM.
        x_scales: float32 `[M, S]` or None.
        scale_layout: layout of the permuted scales: "row" (contiguous) or "deepgemm" (MN-major,
            TMA-aligned, what deep_gemm's fp8 GEMM reads without a transpose).
    Returns:
        PermuteResult(x `[M_sum, H]`, x_scales `[M_sum, S]` | None, m_indices int32 `[M_sum]`,
        inv_perm int32 `[M, K]`, expert_offsets int32 `[E + 1]`, src_rows int32 `[M_sum]`).
    """
