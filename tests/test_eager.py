"""The eager fast path (epmoe._eager): when public op functions may skip the dispatcher, and that
both paths give the same results (GPU)."""

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from epmoe import _eager, reference
from epmoe.ops import permute, quantize, silu_and_mul, silu_and_mul_quant, unpermute
from tests.ops import _stage_cases as C

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_cpu_tensors_take_the_registered_op():
    x = torch.randn(2, 128)
    assert not _eager.direct(x)
    with _Count() as mode:
        quantize(x, "fp8")
    assert "epmoe.quantize.default" in mode.ops


def test_no_tensors_and_disabled():
    assert _eager.direct(None)
    _eager.set_enabled(False)
    try:
        assert not _eager.direct(None)
    finally:
        _eager.set_enabled(True)
    assert _eager.enabled()


def test_functorch_transforms_take_the_registered_op():
    """vmap / grad / functionalize wrap tensors that look like plain ones: no fast path inside."""
    seen = []

    def probe(x):
        seen.append(_eager.direct())
        return x

    torch.func.vmap(probe)(torch.zeros(2))
    torch.func.functionalize(probe)(torch.zeros(2))
    assert seen == [False, False]
    assert _eager.direct()


def test_run_launches_without_the_wrap_triton_hop():
    """Outside a triton op wrap_triton would route each launch through a higher-order op."""
    from torch._library import triton as lib

    before = lib.is_wrap_triton_enabled()
    assert _eager.run(lib.is_wrap_triton_enabled) is False
    assert lib.is_wrap_triton_enabled() == before
    with pytest.raises(ZeroDivisionError):
        _eager.run(lambda: 1 / 0)
    assert lib.is_wrap_triton_enabled() == before


@pytest.mark.gpu
@cuda
def test_direct_conditions_cuda():
    x = torch.randn(4, 128, device="cuda")
    assert _eager.direct(x, None)
    assert not _eager.direct(x, torch.randn(3))  # a CPU tensor among them
    assert not _eager.direct(x.clone().requires_grad_())
    with _Count():
        assert not _eager.direct(x)
    with torch._subclasses.fake_tensor.FakeTensorMode() as fake:
        assert not _eager.direct(fake.from_tensor(x))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not _eager.direct(x)


