"""Stage: quantize activations (FP8 e4m3 per token per group, INT8 per token).

Contract: ``q, s = quantize(x, scheme, group_size=128, masked_m=None)``

- x: bf16/fp16/fp32 `[M, H]` or `[E, T, H]`.
- fp8: q float8_e4m3fn like x, s float32 `[..., H // group_size]`, s = max(amax(group) / 448, 1e-10),
  q = x / s (clamped to +-448, round to nearest even).
- int8: q int8 like x, s float32 `[..., 1]`, s = max(amax(row) / 127, 1e-10),
  q = round-half-away(x / s) clamped to [-127, 127].
- masked_m: int32 `[E]` for 3-D input; rows t >= masked_m[e] are unspecified (kernels skip them).

CUDA-graph safe (static shapes, no host sync). ``group_size`` is the quant block, unrelated to the
permute ``alignment``.
"""

from typing import Optional, Tuple

import torch
from torch.library import triton_op

from epmoe import _checks, reference

OP = "quantize"


def _validate(x, scheme, group_size, masked_m) -> None:
    _checks.check_choice(OP, "scheme", scheme, ("fp8", "int8"))
    _checks.check_dtype(OP, "x", x, _checks.FLOAT_DTYPES)
    _checks.check_ndim(OP, "x", x, (2, 3))
    _checks.check_positive_int(OP, "group_size", group_size)
    if scheme == "fp8":
        _checks.check_multiple(OP, "x.shape[-1]", x.shape[-1], group_size, "(fp8 group_size)")
    if masked_m is not None:
        if x.dim() != 3:
            raise _checks.fail(OP, "masked_m", "None for a 2-D x", "a tensor")
        _checks.check_dtype(OP, "masked_m", masked_m, (torch.int32, torch.int64))
        _checks.check_shape(OP, "masked_m", masked_m, (x.shape[0],))
        _checks.check_device(OP, "masked_m", masked_m, x)


def _reference(x, scheme, group_size, masked_m):
    q, s = reference.quantize(x, scheme, group_size)
    return q, s


@triton_op("epmoe::quantize", mutates_args=())
def _quantize_op(
    x: torch.Tensor, scheme: str, group_size: int = 128, masked_m: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    _validate(x, scheme, group_size, masked_m)
    return _reference(x, scheme, group_size, masked_m)


@_quantize_op.register_kernel("cpu")
def _quantize_cpu(x, scheme, group_size=128, masked_m=None):
    _validate(x, scheme, group_size, masked_m)
    return _reference(x, scheme, group_size, masked_m)


def quantize(
    x: torch.Tensor, scheme: str, group_size: int = 128, masked_m: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations; see the module docstring for the contract.

    Args:
        x: bf16/fp16/fp32 `[M, H]` or `[E, T, H]`.
        scheme: "fp8" or "int8".
        group_size: channels per fp8 scale (H must be a multiple); ignored for int8.
        masked_m: optional int32 `[E]` rows per expert for 3-D x.
    Returns:
        (q float8_e4m3fn/int8 like x, s float32 `[..., H // group_size]` (fp8) or `[..., 1]` (int8)).
    """
    return _quantize_op(x, scheme, group_size, masked_m)
