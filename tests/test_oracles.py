"""Oracles written from the published definitions, in float64, independent of epmoe.reference.

Every other test compares the ops with epmoe.reference, and the kernels import its constants, so a
wrong constant or formula there would go unseen. These oracles share nothing with it: the fp8
e4m3 value grid is built from its bit layout, 448 and 127 are typed in, and each formula is
written out again. Each is compared with the reference and with the public op (on CPU).

Definitions:
- fp8 e4m3 (OCP FP8, "fn": no infinities): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits;
  exponent 0 is subnormal; S.1111.111 is NaN, so the largest finite value is 1.75 * 2**8 = 448.
  Casts round to nearest, ties to even, and saturate to +-448.
- fp8 activations (DeepSeek-V3 / DeepGEMM): a scale per token and 128 channels, s = amax / 448,
  q = e4m3(x / s). fp8 weights: a scale per 128 x 128 block, the same formula.
- int8 (symmetric): s = amax / 127 per token (activations) or per output channel (weights),
  q = round(x / s), half away from zero, in [-127, 127].
- SiLU-and-mul (SwiGLU): y = [gate, up] -> silu(gate) * up, silu(g) = g / (1 + exp(-g)).
- MoE: out[t] = sum over k with id >= 0 of w[t, k] * W2[id] (silu(W1g[id] x[t]) * W1u[id] x[t]).
"""

import math

import pytest
import torch

import epmoe
from epmoe import ops, reference

FP8_MAX = 448.0  # typed in: not reference.FP8_MAX
INT8_MAX = 127.0
GROUP = 128


# ------------------------------------------------------------------------------- the e4m3 grid
def _e4m3_grid() -> torch.Tensor:
    """float64 `[127]`: every finite non-negative e4m3 value, in code order (code = 8 e + m)."""
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


GRID = _e4m3_grid()


def test_e4m3_grid_matches_torch_and_the_published_max():
    assert GRID.max().item() == FP8_MAX == 1.75 * 2**8
    assert torch.all(GRID[1:] > GRID[:-1])  # code order is value order
    codes = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert torch.equal(codes.double(), GRID)


