"""Stage: quantize activations (FP8 e4m3 per token per group, INT8 per token).

Contract: ``q, s = quantize(x, scheme, group_size=128, masked_m=None, scale_layout="row",
width=None)``

- x: bf16/fp16/fp32 `[M, H]` or `[E, T, H]` (any strides).
- width: Wd, the codes' columns (None: H); Wd >= H (fp8: a multiple of group_size; H then need
  not be one). x is quantized as if zero-extended to Wd columns: codes past H are 0, a group
  that x ends inside has the scale of its zero-extended values, groups past H the floor 1e-10
  (a hidden size zero-padded to the GEMMs' multiple; the padded weight columns are 0 too).
- fp8: q float8_e4m3fn `[..., Wd]`, s float32 `[..., Wd // group_size]`,
  s = max(amax(group) / 448, 1e-10), q = x * (1 / s) (clamped to +-448, round to nearest even).
- int8: q int8 `[..., Wd]`, s float32 `[..., 1]`, s = max(amax(row) / 127, 1e-10),
  q = round-half-away(x * (1 / s)) clamped to [-127, 127].
- masked_m: int32 `[E]` for 3-D input; rows t >= masked_m[e] are unspecified (the kernels never
  read or write them).
- scale_layout: "row" gives a contiguous s; "deepgemm" gives the same values in DeepGEMM's
  MN-major, TMA-aligned layout, strides (1, round_up(M, 4)) for `[M, S]` and
  (S * round_up(T, 4), 1, round_up(T, 4)) for `[E, T, S]`: no transpose before the grouped GEMM.

The two divisions per group (amax / max, 1 / s) are IEEE round-to-nearest (``tl.math.div_rn``) and
the casts round to nearest even, so the CUDA kernels are byte-exact with :mod:`epmoe.reference`.

CUDA-graph safe (static shapes, fixed grid, no host sync). ``group_size`` is the quant block,
unrelated to the permute ``alignment``.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from epmoe import _checks, _config, _launch, quant, reference
from epmoe._contract import (
    Case,
    Choice,
    Contract,
    Multiple,
    PositiveInt,
    Rule,
    Tensor,
    masked_m_steps,
)
from epmoe._jit import (  # noqa: F401 (re-exported for the stage modules)
    _EPS,
    _FP8_MAX,
    _INT8_MAX,
    _INTERPRET,
    _MANUAL_RNE,
    _fp8_rne,
    _int8_scale,
    _quant_fp8_groups,
    _quant_int8,
    round_float,
)
from epmoe._launch import pdl
from epmoe._stage import stage
from epmoe.kernels.scales import alloc_scales, as_layout  # noqa: F401 (stages import them here)

OP = "quantize"
SCALE_LAYOUTS = ("row", "deepgemm")
SCHEMES = tuple(s.name for s in quant.QUANTIZED)  # (bf16 has no codes to make)
GROUPED = tuple(s.name for s in quant.QUANTIZED if s.act_group)  # scales per channel group


# ------------------------------------------------------------------------------ launch config
@_config.frozen
class QuantizeConfig:
    """Launch parameters of the quantize kernels; max_warps, min_slots and masked_programs also
    steer the activation kernels (design notes: docs/kernels.md)."""

    fp8_tile: int = 1024  # elements per fp8 program and row (larger tiles: register pressure)
    fp8_block_m: int = 4  # rows per fp8 program: four independent row loads in flight a thread
    fp8_tile_masked: int = 8192  # masked (decode): a row per program, few find no live row
    int8_single_pass_max: int = 8192  # rows up to this many elements stay in registers
    int8_chunk: int = 4096  # chunk of the two-pass loop for longer rows (second read hits L2)
    int8_row_tile: int = 4096  # unmasked int8: shorter rows are batched into one program
    int8_warps: int = 4  # unmasked int8 (more warps wait longer on the row's amax)
    masked_programs: int = 2048  # target programs over [E, slots] for masked inputs (row loops)
    min_slots: int = 16  # row slots per expert at least: ~8 live rows per expert in parallel
    max_warps: int = 8  # warps of programs over 4096 elements


CONFIG = QuantizeConfig()


def override(**fields):
    """Context manager: quantize (and the activation kernels' shared fields) launch with these
    CONFIG fields inside the block (sweeps, scripts/compile_kernels.py, tests)."""
    return _config.override(__name__, **fields)


@triton.jit
def _fp8_tile(
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    """The [R, BLOCK_G] tile of an fp8 program: R = BLOCK_M x GROUPS_PER_PROG (row, group) pairs,
    groups from program_id(2) * GROUPS_PER_PROG. Returns (row in the row block `[R]`, group
    `[R]`, lane `[BLOCK_G]`, column `[R, BLOCK_G]`)."""
    r = tl.arange(0, BLOCK_M * GROUPS_PER_PROG)
    groups = tl.program_id(2) * GROUPS_PER_PROG + r % GROUPS_PER_PROG
    inner = tl.arange(0, BLOCK_G)
    return r // GROUPS_PER_PROG, groups, inner, groups[:, None] * GROUP + inner[None, :]


# -------------------------------------------------------------------------------------- kernels
# Grid (slots, E, column chunks). A program handles BLOCK_M rows at a time, row blocks slot,
# slot + NUM_SLOTS, ... below the expert's bound: one block when unmasked (NUM_SLOTS covers T), a
# short loop for masked inputs (a fixed grid whatever masked_m holds).


@triton.jit
def _quant_fp8_kernel(
    # tensors
    x_ptr, q_ptr, s_ptr, mm_ptr,
    # sizes
    T, H, NUM_GROUPS, NUM_SLOTS,
    # strides (elements)
    stride_xe, stride_xt, stride_xh, stride_qe, stride_qt,
    stride_se, stride_st, stride_sg,
    # meta
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_MASK: tl.constexpr, PAD: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """NUM_GROUPS groups of q's row; with PAD (q wider than x) x's H columns read, the rest 0."""
    pdl(PDL)
    slot = tl.program_id(0)
    e = tl.program_id(1)
    rows, groups, inner, cols = _fp8_tile(GROUP, BLOCK_G, GROUPS_PER_PROG, BLOCK_M)
    cmask = (groups[:, None] < NUM_GROUPS) & (inner[None, :] < GROUP)
    bound = T  # rows of expert e to process: min(masked_m[e], T), or T
    if HAS_MASK:  # (masked_m loaded here, not in a helper: torch.compile would see it written)
        bound = tl.minimum(tl.load(mm_ptr + e).to(tl.int32), T)
    e64 = e.to(tl.int64)
    for t0 in range(slot * BLOCK_M, bound, NUM_SLOTS * BLOCK_M):
        t = t0 + rows
        live = t < bound
        t64 = t.to(tl.int64)
        m = cmask & live[:, None]
        xm = m
        if PAD:  # (columns past x's end: zeros, quantized as such)
            xm = m & (cols < H)
        x_row = x_ptr + e64 * stride_xe + t64 * stride_xt
        x = tl.load(x_row[:, None] + cols * stride_xh, mask=xm, other=0.0)
        q, s = _quant_fp8_groups(x.to(tl.float32))
        tl.store(q_ptr + e64 * stride_qe + (t64 * stride_qt)[:, None] + cols, q, mask=m)
        s_off = e64 * stride_se + t64 * stride_st + groups * stride_sg
        tl.store(s_ptr + s_off, s, mask=(groups < NUM_GROUPS) & live)


@triton.jit
def _quant_int8_kernel(
    # tensors
    x_ptr, q_ptr, s_ptr, mm_ptr,
    # sizes
    T, H, NUM_SLOTS, WD,
    # strides (elements)
    stride_xe, stride_xt, stride_xh, stride_qe, stride_qt, stride_se, stride_st,
    # meta
    BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, SINGLE_PASS: tl.constexpr,
    HAS_MASK: tl.constexpr, PAD: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Rows of H values; with PAD (q wider than x: WD columns, else None) codes past H are 0."""
    pdl(PDL)
    slot = tl.program_id(0)
    e = tl.program_id(1)
    offs = tl.arange(0, BLOCK_H)
    bound = T  # rows of expert e to process: min(masked_m[e], T), or T
    if HAS_MASK:  # (masked_m loaded here, not in a helper: torch.compile would see it written)
        bound = tl.minimum(tl.load(mm_ptr + e).to(tl.int32), T)
    e64 = e.to(tl.int64)
    for t0 in range(slot * BLOCK_M, bound, NUM_SLOTS * BLOCK_M):
        t = t0 + tl.arange(0, BLOCK_M)
        live = t < bound
        t64 = t.to(tl.int64)
        x_row = (x_ptr + e64 * stride_xe + t64 * stride_xt)[:, None]
        q_row = (q_ptr + e64 * stride_qe + t64 * stride_qt)[:, None]
        if SINGLE_PASS:
            m = live[:, None] & (offs[None, :] < H)
            x = tl.load(x_row + offs[None, :] * stride_xh, mask=m, other=0.0).to(tl.float32)
            s = _int8_scale(tl.max(tl.abs(x), axis=1))
            qm = m
            if PAD:  # (x's zeros past H: zero codes)
                qm = live[:, None] & (offs[None, :] < WD)
            tl.store(q_row + offs[None, :], _quant_int8(x, s), mask=qm)
        else:
            amax = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                c = h0 + offs[None, :]
                m = live[:, None] & (c < H)
                x = tl.load(x_row + c * stride_xh, mask=m, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            s = _int8_scale(tl.max(amax, axis=1))
            for h0 in range(0, WD if PAD else H, BLOCK_H):
                c = h0 + offs[None, :]
                m = live[:, None] & (c < H)
                x = tl.load(x_row + c * stride_xh, mask=m, other=0.0).to(tl.float32)
                qm = m
                if PAD:
                    qm = live[:, None] & (c < WD)
                tl.store(q_row + c, _quant_int8(x, s), mask=qm)
        tl.store(s_ptr + e64 * stride_se + t64 * stride_st, s, mask=live)


# ----------------------------------------------------------------------------- host-side helpers


def max_warps() -> int:
    """Warps a stage program may use at most (CONFIG.max_warps, read when launching)."""
    return CONFIG.max_warps


def _warps(elements: int) -> int:
    """4 warps up to 4096 elements a program (32 a thread), CONFIG.max_warps above."""
    return CONFIG.max_warps if elements > 4096 else 4


def num_slots(e: int, t: int, masked: bool, block_m: int = 1, chunks: int = 1) -> int:
    """Row-block slots per expert (grid axis 0); a program handles row blocks slot, slot + slots,
    ... of ``block_m`` rows each.

    Unmasked: one block per program. Masked: enough programs to fill the GPU when few rows are
    live, a fixed number so the grid does not depend on masked_m; ``chunks`` column programs a
    row (grid axis 2) count toward that number: wide rows of few experts get fewer slots, not a
    grid of programs past the counts (docs/kernels.md).
    """
    blocks = _launch.cdiv(t, block_m)
    if not masked:
        return blocks
    # (imin: t may be an unbacked size under torch.compile, and min() would guard on it)
    cfg = CONFIG
    return _launch.imin(blocks, max(cfg.min_slots, cfg.masked_programs // max(e * chunks, 1)))


def fp8_tiling(groups: int, group_size: int, masked: bool, cfg) -> Tuple[int, int, int]:
    """(BLOCK_G, groups per program, rows per program) of the fp8 kernels; ``cfg``: the stage's
    config (quantize's or the activation's: its fp8_tile, fp8_tile_masked, fp8_block_m)."""
    block_g = _launch.pow2(group_size)
    tile = cfg.fp8_tile if not masked else cfg.fp8_tile_masked
    gpp = min(_launch.pow2(max(groups, 1)), max(1, tile // block_g))
    return block_g, gpp, (cfg.fp8_block_m if not masked else 1)


def int8_tiling(n: int, masked: bool, cfg) -> Tuple[int, int, bool]:
    """(BLOCK, rows per program, single pass) of the int8 kernels for rows of n elements: small
    rows are batched up to cfg.int8_row_tile elements a program (more loads in flight per
    thread); ``cfg``: the stage's config (its int8_single_pass_max, int8_chunk, int8_row_tile)."""
    single = n <= cfg.int8_single_pass_max
    block = _launch.pow2(max(n, 1)) if single else cfg.int8_chunk
    block_m = 1 if masked else max(1, cfg.int8_row_tile // block)
    return block, block_m, single


def launch_quant(
    x: torch.Tensor,
    q: torch.Tensor,
    s: torch.Tensor,
    scheme: str,
    group_size: int,
    masked_m: Optional[torch.Tensor],
) -> None:
    """Quantize x `[M, H]` / `[E, T, H]` into preallocated q (contiguous, ``[..., Wd >= H]``:
    zero codes past H) and s (any strides)."""
    masked = masked_m is not None
    wd = q.shape[-1]
    launch = _quant_launch(
        scheme, group_size, tuple(x.shape), x.stride(), q.stride(), s.stride(), masked, CONFIG,
        None if wd == x.shape[-1] else wd,
    )  # fmt: skip
    launch(x, q, s, masked_m if masked else x)  # (x: a placeholder pointer, never read)


def dims(shape, strides) -> Tuple[int, int, Tuple[int, int, int]]:
    """(E, T, strides (e, t, h)) of a 2-D (E = 1) or 3-D tensor of this shape and strides (sizes
    only: launch plans are cached on them)."""
    if len(shape) == 2:
        return 1, shape[0], (0, *strides)
    return shape[0], shape[1], tuple(strides)


@_launch.memo
def _quant_launch(scheme, group_size, shape, x_strides, q_strides, s_strides, masked, cfg,
                  width=None):  # fmt: skip
    """The quantize kernel's launch for x of this shape and these strides (width: q's columns
    when wider than x, else None)."""
    E, T, (sxe, sxt, sxh) = dims(shape, x_strides)
    H = shape[-1]
    wd = H if width is None else width
    _, _, (sqe, sqt, _) = dims(shape, q_strides)
    _, _, (sse, sst, ssg) = dims(shape, s_strides)
    # no `if` on sizes (they may be symbolic under torch.compile): an empty grid launches nothing
    if quant.get(scheme, OP, "scheme").act_group is not None:  # scales per channel group
        groups = wd // group_size
        block_g, gpp, block_m = fp8_tiling(groups, group_size, masked, cfg)
        chunks = _launch.cdiv(groups, gpp)
        slots = num_slots(E, T, masked, block_m, chunks)
        return _launch.Prepared(
            _quant_fp8_kernel,
            (slots, E, chunks),
            (T, H, groups, slots, sxe, sxt, sxh, sqe, sqt, sse, sst, ssg),
            dict(
                GROUP=group_size, BLOCK_G=block_g, GROUPS_PER_PROG=gpp, BLOCK_M=block_m,
                HAS_MASK=masked, PAD=width is not None, num_warps=_warps(block_m * gpp * block_g),
            ),
        )  # fmt: skip
    # one scale per row (int8); width None: a constexpr, no kernel parameter (the kernel as it was)
    block, block_m, single = int8_tiling(wd, masked, cfg)
    slots = num_slots(E, T, masked, block_m)
    return _launch.Prepared(
        _quant_int8_kernel,
        (slots, E),
        (T, H, slots, width, sxe, sxt, sxh, sqe, sqt, sse, sst),
        dict(
            BLOCK_H=block, BLOCK_M=block_m, SINGLE_PASS=single, HAS_MASK=masked,
            PAD=width is not None,
            num_warps=_warps(block_m * block) if masked else cfg.int8_warps,
        ),
    )  # fmt: skip


def _quantize_triton(
    x: torch.Tensor,
    scheme: str,
    group_size: int = 128,
    masked_m: Optional[torch.Tensor] = None,
    scale_layout: str = "row",
    width: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Allocate outputs and launch the kernels (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    q, s = _outputs(x, scheme, group_size, masked_m, scale_layout, width)
    launch_quant(x, q, s, scheme, group_size, masked_m)
    return q, s


# ------------------------------------------------------------------------------------------ op
CONTRACT = Contract(
    OP,
    "x scheme group_size masked_m scale_layout width",
    Choice("scheme", SCHEMES),
    Tensor("x", _checks.FLOAT_DTYPES, ndim=(2, 3)),
    PositiveInt("group_size"),
    Choice("scale_layout", SCALE_LAYOUTS),
    Rule(
        "width is None or (type(width) is int and width >= x.shape[-1])",
        "width",
        lambda a: f"None or an int >= H = {a.x.shape[-1]} (x's columns)",
        lambda a: repr(a.width),
    ),
    Case(
        "scheme in GROUPED",
        [
            Case(
                "width is None",
                [Multiple("x.shape[-1]", "x.shape[-1]", "group_size", "(fp8 group_size)")],
                [Multiple("width", "width", "group_size", "(fp8 group_size)")],
            )
        ],
    ),
    *masked_m_steps("x"),
    consts=dict(GROUPED=GROUPED),
)


def _reference(x, scheme, group_size, masked_m, scale_layout="row", width=None):
    q, s = reference.quantize(x, scheme, group_size, width)
    return q, as_layout(s, scale_layout)


def _outputs(x, scheme, group_size=128, masked_m=None, scale_layout="row", width=None):
    """The op's (q, s), allocated (the CUDA launch fills them; the fake returns them)."""
    qs = quant.get(scheme, OP, "scheme")
    wd = x.shape[-1] if width is None else width
    q = torch.empty((*x.shape[:-1], wd), dtype=qs.act_dtype, device=x.device)
    groups = qs.act_scale_cols(wd, group_size)
    return q, alloc_scales(tuple(x.shape[:-1]), groups, scale_layout, x.device)


@stage(contract=CONTRACT, fake=_outputs, reference=_reference, cuda=_quantize_triton)
def quantize(
    x: torch.Tensor,
    scheme: str,
    group_size: int = 128,
    masked_m: Optional[torch.Tensor] = None,
    scale_layout: str = "row",
    width: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations; see the module docstring for the contract.

    Args:
        x: bf16/fp16/fp32 `[M, H]` or `[E, T, H]`.
        scheme: "fp8" or "int8".
        group_size: channels per fp8 scale (the codes' width must be a multiple); ignored for
            int8.
        masked_m: optional int32 `[E]` rows per expert for 3-D x.
        scale_layout: "row" (contiguous s) or "deepgemm" (MN-major, TMA-aligned s).
        width: Wd >= H, the codes' columns (None: H), x zero-extended to them (a zero-padded
            hidden size): codes past H are 0, scales over x's values.
    Returns:
        (q float8_e4m3fn/int8 `[..., Wd]` (contiguous), s float32 `[..., Wd // group_size]`
        (fp8) or `[..., 1]` (int8)).
    """
