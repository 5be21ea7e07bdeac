"""Stage: ll_scatter (LL, decode). Scatter tokens into the masked layout `[E, C, H]`, one block
of C slots per local expert, quantized on the way.

Shape legend: ``T`` tokens, ``K`` top-k, ``H`` hidden, ``E`` local experts, ``C`` slots per expert
(capacity), ``G`` scale groups per row.

Contract: ``xo, scales, masked_m, rows = ll_scatter(x, topk_ids, num_experts, capacity,
quant="bf16", expert_lo=0, num_global_experts=None, scale_layout="row")``

- x: bf16 `[T, H]` (any strides); with quant="bf16" also int8 / uint8 / float8_e4m3fn / int32 /
  float32, copied as raw bytes (the torch backend's HT payloads and packed metadata).
- topk_ids: int32/int64 `[T, K]` (any strides), global expert id in
  [0, num_global_experts) or -1 (num_global_experts defaults to num_experts). Entry (t, k) goes to
  local expert id - expert_lo when that lies in [0, E) (else it is another rank's: skipped).
- xo `[E, C, H]`: bf16 copies, or quantized as :func:`epmoe.reference.quantize` does (byte-exact):
  float8_e4m3fn with 1x128 per-token-group scales (G = H/128) or int8 with one scale per token
  (G = 1); scales float32 `[E, C, G]` (G = 0 for bf16), contiguous ("row") or in DeepGEMM's
  MN-major, TMA-aligned layout ("deepgemm", strides (G * round_up(C, 4), 1, round_up(C, 4))).
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
from epmoe._contract import Case, Choice, Contract, Let, Multiple, PositiveInt, Rule, Tensor
from epmoe._stage import stage
from epmoe.kernels.scales import as_layout
from epmoe.kernels.scatter import GROUP, RAW, _ll_scatter_triton, outputs

OP = "ll_scatter"
QUANTS = ("bf16", "fp8", "int8")
SCALE_LAYOUTS = ("row", "deepgemm")

# ------------------------------------------------------------------------------------------ op
CONTRACT = Contract(
    OP,
    "x topk_ids num_experts capacity quant expert_lo num_global_experts scale_layout",
    Tensor("x", "RAW if quant == 'bf16' else BF16", ndim=(2,)),
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
    Case("quant == 'fp8'", [Multiple("x.shape[1]", "x.shape[1]", GROUP, "(fp8 groups)")]),
    consts=dict(RAW=tuple(RAW), BF16=(torch.bfloat16,)),
)


def _reference(x, topk_ids, E, C, quant="bf16", lo=0, NG=None, scale_layout="row"):
    xo, s, masked_m, rows = reference.ll_scatter(x, topk_ids, E, C, quant, lo, NG)
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
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter (and quantize) tokens into the masked layout; see the module docstring.

    Args:
        x: bf16 `[T, H]` (any strides); with quant="bf16" also int8 / uint8 / float8_e4m3fn /
            int32 / float32 (raw copies, xo of x's dtype).
        topk_ids: int32/int64 `[T, K]` (any strides), global id or -1.
        num_experts: E, local experts (ids expert_lo .. expert_lo + E - 1).
        capacity: C, slots per expert.
        quant: "bf16" (a copy), "fp8" (H a multiple of 128) or "int8".
        expert_lo: the first local expert's global id.
        num_global_experts: ids must be below it (default num_experts).
        scale_layout: "row" (contiguous scales) or "deepgemm" (MN-major, TMA-aligned).
    Returns:
        (xo bf16/float8_e4m3fn/int8 (quant="bf16": x's dtype) `[E, C, H]`, scales float32
        `[E, C, G]` (G = H/128, 1 or 0), masked_m int32 `[E]`, rows int32 `[T, K]` = e*C + slot
        or -1).
    """
