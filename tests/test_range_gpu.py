"""epmoe._range on CUDA: the one-program kernel agrees with the torch expression, runs only
when nothing traces, and a CUDA graph replays it on fresh values."""

import pytest
import torch

from epmoe import _range

pytestmark = pytest.mark.gpu


def _torch_ok(x, lo, hi) -> bool:
    return bool(((x >= lo) & (x < hi)).all())


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [1, 1000, 1025, _range.MAX_ELEMENTS, _range.MAX_ELEMENTS + 1])
def test_matches_torch(dtype, n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randint(-1, 32, (n,), generator=gen, dtype=dtype).cuda()
    for bad_at in (None, 0, n - 1):
        y = x.clone()
        if bad_at is not None:
            y[bad_at] = 32
        ok = _range.range_ok(y, -1, 32)
        assert ok.dtype == torch.bool and ok.shape == () and ok.is_cuda
        assert bool(ok) == _torch_ok(y, -1, 32)


def test_kernel_runs_only_untraced(monkeypatch):
    """Under torch.compile the torch expression is traced (fullgraph, no graph break)."""
    calls = []
    real = _range._range_kernel

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    monkeypatch.setattr(_range, "_range_kernel", Spy())
    x = torch.tensor([[0, 3], [-1, 2]], device="cuda")
    assert bool(_range.range_ok(x, -1, 4)) and len(calls) == 1
    f = torch.compile(lambda t: _range.range_ok(t, -1, 4), fullgraph=True)
    assert bool(f(x)) and not bool(f(x + 4))
    assert len(calls) == 1  # the compiled function never launched the raw kernel


def test_cuda_graph_replay():
    x = torch.zeros(64, dtype=torch.int32, device="cuda")
    _range.range_ok(x, 0, 8)  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ok = _range.range_ok(x, 0, 8)
    for v, want in ((3, True), (8, False), (-1, False), (7, True)):
        x.fill_(v)
        g.replay()
        assert bool(ok) is want
