"""Per-choice GEMVs on CUDA (Triton kernels) against the CPU reference: every scheme, the decode
shapes of Qwen3-30B-A3B, -1 and repeated experts, bad ids asserted / flagged, a CUDA graph replay,
opcheck and torch.compile on CUDA inputs, the layer's gemv path against reference.quantized_moe;
every gate kind with biases, x narrower than zero-padded weights and an output of the first
``hidden`` columns (gpt-oss's 2880 on 2944)."""

import pytest
import torch

import epmoe
from epmoe import gate, reference
from epmoe.ops import gemv
from tests import _tol
from tests._opcheck import opcheck
from tests._tol import LAYER_VS_QUANT_AWARE, rel_l2
from tests.ops import _stage_cases as C

pytestmark = pytest.mark.gpu
SCHEMES = ("bf16", "fp8", "int8")


GATES = C.GEMV_GATES


def _weights(E, H, I, scheme, gen, width=None):
    w1 = torch.randn((E, width or 2 * I, H), generator=gen) / H**0.5
    w2 = torch.randn((E, H, I), generator=gen) / I**0.5
    return (*reference.quantize_weights(w1, scheme), *reference.quantize_weights(w2, scheme))


def _routing(T, E, K, gen, neg=0.2):
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else (
        torch.zeros((0, K), dtype=torch.long))  # fmt: skip
    ids = torch.where(torch.rand((T, K), generator=gen) < neg, -1, ids)
    return ids, torch.rand((T, K), generator=gen)


def _cuda(*ts):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in ts]


def _check(scheme, T, E, H, I, K, gen, neg=0.2):
    w1, s1, w2, s2 = _weights(E, H, I, scheme, gen)
    x = torch.randn((T, H), generator=gen).bfloat16()
    ids, tw = _routing(T, E, K, gen, neg)
    h_ref = reference.gemv_gate_up(x, ids, w1, s1)
    for byte in C.POISON_BYTES:
        with C.poisoned_empty(byte):
            h = gemv.gemv_gate_up(*_cuda(x, ids, w1, s1))
            torch.cuda.synchronize()
        C.assert_close(h.cpu(), h_ref)
    out_ref = reference.gemv_down(h.cpu(), ids, tw, w2, s2)  # the kernel's own h: one rounding
    for byte in C.POISON_BYTES:
        with C.poisoned_empty(byte):
            out = gemv.gemv_down(h, *_cuda(ids, tw, w2, s2))
            torch.cuda.synchronize()
        C.assert_close(out.cpu(), out_ref)
    return x, ids, tw, (w1, s1, w2, s2)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("T", [1, 4, 16])
def test_qwen3_decode_shapes(scheme, T):
    _check(scheme, T, 128, 2048, 768, 8, torch.Generator().manual_seed(T))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("T", [1, 3])
def test_top2_long_rows(scheme, T):
    """Top-2 (Mixtral's case): the down kernel's K steps four times the config's block_k, rows of
    I = 4992 ending in a partial step."""
    _check(scheme, T, 4, 512, 4992, 2, torch.Generator().manual_seed(T))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("T,neg", [(0, 0.0), (3, 1.0), (5, 0.5)])
def test_edges(scheme, T, neg):
    _check(scheme, T, 8, 384, 256, 4, torch.Generator().manual_seed(7), neg)


def test_repeated_expert_and_int32_strided_ids():
    gen = torch.Generator().manual_seed(3)
    w1, s1, w2, s2 = _weights(4, 256, 128, "fp8", gen)
    x = torch.randn((3, 256), generator=gen).bfloat16()
    ids = torch.tensor([[2, 2], [3, -1], [0, 3]], dtype=torch.int32).t().contiguous().t()
    tw = torch.rand((3, 2), generator=gen)
    h = gemv.gemv_gate_up(*_cuda(x, ids, w1, s1))
    C.assert_close(h.cpu(), reference.gemv_gate_up(x, ids, w1, s1))
    out = gemv.gemv_down(h, *_cuda(ids, tw, w2, s2))
    C.assert_close(out.cpu(), reference.gemv_down(h.cpu(), ids, tw, w2, s2))


