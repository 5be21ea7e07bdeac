"""epmoe._range: the one-program range check, on CPU tensors under TRITON_INTERPRET=1.

Run: TRITON_INTERPRET=1 pytest -m interpret tests/test_range_interpret.py
"""

import os

import pytest
import torch

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (own process)"
    ),
]

from epmoe import _range  # noqa: E402


def _kernel_ok(x: torch.Tensor, lo: int, hi: int) -> bool:
    ok = torch.tensor(not bool(((x >= lo) & (x < hi)).all()))  # start from the wrong answer
    flat = x.reshape(-1)
    _range._range_kernel[(1,)](flat, ok, flat.numel(), lo, hi, BLOCK=_range.BLOCK)
    return bool(ok)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 3000, _range.MAX_ELEMENTS])
def test_range_kernel_matches_torch(dtype, n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randint(-1, 16, (n,), generator=gen, dtype=dtype)
    assert _kernel_ok(x, -1, 16) is True
    if n:
        for bad in (-2, 16, 2**31 - 1):
            y = x.clone()
            y[n - 1] = bad  # the last element: the masked tail of the last block is checked
            assert _kernel_ok(y, -1, 16) is False
            y = x.clone()
            y[0] = bad
            assert _kernel_ok(y, -1, 16) is False


def test_range_kernel_2d_and_bounds():
    x = torch.tensor([[0, 5], [5, 0]], dtype=torch.int32)
    assert _kernel_ok(x, 0, 6) is True
    assert _kernel_ok(x, 0, 5) is False  # hi is exclusive
    assert _kernel_ok(x, 1, 6) is False


def test_range_ok_cpu_uses_torch():
    x = torch.tensor([0, 3, -1])
    assert bool(_range.range_ok(x, -1, 4)) and not bool(_range.range_ok(x, 0, 4))
