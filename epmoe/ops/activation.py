"""Stage: the gate activation between the two grouped GEMMs (SiLU-and-mul by default),
optionally fused with the next quantize.

Shape legend: ``E`` local experts, ``T`` rows per expert (3-D), ``M_sum`` rows (2-D), ``I``
intermediate size, ``W`` y's width: 2I for a GLU gate (gate columns, then up), I without.

Contract:
- ``h = silu_and_mul(y, masked_m=None, m_indices=None, expert_offsets=None, gate="silu",
  bias=None)``: y bf16/fp16/fp32 `[..., W]` (`[M_sum, W]` or `[E, T, W]`) -> y.dtype `[..., I]`:
  g, u = y's gate and up values (+ the bias row of the row's expert, added in float32), h =
  the gate's h (:class:`epmoe.gate.Gate`: silu(g) * u by default) in float32, rounded to y.dtype.
- gate: str, a gate spec (:func:`epmoe.gate.parse`: "silu", "silu:alpha=1.702,limit=7,
  up_offset=1", "relu2:glu=0", ...); a bad spec is a ValueError before any kernel.
- bias: optional bf16/fp16/fp32 `[E_b, W]` (gate then up halves for a GLU gate): row r adds
  bias[m_indices[r]] for 2-D y (m_indices required, ids < E_b: not checked), bias[e] for 3-D y
  (E_b == E).
- ``q, s = silu_and_mul_quant(y, scheme, masked_m=None, group_size=128, m_indices=None,
  scale_layout="row", expert_offsets=None, gate="silu", bias=None)``: same, then the quantize
  rules of :mod:`epmoe.ops.quantize` applied to the y.dtype-rounded activation (identical to the
  unfused pair); ``scale_layout`` as in quantize; fp8: I a multiple of group_size.
- masked_m: int32 `[E]` for 3-D y: rows t >= masked_m[e] are unspecified and never read.
- m_indices: int32 `[M_sum]` for 2-D y (the permute layout): rows with m_indices == -1 (alignment
  padding, unused tail) are unspecified and never read.
- expert_offsets: int32 `[E + 1]` for 2-D y (permute's): rows >= expert_offsets[-1] (the unused
  tail of the static M_sum bound, about half of it at workload W) are unspecified and never
  touched; a fixed number of programs loops over the rows below it.

CUDA-graph safe (fixed grid from shapes only); no alignment needed (any strides). The fused
kernels use the same gate code as the unfused one and the quantizer of :mod:`epmoe.ops.quantize`,
so ``silu_and_mul_quant(y, ...)`` equals ``quantize(silu_and_mul(y, ...))`` bit for bit on the
same backend. The gate is a kernel constexpr: the default "silu" without bias compiles to the
plain SiLU-GLU kernels.
"""

from typing import Optional, Tuple

import torch

from epmoe import _checks, _config, _launch, quant, reference
from epmoe import gate as _gate
from epmoe._contract import (
    Case,
    Choice,
    Contract,
    Multiple,
    PositiveInt,
    Rule,
    Shape,
    Tensor,
    masked_m_steps,
)
from epmoe._stage import stage
from epmoe.ops import quantize as _quantize

# kernels and jit helpers by name (tests and scripts reach them as attributes of this module)
from epmoe.ops._activation_kernels import (  # noqa: F401 - _gate_rounded etc. are re-exported
    _gate_rounded,
    _live_rows,
    _silu_mul_fp8_kernel,
    _silu_mul_int8_kernel,
    _silu_mul_kernel,
)
from epmoe.ops.quantize import (  # host helpers, by name
    SCALE_LAYOUTS,
    _warps,
    alloc_scales,
    as_layout,
    dims,
    fp8_tiling,
    int8_tiling,
    max_warps,
    num_slots,
)

OP = "silu_and_mul"
OPQ = "silu_and_mul_quant"


