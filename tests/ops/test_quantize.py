"""quantize: the documented formulas, opcheck, errors (CPU)."""

import pytest
import torch

from epmoe import ops, reference
from tests._opcheck import opcheck


@pytest.mark.parametrize("shape", [(5, 256), (3, 4, 128), (0, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_formula(shape, dtype, seed):
    x = (torch.randn(shape) * 3).to(dtype)
    q, s = ops.quantize(x, "fp8", group_size=128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (*shape[:-1], shape[-1] // 128)
    g = x.float().reshape(*shape[:-1], shape[-1] // 128, 128)
    want_s = (g.abs().amax(-1) / 448.0).clamp_min(1e-10)
    assert torch.equal(s, want_s)
    want_q = (g / want_s.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(shape)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("shape", [(7, 96), (2, 3, 33)])
def test_int8_formula(shape, seed):
    x = torch.randn(shape).bfloat16()
    x[..., 0] = 0.5  # exercise round-half-away on a tie after scaling
    q, s = ops.quantize(x, "int8")
    assert q.dtype == torch.int8 and s.shape == (*shape[:-1], 1)
    xf = x.float()
    want_s = (xf.abs().amax(-1, keepdim=True) / 127.0).clamp_min(1e-10)
    v = xf / want_s
    want_q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp(-127, 127).to(torch.int8)
    assert torch.equal(s, want_s) and torch.equal(q, want_q)
    assert int(q.abs().max()) == 127


def test_round_half_away_ties():
    # amax 127 -> s = 1, so x / s is exact and ties stay ties
    x = torch.tensor([[127.0, 2.5, -2.5, 0.5, -0.5, 1.49]])
    q, s = ops.quantize(x, "int8")
    assert float(s) == 1.0
    assert q.tolist() == [[127, 3, -3, 1, -1, 1]]


def test_zeros_give_zero(seed):
    for scheme in ("fp8", "int8"):
        q, s = ops.quantize(torch.zeros(2, 128), scheme)
        assert (q.float() == 0).all() and (s > 0).all()


def test_masked_m_rows_inside_count_match(seed):
    x = torch.randn(3, 5, 128).bfloat16()
    masked_m = torch.tensor([0, 2, 5], dtype=torch.int32)
    q, s = ops.quantize(x, "fp8", masked_m=masked_m)
    q_ref, s_ref = reference.quantize_fp8(x)
    for e, n in enumerate(masked_m.tolist()):
        assert torch.equal(q[e, :n].view(torch.uint8), q_ref[e, :n].view(torch.uint8))
        assert torch.equal(s[e, :n], s_ref[e, :n])


def test_dequantize_roundtrip(seed):
    x = torch.randn(16, 256)
    for scheme, tol in (("fp8", 0.07), ("int8", 0.01)):
        err = (reference.dequantize(*ops.quantize(x, scheme)) - x).norm() / x.norm()
        assert err < tol


def test_weight_quant_roundtrip(seed):
    w = torch.randn(2, 256, 128)
    for scheme, tol in (("fp8", 0.07), ("int8", 0.01)):
        q, s = reference.quantize_weights(w, scheme)
        assert q.shape == w.shape
        assert s.shape == ((2, 2, 1) if scheme == "fp8" else (2, 256))
        err = (reference.dequantize_weights(q, s) - w).norm() / w.norm()
        assert err < tol


def test_quantize_opcheck(seed):
    x = torch.randn(4, 256).bfloat16()
    opcheck(torch.ops.epmoe.quantize.default, (x, "fp8", 128, None))
    opcheck(torch.ops.epmoe.quantize.default, (x, "int8", 128, None))
    x3 = torch.randn(2, 3, 128).bfloat16()
    m = torch.tensor([1, 3], dtype=torch.int32)
    opcheck(torch.ops.epmoe.quantize.default, (x3, "fp8", 128, m))


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.zeros(2, 100), "fp8"), "quantize: x.shape\\[-1\\] expected a multiple of 128"),
        ((torch.zeros(2, 128), "nf4"), "quantize: scheme expected one of"),
        ((torch.zeros(2, 128, dtype=torch.int32), "int8"), "quantize: x expected dtype"),
        ((torch.zeros(128), "int8"), "quantize: x expected a 2-D or 3-D tensor"),
    ],
)
def test_quantize_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        ops.quantize(*args)


def _zero_extended(x, width):
    return torch.cat([x, x.new_zeros((*x.shape[:-1], width - x.shape[-1]))], dim=-1)


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
@pytest.mark.parametrize("shape,width", [((5, 160), 256), ((2, 3, 100), 128), ((4, 256), 512)])
def test_width_zero_extends(scheme, shape, width, seed):
    """Codes `[..., width]` of x zero-extended: zero codes past H, scales over x's values (fp8:
    the group x ends inside scaled by its zero-extended values; groups past H the floor)."""
    x = (torch.randn(shape) * 3).bfloat16()
    q, s = ops.quantize(x, scheme, width=width)
    rq, rs = reference.quantize(_zero_extended(x, width), scheme)
    assert q.shape == (*shape[:-1], width) and s.shape == rs.shape
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert (q[..., shape[-1] :].float() == 0).all()
    if scheme == "int8":  # one scale per row: the same as without the padding
        assert torch.equal(s, ops.quantize(x, scheme)[1])
    elif shape[-1] % 128 == 0:  # whole groups of x: its own scales, then the floor
        assert torch.equal(s[..., : shape[-1] // 128], ops.quantize(x, scheme)[1])
        assert (s[..., shape[-1] // 128 :] == 1e-10).all()
    # width == H: the default
    q2, s2 = ops.quantize(_zero_extended(x, width), scheme, width=width)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)


def test_width_masked_and_deepgemm(seed):
    x = torch.randn(3, 5, 160).bfloat16()
    m = torch.tensor([0, 2, 5], dtype=torch.int32)
    for scheme in ("fp8", "int8"):
        q, s = ops.quantize(x, scheme, masked_m=m, scale_layout="deepgemm", width=256)
        rq, rs = reference.quantize(_zero_extended(x, 256), scheme)
        for e, n in enumerate(m.tolist()):
            assert torch.equal(q[e, :n].view(torch.uint8), rq[e, :n].view(torch.uint8))
            assert torch.equal(s[e, :n], rs[e, :n])
        assert s.stride() == (s.shape[-1] * 8, 1, 8)


def test_width_opcheck(seed):
    x = torch.randn(4, 160).bfloat16()
    opcheck(torch.ops.epmoe.quantize.default, (x, "fp8", 128, None, "row", 256))
    opcheck(torch.ops.epmoe.quantize.default, (x, "int8", 128, None, "deepgemm", 200))
    x3 = torch.randn(2, 3, 160).bfloat16()
    m = torch.tensor([1, 3], dtype=torch.int32)
    opcheck(torch.ops.epmoe.quantize.default, (x3, "fp8", 128, m, "row", 384))


@pytest.mark.parametrize(
    "scheme,width,match",
    [
        (
            "fp8",
            128,
            r"quantize: width expected None or an int >= H = 160 \(x's columns\), got 128",
        ),
        ("int8", 159, "quantize: width expected None or an int >= H = 160"),
        ("fp8", 200, r"quantize: width expected a multiple of 128"),
        ("fp8", True, "quantize: width expected None or an int >= H"),
        ("int8", 256.0, "quantize: width expected None or an int >= H"),
        ("fp8", None, r"quantize: x.shape\[-1\] expected a multiple of 128"),
    ],
)
def test_width_bad_input(scheme, width, match):
    with pytest.raises(ValueError, match=match):
        ops.quantize(torch.zeros(2, 160), scheme, width=width)
