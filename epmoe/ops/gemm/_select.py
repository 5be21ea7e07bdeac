"""Backend choice of the grouped GEMM: scheme of a dtype, deep_gemm entry points, row blocks.

Also the fp8 activation-scale layout deep_gemm reads as is (:func:`empty_fp8_act_scales`).
"""

import functools
import math
from typing import Sequence, Tuple

import torch

from epmoe import _checks, _deps, _launch, quant
from epmoe import gate as _gate
from epmoe.ops.gemm import _tuned
from epmoe.ops.gemm._triton import MIN_ROW_BLOCK, _masked_tiling, masked_gate_tiling

OP = "grouped_gemm"
A_DTYPES = tuple(s.act_dtype for s in quant.SCHEMES.values())

# int8's default alignment (its prefill tiles); our Triton kernels take any multiple of
# _triton.MIN_ROW_BLOCK (each BLOCK_M row block inside one expert)
_INT8_ROW_BLOCK = 128
# GPU capabilities our Triton kernels run each scheme on (fp8 tensor-core dots: sm89+)
_TRITON_CAP = {quant.BF16: (8, 0), quant.FP8: (8, 9), quant.INT8: (8, 0)}
# GPU majors deep_gemm runs each scheme on for us (none: int8). Its float32-scale (1x128 / 128x128)
# fp8 kernels are sm90-only; sm100 casts scales to ue8m0.
_DG_ARCH = {quant.FP8: (9,), quant.BF16: (9, 10)}
_TMA_ALIGN_BYTES = 16  # TMA wants 16-byte aligned strides: fp8 scale columns are padded to 4 floats
# deep_gemm's masked kernels address a/out as 2-D `[E * T, *]` tensors: the row block of expert e
# starts at row e * T + i * BLOCK_M and the TMA store writes all BLOCK_M rows, so when BLOCK_M does
# not divide T the last block of expert e overwrites the first rows of expert e + 1 with rows
# computed with w[e] (fp8: zero scales read out of bounds -> zeros). Its heuristics pick BLOCK_M
# from expected_m: sm90 masked (non-W4) from {64, 128}; sm100 uses the contiguous-layout M
# alignment (128 or 256). T a multiple of these (e.g. an LL capacity of 256) needs no padding.
_DG_SM90_MASKED_BLOCK_M = 128
_DG_MASKED_BLOCK_M_OTHER = 256

# Old and new deep_gemm names of the same entry points (same positional arguments), newest first.
_DG_NAMES = {
    "fp8_contiguous": (
        "m_grouped_fp8_gemm_nt_contiguous",
        "m_grouped_fp8_fp4_gemm_nt_contiguous",
        "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
    ),
    "fp8_masked": (
        "m_grouped_fp8_gemm_nt_masked",
        "m_grouped_fp8_fp4_gemm_nt_masked",
        "fp8_m_grouped_gemm_nt_masked",
        "m_grouped_gemm_fp8_fp8_bf16_nt_masked",
    ),
    "bf16_contiguous": ("m_grouped_bf16_gemm_nt_contiguous",),
    "bf16_masked": ("m_grouped_bf16_gemm_nt_masked", "bf16_m_grouped_gemm_nt_masked"),
    "alignment": (
        "get_mk_alignment_for_contiguous_layout",
        "get_m_alignment_for_contiguous_layout",
    ),
}


_SCHEME_DTYPE = {name: s.act_dtype for name, s in quant.SCHEMES.items()}


_NAME_OF_DTYPE = {s.act_dtype: name for name, s in quant.SCHEMES.items()}


def scheme_of(dtype: torch.dtype) -> str:
    """The name of the scheme whose GEMM operands have ``dtype``."""
    name = _NAME_OF_DTYPE.get(dtype)  # (one lookup: every GEMM call asks)
    return name if name is not None else quant.of_dtype(dtype).name  # (else its ValueError)