def _e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """float64 -> nearest e4m3 value (ties to the even code), saturated to +-448."""
    a = v.abs().clamp(max=FP8_MAX)
    hi = torch.searchsorted(GRID, a).clamp(max=GRID.numel() - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - GRID[lo], GRID[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.sign(v) * torch.where(pick_hi, GRID[hi], GRID[lo])


def _near_e4m3_tie(v: torch.Tensor, rel: float) -> torch.Tensor:
    """|v| within ``rel`` (relative) of a midpoint between two e4m3 values."""
    mids = (GRID[1:] + GRID[:-1]) / 2
    a = v.abs().clamp(max=FP8_MAX)
    i = torch.searchsorted(mids, a).clamp(max=mids.numel() - 1)
    near = torch.minimum((a - mids[i]).abs(), (a - mids[(i - 1).clamp(min=0)]).abs())
    return near <= rel * a


def _assert_codes(got: torch.Tensor, want: torch.Tensor, near_tie: torch.Tensor, what: str):
    """Codes equal, except next to a rounding tie (where float32 vs float64 may pick the other
    neighbour), and there at most one step apart."""
    got, want = got.double(), want.double()
    off = got != want
    assert not (off & ~near_tie).any(), f"{what}: {int((off & ~near_tie).sum())} codes differ"
    assert near_tie.float().mean() < 0.01, what  # the exemption stays rare


def _groups(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)


def _act(t=24, h=512, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((t, h), generator=g) * torch.logspace(-3, 2, t)[:, None]  # wide dynamic range
    x[3, :GROUP] = 0.0  # an all-zero group
    x[5, 7] = 1e4  # one outlier dominating its group
    return x.to(torch.bfloat16)


# ------------------------------------------------------------------------------- fp8 activations
def _fp8_act_oracle(x: torch.Tensor):
    g = _groups(x.double())
    amax = g.abs().amax(dim=-1)
    s = amax / FP8_MAX
    q = _e4m3_round(g / torch.where(s > 0, s, 1.0).unsqueeze(-1))
    return q.reshape(x.shape), s


@pytest.mark.parametrize("quantize", [reference.quantize_fp8, lambda x: ops.quantize(x, "fp8")])
def test_fp8_activation_quant(quantize):
    x = _act()
    q, s = quantize(x)
    want_q, want_s = _fp8_act_oracle(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    live = want_s > 0
    assert torch.equal(s[live], want_s[live].float())  # amax / 448, correctly rounded
    assert (s[~live] > 0).all() and (q.reshape(-1, 4, GROUP)[~live] == 0).all()
    v = _groups(x.double()) / s.double().unsqueeze(-1)
    _assert_codes(q, want_q, _near_e4m3_tie(v, 2.0**-22).reshape(x.shape), "fp8 codes")
    assert torch.equal(q.double().abs().amax(), torch.tensor(FP8_MAX, dtype=torch.float64))


@pytest.mark.parametrize("quantize", [reference.quantize_fp8, lambda x: ops.quantize(x, "fp8")])
def test_fp8_ties_round_to_even(quantize):
    """amax 448 makes s = 1: midpoints between e4m3 values go to the even code."""
    x = torch.zeros((1, GROUP))
    ties = [1.0625, 1.1875, -3.375, 3 * 2.0**-10, 432.0]  # subnormal 1 / 2, then 416 / 448
    x[0, 0] = FP8_MAX
    x[0, 1 : 1 + len(ties)] = torch.tensor(ties)
    q, s = quantize(x.to(torch.bfloat16))
    assert s.item() == 1.0
    want = [FP8_MAX, 1.0, 1.25, -3.5, 2.0**-8, 448.0]
    assert q[0, : len(want)].double().tolist() == want
    assert torch.equal(_e4m3_round(x[0, : len(want)].double()), torch.tensor(want).double())


def test_fp8_dequantize_is_code_times_scale():
    x = _act(seed=1)
    q, s = reference.quantize_fp8(x)
    want = (_groups(q.double()) * s.double().unsqueeze(-1)).reshape(x.shape)
    assert torch.equal(reference.dequantize(q, s), want.float())  # one float32 rounding


# --------------------------------------------------------------------------------- fp8 weights
def _weights(e=2, n=256, k=384, seed=2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn((e, n, k), generator=g) * 0.05
    w[1, :GROUP, GROUP : 2 * GROUP] *= 50  # one loud block
    return w.to(torch.bfloat16)


def _fp8_weight_oracle(w: torch.Tensor):
    E, N, Kd = w.shape
    b = w.double().reshape(E, N // GROUP, GROUP, Kd // GROUP, GROUP)
    s = b.abs().amax(dim=(2, 4)) / FP8_MAX
    q = _e4m3_round(b / s[:, :, None, :, None])
    return q.reshape(E, N, Kd), s


def test_fp8_weight_quant_128x128():
    w = _weights()
    q, s = reference.quantize_weights(w, "fp8")
    want_q, want_s = _fp8_weight_oracle(w)
    assert s.shape == (2, 2, 3)
    assert torch.equal(s, want_s.float())
    E, N, Kd = w.shape
    v = (
        w.double().reshape(E, N // GROUP, GROUP, Kd // GROUP, GROUP)
        / s.double()[:, :, None, :, None]
    )
    _assert_codes(q, want_q, _near_e4m3_tie(v, 2.0**-23).reshape(w.shape), "fp8 weight codes")
    deq = reference.dequantize_weights(q, s)
    want_deq = (
        q.double().reshape(E, N // GROUP, GROUP, Kd // GROUP, GROUP)
        * s.double()[:, :, None, :, None]
    ).reshape(E, N, Kd)
    assert torch.equal(deq, want_deq.float())


# ------------------------------------------------------------------------------------------ int8
def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def _near_half(v: torch.Tensor, rel: float) -> torch.Tensor:
    frac = v.abs() - torch.floor(v.abs())
    return (frac - 0.5).abs() <= rel * v.abs().clamp(min=1.0)


@pytest.mark.parametrize("quantize", [reference.quantize_int8, lambda x: ops.quantize(x, "int8")])
def test_int8_per_token_quant(quantize):
    x = _act(seed=3)
    q, s = quantize(x)
    amax = x.double().abs().amax(dim=-1, keepdim=True)
    live = (amax > 0).squeeze(-1)
    assert q.dtype == torch.int8 and s.shape == (x.shape[0], 1)
    assert torch.equal(s[live], (amax / INT8_MAX)[live].float())
    v = x.double() / s.double()
    want = _round_half_away(v).clamp(-INT8_MAX, INT8_MAX)
    off = (q.double() != want) & ~_near_half(v, 2.0**-22)
    assert not off.any(), f"{int(off.sum())} int8 codes differ"
    assert (q[live].abs().amax(dim=-1) == 127).all() and (q[~live] == 0).all()
    assert q.min() >= -127


@pytest.mark.parametrize("quantize", [reference.quantize_int8, lambda x: ops.quantize(x, "int8")])
def test_int8_ties_round_half_away_from_zero(quantize):
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5]])
    q, s = quantize(x.to(torch.bfloat16))
    assert s.item() == 1.0
    assert q.tolist() == [[127, 1, 2, 3, -1, -3, 127]]


def test_int8_per_channel_weight_quant():
    w = _weights(seed=4)
    q, s = reference.quantize_weights(w, "int8")
    s_want = w.double().abs().amax(dim=-1) / INT8_MAX
    assert s.shape == w.shape[:2] and torch.equal(s, s_want.float())
    v = w.double() / s.double().unsqueeze(-1)
    want = _round_half_away(v).clamp(-INT8_MAX, INT8_MAX)
    off = (q.double() != want) & ~_near_half(v, 2.0**-23)
    assert not off.any(), f"{int(off.sum())} int8 weight codes differ"
    deq = reference.dequantize_weights(q, s)
    assert torch.equal(deq, (q.double() * s.double().unsqueeze(-1)).float())


# --------------------------------------------------------------------------------- SiLU-and-mul
def _silu_mul_oracle(y: torch.Tensor) -> torch.Tensor:
    yd = y.double()
    inter = y.shape[-1] // 2
    g, u = yd[..., :inter], yd[..., inter:]
    return g / (1.0 + torch.exp(-g)) * u


@pytest.mark.parametrize("silu_and_mul", [reference.silu_and_mul, ops.silu_and_mul])
def test_silu_and_mul(silu_and_mul):
    g = torch.Generator().manual_seed(5)
    y = torch.randn((16, 2 * 256), generator=g) * 4
    want = _silu_mul_oracle(y)
    got32 = silu_and_mul(y)  # float32 in, float32 out: only float32 math between
    torch.testing.assert_close(got32.double(), want, rtol=2e-6, atol=1e-7)
    got = silu_and_mul(y.to(torch.bfloat16))  # bf16: one rounding of the float32 result
    want16 = _silu_mul_oracle(y.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want16, rtol=2.0**-8, atol=1e-30)
    # gate first: swapping the halves changes the result
    assert not torch.allclose(got32.double(), _silu_mul_oracle(y.roll(256, dims=-1)))


def test_silu_and_mul_quant_fp8():
    g = torch.Generator().manual_seed(6)
    y = (torch.randn((8, 2 * 256), generator=g) * 3).to(torch.bfloat16)
    q, s = ops.silu_and_mul_quant(y, "fp8")
    h = _silu_mul_oracle(y).to(torch.bfloat16)  # the activation rounded to y.dtype first
    want_q, want_s = _fp8_act_oracle(h)
    # h's bf16 rounding may differ from the float32 path's next to a bf16 tie: allow one step
    torch.testing.assert_close(s.double(), want_s, rtol=2.0**-7, atol=0)
    step = (q.double() - want_q).abs() / GRID[1:].sub(GRID[:-1]).max()
    assert (q.double() == want_q).float().mean() > 0.99 and step.max() <= 1


# --------------------------------------------------------------------------------- grouped GEMM
@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_grouped_gemm_contiguous_dequantizes_both_sides(scheme):
    """out[r] = deq(a[r]) @ deq(w[m_indices[r]]).T, deq = code * scale from the layouts above."""
    w = _weights(seed=7)  # [2, 256, 384]
    wq, ws = reference.quantize_weights(w, scheme)
    g = torch.Generator().manual_seed(8)
    a = torch.randn((6, 384), generator=g).to(torch.bfloat16)
    aq, as_ = reference.quantize(a, scheme)
    m_idx = torch.tensor([0, 0, 1, -1, 1, 1], dtype=torch.int32)
    out = ops.grouped_gemm(aq, wq, m_indices=m_idx, a_scales=as_, w_scales=ws)
    if scheme == "fp8":
        ad = (_groups(aq.double()) * as_.double().unsqueeze(-1)).reshape(a.shape)
        E, N, Kd = w.shape
        wd = (
            wq.double().reshape(E, N // GROUP, GROUP, Kd // GROUP, GROUP)
            * ws.double()[:, :, None, :, None]
        ).reshape(E, N, Kd)
    else:
        ad = aq.double() * as_.double()
        wd = wq.double() * ws.double().unsqueeze(-1)
    want = torch.zeros((6, 256), dtype=torch.float64)
    for r, e in enumerate(m_idx.tolist()):
        if e >= 0:
            want[r] = wd[e] @ ad[r]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, rtol=2.0**-7, atol=1e-3)


# ------------------------------------------------------------------------------------ dense MoE
def _moe_oracle(x, ids, w, w1, w2) -> torch.Tensor:
    inter = w1.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double()
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            h = w1[e].double() @ xt
            gate, up = h[:inter], h[inter:]
            out[t] += float(w[t, k]) * (w2[e].double() @ (gate / (1 + torch.exp(-gate)) * up))
    return out


def test_dense_moe_and_the_layer():
    T, H, I, E, K = 12, 128, 128, 4, 2
    g = torch.Generator().manual_seed(9)
    x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    w = torch.rand((T, K), generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[2, 1] = -1
    ids[4] = torch.tensor([3, 3])  # the same expert twice: both weights count
    w1 = (torch.randn((E, 2 * I, H), generator=g) / math.sqrt(H)).to(torch.bfloat16)
    w2 = (torch.randn((E, H, I), generator=g) / math.sqrt(I)).to(torch.bfloat16)
    want = _moe_oracle(x, ids, w, w1, w2)
    ref = reference.dense_moe(x, ids, w, w1, w2)
    assert ref.dtype == torch.float32
    torch.testing.assert_close(ref.double(), want, rtol=1e-5, atol=1e-5)
    for mode in ("ht", "ll"):
        layer = epmoe.EPMoE(E, H, I, K, quant="bf16", mode=mode, backend="local",
                            max_tokens_per_rank=T, device="cpu")  # fmt: skip
        layer.load_weights(w1, w2)
        out = layer(x, ids, w)
        assert out.dtype == torch.bfloat16
        err = ((out.double() - want).norm() / want.norm()).item()
        assert err < 1e-2, (mode, err)
