"""CPU test of benchmarks/bench_weight_stream.py: its stream kernel reads every weight byte once,
each program its own rows (under TRITON_INTERPRET=1, which the tests' conftest sets without a GPU).

Run: ``python -m pytest -q tests benchmarks/test_bench_weight_stream_cpu.py``.
"""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (no GPU)"
)


@pytest.mark.parametrize("linear", [False, True])
def test_stream_kernel_sums_each_programs_rows(linear):
    import bench_weight_stream as bws

    gen = torch.Generator().manual_seed(0)
    # (float32: the interpreter multiplies bf16 dot operands as raw 16-bit patterns)
    w = torch.randn((2, 256, 256), generator=gen)
    bn, bk = 128, 64
    v = w.view(2, -1, bk) if linear else w
    E, R, K = v.shape
    out = torch.full((E * (R // bn) * 16,), float("nan"))
    ones = torch.ones((16, bk))
    bws._stream_kernel[(R // bn, E)](v, ones, out, R, K, BN=bn, BK=bk, STAGES=2)
    want = v.float().view(E, R // bn, bn * K).sum(-1).flatten()  # (a program's rows, every K)
    got = out.view(-1, 16)
    torch.testing.assert_close(got, want[:, None].expand(-1, 16), rtol=1e-4, atol=1e-3)
    assert torch.isclose(got.sum() / 16, w.float().sum(), rtol=1e-4, atol=1e-1)