@pytest.mark.parametrize("bad", [8, -2])
def test_bad_id_debug_raises(bad):
    gen = torch.Generator().manual_seed(4)
    w1, s1, w2, s2 = _weights(8, 128, 128, "bf16", gen)
    x = torch.randn((2, 128), generator=gen).bfloat16().cuda()
    ids = torch.tensor([[0, bad], [1, 2]]).cuda()
    epmoe.set_debug(True)
    try:
        with pytest.raises(ValueError, match="gemv_gate_up: topk_ids expected ids in"):
            gemv.gemv_gate_up(x, ids, w1.cuda())
        with pytest.raises(ValueError, match="gemv_down: topk_ids expected ids in"):
            gemv.gemv_down(torch.zeros((2, 2, 128)).bfloat16().cuda(), ids,
                           torch.rand((2, 2)).cuda(), w2.cuda())  # fmt: skip
    finally:
        epmoe.set_debug(False)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_graph_replay_and_compile(scheme):
    gen = torch.Generator().manual_seed(5)
    w1, s1, w2, s2 = _cuda(*_weights(16, 256, 128, scheme, gen))
    x = torch.randn((2, 256), generator=gen).bfloat16().cuda()
    ids, tw = _cuda(*_routing(2, 16, 4, gen))

    def run(x, ids, tw):
        return gemv.gemv_down(gemv.gemv_gate_up(x, ids, w1, s1), ids, tw, w2, s2)

    eager = run(x, ids, tw)
    g = torch.cuda.CUDAGraph()
    static = [x.clone(), ids.clone(), tw.clone()]
    run(*static)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        out = run(*static)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    compiled = torch.compile(run, fullgraph=True)(x, ids, tw)
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_opcheck_cuda(scheme):
    gen = torch.Generator().manual_seed(6)
    w1, s1, w2, s2 = _cuda(*_weights(4, 128, 128, scheme, gen))
    x = torch.randn((2, 128), generator=gen).bfloat16().cuda()
    ids, tw = _cuda(*_routing(2, 4, 2, gen))
    opcheck(torch.ops.epmoe.gemv_gate_up.default, (x, ids, w1, s1))
    h = gemv.gemv_gate_up(x, ids, w1, s1)
    opcheck(torch.ops.epmoe.gemv_down.default, (h, ids, tw, w2, s2))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("T", [1, 4])
def test_layer_gemv_path(scheme, T):
    gen = torch.Generator().manual_seed(T)
    E, H, I, K = 32, 256, 128, 4  # noqa: E741 (32 experts, top-4: GEMVs up to T = 4)
    w1 = torch.randn((E, 2 * I, H), generator=gen) / H**0.5
    w2 = torch.randn((E, H, I), generator=gen) / I**0.5
    x = torch.randn((T, H), generator=gen).bfloat16()
    ids, tw = _routing(T, E, K, gen)
    layer = epmoe.EPMoE(E, H, I, K, quant=scheme, mode="auto", backend="local", device="cuda")
    layer.load_weights(w1.cuda(), w2.cuda())
    assert layer.path(T) == "gemv"
    with layer.record_stages() as rec:
        out = layer(*_cuda(x, ids, tw))
    assert rec.names == epmoe.layer.GEMV_STAGES
    ref = reference.quantized_moe(x, ids, tw, w1, w2, scheme)
    assert rel_l2(out.cpu(), ref) < LAYER_VS_QUANT_AWARE
    torch._dynamo.reset()  # (each case compiles a new layer: forward's recompile limit is 8)
    compiled = torch.compile(layer, fullgraph=True)(*_cuda(x, ids, tw))
    assert torch.equal(compiled, out)


# ------------------------------------------------------------------ gates, biases, padded sizes
def _biases(E, W, H, gen, dtype=torch.bfloat16):
    return torch.randn((E, W), generator=gen).to(dtype), (
        torch.randn((E, H), generator=gen) / 4
    ).to(dtype)


