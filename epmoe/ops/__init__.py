"""Every stage of the expert-parallel MoE layer as a ``torch.ops.epmoe.*`` op.

One module per stage.
"""

from epmoe.ops.activation import silu_and_mul, silu_and_mul_quant
from epmoe.ops.combine import ht_combine, ll_combine
from epmoe.ops.dispatch import HTDispatchResult, LLDispatchResult, ht_dispatch, ll_dispatch
from epmoe.ops.gemm import grouped_gemm, grouped_gemm_gate, grouped_gemm_masked_gate
from epmoe.ops.gemv import gemv_down, gemv_gate_up
from epmoe.ops.ll_gather import ll_gather, ll_gather_out
from epmoe.ops.ll_scatter import ll_scatter
from epmoe.ops.permute import PermuteResult, permute
from epmoe.ops.quantize import quantize
from epmoe.ops.unpermute import unpermute

__all__ = [
    "HTDispatchResult",
    "LLDispatchResult",
    "PermuteResult",
    "gemv_down",
    "gemv_gate_up",
    "grouped_gemm",
    "grouped_gemm_gate",
    "grouped_gemm_masked_gate",
    "ht_combine",
    "ht_dispatch",
    "ll_combine",
    "ll_dispatch",
    "ll_gather",
    "ll_gather_out",
    "ll_scatter",
    "permute",
    "quantize",
    "silu_and_mul",
    "silu_and_mul_quant",
    "unpermute",
]
