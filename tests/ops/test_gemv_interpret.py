"""gemv_gate_up / gemv_down Triton kernels on CPU tensors under TRITON_INTERPRET=1 vs the reference.

The kernels sum their float32 products in their own order (tiles reduced with tl.sum, fp8 group
sums scaled once, int8 in int32), the reference in torch's. On random data the float32 sums
differ in their last bits, and now and then the bf16 rounding of a g, u or down product flips
by one step (a few elements in a thousand, bf16 and fp8 alike). So:

- exact inputs (small integers times powers of two; for fp8 / int8 one value of every scale group
  at the top code, so every scale is a power of two and every code exact): each product and sum
  is exact in float32 in any order, and h and out equal the reference byte for byte, every scheme;
- random inputs: within the bf16 tolerance, and byte-equal on all but a small fraction.

Small launch configs (``gemv.override``) make several column blocks, k-steps, fp8 groups per
step and check-program steps run, with partial last blocks (H, I not multiples of the blocks).
Outputs come from poisoned memory (tests/ops/_stage_cases.poisoned_empty): an element the
kernels never write shows.

Gates, biases and padded sizes: every activation (byte-exact for the ones without a
transcendental function, on exact inputs), gpt-oss's clamped gate, Inkling2's softcaps, a gate
without a gate half, bf16 / fp16 / fp32 biases, x narrower than the zero-padded weights (H = 160
on 256) and an output of the first ``hidden`` columns.
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)

import torch  # noqa: E402

from epmoe import gate, reference  # noqa: E402
from epmoe.ops import gemv as G  # noqa: E402
from tests._routing import random_ids, random_weights  # noqa: E402
from tests.ops import _stage_cases as C  # noqa: E402

pytestmark = pytest.mark.interpret
SCHEMES = ("bf16", "fp8", "int8")
FP8 = torch.float8_e4m3fn
bf16 = torch.bfloat16
NAN = C.POISON_BYTES[0]

# bf16 / int8: I = 72 is 5 column blocks of 16 (the last 8 wide) and 3 down k-steps of 32 (the
# last 8), H = 200 is 2 gate/up k-steps of 128 (the last 72) and 13 down column blocks of 16.
# fp8: H = 384 is 2 gate/up steps of 2 groups (the last group dead) and 6 down column blocks of
# 64, I = 384 is 6 gate/up column blocks of 64 and 2 down steps of 2 groups (the last one dead).
# T * K = 6 ids: 2 steps of the check program. (block_n, block_k, warps) per kernel; down's
# top_k 1: steps of block_k whatever K (test_down_step_follows_top_k).
CONFIGS = {
    "bf16": dict(up_bf16=(16, 128, 4), down_bf16=(16, 32, 4, 1), check_ids=4),
    "fp8": dict(up_fp8=(64, 256, 4), down_fp8=(64, 256, 4, 1), check_ids=4),
    "int8": dict(up_int8=(16, 128, 4), down_int8=(16, 32, 4, 1), check_ids=4),
}
for _conf in CONFIGS.values():  # the same blocks for calls of one token
    _conf.update({k + "_one": v for k, v in list(_conf.items()) if k != "check_ids"})
SIZES = {"bf16": (200, 72), "fp8": (384, 384), "int8": (200, 72)}  # (H, I)
MIN_SIZES = {"bf16": (64, 40), "fp8": (128, 128), "int8": (64, 40)}


# ------------------------------------------------------------------------------- exact inputs
def _small_ints(shape, gen):
    return torch.randint(-8, 9, shape, generator=gen).float()


def exact_rows(shape, scheme, gen, m=3):
    """bf16 `[..., D]` activations: small integers times 2**-m; for fp8 one entry per 128
    channels, for int8 one per row, at the top code (+-448, 127), so the scale is 2**-m."""
    v = _small_ints(shape, gen)
    if scheme == "fp8":
        groups = v.view(*shape[:-1], shape[-1] // 128, 128)
        sign = torch.randint(0, 2, groups.shape[:-1], generator=gen).float() * 2 - 1
        groups[..., 0] = 448.0 * sign
    elif scheme == "int8":
        v[..., 0] = 127.0
    return (v * 2.0**-m).to(bf16)


def exact_weights(E, N, Kd, scheme, gen):
    """`[E, N, Kd]` weights and scales: small-integer codes, power-of-two scales (fp8: one code per
    128 x 128 block at 448, never in an activation's top-code column)."""
    codes = _small_ints((E, N, Kd), gen)
    if scheme == "bf16":
        return (codes * 2.0**-5).to(bf16), None
    if scheme == "fp8":
        codes.view(E, N // 128, 128, Kd // 128, 128)[:, :, 0, :, 1] = 448.0
        s = 2.0 ** -torch.randint(8, 11, (E, N // 128, Kd // 128), generator=gen).float()
        return codes.to(FP8), s
    return codes.to(torch.int8), 2.0 ** -torch.randint(5, 8, (E, N), generator=gen).float()


# --------------------------------------------------------------------------------- launches
_SCHEME = {bf16: "bf16", FP8: "fp8", torch.int8: "int8"}


def _up(x, ids, w1, s1, check=True, byte=NAN, cfg=None, spec="silu", bias=None):
    """The gate/up launch from ``byte``-poisoned memory, with ``cfg`` (default: CONFIGS)."""
    cfg = CONFIGS[_SCHEME[w1.dtype]] if cfg is None else cfg
    with G.override(**cfg), C.poisoned_empty(byte):
        h = G._gemv_gate_up_triton(x, ids, w1, s1, check, spec, bias)
    inter = w1.shape[1] // 2 if gate.parse(spec).glu else w1.shape[1]
    assert h.dtype == bf16 and h.shape == (*ids.shape, inter)
    return h


def _down(h, ids, tw, w2, s2, check=True, byte=NAN, cfg=None, bias=None, hidden=None):
    cfg = CONFIGS[_SCHEME[w2.dtype]] if cfg is None else cfg
    with G.override(**cfg), C.poisoned_empty(byte):
        out = G._gemv_down_triton(h, ids, tw, w2, s2, check, bias, hidden)
    assert out.dtype == bf16 and out.shape == (ids.shape[0], hidden or w2.shape[1])
    return out


def _mostly_equal(actual, expected, what, max_frac=0.01, floor=0.0):
    """Within the bf16 tolerance, and byte-equal but for a small fraction (rounding flips) of the
    elements above ``floor`` in magnitude."""
    C.assert_close(actual, expected)
    big = expected.float().abs() >= floor
    if big.any():
        differ = actual.view(torch.int16)[big] != expected.view(torch.int16)[big]
        frac = differ.float().mean().item()
        assert frac <= max_frac, f"{what}: {frac:.2%} of the elements differ"


def _random_problem(scheme, T, K, E, H, I, seed, p_none=0.25, width=None):  # noqa: E741
    """Random x, ids, weights and quantized weights (w1 of ``width`` rows, default 2I)."""
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn((E, width or 2 * I, H), generator=gen) / H**0.5
    w2 = torch.randn((E, H, I), generator=gen) / I**0.5
    x = (torch.randn((T, H), generator=gen) * 2).to(bf16)
    ids, tw = random_ids(T, K, E, p_none, gen), random_weights(T, K, gen)
    q1, q2 = reference.quantize_weights(w1, scheme), reference.quantize_weights(w2, scheme)
    return x, ids, tw, (*q1, *q2)


# ------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("scheme", SCHEMES)
def test_exact_inputs_byte_exact(scheme):
    gen = torch.Generator().manual_seed(0)
    H, I = SIZES[scheme]  # noqa: E741
    E = 4
    w1, s1 = exact_weights(E, 2 * I, H, scheme, gen)
    w2, s2 = exact_weights(E, H, I, scheme, gen)
    x = exact_rows((2, H), scheme, gen)
    ids = torch.tensor([[1, -1, 1], [3, 0, 2]])  # a skipped choice, one expert twice, E - 1
    tw = random_weights(2, 3, gen)
    h_exact = exact_rows((2, 3, I), scheme, gen)  # gemv_down's input: exact too
    h_ref = reference.gemv_gate_up(x, ids, w1, s1)
    out_ref = reference.gemv_down(h_exact, ids, tw, w2, s2)
    for byte in C.POISON_BYTES:
        C.assert_equal(_up(x, ids, w1, s1, byte=byte), h_ref, "h")
        C.assert_equal(_down(h_exact, ids, tw, w2, s2, byte=byte), out_ref, "out")
    assert (h_ref[0, 1] == 0).all() and torch.equal(h_ref[0, 0], h_ref[0, 2])
    assert h_ref.float().abs().amax() > 0.1 and out_ref.float().abs().amax() > 0.1


@pytest.mark.parametrize("scheme", SCHEMES)
def test_random_inputs(scheme):
    """Random data, -1 routing, an all-zero token (int8 / fp8: the scale floor, codes 0);
    gemv_down from the kernel's own h."""
    H, I = SIZES[scheme]  # noqa: E741
    x, ids, tw, (w1, s1, w2, s2) = _random_problem(scheme, 3, 3, 6, H, I, seed=1)
    x[2] = 0.0
    h = _up(x, ids, w1, s1)
    _mostly_equal(h, reference.gemv_gate_up(x, ids, w1, s1), "h")
    out = _down(h, ids, tw, w2, s2)
    _mostly_equal(out, reference.gemv_down(h, ids, tw, w2, s2), "out")
    assert (h[ids < 0] == 0).all()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("T", [0, 2])
def test_no_live_choice(scheme, T):
    """T = 0, and every choice -1: zero h and out, and nothing read (NaN x and h rows stay out);
    at the default launch config."""
    H, I = MIN_SIZES[scheme]  # noqa: E741
    x, _, tw, (w1, s1, w2, s2) = _random_problem(scheme, T, 2, 4, H, I, seed=2)
    ids = torch.full((T, 2), -1)
    x.fill_(float("nan"))
    h = _up(x, ids, w1, s1, cfg={})
    assert torch.equal(h, torch.zeros((T, 2, I), dtype=bf16))
    out = _down(torch.full_like(h, float("nan")), ids, tw, w2, s2, cfg={})
    assert torch.equal(out, torch.zeros((T, H), dtype=bf16))


def test_skipped_rows_are_never_read():
    """A token with live and skipped choices: NaN in the h rows of the skipped ones stays out (the
    reference agrees), and K = 1 (K_PAD 1) works."""
    H, I = MIN_SIZES["bf16"]  # noqa: E741
    x, _, tw, (w1, s1, w2, s2) = _random_problem("bf16", 3, 2, 4, H, I, seed=3)
    ids = torch.tensor([[2, -1], [-1, 0], [3, 3]])
    h = _up(x, ids, w1, s1)
    poisoned = torch.where((ids < 0).unsqueeze(-1), float("nan"), h.float()).to(bf16)
    out = _down(poisoned, ids, tw, w2, s2)
    assert torch.equal(out, _down(h, ids, tw, w2, s2)) and not out.isnan().any()
    _mostly_equal(out, reference.gemv_down(poisoned, ids, tw, w2, s2), "out")
    one = _down(h[:, :1], ids[:, :1], tw[:, :1], w2, s2)  # K = 1
    _mostly_equal(one, reference.gemv_down(h[:, :1], ids[:, :1], tw[:, :1], w2, s2), "K=1")


@pytest.mark.parametrize("bad", [4, -2])
@pytest.mark.parametrize("pos", [0, 5])  # the check program's first and second step
def test_bad_ids_raise(bad, pos):
    H, I = MIN_SIZES["bf16"]  # noqa: E741
    x, _, tw, (w1, s1, w2, s2) = _random_problem("bf16", 2, 3, 4, H, I, seed=4)
    ids = torch.tensor([[0, 1, -1], [3, 2, 3]])
    ids.view(-1)[pos] = bad
    h = torch.zeros((2, 3, I), dtype=bf16)
    with pytest.raises(ValueError, match=r"gemv_gate_up: topk_ids expected ids in \[0, 4\) or -1, "
                       "got values outside it"):  # fmt: skip
        _up(x, ids, w1, s1)
    with pytest.raises(ValueError, match=r"gemv_down: topk_ids expected ids in \[0, 4\) or -1, "
                       "got values outside it"):  # fmt: skip
        _down(h, ids, tw, w2, s2)


def test_good_ids_write_the_flag():
    """With zero-filled memory an unwritten ok flag would read as "bad ids": the check program
    writes it, on both of its steps' worth of ids (-1 and E - 1 are valid)."""
    H, I = MIN_SIZES["bf16"]  # noqa: E741
    x, _, tw, (w1, s1, w2, s2) = _random_problem("bf16", 2, 3, 4, H, I, seed=5)
    ids = torch.tensor([[0, -1, 3], [3, 2, -1]])
    h = _up(x, ids, w1, s1, byte=0)
    _down(h, ids, tw, w2, s2, byte=0)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_unchecked_launch(scheme):
    """check=False (the layer's gemv_down after gemv_gate_up): the same bytes, no id check, and a
    bad id is still never read through (it counts as -1)."""
    H, I = MIN_SIZES[scheme]  # noqa: E741
    x, _, tw, (w1, s1, w2, s2) = _random_problem(scheme, 2, 2, 4, H, I, seed=6)
    ids = torch.tensor([[1, 3], [0, -1]])
    h = _up(x, ids, w1, s1)
    C.assert_equal(_up(x, ids, w1, s1, check=False), h, "h")
    out = _down(h, ids, tw, w2, s2)
    C.assert_equal(_down(h, ids, tw, w2, s2, check=False), out, "out")
    bad = torch.tensor([[1, 4], [-2, -1]])  # E and -2 where the good ids have 3 and 0
    skipped = torch.tensor([[1, -1], [-1, -1]])
    C.assert_equal(_up(x, bad, w1, s1, check=False), _up(x, skipped, w1, s1), "h")
    C.assert_equal(_down(h, bad, tw, w2, s2, check=False), _down(h, skipped, tw, w2, s2), "out")


def test_int32_strided_inputs():
    """int32 and non-contiguous ids, strided x, bf16 topk_weights: the bytes of the plain call."""
    H, I = MIN_SIZES["int8"]  # noqa: E741
    x, ids, tw, (w1, s1, w2, s2) = _random_problem("int8", 3, 3, 4, H, I, seed=7)
    h = _up(x, ids, w1, s1)
    ids32 = ids.int().t().contiguous().t()
    x_strided = torch.stack([x, torch.zeros_like(x)], dim=-1)[..., 0]
    assert not ids32.is_contiguous() and not x_strided.is_contiguous()
    C.assert_equal(_up(x_strided, ids32, w1, s1), h, "h")
    tw16 = tw.to(bf16)
    C.assert_equal(_down(h, ids32, tw16.t().contiguous().t(), w2, s2), _down(h, ids, tw16, w2, s2),
                   "out")  # fmt: skip


# ------------------------------------------------------------------ gates, biases, padded sizes
GATES = C.GEMV_GATES
# gpt-oss's, the softcaps, no gate half (the gate math is the same code for every scheme)
QUANT_GATES = (GATES[0], GATES[-2], GATES[-1])


def _biases(E, W, H, dtype, gen, m=3):
    """b1 `[E, W]`, b2 `[E, H]`: small integers times 2**-m (exact in any float dtype)."""
    return tuple((_small_ints((E, n), gen) * 2.0**-m).to(dtype) for n in (W, H))


@pytest.mark.parametrize(
    "scheme,spec", [("bf16", g) for g in GATES] + [(q, g) for q in ("fp8", "int8") for g in
                                                   QUANT_GATES]
)  # fmt: skip
def test_gates_with_bias(scheme, spec):
    """Random data, -1 routing, a bias on each GEMV; x scaled so a limit of 7 clamps."""
    H, I = SIZES[scheme]  # noqa: E741
    W = gate.parse(spec).width(I)
    x, ids, tw, (w1, s1, w2, s2) = _random_problem(scheme, 3, 3, 6, H, I, seed=8, width=W)
    x = (x.float() * 3).to(bf16)
    b1, b2 = _biases(6, W, H, bf16, torch.Generator().manual_seed(9))
    h = _up(x, ids, w1, s1, spec=spec, bias=b1)
    # (torch's tanh GELU, 0.5 g (1 + tanh(z)), loses the far negative tail to cancellation that
    # the kernel's g sigmoid(2z) keeps: bytes compared above it)
    floor = 1e-3 if spec == "gelu_tanh" else 0.0
    _mostly_equal(h, reference.gemv_gate_up(x, ids, w1, s1, spec, b1), "h", floor=floor)
    assert (h[ids < 0] == 0).all()  # (a skipped choice reads no bias)
    out = _down(h, ids, tw, w2, s2, bias=b2)
    _mostly_equal(out, reference.gemv_down(h, ids, tw, w2, s2, b2), "out")


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("spec", ["relu", "relu2:glu=0"])
def test_exact_gates_and_biases_byte_exact(scheme, spec):
    """Exact inputs and biases, gates without a transcendental function: h and out equal the
    reference byte for byte; a bias dtype per scheme (bf16, fp16, fp32)."""
    gen = torch.Generator().manual_seed(10)
    H, I = SIZES[scheme]  # noqa: E741
    W = gate.parse(spec).width(I)
    w1, s1 = exact_weights(4, W, H, scheme, gen)
    w2, s2 = exact_weights(4, H, I, scheme, gen)
    x = exact_rows((2, H), scheme, gen)
    ids = torch.tensor([[1, -1, 1], [3, 0, 2]])
    tw = random_weights(2, 3, gen)
    h_exact = exact_rows((2, 3, I), scheme, gen)
    dtype = {"bf16": bf16, "fp8": torch.float16, "int8": torch.float32}[scheme]
    b1, b2 = _biases(4, W, H, dtype, gen)
    h_ref = reference.gemv_gate_up(x, ids, w1, s1, spec, b1)
    C.assert_equal(_up(x, ids, w1, s1, spec=spec, bias=b1), h_ref, "h")
    out_ref = reference.gemv_down(h_exact, ids, tw, w2, s2, b2)
    C.assert_equal(_down(h_exact, ids, tw, w2, s2, bias=b2), out_ref, "out")
    assert h_ref.float().abs().amax() > 0.1 and (h_ref[0, 1] == 0).all()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_padded_hidden(scheme):
    """x `[T, 160]` on weights zero-padded to H = 256 (fp8: the activation group at the edge half
    zeros, one gate/up step of two groups), out `[T, 160]`: the first columns, 3 down column
    blocks (the last partial); biases on both."""
    gen = torch.Generator().manual_seed(12)
    E, H, Hp, I = 4, 160, 256, 128  # noqa: E741
    w1 = torch.zeros((E, 2 * I, Hp))
    w1[..., :H] = torch.randn((E, 2 * I, H), generator=gen) / H**0.5
    w2 = torch.zeros((E, Hp, I))
    w2[:, :H] = torch.randn((E, H, I), generator=gen) / I**0.5
    (w1, s1), (w2, s2) = (
        reference.quantize_weights(w1, scheme),
        reference.quantize_weights(w2, scheme),
    )
    x = (torch.randn((3, H), generator=gen) * 2).to(bf16)
    x[2] = 0.0
    ids, tw = random_ids(3, 3, E, 0.25, gen), random_weights(3, 3, gen)
    b1, b2 = _biases(E, 2 * I, Hp, torch.float32, gen)
    cfg = dict(CONFIGS[scheme], **{f"down_{scheme}": (64, 128, 4, 1)})
    h = _up(x, ids, w1, s1, cfg=cfg, spec="gelu_tanh", bias=b1)
    _mostly_equal(h, reference.gemv_gate_up(x, ids, w1, s1, "gelu_tanh", b1), "h", floor=1e-3)
    out = _down(h, ids, tw, w2, s2, cfg=cfg, bias=b2, hidden=H)
    _mostly_equal(out, reference.gemv_down(h, ids, tw, w2, s2, b2, H), "out")
    full = _down(h, ids, tw, w2, s2, cfg=cfg, bias=b2)
    C.assert_equal(full[:, :H], out, "out")