def _close_up_to_flips(actual, expected, max_frac=1e-3):
    """Within the bf16 tolerance but for at most ``max_frac`` of the elements: a GEMV sum in
    another order can round to the neighbouring bf16 before the gate (an ulp of 0.03 near the
    limit of 7 at these scales), which the gate passes on; everything stays within rel L2 1e-2."""
    atol, rtol = _tol.ATOL_RTOL[expected.dtype]
    a, e = actual.float(), expected.float()
    off = (a - e).abs() > atol + rtol * e.abs()
    assert off.float().mean().item() <= max_frac, f"{int(off.sum())} of {off.numel()} differ"
    assert _tol.rel_l2(actual, expected) <= 1e-2


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("spec", GATES)
def test_gates_and_biases(scheme, spec):
    """Qwen3's decode shapes, x scaled so a limit of 7 clamps; -1 choices stay zero."""
    gen = torch.Generator().manual_seed(8)
    E, H, I, K, T = 128, 2048, 768, 8, 4  # noqa: E741
    W = gate.parse(spec).width(I)
    w1, s1, w2, s2 = _weights(E, H, I, scheme, gen, W)
    b1, b2 = _biases(E, W, H, gen)
    x = (torch.randn((T, H), generator=gen) * 3).bfloat16()
    ids, tw = _routing(T, E, K, gen)
    h_ref = reference.gemv_gate_up(x, ids, w1, s1, spec, b1)
    for byte in C.POISON_BYTES:
        with C.poisoned_empty(byte):
            h = gemv.gemv_gate_up(*_cuda(x, ids, w1, s1), gate=spec, bias=b1.cuda())
            torch.cuda.synchronize()
        _close_up_to_flips(h.cpu(), h_ref)
    assert (h.cpu()[ids < 0] == 0).all()
    out_ref = reference.gemv_down(h.cpu(), ids, tw, w2, s2, b2)
    for byte in C.POISON_BYTES:
        with C.poisoned_empty(byte):
            out = gemv.gemv_down(h, *_cuda(ids, tw, w2, s2), bias=b2.cuda())
            torch.cuda.synchronize()
        C.assert_close(out.cpu(), out_ref)


