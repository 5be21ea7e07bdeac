"""Stage: ll_scatter (LL, decode). Scatter tokens into the masked layout `[E, C, H]`, one block
of C slots per local expert, quantized on the way.

Shape legend: ``T`` tokens, ``K`` top-k, ``H`` hidden, ``Wd`` the layout's columns, ``E`` local
experts, ``C`` slots per expert (capacity), ``G`` scale groups per row.

Contract: ``xo, scales, masked_m, rows = ll_scatter(x, topk_ids, num_experts, capacity,
quant="bf16", expert_lo=0, num_global_experts=None, scale_layout="row", width=None)``

- x: bf16 `[T, H]` (any strides); with quant="bf16" also int8 / uint8 / float8_e4m3fn / int32 /
  float32, copied as raw bytes (the torch backend's HT payloads and packed metadata).
- topk_ids: int32/int64 `[T, K]` (any strides), global expert id in
  [0, num_global_experts) or -1 (num_global_experts defaults to num_experts). Entry (t, k) goes to
  local expert id - expert_lo when that lies in [0, E) (else it is another rank's: skipped).
- width: Wd >= H, the layout's columns (None: H; fp8: a multiple of 128, H then need not be
  one): each slot holds x's row zero-extended to Wd (a hidden size zero-padded to the GEMMs'
  multiple: the masked GEMM reads zeros there, never garbage).
- xo `[E, C, Wd]`: bf16 copies, or quantized as :func:`epmoe.reference.quantize` does (byte-exact,
  with its ``width``): float8_e4m3fn with 1x128 per-token-group scales (G = Wd/128) or int8 with
  one scale per token (G = 1); scales float32 `[E, C, G]` (G = 0 for bf16), contiguous ("row")
  or in DeepGEMM's MN-major, TMA-aligned layout ("deepgemm", strides (G * round_up(C, 4), 1,
  round_up(C, 4))).
- masked_m int32 `[E]`: entries per expert, at most C; rows int32 `[T, K]`: e*C + slot of entry
  (t, k), or -1. Slots inside an expert follow the flat (t, k) order (deterministic).
- Rows of xo / scales at or past masked_m are unspecified (never written: no zero fill).

One kernel (:mod:`epmoe.kernels.scatter`, which the torch backend also buckets rows with),
CUDA-graph safe (static shapes, fixed grid, no host sync, no atomics). Bad ids (outside
[0, num_global_experts) other than -1) and an expert given more than C entries are errors:
ValueError on CPU; on CUDA a device assert inside the kernel on direct launches (ValueError in
debug mode), an async assert after the kernel under torch.compile. A bad entry is skipped, and
entries past capacity are never written, so masked_m never exceeds C and a masked GEMM never
reads out of bounds.
"""

from typing import Optional, Tuple

import torch

from epmoe import _checks, reference
from epmoe import quant as _quant
from epmoe._contract import Case, Choice, Contract, Let, Multiple, PositiveInt, Rule, Tensor
from epmoe._stage import stage
from epmoe.kernels.scales import as_layout
from epmoe.kernels.scatter import RAW, _ll_scatter_triton, outputs

OP = "ll_scatter"
QUANTS = tuple(_quant.SCHEMES)
SCALE_LAYOUTS = ("row", "deepgemm")
# the scheme's channels per scale (0: none, or one per row): what the layout's width divides into
ACT_GROUP = {name: qs.act_group or 0 for name, qs in _quant.SCHEMES.items()}
COPIES = tuple(name for name, qs in _quant.SCHEMES.items() if not qs.quantized)  # (no codes)

# ------------------------------------------------------------------------------------------ op
CONTRACT = Contract(
    OP,
    "x topk_ids num_experts capacity quant expert_lo num_global_experts scale_layout width",
    Tensor("x", "RAW if quant in COPIES else BF16", ndim=(2,)),
    Tensor("topk_ids", _checks.INDEX_DTYPES, shape=("x.shape[0]", None)),
    PositiveInt("num_experts"),
    PositiveInt("capacity"),
    Choice("quant", QUANTS),
    Choice("scale_layout", SCALE_LAYOUTS),
    Rule(
        "type(expert_lo) is int and expert_lo >= 0",
        "expert_lo",
        "a non-negative int",
        lambda a: repr(a.expert_lo),
    ),
    Let("ng", "num_experts if num_global_experts is None else num_global_experts"),
    PositiveInt("ng", "num_global_experts"),
    Rule(
        "expert_lo + num_experts <= ng",
        "num_global_experts",
        lambda a: f"at least expert_lo + num_experts = {a.expert_lo + a.num_experts}",
        lambda a: a.ng,
    ),
    Rule(
        "width is None or (type(width) is int and width >= x.shape[1])",
        "width",
        lambda a: f"None or an int >= H = {a.x.shape[1]} (x's columns)",
        lambda a: repr(a.width),
    ),
    Case(
        "ACT_GROUP[quant]",
        [
            Case(
                "width is None",
                [Multiple("x.shape[1]", "x.shape[1]", "ACT_GROUP[quant]", "(fp8 groups)")],
                [Multiple("width", "width", "ACT_GROUP[quant]", "(fp8 groups)")],
            )
        ],
    ),
    consts=dict(RAW=tuple(RAW), BF16=(torch.bfloat16,), COPIES=COPIES, ACT_GROUP=ACT_GROUP),
)


def _reference(x, topk_ids, E, C, quant="bf16", lo=0, NG=None, scale_layout="row", width=None):
    xo, s, masked_m, rows = reference.ll_scatter(x, topk_ids, E, C, quant, lo, NG, width)
    return xo, as_layout(s, scale_layout if s.shape[2] else "row"), masked_m, rows


@stage(contract=CONTRACT, fake=outputs, reference=_reference, cuda=_ll_scatter_triton)
def ll_scatter(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    capacity: int,
    quant: str = "bf16",
    expert_lo: int = 0,
    num_global_experts: Optional[int] = None,
    scale_layout: str = "row",
    width: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter (and quantize) tokens into the masked layout; see the module docstring.

    Args:
        x: bf16 `[T, H]` (any strides); with quant="bf16" also int8 / uint8 / float8_e4m3fn /
            int32 / float32 (raw copies, xo of x's dtype).
        topk_ids: int32/int64 `[T, K]` (any strides), global id or -1.
        num_experts: E, local experts (ids expert_lo .. expert_lo + E - 1).
        capacity: C, slots per expert.
        quant: "bf16" (a copy), "fp8" (H, or width, a multiple of 128) or "int8".
        expert_lo: the first local expert's global id.
        num_global_experts: ids must be below it (default num_experts).
        scale_layout: "row" (contiguous scales) or "deepgemm" (MN-major, TMA-aligned).
        width: Wd >= H, the layout's columns (None: H; fp8: a multiple of 128), each slot x's
            row zero-extended (a zero-padded hidden size): codes past H are 0, scales over x's
            values.
    Returns:
        (xo bf16/float8_e4m3fn/int8 (quant="bf16": x's dtype) `[E, C, Wd]`, scales float32
        `[E, C, G]` (G = Wd/128, 1 or 0), masked_m int32 `[E]`, rows int32 `[T, K]` = e*C + slot
        or -1).
    """
