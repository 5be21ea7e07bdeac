"""gemv_gate_up / gemv_down on CPU (the reference path) against a float64 oracle, opcheck, errors.

The oracle is written from the contract in epmoe/ops/gemv.py's docstring and shares nothing with
epmoe.reference's gemv functions, silu_and_mul or Gate.reference: it takes the activation codes
and scales from reference.quantize (the contract says "quantized exactly as quantize does"),
dequantizes them and the weights itself (code * scale per 128 channels / 128 x 128 block, per
row / output channel), writes each gate's formula itself (from the gate's fields), and computes
in float64, rounding to bf16 exactly where the contract does (g and u, h, each choice's down
product, the output). Biases are added after those roundings, x narrower than the weights is
zero-extended, and ``hidden`` keeps the first output columns.
"""

import json
import math

import pytest
import torch

from epmoe import gate, ops, reference
from tests import _tol
from tests._opcheck import opcheck
from tests._routing import random_ids, random_weights
from tests.ops import _stage_cases as C

SCHEMES = ("bf16", "fp8", "int8")
GROUP = 128  # typed in: the fp8 activation group and weight block of the contract
FP8 = torch.float8_e4m3fn
bf16 = torch.bfloat16


# -------------------------------------------------------------------------------------- oracle
def _deq_rows(v: torch.Tensor, scheme: str) -> torch.Tensor:
    """bf16 activations `[..., D]` as the scheme's GEMM reads them, in float64."""
    if scheme == "bf16":
        return v.double()
    q, s = reference.quantize(v, scheme)
    if scheme == "int8":
        assert s.shape == (*v.shape[:-1], 1)
        return q.double() * s.double()
    g = q.double().reshape(*v.shape[:-1], v.shape[-1] // GROUP, GROUP)
    return (g * s.double().unsqueeze(-1)).reshape(v.shape)


def _deq_weights(w: torch.Tensor, s) -> torch.Tensor:
    """`[E, N, Kd]` weights in float64: bf16 as is, int8 code * channel scale, fp8 code * the
    scale of its 128 x 128 block."""
    if s is None:
        return w.double()
    if w.dtype == torch.int8:
        return w.double() * s.double().unsqueeze(-1)
    E, N, Kd = w.shape
    b = w.double().reshape(E, N // GROUP, GROUP, Kd // GROUP, GROUP)
    return (b * s.double()[:, :, None, :, None]).reshape(E, N, Kd)


def _act(g: torch.Tensor, act: str, alpha: float) -> torch.Tensor:
    """float64 activations, from their textbook formulas."""
    if act == "silu":
        return g / (1.0 + torch.exp(-alpha * g))
    if act == "gelu_tanh":
        return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))
    if act == "gelu":
        return 0.5 * g * (1.0 + torch.erf(g / math.sqrt(2.0)))
    r = g.clamp(min=0.0)
    return r * r if act == "relu2" else r


def _gate(y: torch.Tensor, spec: str) -> torch.Tensor:
    """float64 h of y `[W]` (gate half, then up half) for the gate ``spec`` names."""
    gt = gate.parse(spec)
    if not gt.glu:
        return _act(y, gt.act, gt.alpha)
    g, u = y.chunk(2)
    if gt.limit is not None:
        u = u.clamp(-gt.limit, gt.limit)
        g = g if gt.clamp_after else g.clamp(max=gt.limit)
    if gt.up_softcap is not None:
        u = gt.up_softcap * torch.tanh(u / gt.up_softcap)
    a = _act(g, gt.act, gt.alpha)
    if gt.gate_softcap is not None:  # SiLU's linear factor capped, the sigmoid of the raw gate
        a = gt.gate_softcap * torch.tanh(g / gt.gate_softcap) / (1.0 + torch.exp(-gt.alpha * g))
    if gt.limit is not None and gt.clamp_after:
        a = a.clamp(max=gt.limit)
    return a * (u + gt.up_offset)