def _padded(scheme, gen, E=16, H=2880, Hp=2944, I=256):  # noqa: E741
    """gpt-oss's H = 2880 zero-padded to 2944 (23 fp8 blocks), quantized after the padding;
    biases b1 `[E, 2I]` (fp32), b2 `[E, Hp]` (fp32, zeros past H)."""
    w1 = torch.zeros((E, 2 * I, Hp))
    w1[..., :H] = torch.randn((E, 2 * I, H), generator=gen) / H**0.5
    w2 = torch.zeros((E, Hp, I))
    w2[:, :H] = torch.randn((E, H, I), generator=gen) / I**0.5
    b2 = torch.zeros((E, Hp))
    b2[:, :H] = torch.randn((E, H), generator=gen) / 4
    w = (*reference.quantize_weights(w1, scheme), *reference.quantize_weights(w2, scheme))
    return w, torch.randn((E, 2 * I), generator=gen), b2


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("T", [1, 4])
def test_padded_hidden(scheme, T):
    """x `[T, 2880]` on weights padded to 2944 (fp8: the activation group at the edge zero-filled
    past 2880), out `[T, 2880]`: the first columns of the padded call's output."""
    gen = torch.Generator().manual_seed(9)
    (w1, s1, w2, s2), b1, b2 = _padded(scheme, gen)
    spec = GATES[0]
    x = (torch.randn((T, 2880), generator=gen) * 2).bfloat16()
    ids, tw = _routing(T, 16, 4, gen)
    h = gemv.gemv_gate_up(*_cuda(x, ids, w1, s1), gate=spec, bias=b1.cuda())
    C.assert_close(h.cpu(), reference.gemv_gate_up(x, ids, w1, s1, spec, b1))
    with C.poisoned_empty(C.POISON_BYTES[0]):
        out = gemv.gemv_down(h, *_cuda(ids, tw, w2, s2), bias=b2.cuda(), hidden=2880)
        torch.cuda.synchronize()
    assert out.shape == (T, 2880)
    C.assert_close(out.cpu(), reference.gemv_down(h.cpu(), ids, tw, w2, s2, b2, 2880))
    full = gemv.gemv_down(h, *_cuda(ids, tw, w2, s2), bias=b2.cuda())
    assert torch.equal(full[:, :2880], out) and (full[:, 2880:] == 0).all()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_gate_bias_hidden_graph_replay_compile_opcheck(scheme):
    """gpt-oss's gate with biases and a hidden output: CUDA graph replay and torch.compile give
    the eager bytes (Inductor copies the gate's jit helpers from epmoe.gate); opcheck."""
    gen = torch.Generator().manual_seed(10)
    (w1, s1, w2, s2), b1, b2 = _padded(scheme, gen, E=8, H=200, Hp=256, I=128)
    w1, s1, w2, s2, b1, b2 = _cuda(w1, s1, w2, s2, b1, b2)
    spec = GATES[0]
    x = torch.randn((2, 200), generator=gen).bfloat16().cuda()
    ids, tw = _cuda(*_routing(2, 8, 4, gen))

    def run(x, ids, tw):
        h = gemv.gemv_gate_up(x, ids, w1, s1, gate=spec, bias=b1)
        return gemv.gemv_down(h, ids, tw, w2, s2, bias=b2, hidden=200)

    eager = run(x, ids, tw)
    g = torch.cuda.CUDAGraph()
    static = [x.clone(), ids.clone(), tw.clone()]
    run(*static)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        out = run(*static)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    compiled = torch.compile(run, fullgraph=True)(x, ids, tw)
    assert torch.equal(compiled, eager)
    opcheck(torch.ops.epmoe.gemv_gate_up.default, (x, ids, w1, s1, True, spec, b1))
    h = gemv.gemv_gate_up(x, ids, w1, s1, gate=spec, bias=b1)
    opcheck(torch.ops.epmoe.gemv_down.default, (h, ids, tw, w2, s2, True, b2, 200))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("spec", [GATES[0], GATES[-1]])
def test_layer_gemv_path_gates_and_biases(scheme, spec):
    gen = torch.Generator().manual_seed(11)
    E, H, I, K, T = 16, 200, 72, 4, 2  # noqa: E741 (fp8: padded to 256 / 128 at load)
    W = gate.parse(spec).width(I)
    w1 = torch.randn((E, W, H), generator=gen) * 3 / H**0.5
    w2 = torch.randn((E, H, I), generator=gen) / I**0.5
    b1, b2 = torch.randn((E, W), generator=gen), torch.randn((E, H), generator=gen) / 10
    x = torch.randn((T, H), generator=gen).bfloat16()
    ids, tw = _routing(T, E, K, gen)
    layer = epmoe.EPMoE(E, H, I, K, quant=scheme, mode="auto", backend="local", device="cuda",
                        gate=spec, bias=True)  # fmt: skip
    layer.load_weights(w1.cuda(), w2.cuda(), b1=b1.cuda(), b2=b2.cuda())
    assert layer.path(T) == "gemv"
    with layer.record_stages() as rec:
        out = layer(*_cuda(x, ids, tw))
    assert rec.names == epmoe.layer.GEMV_STAGES
    assert out.shape == (T, H)
    ref = reference.quantized_moe(x, ids, tw, w1, w2, scheme, spec, b1, b2)
    assert rel_l2(out.cpu(), ref) < LAYER_VS_QUANT_AWARE
    torch._dynamo.reset()  # (each case compiles a new layer: forward's recompile limit is 8)
    compiled = torch.compile(layer, fullgraph=True)(*_cuda(x, ids, tw))
    assert torch.equal(compiled, out)