# ------------------------------------------------------------------------------- backend selection
@functools.cache
def _dg_functions() -> dict:
    """deep_gemm entry points by role (None where this version has none); resolved once."""
    dg = _deps.deep_gemm()
    fns = {}
    for role, names in _DG_NAMES.items():
        fns[role] = next((getattr(dg, n) for n in names if hasattr(dg, n)), None)
    return fns


@functools.cache
def _capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _cap(device: torch.device) -> Tuple[int, int]:
    device = torch.device(device)
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def _dg_role(role: str, device: torch.device) -> bool:
    """True when deep_gemm's entry point ``role`` ("<scheme>_<layout>") exists and runs our scale
    format on ``device``."""
    if not _deps.available("deep_gemm"):
        return False
    arch = _DG_ARCH.get(quant.SCHEMES.get(role.split("_")[0]), ())
    return _cap(device)[0] in arch and _dg_functions()[role] is not None


def _grouped_mm_ok(device: torch.device, n: int, k: int) -> bool:
    # torch._grouped_mm: sm90+, 16-byte aligned rows of a and of w.T.
    return hasattr(torch, "_grouped_mm") and _cap(device)[0] >= 9 and n % 8 == 0 and k % 8 == 0


def _triton_ok(scheme, device: torch.device) -> bool:
    return _cap(device) >= _TRITON_CAP[scheme]


def _dg_alignment() -> int:
    get = _dg_functions()["alignment"]
    return int(get()) if get is not None else 128


def _runs(name: str, scheme, layout: str, device, n: int, k: int, row_block: int) -> bool:
    """Whether backend ``name`` runs this problem on the CUDA ``device``."""
    if name == "triton":
        return _triton_ok(scheme, device) and (layout == "masked" or row_block % MIN_ROW_BLOCK == 0)
    if name == "deep_gemm":  # (its alignment asked only where it is installed)
        if scheme is quant.INT8 or not _dg_role(f"{scheme}_{layout}", device):
            return False
        # fp8 shapes are validated multiples of 128; bf16 goes to deep_gemm on its 64-wide tiles
        shape_ok = scheme is quant.FP8 or (n % 64 == 0 and k % 64 == 0)
        return shape_ok and (layout == "masked" or row_block % _dg_alignment() == 0)
    if name == "grouped_mm":
        return scheme is quant.BF16 and layout == "contiguous" and _grouped_mm_ok(device, n, k)
    return name == "bmm" and scheme is quant.BF16 and layout == "masked"


# without a tuned entry, the first backend that runs the problem (the measured choices so far:
# deep_gemm where it runs; int8 has only ours). bmm multiplies every slot row, padding included:
# last.
_ORDER = ("deep_gemm", "grouped_mm", "triton", "bmm")


@_tuned.reader
@functools.lru_cache(maxsize=4096)  # (a function of the process's packages, GPUs and the sizes)
def _backend(scheme, layout: str, device: torch.device, n: int, k: int, e: int = 0,
             row_block: int = 0, m: int = 0) -> str:  # fmt: skip
    """The implementation of ``scheme`` (a name or a scheme) x ``layout`` ("contiguous"/"masked")
    for an N x K problem on a CUDA device: the tuned table's faster backend for (e, row_block, m)
    where it has one (its fastest measured backend that runs here: deep_gemm may not be
    installed), else the first of _ORDER that runs it, else "reference". ``row_block``: the
    contiguous layout's alignment (0: the default backend's, :func:`contiguous_row_block`); masked:
    T, the slot's rows. ``m``: M_sum, or masked expected_m."""
    scheme = quant.get(scheme, OP, "scheme")
    if layout == "contiguous" and not row_block:
        row_block = contiguous_row_block(scheme, device)
    # (masked: the table's block is the kernel's BLOCK_M for T = row_block rows)
    table_block = row_block if layout == "contiguous" else _masked_tiling(row_block, m)[0]
    found = _tuned.entry(layout, scheme, n, k, e, table_block, m, device) if e else None
    block = row_block if layout == "contiguous" else 0
    if found is not None:
        us = found.get("us") or {found["backend"]: 0.0}
        timed = sorted(sorted(us), key=us.get)  # (the tuner's order: fastest, then by name)
        best = next((b for b in timed if _runs(b, scheme, layout, device, n, k, block)), None)
        if best is not None:
            return best
    for name in _ORDER:
        if _runs(name, scheme, layout, device, n, k, block):
            return name
    return "reference"


