"""One table of tolerances, by dtype / scheme. Index outputs are always compared exactly."""

import torch

# (atol, rtol) for elementwise comparisons of float outputs against the reference.
ATOL_RTOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}

# relative L2 error bounds for whole-layer outputs.
LAYER_VS_QUANT_AWARE = 2e-2  # any scheme vs reference.quantized_moe of the same scheme
LAYER_VS_DENSE = {"bf16": 1e-2, "fp8": 8e-2, "int8": 3e-2}  # vs reference.dense_moe
GEMM_VS_QUANT_AWARE = 1e-2  # grouped GEMM (fp8/int8) vs dequantized float32 math


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = ATOL_RTOL[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