# ------------------------------------------------------------------------------ launch config
@_config.frozen
class ActivationConfig:
    """Launch parameters of the activation kernels; warps and masked slots come from the quantize
    module's config (design notes: docs/kernels.md)."""

    silu_tile: int = 2048  # outputs per silu_and_mul program and row: 8 KiB of bf16 input
    silu_block_m: int = 2  # rows per silu_and_mul program (unmasked): more loads in flight
    fp8_tile: int = 2048  # outputs per fused fp8 program and row (groups x group size): 8 KiB
    fp8_block_m: int = 1  # rows per fused fp8 program (unmasked)
    fp8_tile_masked: int = 1024  # masked (decode): a row of I = 2048 in two programs
    # I up to this stays in registers (Mixtral's 14336: 64 elements a thread at 8 warps); longer:
    # a second pass
    int8_single_pass_max: int = 16384
    int8_chunk: int = 4096
    int8_row_tile: int = 2048  # unmasked int8: shorter rows are batched into one program
    # elements a thread of the unmasked int8 kernel: the row's amax is a reduction over the whole
    # program, so fewer warps per row wait on each other
    int8_thread_elems: int = 32
    # m_indices without expert_offsets: programs per column chunk looping over the row blocks,
    # the next block's m_indices prefetched
    row_programs: int = 8192
    # with expert_offsets: programs looping over the rows below expert_offsets[-1] (a program per
    # row of the unused tail would cost a memory latency each)
    offsets_programs: int = 8192
    row_stages: int = 1  # software-pipelining stages of the row loops (tl.range num_stages)


CONFIG = ActivationConfig()


def override(**fields):
    """Context manager: the activation kernels launch with these CONFIG fields inside the block
    (sweeps, scripts/compile_kernels.py, tests)."""
    return _config.override(__name__, **fields)


# sigmoids with the MUFU ex2 / rcp instructions (see epmoe.gate); the interpreter runs no PTX
_FAST_MATH = not _launch._INTERPRET


# ----------------------------------------------------------------------------- host-side launch
# The row bound the kernels read: none, expert_offsets[-1] (HT: the unused tail is skipped) or
# masked_m (decode: few live rows per expert)
_NO_BOUND, _OFFSETS, _MASKED = 0, 1, 2


def _bound(y, masked_m, expert_offsets) -> Tuple[torch.Tensor, int]:
    """(the tensor the kernels read the row bound from, its kind)."""
    if masked_m is not None:
        return masked_m, _MASKED
    if expert_offsets is not None:
        return expert_offsets[-1:], _OFFSETS
    return y, _NO_BOUND  # placeholder pointer, never read


def _slots(E, T, kind: int, block_m: int, has_rows: bool, cfg: ActivationConfig,
           chunks: int = 1) -> int:  # fmt: skip
    """Row-block slots (grid axis 0) of rows in ``chunks`` column programs. With m_indices, or
    with expert_offsets, a fixed number of programs loops over the row blocks (prefetching the
    next block's m_indices); programs past the bound (the unused tail) then never start."""
    slots = num_slots(E, T, kind == _MASKED, block_m, chunks)
    # (imin: the rows may be an unbacked size, exact-size HT under torch.compile, and min()
    # would guard on it)
    if kind == _OFFSETS:
        return _launch.imin(slots, cfg.offsets_programs)
    if has_rows:
        return _launch.imin(slots, cfg.row_programs)
    return slots


def _out_width(spec: str, width: int, op: str) -> int:
    """I of y's width for the gate ``spec`` (the default's without a parse: host time per call)."""
    return width // 2 if spec == "silu" else _gate.parse(spec, op).inter(width)


def _bias_args(b_strides) -> Tuple[Tuple[int, int], dict]:
    """(bias strides, HAS_BIAS meta) of a launch; ``b_strides`` None: no bias (the kernel never
    reads its placeholder)."""
    return (b_strides or (0, 0)), dict(HAS_BIAS=b_strides is not None)


@_launch.memo
def _silu_launch(shape, y_strides, kind, has_rows, spec, b_strides, cfg, qcfg):
    """The silu_and_mul kernel's launch for y of this shape and strides (h contiguous), gate
    ``spec`` and bias strides ``b_strides`` (None: no bias); ``qcfg`` as in
    :func:`_silu_quant_launch`."""
    g = _gate.parse(spec, OP)
    inter = g.inter(shape[-1])
    E, T, (sye, syt, syh) = dims(shape, y_strides)
    she, sht = (T * inter if len(shape) == 3 else 0), inter
    block = min(_launch.pow2(max(inter, 1)), cfg.silu_tile)
    block_m = 1 if kind == _MASKED else cfg.silu_block_m
    chunks = _launch.cdiv(inter, block)
    slots = _slots(E, T, kind, block_m, has_rows, cfg, chunks)
    # no `if` on sizes: T may be unbacked (exact-size HT under torch.compile); an empty grid
    # launches nothing
    b_tail, b_meta = _bias_args(b_strides)
    return _launch.Prepared(
        _silu_mul_kernel,
        (slots, E, chunks),
        (T, inter, slots, sye, syt, syh, she, sht, *b_tail),
        dict(
            BLOCK=block, BLOCK_M=block_m, HAS_MASK=kind != _NO_BOUND, HAS_ROWS=has_rows,
            STAGES=cfg.row_stages, FAST=_FAST_MATH, num_warps=_warps(block * block_m),
            **b_meta, **g.meta(),
        ),
    )  # fmt: skip


