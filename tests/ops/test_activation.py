"""silu_and_mul(_quant): formula (gate first), gate kinds and the expert bias, fused == unfused,
opcheck, the contract (CPU)."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from epmoe import ops, reference
from tests._opcheck import opcheck
from tests._tol import assert_close

A = importlib.import_module("epmoe.ops.activation")


def _halves(y):
    inter = y.shape[-1] // 2
    return y[..., :inter].float(), y[..., inter:].float()


# each gate spec with its formula written out in torch (g, u: the float32 gate and up halves)
GATES = {
    "silu": lambda g, u: F.silu(g) * u,
    "silu:alpha=1.702,limit=7,up_offset=1": lambda g, u: (  # gpt-oss
        g.clamp(max=7) * torch.sigmoid(1.702 * g.clamp(max=7)) * (u.clamp(-7, 7) + 1)
    ),
    "gelu_tanh": lambda g, u: F.gelu(g, approximate="tanh") * u,
    "gelu:limit=3,clamp_after=1": lambda g, u: F.gelu(g).clamp(max=3) * u.clamp(-3, 3),
    "relu": lambda g, u: torch.relu(g) * u,
    "silu:gate_softcap=2,up_softcap=3": lambda g, u: (  # Inkling2 (smaller caps: they act)
        torch.tanh(g / 2) * 2 * torch.sigmoid(g) * (torch.tanh(u / 3) * 3)
    ),
    "relu2:glu=0": None,  # relu(y) ** 2 on y [..., I]
}


def _formula(y, spec):
    if spec == "relu2:glu=0":
        return (torch.relu(y.float()) ** 2).to(y.dtype)
    return GATES[spec](*_halves(y)).to(y.dtype)


@pytest.mark.parametrize("shape", [(6, 64), (2, 3, 256), (0, 32)])
def test_silu_and_mul_formula(shape, seed):
    y = torch.randn(shape).bfloat16()
    h = ops.silu_and_mul(y)
    inter = shape[-1] // 2
    want = (F.silu(y[..., :inter].float()) * y[..., inter:].float()).bfloat16()
    assert h.shape == (*shape[:-1], inter) and h.dtype == torch.bfloat16
    torch.testing.assert_close(h, want, atol=0, rtol=0)


def test_default_gate_keeps_the_silu_bits(seed):
    """The default gate is torch's SiLU times up, bit for bit, signed zeros included (an up
    offset of + 0.0 would turn -0.0 into +0.0)."""
    y = torch.randn(7, 256).bfloat16()
    y[:, 128:][y[:, 128:].abs() < 0.3] = -0.0
    g, u = _halves(y)
    want = (F.silu(g) * u).bfloat16()
    for h in (ops.silu_and_mul(y), ops.silu_and_mul(y, gate="silu"), reference.silu_and_mul(y)):
        assert torch.equal(h.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("spec", list(GATES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gate_formula(spec, dtype, seed):
    y = (torch.randn(2, 3, 256) * 4).to(dtype)  # (|y| > limit often: the clamps act)
    h = ops.silu_and_mul(y, gate=spec)
    inter = 256 if spec.endswith("glu=0") else 128
    assert h.shape == (2, 3, inter) and h.dtype == dtype
    assert_close(h, _formula(y, spec))


def test_bias_2d_rows_and_3d_experts(seed):
    """bias[m_indices[r]] added to row r of a 2-D y (rows of -1 unspecified), bias[e] to y[e]."""
    spec = "silu:alpha=1.702,limit=7,up_offset=1"
    y = (torch.randn(6, 256) * 3).bfloat16()
    b = torch.randn(3, 256)
    mi = torch.tensor([2, -1, 0, 0, 1, -1], dtype=torch.int32)
    live = mi >= 0
    h = ops.silu_and_mul(y, m_indices=mi, gate=spec, bias=b)
    want = _formula((y.float() + b[mi.clamp(min=0).long()]), spec).bfloat16()
    assert_close(h[live], want[live])
    y3 = (torch.randn(3, 4, 128) * 3).half()
    b3 = torch.randn(3, 128).bfloat16()
    h3 = ops.silu_and_mul(y3, gate="relu2:glu=0", bias=b3)
    assert h3.shape == (3, 4, 128) and h3.dtype == torch.float16
    assert_close(h3, (torch.relu(y3.float() + b3.float()[:, None]) ** 2).half())


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_gate_bias_fused_equals_unfused(scheme, seed):
    y = (torch.randn(5, 2, 512) * 3).bfloat16()
    b = torch.randn(5, 512).bfloat16()
    for spec in ("gelu_tanh:limit=5", "relu2:glu=0"):
        q, s = ops.silu_and_mul_quant(y, scheme, gate=spec, bias=b)
        q2, s2 = ops.quantize(ops.silu_and_mul(y, gate=spec, bias=b), scheme)
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
        assert q.shape == (5, 2, 512 if spec.endswith("glu=0") else 256)


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_fused_equals_unfused(scheme, seed):
    y = torch.randn(5, 512).bfloat16()
    q, s = ops.silu_and_mul_quant(y, scheme)
    q2, s2 = ops.quantize(ops.silu_and_mul(y), scheme)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


def test_masked_rows(seed):
    y = torch.randn(2, 4, 256).bfloat16()
    m = torch.tensor([1, 4], dtype=torch.int32)
    q, s = ops.silu_and_mul_quant(y, "fp8", masked_m=m)
    q2, s2 = ops.quantize(ops.silu_and_mul(y), "fp8")
    for e, n in enumerate(m.tolist()):
        assert torch.equal(q[e, :n].view(torch.uint8), q2[e, :n].view(torch.uint8))
        assert torch.equal(s[e, :n], s2[e, :n])


def test_activation_opcheck(seed):
    y = torch.randn(3, 256).bfloat16()
    opcheck(torch.ops.epmoe.silu_and_mul.default, (y,))
    opcheck(torch.ops.epmoe.silu_and_mul_quant.default, (y, "fp8", None, 128))
    y3 = torch.randn(2, 3, 256).bfloat16()
    m = torch.tensor([0, 2], dtype=torch.int32)
    opcheck(torch.ops.epmoe.silu_and_mul_quant.default, (y3, "int8", m, 128))
    mi = torch.tensor([0, 0, -1], dtype=torch.int32)
    offs = torch.tensor([0, 2], dtype=torch.int32)
    opcheck(torch.ops.epmoe.silu_and_mul.default, (y, None, mi, offs))
    opcheck(torch.ops.epmoe.silu_and_mul_quant.default, (y, "fp8", None, 128, mi, "row", offs))
    b = torch.randn(2, 256).bfloat16()
    spec = "silu:alpha=1.702,limit=7,up_offset=1"
    opcheck(torch.ops.epmoe.silu_and_mul.default, (y, None, mi, offs, spec, b))
    opcheck(torch.ops.epmoe.silu_and_mul.default, (y, None, None, None, "relu2:glu=0"))
    opcheck(
        torch.ops.epmoe.silu_and_mul_quant.default,
        (y, "int8", None, 128, mi, "row", None, "gelu", b.float()),
    )
    opcheck(
        torch.ops.epmoe.silu_and_mul_quant.default,
        (y3, "fp8", m, 128, None, "deepgemm", None, "relu2:glu=0", torch.randn(2, 256)),
    )


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: ops.silu_and_mul(torch.zeros(2, 5)), "silu_and_mul: y.shape\\[-1\\] expected"),
        (lambda: ops.silu_and_mul_quant(torch.zeros(2, 200), "fp8"), "silu_and_mul_quant: y.shape"),
        (lambda: ops.silu_and_mul_quant(torch.zeros(2, 256), "int4"), "silu_and_mul_quant: scheme"),
        (
            lambda: ops.silu_and_mul_quant(
                torch.zeros(2, 256), "fp8", torch.zeros(2, dtype=torch.int32)
            ),
            "silu_and_mul_quant: masked_m expected None for a 2-D y",
        ),
        (
            lambda: ops.silu_and_mul(torch.zeros(2, 4), expert_offsets=torch.zeros(2)),
            "silu_and_mul: expert_offsets expected dtype torch.int32",
        ),
        (
            lambda: ops.silu_and_mul(
                torch.zeros(2, 3, 4), expert_offsets=torch.zeros(2, dtype=torch.int32)
            ),
            "silu_and_mul: expert_offsets expected None for a 3-D y",
        ),
        (
            lambda: ops.silu_and_mul_quant(
                torch.zeros(2, 256), "fp8", expert_offsets=torch.zeros(0, dtype=torch.int32)
            ),
            "silu_and_mul_quant: expert_offsets expected \\[E \\+ 1\\]",
        ),
    ],
)
def test_activation_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


_Y, _MI = torch.zeros(4, 256), torch.tensor([0, 1, -1, 0], dtype=torch.int32)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(gate="swish"), "gate expected a gate spec .*, got 'swish'"),
        (dict(gate="relu:alpha=2"), "gate expected a gate spec .*, got 'relu:alpha=2'"),
        (dict(gate="silu:limit=-1"), "gate expected a gate spec"),
        (dict(gate="silu:glu=0,limit=7"), "gate expected a gate spec"),
        (dict(gate="silu:beta=1"), "gate expected a gate spec"),
        (dict(bias=torch.zeros(2, 256)), "m_indices expected int32 \\[M_sum\\] .* with a bias"),
        (dict(m_indices=_MI, bias=torch.zeros(2, 128)), "bias expected shape \\[any, 256\\]"),
        (dict(m_indices=_MI, bias=torch.zeros(256)), "bias expected shape"),
        (dict(m_indices=_MI, bias=torch.zeros(2, 256, dtype=torch.int8)), "bias expected dtype"),
    ],
)
@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_bad_gate_or_bias_before_any_kernel(kwargs, match, quant, device, monkeypatch):
    """A bad gate spec or bias is the contract's ValueError, on the CPU op and its fake alike:
    neither the reference nor a launch plan is reached."""

    def never(*a, **k):
        raise AssertionError("reached a kernel")

    for name in ("_silu_launch", "_silu_quant_launch"):
        monkeypatch.setattr(A, name, never)
    for name in ("silu_and_mul", "silu_and_mul_quant"):
        monkeypatch.setattr(reference, name, never)
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    y = _Y.to(device)
    op = "silu_and_mul" if quant is None else "silu_and_mul_quant"
    with pytest.raises(ValueError, match=f"{op}: {match}"):
        if quant is None:
            ops.silu_and_mul(y, **kw)
        else:
            ops.silu_and_mul_quant(y, quant, **kw)


def test_bias_3d_and_width_rules():
    with pytest.raises(ValueError, match="silu_and_mul: bias expected shape \\[2, 8\\]"):
        ops.silu_and_mul(torch.zeros(2, 3, 8), bias=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="silu_and_mul_quant: y.shape\\[-1\\] expected a multiple"):
        ops.silu_and_mul_quant(torch.zeros(2, 200), "fp8", gate="relu2:glu=0")  # I = 200
    assert ops.silu_and_mul(torch.zeros(2, 5), gate="relu2:glu=0").shape == (2, 5)  # no halves
    q, s = ops.silu_and_mul_quant(torch.zeros(2, 128), "fp8", gate="relu:glu=0")
    assert q.shape == (2, 128) and s.shape == (2, 1)


@pytest.mark.parametrize("E, inter", [(8, 14336), (128, 768)])
def test_masked_grid_counts_column_programs(E, inter):
    """Masked (decode) grids: row slots x experts x column programs stay near masked_programs
    whatever the row width (Mixtral's I = 14336 in 14 / 7 column programs launched 28672 / 14336
    programs at 256 slots, nearly all past the counts); Qwen3's (one column program) keep 16."""
    Q = importlib.import_module("epmoe.ops.quantize")
    T, shape = 512, (E, 512, 2 * inter)
    strides = (T * 2 * inter, 2 * inter, 1)
    s_strides = (T * inter // 128, inter // 128, 1)
    bf16 = A._silu_launch(shape, strides, A._MASKED, False, "silu", None, A.CONFIG, Q.CONFIG)
    fp8 = A._silu_quant_launch("fp8", 128, shape, strides, s_strides, A._MASKED, False, "silu",
                               None, A.CONFIG, Q.CONFIG)  # fmt: skip
    x_strides = (T * inter, inter, 1)
    qz = Q._quant_launch("fp8", 128, (E, T, inter), x_strides, x_strides, s_strides, True, Q.CONFIG)
    for launch in (bf16, fp8, qz):
        slots, experts, chunks = launch.grid
        assert experts == E and slots * experts * chunks <= 2 * Q.CONFIG.masked_programs
        assert slots >= Q.CONFIG.min_slots
    if E == 128:  # (one column program: as before)
        assert bf16.grid == fp8.grid == (16, 128, 1)


def test_fast_path_takes_plain_tensors_only():
    """The public functions' one-pass fast path (the contract's ``direct``): y and expert_offsets
    must be plain tensors without grad, as _eager.direct asks of every tensor; a Parameter or a
    tensor that needs grad goes the dispatcher's way (built here to accept CPU tensors)."""
    import importlib

    A = importlib.import_module("epmoe.ops.activation")
    direct = A.CONTRACT._build("direct", direct=True, cuda_attr="is_cpu")
    y = torch.zeros((4, 8))
    offs = torch.zeros(3, dtype=torch.int32)
    mi = torch.zeros(4, dtype=torch.int32)
    b = torch.zeros((2, 8))
    assert direct(y, None, None, None, "silu", None) and direct(y, None, None, offs, "silu", None)
    assert direct(y, None, mi, None, "gelu", b)
    assert not direct(torch.nn.Parameter(y), None, None, None, "silu", None)
    assert not direct(y.clone().requires_grad_(), None, None, offs, "silu", None)
    assert not direct(y, None, None, torch.nn.Parameter(offs, requires_grad=False), "silu", None)
    assert not direct(y, None, mi, None, "silu", torch.nn.Parameter(b))
    assert not direct(y, None, mi, None, "swish", None)


@pytest.mark.parametrize("use_compile", [False, True])
def test_gate_bias_under_compile(use_compile, seed):
    """The gate spec and the bias through torch.compile(fullgraph=True): the same bytes as eager
    (on CPU the op stays one opaque node calling the reference), fake shapes per glu."""
    y = (torch.randn(6, 256) * 3).bfloat16()
    b = torch.randn(2, 256)
    mi = torch.tensor([0, 1, -1, 1, 0, 0], dtype=torch.int32)

    def fn(y, b, mi):
        h = ops.silu_and_mul(y, m_indices=mi, gate="silu:alpha=1.702,limit=7,up_offset=1", bias=b)
        q, s = ops.silu_and_mul_quant(y, "fp8", m_indices=mi, gate="relu2:glu=0", bias=b)
        return h, q, s

    run = torch.compile(fn, fullgraph=True) if use_compile else fn
    h, q, s = run(y, b, mi)
    h2, q2, s2 = fn(y, b, mi)
    assert h.shape == (6, 128) and q.shape == (6, 256) and s.shape == (6, 2)
    live = mi >= 0
    assert torch.equal(h[live], h2[live])
    assert torch.equal(q[live].view(torch.uint8), q2[live].view(torch.uint8))
    assert torch.equal(s[live], s2[live])