def oracle_gate_up(x, ids, w1, s1, scheme, spec="silu", bias=None):
    T, K = ids.shape
    inter = w1.shape[1] // 2 if gate.parse(spec).glu else w1.shape[1]
    xp = torch.nn.functional.pad(x, (0, w1.shape[2] - x.shape[1]))  # zero-extended to the weights
    xd, wd = _deq_rows(xp, scheme), _deq_weights(w1, s1)
    h = torch.zeros((T, K, inter), dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if e < 0:
                continue
            y = (wd[e] @ xd[t]).to(bf16).double()  # g and u rounded to bf16
            if bias is not None:
                y = y + bias[e].double()
            h[t, k] = _gate(y, spec)
    return h.to(bf16)


def oracle_down(h, ids, tw, w2, s2, scheme, bias=None, hidden=None):
    T, K = ids.shape
    hd, wd = _deq_rows(h, scheme), _deq_weights(w2, s2)
    out = torch.zeros((T, w2.shape[1]), dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if e >= 0:
                y = (wd[e] @ hd[t, k]).to(bf16).double()
                out[t] += float(tw[t, k]) * (y if bias is None else y + bias[e].double())
    return out[:, :hidden].to(bf16)


# -------------------------------------------------------------------------------------- inputs
def _weights(E, H, I, scheme, gen):  # noqa: E741 (the intermediate size)
    w1 = torch.randn((E, 2 * I, H), generator=gen) / math.sqrt(H)
    w2 = torch.randn((E, H, I), generator=gen) / math.sqrt(I)
    return (*reference.quantize_weights(w1, scheme), *reference.quantize_weights(w2, scheme))


def _problem(scheme, T, K, E, H, I, seed, p_none=0.25):  # noqa: E741
    gen = torch.Generator().manual_seed(seed)
    w1, s1, w2, s2 = _weights(E, H, I, scheme, gen)
    x = (torch.randn((T, H), generator=gen) * 2).to(bf16)
    ids = random_ids(T, K, E, p_none, gen)
    return x, ids, random_weights(T, K, gen), (w1, s1, w2, s2)


def _check_pair(scheme, x, ids, tw, w):
    """Both ops against the oracle; gemv_down from the op's own h (one rounding of h)."""
    w1, s1, w2, s2 = w
    h = ops.gemv_gate_up(x, ids, w1, s1)
    assert h.dtype == bf16 and h.shape == (*ids.shape, w1.shape[1] // 2)
    _tol.assert_close(h, oracle_gate_up(x, ids, w1, s1, scheme))
    out = ops.gemv_down(h, ids, tw, w2, s2)
    assert out.dtype == bf16 and out.shape == (ids.shape[0], w2.shape[1])
    _tol.assert_close(out, oracle_down(h, ids, tw, w2, s2, scheme))
    return h, out


# --------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("T", [1, 4, 9])
def test_matches_float64_oracle(scheme, T):
    x, ids, tw, w = _problem(scheme, T, 4, 8, 256, 128, seed=T)
    h, out = _check_pair(scheme, x, ids, tw, w)
    assert (h[ids < 0] == 0).all()
    # the CPU kernel is the reference, called through the dispatcher or not
    w1, s1, w2, s2 = w
    assert torch.equal(torch.ops.epmoe.gemv_gate_up(x, ids, w1, s1), h)
    assert torch.equal(torch.ops.epmoe.gemv_down(h, ids, tw, w2, s2), out)


@pytest.mark.parametrize("scheme", ["bf16", "int8"])
def test_weird_sizes(scheme):
    """bf16 and int8 take any H and I (fp8 needs whole 128-channel blocks)."""
    _check_pair(scheme, *_problem(scheme, 5, 3, 5, 200, 72, seed=11))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_zero_tokens(scheme):
    x, ids, tw, w = _problem(scheme, 0, 4, 8, 256, 128, seed=0)
    h, out = _check_pair(scheme, x, ids, tw, w)
    assert h.shape == (0, 4, 128) and out.shape == (0, 256)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_all_choices_skipped(scheme):
    x, _, tw, (w1, s1, w2, s2) = _problem(scheme, 3, 4, 8, 256, 128, seed=1)
    ids = torch.full((3, 4), -1)
    x[1] = float("nan")  # a token with no live choice is never read
    h = ops.gemv_gate_up(x, ids, w1, s1)
    assert torch.equal(h, torch.zeros((3, 4, 128), dtype=bf16))
    out = ops.gemv_down(h, ids, tw, w2, s2)
    assert torch.equal(out, torch.zeros((3, 256), dtype=bf16))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_choices_of_one_expert(scheme):
    """K choices of one expert: identical h rows, each weighted in the sum."""
    x, _, tw, w = _problem(scheme, 3, 3, 4, 256, 128, seed=2)
    ids = torch.tensor([[2, 2, 2], [1, -1, 1], [3, 0, 3]])
    h, out = _check_pair(scheme, x, ids, tw, w)
    assert torch.equal(h[0, 0], h[0, 1]) and torch.equal(h[0, 0], h[0, 2])
    assert torch.equal(h[1, 0], h[1, 2]) and torch.equal(h[2, 0], h[2, 2])
    one = ops.gemv_down(h[:1, :1], ids[:1, :1], torch.ones((1, 1)), w[2], w[3])  # y of expert 2
    _tol.assert_close(out[0], (one[0].double() * tw[0].sum().double()).to(bf16))


def test_dead_rows_of_h_are_never_read():
    """gemv_down sums live choices only: garbage (NaN) in the h row of a -1 choice does not reach
    the output, as the CUDA kernel never loads it."""
    x, ids, tw, (w1, s1, w2, s2) = _problem("bf16", 4, 3, 4, 256, 128, seed=3)
    ids[0, 1] = -1
    h = ops.gemv_gate_up(x, ids, w1, s1)
    garbage = torch.where((ids < 0).unsqueeze(-1), float("nan"), h.float()).to(bf16)
    assert torch.equal(ops.gemv_down(garbage, ids, tw, w2, s2), ops.gemv_down(h, ids, tw, w2, s2))


def test_int32_strided_ids_and_bf16_weights():
    x, ids, tw, (w1, s1, w2, s2) = _problem("int8", 4, 3, 6, 256, 128, seed=4)
    h = ops.gemv_gate_up(x, ids, w1, s1)
    out = ops.gemv_down(h, ids, tw, w2, s2)
    ids32 = ids.int().t().contiguous().t()
    x_strided = torch.stack([x, torch.zeros_like(x)], dim=-1)[..., 0]
    assert not ids32.is_contiguous() and not x_strided.is_contiguous()
    assert torch.equal(ops.gemv_gate_up(x_strided, ids32, w1, s1), h)
    assert torch.equal(ops.gemv_down(h, ids32, tw.t().contiguous().t(), w2, s2), out)
    tw16 = tw.to(bf16)
    _tol.assert_close(
        ops.gemv_down(h, ids, tw16, w2, s2), oracle_down(h, ids, tw16, w2, s2, "int8")
    )


@pytest.mark.parametrize("scheme", SCHEMES)
def test_pair_computes_the_chain(scheme):
    """gemv_gate_up is quantize -> grouped GEMM -> silu_and_mul (on the permuted rows); gemv_down
    is silu_and_mul_quant's quantization -> grouped GEMM -> unpermute, up to summation order."""
    x, ids, tw, (w1, s1, w2, s2) = _problem(scheme, 6, 3, 8, 256, 128, seed=5)
    E = w1.shape[0]
    h = ops.gemv_gate_up(x, ids, w1, s1)
    a, a_s = (x, None) if scheme == "bf16" else ops.quantize(x, scheme)
    p = ops.permute(a, ids, E, 8, x_scales=a_s)
    gk = dict(m_indices=p.m_indices, expert_offsets=p.expert_offsets)
    y1 = ops.grouped_gemm(p.x, w1, a_scales=p.x_scales, w_scales=s1, **gk)
    act = ops.silu_and_mul(y1, **gk)
    live = ids >= 0
    rows = p.inv_perm[live].long()
    _tol.assert_close(h[live], act[rows])
    # the second half from the same rows of h (so the two sides share one h)
    hp = torch.zeros_like(act)
    hp[rows] = h[live]
    b, b_s = (hp, None) if scheme == "bf16" else ops.quantize(hp, scheme)
    y2 = ops.grouped_gemm(b, w2, a_scales=b_s, w_scales=s2, **gk)
    _tol.assert_close(ops.gemv_down(h, ids, tw, w2, s2), ops.unpermute(y2, p.inv_perm, tw))


@pytest.mark.parametrize(
    "K, inter, block_k",
    [(8, 768, 256), (2, 14336, 1024), (4, 2880, 512), (3, 14336, 512), (1, 200, 256),
     (2, 384, 512)],
)  # fmt: skip
def test_down_step_follows_top_k(K, inter, block_k):
    """Without a tuned entry the down kernel's step tile [K_PAD, block_n, block_k] is the swept
    top-8 one's: block_k grows as K_PAD shrinks, at most the row rounded up to a power of two,
    never below the config's."""
    from epmoe.ops import gemv as G

    with G.override(down_fp8=(8, 256, 4, 8)):
        launch = G._down_launch(1, 4096, inter, 8, K, FP8, False, (K, 1), (K, 1),
                                (4096 * inter, inter, 1), (1, 1, 1), (0, 0), False, False,
                                G.CONFIG, 4096, torch.device("cpu"))  # fmt: skip
    assert launch.meta["BLOCK_K"] == block_k and launch.meta["K_PAD"] == 1 << (K - 1).bit_length()


@pytest.fixture
def gemv_table(h200_table):
    """An H200 table of GEMV entries (one token and four; the up ones of the default gate) read
    for ``cuda:0``."""
    from epmoe.ops import gemv as G
    from epmoe.ops.gemm import _tuned

    def entry(layout, m, config, **layer):
        return dict(layout=layout, scheme="fp8", N=768, K=2048, E=128, block=8, m=m, **layer,
                    config=dict(zip(("block_n", "block_k", "num_warps"), config, strict=True)),
                    backend="triton", us={"triton": 1.0})  # fmt: skip

    up = dict(gate="silu", bias=False)
    doc = dict(entries=[entry("gemv_up", 1, (32, 1024, 8), **up),
                        entry("gemv_up", 4, (8, 512, 4), **up),
                        entry("gemv_down", 4, (16, 512, 8))])  # fmt: skip
    (h200_table / _tuned.file_name("NVIDIA H200")).write_text(json.dumps(doc))
    return G, torch.device("cuda", 0)


def test_launch_config_reads_the_tuned_table(gemv_table):
    """A tuned entry sets the launch (one token: the m = 1 entry; any other count, a SymInt's
    included: the entry of the most tokens); an override, a CPU device or another problem (gate,
    sizes) falls back to CONFIG, down's step by its top-k rule."""
    G, dev = gemv_table
    up = ("up", "fp8", 768, 2048, 128, 8, dev)
    assert G.launch_config(up[0], up[1], 1, *up[2:]) == (32, 1024, 8)
    for t in (2, 4, 64):
        assert G.launch_config(up[0], up[1], t, *up[2:]) == (8, 512, 4)
    down = ("down", "fp8", 1, 768, 2048, 128, 8, dev)
    assert G.launch_config(*down) == (16, 512, 8)  # (no m = 1 entry: the one there is)
    assert G.launch_config(*down[:-1], torch.device("cpu")) == G.CONFIG.down_fp8_one[:3]
    assert G.launch_config(*up[:2], 4, *up[2:], gate="gelu_tanh") == G.CONFIG.up_fp8[:3]
    assert G.launch_config(*up[:2], 4, 1536, *up[3:]) == G.CONFIG.up_fp8[:3]
    with G.override(up_fp8=(16, 256, 4)):
        assert G.launch_config(up[0], up[1], 4, *up[2:]) == (16, 256, 4)
    block_n, block_k, warps, at_k = G.CONFIG.down_fp8
    assert G.launch_config("down", "fp8", 4, 768, 2048, 128, 2, dev) == (
        block_n, G.down_block_k(block_k, at_k, 2, 2048), warps)  # fmt: skip


def test_launch_config_of_symbolic_sizes(gemv_table):
    """Sizes traced as SymInts (opcheck's dynamic pass) look up the same entries: the weights'
    sizes specialized, a symbolic token count the several-token entry."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    G, dev = gemv_table
    env = ShapeEnv()

    def sym(value, name):
        return env.create_symintnode(env.create_symbol(value, ConstantSource(name)), hint=value)

    got = G.launch_config("up", "fp8", sym(3, "t"), sym(768, "i"), sym(2048, "h"), sym(128, "e"),
                          8, dev)  # fmt: skip
    assert got == (8, 512, 4)


def test_candidates_fit_their_kernels():
    """The tuner's candidates: fp8 within one weight-scale block, no step past the row (its
    power of two, or the shortest candidate's), a down step tile within the register budget; the
    module's defaults among them."""
    from epmoe.ops import gemv as G

    assert G.fits("up", "bf16", (32, 1024, 4), 2048, 8)
    assert not G.fits("up", "bf16", (32, 1024, 4), 512, 8)  # (a step past a 512-channel row)
    assert G.fits("up", "bf16", (32, 512, 4), 200, 2)  # (the shortest step: short rows run it)
    assert not G.fits("down", "fp8", (16, 2048, 8), 768, 2)  # (past 768's power of two)
    assert not G.fits("down", "bf16", (16, 1024, 8), 14336, 8)  # (a spilling step tile)
    assert G.fits("down", "bf16", (16, 1024, 8), 14336, 2)
    assert not G.fits("up", "fp8", (24, 512, 4), 2048, 8)  # (24 columns: two scale blocks)
    assert not G.fits("down", "fp8", (8, 192, 4), 768, 8)  # (a step of part of a block)
    for scheme in SCHEMES:
        for one in ("", "_one"):
            up = getattr(G.CONFIG, f"up_{scheme}{one}")
            assert up in G.UP_CANDIDATES and G.fits("up", scheme, up, 2048, 8)
            n, k, w, at_k = getattr(G.CONFIG, f"down_{scheme}{one}")
            assert (n, k, w) in G.DOWN_CANDIDATES and G.fits("down", scheme, (n, k, w), 768, at_k)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_opcheck(scheme):
    x, ids, tw, (w1, s1, w2, s2) = _problem(scheme, 3, 2, 4, 128, 128, seed=6)
    h = ops.gemv_gate_up(x, ids, w1, s1)
    opcheck(torch.ops.epmoe.gemv_gate_up.default, (x, ids, w1, s1))
    opcheck(torch.ops.epmoe.gemv_down.default, (h, ids, tw, w2, s2))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_opcheck_gate_bias_hidden(scheme):
    x, ids, tw, (w1, s1, w2, s2), b1, b2 = _gate_problem(scheme, "relu2:glu=0", 6, 3, 2, 4)
    h = ops.gemv_gate_up(x, ids, w1, s1, gate="relu2:glu=0", bias=b1)
    opcheck(torch.ops.epmoe.gemv_gate_up.default, (x[:, :200], ids, w1, s1, True, "relu2:glu=0",
                                                   b1))  # fmt: skip
    opcheck(torch.ops.epmoe.gemv_down.default, (h, ids, tw, w2, s2, True, b2, 200))


def test_opcheck_unchecked_int32_ids():
    """check=False (the layer's gemv_down after gemv_gate_up checked the ids), int32 ids."""
    x, ids, tw, (w1, s1, w2, s2) = _problem("int8", 3, 2, 4, 128, 128, seed=6)
    ids = ids.int()
    h = ops.gemv_gate_up(x, ids, w1, s1)
    opcheck(torch.ops.epmoe.gemv_gate_up.default, (x, ids, w1, s1, False))
    opcheck(torch.ops.epmoe.gemv_down.default, (h, ids, tw, w2, s2, False))


# ---------------------------------------------------------------- gates, biases, padded sizes
GATES = C.GEMV_GATES


def _gate_problem(scheme, spec, seed, T=4, K=3, E=6, H=256, I=128, bias_dtype=bf16):  # noqa: E741
    """Weights of the gate's width (2I, or I without glu), x large enough that a limit of 7
    clamps, and biases b1 `[E, W]`, b2 `[E, H]`."""
    gen = torch.Generator().manual_seed(seed)
    W = gate.parse(spec).width(I)
    w1 = torch.randn((E, W, H), generator=gen) / math.sqrt(H)
    w2 = torch.randn((E, H, I), generator=gen) / math.sqrt(I)
    w = (*reference.quantize_weights(w1, scheme), *reference.quantize_weights(w2, scheme))
    x = (torch.randn((T, H), generator=gen) * 4).to(bf16)
    b1 = torch.randn((E, W), generator=gen).to(bias_dtype)
    b2 = (torch.randn((E, H), generator=gen) / 4).to(bias_dtype)
    return x, random_ids(T, K, E, 0.25, gen), random_weights(T, K, gen), w, b1, b2


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("spec", GATES)
def test_gates_and_biases(scheme, spec):
    x, ids, tw, (w1, s1, w2, s2), b1, b2 = _gate_problem(scheme, spec, seed=len(spec))
    h = ops.gemv_gate_up(x, ids, w1, s1, gate=spec, bias=b1)
    assert h.shape == (*ids.shape, w2.shape[2])
    _tol.assert_close(h, oracle_gate_up(x, ids, w1, s1, scheme, spec, b1))
    assert (h[ids < 0] == 0).all()  # (a skipped choice adds no bias)
    plain = ops.gemv_gate_up(x, ids, w1, s1, gate=spec)
    _tol.assert_close(plain, oracle_gate_up(x, ids, w1, s1, scheme, spec))
    assert not torch.equal(plain, h)
    out = ops.gemv_down(h, ids, tw, w2, s2, bias=b2)
    _tol.assert_close(out, oracle_down(h, ids, tw, w2, s2, scheme, b2))
    assert torch.equal(torch.ops.epmoe.gemv_gate_up(x, ids, w1, s1, True, spec, b1), h)
    assert torch.equal(torch.ops.epmoe.gemv_down(h, ids, tw, w2, s2, True, b2), out)


def test_the_limit_clamps():
    """The gpt-oss gate's limit is reached on these inputs (so the tests above exercise it)."""
    spec = GATES[0]
    x, ids, _, (w1, s1, *_), b1, _ = _gate_problem("bf16", spec, seed=len(spec))
    clamped = ops.gemv_gate_up(x, ids, w1, s1, gate=spec, bias=b1)
    free = ops.gemv_gate_up(x, ids, w1, s1, gate="silu:alpha=1.702,up_offset=1", bias=b1)
    assert (clamped != free).float().mean() > 0.05


@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.float32])
def test_bias_dtypes(bias_dtype):
    x, ids, tw, (w1, s1, w2, s2), b1, b2 = _gate_problem("int8", "silu", 3, bias_dtype=bias_dtype)
    h = ops.gemv_gate_up(x, ids, w1, s1, bias=b1)
    _tol.assert_close(h, oracle_gate_up(x, ids, w1, s1, "int8", "silu", b1))
    out = ops.gemv_down(h, ids, tw, w2, s2, bias=b2)
    _tol.assert_close(out, oracle_down(h, ids, tw, w2, s2, "int8", b2))


def _padded(scheme, gen, E=4, H=160, Hp=256, I=128):  # noqa: E741
    """Weights of hidden size H zero-padded to Hp (as the layer pads them for fp8), quantized
    after the padding; biases b1 `[E, 2I]`, b2 `[E, Hp]` (zeros past H)."""
    w1 = torch.zeros((E, 2 * I, Hp))
    w1[..., :H] = torch.randn((E, 2 * I, H), generator=gen) / math.sqrt(H)
    w2 = torch.zeros((E, Hp, I))
    w2[:, :H] = torch.randn((E, H, I), generator=gen) / math.sqrt(I)
    b2 = torch.zeros((E, Hp))
    b2[:, :H] = torch.randn((E, H), generator=gen)
    w = (*reference.quantize_weights(w1, scheme), *reference.quantize_weights(w2, scheme))
    return w, torch.randn((E, 2 * I), generator=gen).to(bf16), b2


@pytest.mark.parametrize("scheme", SCHEMES)
def test_padded_hidden(scheme):
    """x `[T, 160]` on weights padded to H = 256: x zero-extended; out `[T, hidden]`, the first
    columns (fp8: its activation group at the edge half zeros)."""
    gen = torch.Generator().manual_seed(9)
    (w1, s1, w2, s2), b1, b2 = _padded(scheme, gen)
    x = (torch.randn((3, 160), generator=gen) * 2).to(bf16)
    ids, tw = random_ids(3, 2, 4, 0.25, gen), random_weights(3, 2, gen)
    h = ops.gemv_gate_up(x, ids, w1, s1, gate="gelu_tanh", bias=b1)
    _tol.assert_close(h, oracle_gate_up(x, ids, w1, s1, scheme, "gelu_tanh", b1))
    out = ops.gemv_down(h, ids, tw, w2, s2, bias=b2, hidden=160)
    assert out.shape == (3, 160) and out.is_contiguous()
    _tol.assert_close(out, oracle_down(h, ids, tw, w2, s2, scheme, b2, hidden=160))
    full = ops.gemv_down(h, ids, tw, w2, s2, bias=b2)
    assert full.shape == (3, 256) and (full[:, 160:] == 0).all()
    assert torch.equal(full[:, :160], out)
    assert torch.equal(ops.gemv_down(h, ids, tw, w2, s2, bias=b2, hidden=256), full)
    one = ops.gemv_down(h, ids, tw, w2, s2, hidden=1)  # the narrowest output
    assert torch.equal(one, ops.gemv_down(h, ids, tw, w2, s2)[:, :1])


@pytest.mark.parametrize("scheme", ["bf16", "int8"])
def test_padding_changes_nothing(scheme):
    """bf16 / int8 run H = 160 as it is: zero-padded weights (int8: the same per-channel scales)
    give the same h and out, up to summation order."""
    gen = torch.Generator().manual_seed(10)
    (w1, s1, w2, s2), b1, b2 = _padded(scheme, gen)
    x = (torch.randn((3, 160), generator=gen) * 2).to(bf16)
    ids, tw = random_ids(3, 2, 4, 0.25, gen), random_weights(3, 2, gen)
    h = ops.gemv_gate_up(x, ids, w1, s1, bias=b1)
    _tol.assert_close(h, ops.gemv_gate_up(x, ids, w1[..., :160].contiguous(), s1, bias=b1))
    out = ops.gemv_down(h, ids, tw, w2, s2, bias=b2, hidden=160)
    s2_160 = None if s2 is None else s2[:, :160]
    _tol.assert_close(out, ops.gemv_down(h, ids, tw, w2[:, :160], s2_160, bias=b2[:, :160]))


# --------------------------------------------------------------------------------- bad input
def _good(scheme="bf16", T=3, K=2, E=4, H=256, I=128):  # noqa: E741
    x, ids, tw, (w1, s1, w2, s2) = _problem(scheme, T, K, E, H, I, seed=7)
    return dict(x=x, ids=ids, tw=tw, h=torch.zeros((T, K, I), dtype=bf16), w1=w1, s1=s1, w2=w2,
                s2=s2)  # fmt: skip


def _up(a, **kw):
    a = {**a, **kw}
    opt = {k: a[k] for k in ("gate", "bias") if k in a}
    return ops.gemv_gate_up(a["x"], a["ids"], a["w1"], a["s1"], **opt)


def _down(a, **kw):
    a = {**a, **kw}
    opt = {k: a[k] for k in ("bias", "hidden") if k in a}
    return ops.gemv_down(a["h"], a["ids"], a["tw"], a["w2"], a["s2"], **opt)


BF, F8, I8 = _good(), _good("fp8"), _good("int8")
BAD = [
    (_up, BF, dict(x=BF["x"].float()), "gemv_gate_up: x expected dtype torch.bfloat16, got "
     "torch.float32"),
    (_up, BF, dict(x=BF["x"][0]), r"gemv_gate_up: x expected a 2-D tensor, got shape \(256,\)"),
    (_up, BF, dict(ids=BF["ids"][:2]), r"gemv_gate_up: topk_ids expected shape \[3, any\], got "
     r"\[2, 2\]"),
    (_up, BF, dict(ids=BF["ids"].float()), "gemv_gate_up: topk_ids expected dtype torch.int32 or "
     "torch.int64, got torch.float32"),
    (_up, BF, dict(w1=BF["w1"][:, :255]), r"gemv_gate_up: w1 expected shape \[E, 2I, H\] \(an "
     r"even row count: gate rows, then up rows\), got \[4, 255, 256\]"),
    (_up, BF, dict(w1=BF["w1"][:, :, :128]), r"gemv_gate_up: x expected at most 128 columns "
     r"\(w1's H\), got 256"),
    (_up, BF, dict(gate="swish"), r"gemv_gate_up: gate expected a gate spec such as "
     r"'silu:alpha=1\.702,limit=7' \(act in \('silu', 'gelu_tanh', 'gelu', 'relu', 'relu2'\), "
     r"fields .*\), got 'swish'"),
    (_up, BF, dict(gate="silu:beta=2"), r"gemv_gate_up: gate expected a gate spec .*, got "
     r"'silu:beta=2'"),
    (_up, BF, dict(gate="relu:alpha=2"), r"gemv_gate_up: gate expected a gate spec"),
    (_up, BF, dict(gate="silu:limit=-1"), r"gemv_gate_up: gate expected a gate spec"),
    (_up, BF, dict(gate="relu2:glu=0", w1=BF["w1"][:, :255, :], bias=torch.zeros((4, 256))),
     r"gemv_gate_up: bias expected shape \[4, 255\], got \[4, 256\]"),
    (_up, BF, dict(bias=torch.zeros((4, 128))), r"gemv_gate_up: bias expected shape \[4, 256\], "
     r"got \[4, 128\]"),
    (_up, BF, dict(bias=torch.zeros((4, 256), dtype=torch.int32)), "gemv_gate_up: bias expected "
     "dtype torch.bfloat16 or torch.float16 or torch.float32, got torch.int32"),
    (_up, BF, dict(bias=torch.zeros((4, 256), device="meta")), r"gemv_gate_up: bias expected "
     r"device cpu \(same as the first input\), got meta"),
    (_up, F8, dict(gate="relu2:glu=0", w1=torch.zeros((4, 192, 256), dtype=FP8),
                   s1=torch.ones((4, 1, 2))),
     r"gemv_gate_up: I expected a multiple of 128 for fp8 \(128-channel blocks\), got 192"),
    (_up, BF, dict(w1=BF["w1"].float()), "gemv_gate_up: w1 expected dtype torch.bfloat16 or "
     "torch.float8_e4m3fn or torch.int8, got torch.float32"),
    (_up, BF, dict(s1=I8["s1"]), "gemv_gate_up: w1_scales expected None for bf16 weights, got a "
     "tensor"),
    (_up, F8, dict(s1=None), "gemv_gate_up: w1_scales expected a float32 tensor for fp8 / int8 "
     "weights, got None"),
    (_up, I8, dict(s1=None), "gemv_gate_up: w1_scales expected a float32 tensor for fp8 / int8 "
     "weights, got None"),
    (_up, I8, dict(s1=I8["s1"].double()), "gemv_gate_up: w1_scales expected dtype torch.float32, "
     "got torch.float64"),
    (_up, F8, dict(s1=F8["s1"][:, :1]), r"gemv_gate_up: w1_scales expected shape \[4, 2, 2\], got "
     r"\[4, 1, 2\]"),
    (_up, I8, dict(s1=I8["s1"][:, :128]), r"gemv_gate_up: w1_scales expected shape \[4, 256\], got "
     r"\[4, 128\]"),
    (_up, F8, dict(x=torch.zeros((3, 192), dtype=bf16), w1=torch.zeros((4, 256, 192), dtype=FP8),
                   s1=torch.ones((4, 2, 1))),
     r"gemv_gate_up: H expected a multiple of 128 for fp8 \(128-channel blocks\), got 192"),
    (_up, F8, dict(w1=torch.zeros((4, 192, 256), dtype=FP8), s1=torch.ones((4, 1, 2))),
     r"gemv_gate_up: I expected a multiple of 128 for fp8 \(128-channel blocks\), got 96"),
    (_down, BF, dict(h=BF["h"].float()), "gemv_down: h expected dtype torch.bfloat16, got "
     "torch.float32"),
    (_down, BF, dict(h=BF["h"][0]), r"gemv_down: h expected a 3-D tensor, got shape \(2, 128\)"),
    (_down, BF, dict(ids=BF["ids"][:, :1]), r"gemv_down: topk_ids expected shape \[3, 2\], got "
     r"\[3, 1\]"),
    (_down, BF, dict(tw=BF["tw"][:2]), r"gemv_down: topk_weights expected shape \[3, 2\], got "
     r"\[2, 2\]"),
    (_down, BF, dict(tw=BF["tw"].int()), "gemv_down: topk_weights expected dtype torch.bfloat16 "
     "or torch.float16 or torch.float32, got torch.int32"),
    (_down, BF, dict(w2=BF["w2"][:, :, :64]),
     r"gemv_down: w2 expected shape \[any, any, 128\], got \[4, 256, 64\]"),
    (_down, BF, dict(s2=I8["s2"]), "gemv_down: w2_scales expected None for bf16 weights"),
    (_down, F8, dict(s2=None), "gemv_down: w2_scales expected a float32 tensor for fp8 / int8"),
    (_down, F8, dict(s2=F8["s2"][:, :, :0]), r"gemv_down: w2_scales expected shape \[4, 2, 1\], "
     r"got \[4, 2, 0\]"),
    (_down, I8, dict(s2=I8["s2"][:3]), r"gemv_down: w2_scales expected shape \[4, 256\], got "
     r"\[3, 256\]"),
    (_down, F8, dict(h=torch.zeros((3, 2, 192), dtype=bf16), w2=torch.zeros((4, 256, 192),
                     dtype=FP8), s2=torch.ones((4, 2, 1))),
     r"gemv_down: I expected a multiple of 128 for fp8 \(128-channel blocks\), got 192"),
    (_down, F8, dict(w2=torch.zeros((4, 320, 128), dtype=FP8), s2=torch.ones((4, 2, 1))),
     r"gemv_down: H expected a multiple of 128 for fp8 \(128-channel blocks\), got 320"),
    (_down, BF, dict(bias=torch.zeros((4, 128))), r"gemv_down: bias expected shape \[4, 256\], got "
     r"\[4, 128\]"),
    (_down, BF, dict(bias=torch.zeros((4, 256), dtype=torch.float64)), "gemv_down: bias expected "
     "dtype torch.bfloat16 or torch.float16 or torch.float32, got torch.float64"),
    (_down, BF, dict(bias=torch.zeros((4, 256), device="meta")), r"gemv_down: bias expected device "
     r"cpu \(same as the first input\), got meta"),
    (_down, BF, dict(hidden=0), r"gemv_down: hidden expected None or an int in \[1, 256\] \(w2's "
     r"H\), got 0"),
    (_down, BF, dict(hidden=257), r"gemv_down: hidden expected None or an int in \[1, 256\] "
     r"\(w2's H\), got 257"),
    (_down, BF, dict(hidden=True), r"gemv_down: hidden expected None or an int in \[1, 256\] "
     r"\(w2's H\), got True"),
]  # fmt: skip


@pytest.mark.parametrize(
    "call,good,change,match", BAD, ids=[f"{c.__name__}-{i}" for i, (c, *_) in enumerate(BAD)]
)
def test_bad_input(call, good, change, match):
    with pytest.raises(ValueError, match=match):
        call(good, **change)


@pytest.mark.parametrize("bad", [4, -2, 100])
@pytest.mark.parametrize("call", [_up, _down], ids=["gate_up", "down"])
def test_bad_ids_are_value_errors(call, bad):
    ids = torch.tensor([[0, 1], [2, bad], [3, -1]])
    for dt in (torch.int64, torch.int32):
        op = "gemv_gate_up" if call is _up else "gemv_down"
        with pytest.raises(ValueError, match=rf"{op}: topk_ids expected ids in \[0, 4\) or -1, "
                           "got values outside it"):  # fmt: skip
            call(BF, ids=ids.to(dt))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_edge_ids_are_fine(scheme):
    """-1 (skipped) and E - 1 (the last expert) are valid ids."""
    g = _good(scheme)
    ids = torch.tensor([[3, -1], [-1, 3], [0, 3]])
    h = _up(g, ids=ids)
    out = _down(g, ids=ids, h=h)
    _tol.assert_close(h, oracle_gate_up(g["x"], ids, g["w1"], g["s1"], scheme))
    _tol.assert_close(out, oracle_down(h, ids, g["tw"], g["w2"], g["s2"], scheme))