@_tuned.reader
@_launch.memo  # (as _backend; sizes may be SymInts under torch.compile: computed, not cached)
def fuses_gate(scheme, device: torch.device, inter: int, k: int, e: int, row_block: int,
               m: int, gate="silu", bias: bool = False) -> bool:  # fmt: skip
    """Whether GEMM1 and the gate of an HT call run as one kernel (:func:`grouped_gemm_gate`):
    where this GPU's tuned table measured the fused kernel faster than GEMM1 then the activation
    stage ("gate" entries), for h of ``inter`` channels, GEMM1's reduction ``k``, ``e`` experts,
    expert blocks of ``row_block`` rows and ``m`` rows, the layer's ``gate`` (spec) and ``bias``
    (whether it has gate/up biases)."""
    scheme = quant.get(scheme, OP, "scheme")
    if torch.device(device).type != "cuda":
        return False
    best = _tuned.backend("gate", scheme, inter, k, e, row_block, m, device, str(gate), bias)
    return best == "triton" and _runs("triton", scheme, "contiguous", device, inter, k, row_block)


@_tuned.reader
@_launch.memo  # (as fuses_gate)
def fuses_masked_gate(scheme, device: torch.device, inter: int, k: int, e: int, t: int,
                      expected_m: int, gate="silu", bias: bool = False) -> bool:  # fmt: skip
    """Whether masked GEMM1 and the gate of an LL call run as one kernel
    (:func:`grouped_gemm_masked_gate`): where this GPU's tuned table measured the fused kernel
    faster than masked GEMM1 then the activation stage ("masked_gate" entries), for h of
    ``inter`` channels, GEMM1's reduction ``k``, ``e`` experts, slots of ``t`` rows,
    ``expected_m`` rows per expert (0: t), the layer's ``gate`` (spec) and ``bias``."""
    scheme = quant.get(scheme, OP, "scheme")
    if torch.device(device).type != "cuda":
        return False
    block = masked_gate_tiling(t, expected_m, scheme.kernel_code)[0]
    best = _tuned.backend("masked_gate", scheme, inter, k, e, block, expected_m or t, device,
                          str(gate), bias)  # fmt: skip
    return best == "triton" and _runs("triton", scheme, "masked", device, inter, k, 0)


@_tuned.reader
@_launch.memo  # (as fuses_gate)
def gathers(scheme, device: torch.device, width: int, k: int, e: int, row_block: int, m: int,
            gate="silu", bias: bool = False) -> bool:  # fmt: skip
    """Whether an HT call's GEMM1 reads its rows of x through permute's src_rows (permute then
    copies none): where this GPU's tuned table measured that faster than permute's copy ("gather"
    entries) and GEMM1 runs on our Triton kernels (fused with the gate, :func:`fuses_gate`, or
    the contiguous backend) on a tile that can gather (not a Gluon config: TMA reads only), for
    GEMM1 of ``width`` outputs (w1's rows), reduction ``k``, ``e`` experts, blocks of
    ``row_block`` rows, ``m`` rows, the layer's ``gate`` spec and ``bias``."""
    scheme = quant.get(scheme, OP, "scheme")
    if torch.device(device).type != "cuda":
        return False
    best = _tuned.backend("gather", scheme, width, k, e, row_block, m, device, str(gate), bias)
    if best != "gather":
        return False
    inter = _gate.get(gate).inter(width)
    if fuses_gate(scheme, device, inter, k, e, row_block, m, gate, bias):
        cfg = _tuned.lookup("gate", scheme, inter, k, e, row_block, m, device, str(gate), bias)
    elif _backend(scheme, "contiguous", device, width, k, e, row_block, m) == "triton":
        cfg = _tuned.lookup("contiguous", scheme, width, k, e, row_block, m, device)
    else:
        return False
    return not (cfg or {}).get("GLUON")  # (a Gluon kernel reads its rows through TMA only)