def _silu_and_mul_triton(
    y: torch.Tensor,
    masked_m: Optional[torch.Tensor] = None,
    m_indices: Optional[torch.Tensor] = None,
    expert_offsets: Optional[torch.Tensor] = None,
    gate: str = "silu",
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """silu_and_mul on CUDA (or CPU tensors under TRITON_INTERPRET=1)."""
    h = _output(y, masked_m, m_indices, expert_offsets, gate)
    bound, kind = _bound(y, masked_m, expert_offsets)
    has_rows = m_indices is not None
    b_strides = None if bias is None else bias.stride()
    launch = _silu_launch(
        tuple(y.shape), y.stride(), kind, has_rows, gate, b_strides, CONFIG, _quantize.CONFIG
    )
    launch(y, h, bound, m_indices if has_rows else y, y if bias is None else bias)
    return h


@_launch.memo
def _silu_quant_launch(scheme, group_size, shape, y_strides, s_strides, kind, has_rows, spec,
                       b_strides, cfg, qcfg):  # fmt: skip
    """The fused silu_and_mul + quantize kernel's launch for y of this shape and strides (q
    contiguous, scales of these strides), gate ``spec`` and bias strides ``b_strides`` (None: no
    bias). ``qcfg``: the quantize config in force, which the slot and warp counts read (a key of
    the cache only)."""
    g = _gate.parse(spec, OPQ)
    inter = g.inter(shape[-1])
    E, T, (sye, syt, syh) = dims(shape, y_strides)
    sqe, sqt = (T * inter if len(shape) == 3 else 0), inter
    _, _, (sse, sst, ssg) = dims(shape, s_strides)
    b_tail, b_meta = _bias_args(b_strides)
    flags = dict(HAS_MASK=kind != _NO_BOUND, HAS_ROWS=has_rows, STAGES=cfg.row_stages,
                 FAST=_FAST_MATH, **b_meta, **g.meta())  # fmt: skip
    masked = kind == _MASKED
    if quant.get(scheme, OPQ, "scheme").act_group is not None:  # grouped scales: fp8's kernel
        groups = inter // group_size
        block_g, gpp, block_m = fp8_tiling(groups, group_size, masked, cfg)
        chunks = _launch.cdiv(groups, gpp)
        slots = _slots(E, T, kind, block_m, has_rows, cfg, chunks)
        return _launch.Prepared(
            _silu_mul_fp8_kernel,
            (slots, E, chunks),
            (T, inter, groups, slots, sye, syt, syh, sqe, sqt, sse, sst, ssg, *b_tail),
            dict(
                GROUP=group_size, BLOCK_G=block_g, GROUPS_PER_PROG=gpp, BLOCK_M=block_m,
                num_warps=_warps(block_m * gpp * block_g), **flags,
            ),
        )  # fmt: skip
    block, block_m, single = int8_tiling(inter, masked, cfg)
    slots = _slots(E, T, kind, block_m, has_rows, cfg)
    if masked:
        warps = _warps(block * block_m)
    else:
        warps = _int8_warps(block * block_m, cfg.int8_thread_elems)
    return _launch.Prepared(  # one scale per row: int8's kernel
        _silu_mul_int8_kernel,
        (slots, E),
        (T, inter, slots, sye, syt, syh, sqe, sqt, sse, sst, *b_tail),
        dict(BLOCK=block, BLOCK_M=block_m, SINGLE_PASS=single, num_warps=warps, **flags),
    )


def _silu_and_mul_quant_triton(
    y: torch.Tensor,
    scheme: str,
    masked_m: Optional[torch.Tensor] = None,
    group_size: int = 128,
    m_indices: Optional[torch.Tensor] = None,
    scale_layout: str = "row",
    expert_offsets: Optional[torch.Tensor] = None,
    gate: str = "silu",
    bias: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fused silu_and_mul + quantize on CUDA (or CPU tensors under TRITON_INTERPRET=1)."""
    shape = tuple(y.shape)
    q, s = _outputs_quant(
        y, scheme, masked_m, group_size, m_indices, scale_layout, expert_offsets, gate
    )
    bound, kind = _bound(y, masked_m, expert_offsets)
    has_rows = m_indices is not None
    b_strides = None if bias is None else bias.stride()
    launch = _silu_quant_launch(
        scheme, group_size, shape, y.stride(), s.stride(), kind, has_rows, gate, b_strides,
        CONFIG, _quantize.CONFIG,
    )  # fmt: skip
    launch(y, q, s, bound, m_indices if has_rows else y, y if bias is None else bias)
    return q, s


def _int8_warps(elements, thread_elems: int) -> int:
    """Warps of an unmasked int8 program: thread_elems elements a thread, a power of two up to
    the quantize config's max_warps. A plain int also when ``elements`` is symbolic (opcheck's
    dynamic shapes): the comparisons guard, where arithmetic would hand the launcher an
    unhashable SymInt."""
    warps = 1
    while warps < max_warps() and elements > warps * 32 * thread_elems:
        warps *= 2
    return warps


# ------------------------------------------------------------------------------------------ ops
_ROWS_WANTED = "int32 [M_sum] (each row's expert) with a bias on a 2-D y"


def _act_steps():
    """The contract steps of y, its row arguments, the gate and the bias, shared by both ops."""
    rows = [
        Case(
            f"{name} is not None",
            [
                Rule("len(y.shape) == 2", name, "None for a 3-D y", "a tensor"),
                Tensor(name, _checks.INT32, ndim=(1,)),
            ],
        )
        for name in ("m_indices", "expert_offsets")
    ]
    offsets_len = Rule(
        "expert_offsets.shape[0] >= 1",
        "expert_offsets",
        "[E + 1] with E >= 0",
        lambda a: list(a.expert_offsets.shape),
    )
    # a 2-D y finds each row's bias through m_indices; a 3-D y has one bias row per expert
    bias_rows = Case(
        "len(y.shape) == 3",
        [Shape("bias", ("y.shape[0]", "y.shape[-1]"))],
        [Rule("m_indices is not None", "m_indices", _ROWS_WANTED, "None")],
    )
    spec = Rule(_gate.OK, "gate", _gate.SPEC_EXPECTED, lambda a: repr(a.gate))
    return (
        Tensor("y", _checks.FLOAT_DTYPES, ndim=(2, 3)),
        spec,
        Case(_gate.GLU, [Multiple("y.shape[-1]", "y.shape[-1]", 2, "(gate and up halves)")]),
        *masked_m_steps("y"),
        *rows,
        Case("m_indices is not None", [Shape("m_indices", ("y.shape[0]",))]),
        Case("expert_offsets is not None", [offsets_len]),
        Tensor("bias", _checks.FLOAT_DTYPES, shape=(None, "y.shape[-1]"), optional=True),
        Case("bias is not None", [bias_rows]),
    )


_CONSTS = dict(_gate.CONTRACT_CONSTS, SCHEMES=quant.SCHEMES)
CONTRACT = Contract(
    OP, "y masked_m m_indices expert_offsets gate bias", *_act_steps(), consts=_CONSTS
)
CONTRACT_QUANT = Contract(
    OPQ,
    "y scheme masked_m group_size m_indices scale_layout expert_offsets gate bias",
    *_act_steps(),
    Choice("scheme", ("fp8", "int8")),
    PositiveInt("group_size"),
    Choice("scale_layout", SCALE_LAYOUTS),
    Case(  # grouped scales (fp8): I whole groups
        "SCHEMES[scheme].act_group is not None",
        [
            Case(
                _gate.GLU,
                [Multiple("y.shape[-1] // 2", "y.shape[-1] // 2", "group_size", "(fp8 group)")],
                [Multiple("y.shape[-1]", "y.shape[-1]", "group_size", "(fp8 group)")],
            )
        ],
    ),
    consts=_CONSTS,
)


def _output(y, masked_m=None, m_indices=None, expert_offsets=None, gate="silu", bias=None):
    """silu_and_mul's h, allocated (the CUDA launch fills it; the fake returns it)."""
    inter = _out_width(gate, y.shape[-1], OP)
    return torch.empty((*y.shape[:-1], inter), dtype=y.dtype, device=y.device)


def _reference(y, masked_m=None, m_indices=None, expert_offsets=None, gate="silu", bias=None):
    return reference.silu_and_mul(y, gate, bias, m_indices)


def _outputs_quant(
    y, scheme, masked_m=None, group_size=128, m_indices=None, scale_layout="row",
    expert_offsets=None, gate="silu", bias=None,
):  # fmt: skip
    """silu_and_mul_quant's (q, s), allocated (the CUDA launch fills them; the fake returns
    them)."""
    lead, inter = tuple(y.shape[:-1]), _out_width(gate, y.shape[-1], OPQ)
    qs = quant.get(scheme, OPQ, "scheme")
    q = torch.empty((*lead, inter), dtype=qs.act_dtype, device=y.device)
    return q, alloc_scales(lead, qs.act_scale_cols(inter, group_size), scale_layout, y.device)


def _reference_quant(
    y, scheme, masked_m=None, group_size=128, m_indices=None, scale_layout="row",
    expert_offsets=None, gate="silu", bias=None,
):  # fmt: skip
    q, s = reference.silu_and_mul_quant(y, scheme, group_size, gate, bias, m_indices)
    return q, as_layout(s, scale_layout)


@stage(contract=CONTRACT, fake=_output, reference=_reference, cuda=_silu_and_mul_triton)
def silu_and_mul(
    y: torch.Tensor,
    masked_m: Optional[torch.Tensor] = None,
    m_indices: Optional[torch.Tensor] = None,
    expert_offsets: Optional[torch.Tensor] = None,
    gate: str = "silu",
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The gate's activation, silu(gate) * up by default, in y.dtype.

    Args:
        y: bf16/fp16/fp32 `[M_sum, W]` or `[E, T, W]`: W = 2I, gate columns first, for a GLU
            gate; W = I without.
        masked_m: optional int32 `[E]` live rows per expert (3-D y); other rows unspecified.
        m_indices: optional int32 `[M_sum]` expert per row (2-D y); rows with -1 unspecified.
        expert_offsets: optional int32 `[E + 1]` (permute's, 2-D y); rows >= expert_offsets[-1]
            (the unused tail of the static bound) are unspecified and never touched.
        gate: the gate's spec string (:func:`epmoe.gate.parse`), e.g. "silu",
            "silu:alpha=1.702,limit=7,up_offset=1", "relu2:glu=0".
        bias: optional bf16/fp16/fp32 `[E_b, W]` added to y (float32) before the gate: row r of
            a 2-D y adds bias[m_indices[r]] (m_indices required), y[e] of a 3-D y bias[e]
            (E_b == E).
    Returns:
        y.dtype `[..., I]`.
    """


@stage(
    contract=CONTRACT_QUANT,
    fake=_outputs_quant,
    reference=_reference_quant,
    cuda=_silu_and_mul_quant_triton,
)
def silu_and_mul_quant(
    y: torch.Tensor,
    scheme: str,
    masked_m: Optional[torch.Tensor] = None,
    group_size: int = 128,
    m_indices: Optional[torch.Tensor] = None,
    scale_layout: str = "row",
    expert_offsets: Optional[torch.Tensor] = None,
    gate: str = "silu",
    bias: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fused silu_and_mul + quantize.

    Args:
        y: bf16/fp16/fp32 `[M_sum, W]` or `[E, T, W]` (W = 2I, gate columns first, or I
            without GLU).
        scheme: "fp8" (per token per ``group_size`` channels) or "int8" (per token).
        masked_m: optional int32 `[E]` live rows per expert (3-D y); other rows unspecified.
        group_size: fp8 channels per scale (I must be a multiple).
        m_indices: optional int32 `[M_sum]` expert per row (2-D y); rows with -1 unspecified.
        scale_layout: "row" or "deepgemm" (see :mod:`epmoe.ops.quantize`).
        expert_offsets: optional int32 `[E + 1]` (permute's, 2-D y); rows >= expert_offsets[-1]
            are unspecified and never touched. With m_indices this is the fast HT path.
        gate: the gate's spec string, as in :func:`silu_and_mul`.
        bias: optional bf16/fp16/fp32 `[E_b, W]`, as in :func:`silu_and_mul`.
    Returns:
        (q float8_e4m3fn/int8 `[..., I]`, s float32 `[..., I // group_size]` (fp8) or `[..., 1]`).
    """