@pytest.mark.gpu
@cuda
def test_fast_path_skips_the_dispatcher(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the registered op was called")

    # the op the generated public function calls off its fast path (epmoe._stage._public)
    assert quantize.__globals__["_op"] is quantize.op
    monkeypatch.setitem(quantize.__globals__, "_op", boom)
    x = torch.randn(4, 256, device="cuda")
    quantize(x, "fp8")  # fast path: never reaches the op
    with pytest.raises(AssertionError, match="registered op"):
        with _Count():
            quantize(x, "fp8")


def _stage_outputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((64, 512), generator=gen).to(torch.bfloat16).cuda()
    ids = C.routing(64, 4, 8, gen).cuda()
    w = torch.rand(ids.shape, generator=gen).cuda()
    xq, xs = reference.quantize(x, "fp8")
    y3 = torch.randn((8, 32, 512), generator=gen).to(torch.bfloat16).cuda()
    mm = torch.randint(0, 33, (8,), generator=gen, dtype=torch.int32).cuda()
    p = permute(xq, ids, 8, 128, xs)
    live = p.m_indices >= 0
    rows = C.masked_rows(8, 32, mm).cuda()  # rows past masked_m are unspecified
    q3, s3 = quantize(y3, "fp8", masked_m=mm)
    out = [quantize(x, "int8"), (q3.view(torch.uint8)[rows], s3[rows])]
    out.append((p.x.view(torch.uint8)[live], p.x_scales[live], p.m_indices, p.inv_perm))
    yp = torch.randn((p.x.shape[0], 512), generator=gen).to(torch.bfloat16).cuda()
    out.append(unpermute(yp, p.inv_perm, w))
    out.append(silu_and_mul(y3, mm)[rows])
    q, s = silu_and_mul_quant(y3, "fp8", mm)
    out.append((q.view(torch.uint8)[rows], s[rows]))
    return out


@pytest.mark.gpu
@cuda
def test_fast_path_equals_registered_op():
    fast = _stage_outputs()
    _eager.set_enabled(False)
    try:
        slow = _stage_outputs()
    finally:
        _eager.set_enabled(True)
    flat = torch.utils._pytree.tree_leaves
    for a, b in zip(flat(fast), flat(slow), strict=True):
        C.assert_equal(a, b, "fast vs registered op")


def _bad_calls():
    """(name, call) pairs, each with one thing wrong; tensors on CUDA (the validation fast paths,
    `_valid`, only accept CUDA tensors: anything off must fall through to the full checks)."""
    d = "cuda"
    x = torch.randn(4, 256, device=d).bfloat16()
    ids = torch.zeros(4, 2, dtype=torch.int32, device=d)
    w = torch.rand(4, 2, device=d)
    y2 = torch.randn(8, 256, device=d).bfloat16()
    y3 = torch.randn(2, 4, 256, device=d).bfloat16()
    mm = torch.tensor([1, 2], dtype=torch.int32, device=d)
    mi = torch.zeros(8, dtype=torch.int32, device=d)
    offs = torch.zeros(3, dtype=torch.int32, device=d)
    g = importlib.import_module("epmoe.ops.gemm")
    a8 = torch.zeros(2, 4, 128, dtype=torch.int8, device=d)
    w8 = torch.zeros(2, 128, 128, dtype=torch.int8, device=d)
    s8 = torch.ones(2, 4, 1, device=d)
    ws8 = torch.ones(2, 128, device=d)
    a8c, s8c = a8.view(8, 128), s8.view(8, 1)  # contiguous layout, 8 rows
    return [
        ("quantize scheme", lambda: quantize(x, "int4")),
        ("quantize group multiple", lambda: quantize(x, "fp8", group_size=96)),
        ("quantize group_size bool", lambda: quantize(x, "fp8", group_size=True)),
        ("quantize x dtype", lambda: quantize(ids, "int8")),
        ("quantize masked_m with 2-D x", lambda: quantize(x, "fp8", masked_m=mm)),
        ("quantize masked_m length", lambda: quantize(y3, "fp8", masked_m=mm[:1])),
        ("quantize masked_m dtype", lambda: quantize(y3, "fp8", masked_m=mm.float())),
        ("quantize layout", lambda: quantize(x, "fp8", scale_layout="col")),
        ("permute ids dtype", lambda: permute(x, ids.float(), 3, 4)),
        ("permute ids rows", lambda: permute(x, ids[:3], 3, 4)),
        ("permute ids device", lambda: permute(x, ids.cpu(), 3, 4)),
        ("permute scales rows", lambda: permute(x, ids, 3, 4, torch.ones(3, 2, device=d))),
        ("permute scales dtype", lambda: permute(x, ids, 3, 4, torch.ones(4, 2, device=d).half())),
        ("unpermute weights shape", lambda: unpermute(y2, ids, w[:, :1])),
        ("unpermute inv_perm dtype", lambda: unpermute(y2, ids.float(), w)),
        ("unpermute y 3-D", lambda: unpermute(y3, ids, w)),
        ("unpermute weights device", lambda: unpermute(y2, ids, w.cpu())),
        ("silu odd columns", lambda: silu_and_mul(y2[:, :255])),
        ("silu masked_m with 2-D y", lambda: silu_and_mul(y2, mm)),
        ("silu masked_m length", lambda: silu_and_mul(y3, mm[:1])),
        ("silu m_indices length", lambda: silu_and_mul(y2, None, mi[:7])),
        ("silu m_indices dtype", lambda: silu_and_mul(y2, None, mi.long())),
        ("silu offsets empty", lambda: silu_and_mul(y2, None, mi, offs[:0])),
        ("silu offsets with 3-D y", lambda: silu_and_mul(y3, None, None, offs)),
        ("quant scheme", lambda: silu_and_mul_quant(y2, "int4")),
        ("quant group_size", lambda: silu_and_mul_quant(y2, "fp8", group_size=0)),
        ("quant fp8 group multiple", lambda: silu_and_mul_quant(y2, "fp8", group_size=96)),
        ("quant layout", lambda: silu_and_mul_quant(y2, "fp8", scale_layout="col")),
        ("gemm masked_m length", lambda: g.grouped_gemm(a8, w8, None, mm[:1], s8, ws8)),
        ("gemm masked_m device", lambda: g.grouped_gemm(a8, w8, None, mm.cpu(), s8, ws8)),
        ("gemm scales missing", lambda: g.grouped_gemm(a8, w8, None, mm, None, ws8)),
        ("gemm w scales shape", lambda: g.grouped_gemm(a8, w8, None, mm, s8, ws8[:, :64])),
        ("gemm a scales dtype", lambda: g.grouped_gemm(a8, w8, None, mm, s8.half(), ws8)),
        ("gemm masked_m dtype", lambda: g.grouped_gemm(a8, w8, None, mm.long(), s8, ws8)),
        ("gemm m_indices length", lambda: g.grouped_gemm(a8c, w8, mi[:7], None, s8c, ws8)),
        ("gemm m_indices dtype", lambda: g.grouped_gemm(a8c, w8, mi.long(), None, s8c, ws8)),
        ("gemm m_indices device", lambda: g.grouped_gemm(a8c, w8, mi.cpu(), None, s8c, ws8)),
        (
            "gemm offsets length",
            lambda: g.grouped_gemm(a8c, w8, mi, None, s8c, ws8, expert_offsets=offs[:2]),
        ),
        (
            "gemm offsets dtype",
            lambda: g.grouped_gemm(a8c, w8, mi, None, s8c, ws8, expert_offsets=offs.long()),
        ),
    ]


@pytest.mark.gpu
@cuda
def test_fast_path_bad_cuda_inputs_raise_value_error():
    wrong = []
    for name, call in _bad_calls():
        try:
            call()
            wrong.append(f"{name}: no error")
        except ValueError:
            pass
        except Exception as e:  # noqa: BLE001 - collect every case that is not a ValueError
            wrong.append(f"{name}: {type(e).__name__}: {e}")
    assert not wrong, wrong


class _FakeDeviceTensor:
    """Stands for a CUDA tensor on device 1 (on_device reads get_device() only)."""

    def get_device(self):
        return 1


def test_on_device_switches_only_when_needed(monkeypatch):
    """The context a launch runs under (the layer's call, a public fast path, an op's CUDA
    kernel): torch.cuda.device(the tensor's device) when that is not the current device, nothing
    otherwise (CPU tensors included)."""
    entered = []

    class _Device:
        def __init__(self, d):
            self.d = d

        def __enter__(self):
            entered.append(self.d)

        def __exit__(self, *exc):
            return False

    def launch(t, a, b=2):
        with _eager.on_device(t):
            return a + b

    monkeypatch.setattr(torch.cuda, "device", _Device)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    assert launch(torch.zeros(1), 1, b=3) == 4 and entered == []  # CPU: no device query at all
    assert launch(_FakeDeviceTensor(), 1) == 3 and entered == [1]
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    assert launch(_FakeDeviceTensor(), 5) == 7 and entered == [1]  # already current


@pytest.mark.multi_gpu
def test_stage_ops_launch_on_their_inputs_device():
    """Inputs on cuda:1 while cuda:0 is current: every stage op (public function and registered
    op) computes on cuda:1 and equals the CPU reference; the current device stays cuda:0."""
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    gen = torch.Generator().manual_seed(11)
    m, k, e, a, h = 96, 4, 8, 16, 512
    x = torch.randn((m, h), generator=gen).to(torch.bfloat16)
    ids = C.routing(m, k, e, gen)
    w = torch.rand((m, k), generator=gen)
    xq, xs = reference.quantize(x, "fp8")
    y = torch.randn((reference.permuted_rows(m, k, e, a), 2 * h), generator=gen)
    y = y.to(torch.bfloat16)
    ops = torch.ops.epmoe
    for public in (True, False):
        q, s = quantize(x.to(dev), "fp8") if public else ops.quantize.default(x.to(dev), "fp8")
        C.assert_equal(q.cpu().view(torch.uint8), xq.view(torch.uint8), "quantize")
        C.assert_equal(s.cpu(), xs, "quantize scales")
        args = (xq.to(dev), ids.to(dev), e, a, xs.to(dev))
        p = permute(*args) if public else C.permute_mod.PermuteResult(*ops.permute.default(*args))
        ref = C.reference_permute(xq, ids, e, a, xs)
        C.assert_permute_equal(tuple(p), ref)
        h1 = silu_and_mul(y.to(dev)) if public else ops.silu_and_mul.default(y.to(dev))
        C.assert_close(h1, reference.silu_and_mul(y))
        hq, hs = silu_and_mul_quant(y.to(dev), "int8")
        rq, rs = reference.quantize(h1.cpu(), "int8")  # (of the GPU's own SiLU, as in its tests)
        C.assert_equal(hq, rq, "silu_and_mul_quant")
        C.assert_equal(hs, rs, "silu_and_mul_quant scales")
        yo = torch.randn((p.x.shape[0], h), generator=gen).to(torch.bfloat16)
        inv = p.inv_perm.cpu()
        out = unpermute(yo.to(dev), inv.to(dev), w.to(dev))
        C.assert_close(out, reference.unpermute(yo, inv, w))
        assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(dev)
