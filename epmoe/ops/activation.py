"""Stage: SiLU-and-mul between the two grouped GEMMs, optionally fused with the next quantize.

Contract:
- ``h = silu_and_mul(y)``: y bf16/fp16/fp32 `[..., 2I]` (`[M_sum, 2I]` or `[E, T, 2I]`) -> `[..., I]`,
  silu(y[..., :I]) * y[..., I:] (gate first), float32 math, y.dtype out.
- ``q, s = silu_and_mul_quant(y, scheme, masked_m=None, group_size=128)``: same, then the quantize rules
  of :mod:`epmoe.ops.quantize` applied to the y.dtype-rounded activation (identical to the unfused pair).
  masked_m int32 `[E]` for 3-D y: rows t >= masked_m[e] unspecified.

CUDA-graph safe.
"""

from typing import Optional, Tuple

import torch
from torch.library import triton_op

from epmoe import _checks, reference

OP = "silu_and_mul"
OPQ = "silu_and_mul_quant"


def _validate(op, y, masked_m=None) -> None:
    _checks.check_dtype(op, "y", y, _checks.FLOAT_DTYPES)
    _checks.check_ndim(op, "y", y, (2, 3))
    _checks.check_multiple(op, "y.shape[-1]", y.shape[-1], 2, "(gate and up halves)")
    if masked_m is not None:
        if y.dim() != 3:
            raise _checks.fail(op, "masked_m", "None for a 2-D y", "a tensor")
        _checks.check_dtype(op, "masked_m", masked_m, (torch.int32, torch.int64))
        _checks.check_shape(op, "masked_m", masked_m, (y.shape[0],))
        _checks.check_device(op, "masked_m", masked_m, y)


def _validate_quant(y, scheme, masked_m, group_size) -> None:
    _validate(OPQ, y, masked_m)
    _checks.check_choice(OPQ, "scheme", scheme, ("fp8", "int8"))
    _checks.check_positive_int(OPQ, "group_size", group_size)
    if scheme == "fp8":
        _checks.check_multiple(OPQ, "y.shape[-1] // 2", y.shape[-1] // 2, group_size, "(fp8 group)")


@triton_op("epmoe::silu_and_mul", mutates_args=())
def _silu_and_mul_op(y: torch.Tensor) -> torch.Tensor:
    _validate(OP, y)
    return reference.silu_and_mul(y)


@_silu_and_mul_op.register_kernel("cpu")
def _silu_and_mul_cpu(y):
    _validate(OP, y)
    return reference.silu_and_mul(y)


@triton_op("epmoe::silu_and_mul_quant", mutates_args=())
def _silu_and_mul_quant_op(
    y: torch.Tensor, scheme: str, masked_m: Optional[torch.Tensor] = None, group_size: int = 128
) -> Tuple[torch.Tensor, torch.Tensor]:
    _validate_quant(y, scheme, masked_m, group_size)
    return reference.silu_and_mul_quant(y, scheme, group_size)


@_silu_and_mul_quant_op.register_kernel("cpu")
def _silu_and_mul_quant_cpu(y, scheme, masked_m=None, group_size=128):
    _validate_quant(y, scheme, masked_m, group_size)
    return reference.silu_and_mul_quant(y, scheme, group_size)


def silu_and_mul(y: torch.Tensor) -> torch.Tensor:
    """y `[..., 2I]` -> `[..., I]` = silu(gate) * up, in y.dtype."""
    return _silu_and_mul_op(y)


def silu_and_mul_quant(
    y: torch.Tensor, scheme: str, masked_m: Optional[torch.Tensor] = None, group_size: int = 128
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fused silu_and_mul + quantize: y `[..., 2I]` -> (q `[..., I]`, s float32 `[..., S]`)."""
    return _silu_and_mul_quant_op(y, scheme, masked_m, group_size)