def contiguous_row_block(scheme, device: torch.device) -> int:
    """The default alignment of the contiguous layout on ``device``: what its default backend
    needs every expert block to start at.

    CPU (the reference) has no constraint: 1. CUDA: deep_gemm's
    ``get_mk_alignment_for_contiguous_layout()`` (128 today) for fp8/bf16 when deep_gemm runs them,
    128 for int8 (our Triton kernel's prefill tiles), 1 for torch._grouped_mm and the reference.
    Any multiple of :func:`smallest_row_block` also runs (a smaller one pads less).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    scheme = quant.get(scheme, OP, "scheme")
    if scheme is quant.INT8:
        return _INT8_ROW_BLOCK
    if _dg_role(f"{scheme}_contiguous", device):
        return _dg_alignment()
    return 1 if scheme is quant.BF16 or not _triton_ok(scheme, device) else _INT8_ROW_BLOCK


def smallest_row_block(scheme, device: torch.device) -> int:
    """The smallest alignment the contiguous layout takes on ``device``: 1 on CPU and where
    torch._grouped_mm or the reference runs it (bf16), else our Triton kernels' 16 rows."""
    device = torch.device(device)
    scheme = quant.get(scheme, OP, "scheme")
    if device.type != "cuda" or not _triton_ok(scheme, device):
        return 1
    if scheme is quant.BF16 and _grouped_mm_ok(device, 64, 64):
        return 1
    return MIN_ROW_BLOCK


@_tuned.reader
@functools.cache  # (as _backend)
def masked_row_block(scheme, device: torch.device) -> int:
    """Rows T (per expert slot) of the masked layout must be a multiple of to avoid a padding copy.

    1 on CPU and wherever deep_gemm does not run ``scheme``'s masked GEMM (INT8 Triton, bmm, the
    reference: any T is used as is). With deep_gemm: the largest row block its masked kernels can
    pick on the device (128 on sm90, 256 elsewhere); for T not a multiple of it the op copies a
    (and fp8 scales) into a `[E, T_pad, Kd]` buffer and the output back to `[E, T, N]`.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    scheme = quant.get(scheme, OP, "scheme")
    if _backend(scheme, "masked", device, 128, 128) != "deep_gemm":
        return 1
    if _cap(device)[0] == 9:
        return _DG_SM90_MASKED_BLOCK_M
    get = _dg_functions()["alignment"]
    return math.lcm(_DG_MASKED_BLOCK_M_OTHER, int(get()) if get is not None else 1)


def empty_fp8_act_scales(lead: Sequence[int], groups: int, device) -> torch.Tensor:
    """Uninitialized float32 activation scales `[*lead, groups]` in deep_gemm's sm90 layout.

    MN-major (the row index is contiguous) with the row count padded to 4 floats (16-byte TMA
    alignment): deep_gemm then uses them as they are. ``lead`` is `(M,)` or `(E, T)`.
    """
    lead = tuple(int(s) for s in lead)
    rows = lead[-1]
    pad = _TMA_ALIGN_BYTES // 4
    rows_aligned = (rows + pad - 1) // pad * pad
    if len(lead) == 1:
        size, stride = (rows, groups), (1, rows_aligned)
    elif len(lead) == 2:
        size, stride = (lead[0], rows, groups), (rows_aligned * groups, 1, rows_aligned)
    else:
        raise _checks.fail("empty_fp8_act_scales", "lead", "(M,) or (E, T)", lead)
    return torch.empty_strided(size, stride, dtype=torch.float32, device=device)
