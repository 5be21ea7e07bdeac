"""epmoe._launch on CUDA: the cached direct launch writes what Triton's own launch writes, keeps
one compiled kernel per specialization, and yields to launch hooks."""

import pytest
import torch
import triton
import triton.language as tl

from epmoe import _eager, _launch

pytestmark = pytest.mark.gpu


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, a, FLIP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    y = tl.load(y_ptr + offs, mask=m)
    v = a * x + y
    if FLIP:
        v = -v
    tl.store(out_ptr + offs, v, mask=m)


def _run(launch, x, y, n, a, flip, block=128):
    out = torch.full_like(x, 7.0)
    launch[(triton.cdiv(n, block),)](x, y, out, n, a, FLIP=flip, BLOCK=block, num_warps=4)
    return out


@pytest.mark.parametrize("n", [1, 16, 100, 1000])
@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize("offset", [0, 1])
def test_direct_matches_triton(n, flip, offset):
    x = torch.randn(n + offset, device="cuda")[offset:]
    y = torch.randn(n + offset, device="cuda")[offset:]
    d = _launch.direct(_axpy_kernel)
    for _ in range(3):  # first call through Triton, then cached
        got = _run(d, x, y, n, 2.5, flip)
        want = _run(_axpy_kernel, x, y, n, 2.5, flip)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_runtime_scalar_by_keyword_is_cached_in_signature_order():
    """A runtime argument given by keyword (permute's PF_DIST) rides in the cached launch's
    trailing arguments at its place in the signature: same bytes as Triton's own launch."""
    d = _launch.direct(_axpy_kernel)
    d.cache.clear()
    x = torch.randn(1000, device="cuda")
    y = torch.randn(1000, device="cuda")
    for a in (2.5, 2.5, 2.5, -1.0):
        got = torch.full_like(x, 7.0)
        d[(8,)](x, y, got, 1000, a=a, FLIP=True, BLOCK=128, num_warps=4)
        want = torch.full_like(x, 7.0)
        _axpy_kernel[(8,)](x, y, want, 1000, a=a, FLIP=True, BLOCK=128, num_warps=4)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(d.cache) == 2  # (one entry per value of a)


def test_one_entry_per_specialization():
    d = _launch.direct(_axpy_kernel)
    d.cache.clear()
    x = torch.randn(4096, device="cuda")
    for n in (100, 200, 300):  # same specialization (not 1, not a multiple of 16, int32)
        _run(d, x, x, n, 1.0, False)
    assert len(d.cache) == 1
    _run(d, x, x, 256, 1.0, False)  # multiple of 16
    _run(d, x[1:], x, 100, 1.0, False)  # unaligned
    _run(d, x, x, 100, 1.0, True)  # constexpr
    assert len(d.cache) == 4


def test_graph_capture_replays():
    d = _launch.direct(_axpy_kernel)
    x = torch.randn(1000, device="cuda")
    y = torch.randn(1000, device="cuda")
    out = torch.empty_like(x)
    launch = d[(8,)]
    launch(x, y, out, 1000, 3.0, FLIP=False, BLOCK=128, num_warps=4)  # warm
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launch(x, y, out, 1000, 3.0, FLIP=False, BLOCK=128, num_warps=4)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.testing.assert_close(out, 3.0 * x + y)


def test_launch_hooks_take_tritons_path():
    seen = []
    hook = seen.append
    rt = triton.knobs.runtime
    d = _launch.direct(_axpy_kernel)
    x = torch.randn(256, device="cuda")
    _run(d, x, x, 256, 1.0, False)  # cached
    if hasattr(rt.launch_enter_hook, "add"):
        rt.launch_enter_hook.add(hook)
        try:
            _run(d, x, x, 256, 1.0, False)
        finally:
            rt.launch_enter_hook.remove(hook)
    else:
        rt.launch_enter_hook = hook
        try:
            _run(d, x, x, 256, 1.0, False)
        finally:
            rt.launch_enter_hook = None
    assert len(seen) == 1


@pytest.mark.parametrize("offset", [0, 1])
def test_prepared_launch_matches_triton_and_keys_alignment(offset):
    """A Prepared launch writes what Triton's own launch writes, from its own cache after the
    first call, with one entry per (device, dtypes, 16-byte alignment) of its tensors."""
    n = 1000
    x = torch.randn(n + offset, device="cuda")[offset:]
    y = torch.randn(n + offset, device="cuda")[offset:]
    p = _launch.Prepared(_axpy_kernel, (triton.cdiv(n, 128),), (n, 2.5),
                         dict(FLIP=True, BLOCK=128, num_warps=4))  # fmt: skip
    want = _run(_axpy_kernel, x, y, n, 2.5, True)
    # as a triton op's body calls it (wrap_triton off), and from a dispatcher kernel's body
    for launch in (lambda *t: _eager.run(p, *t), p.untraced, p.untraced):
        out = torch.full_like(x, 7.0)
        launch(x, y, out)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert len(p.hits) == 1
    z = torch.randn(n, device="cuda")
    out = torch.full_like(z, 7.0)
    p.untraced(z, z, out)  # aligned where x was not (offset 1): a key of its own
    assert len(p.hits) == 1 + offset
