"""torch.compile (Inductor, fullgraph) on CPU gives eager's bytes, op by op and for the layer.

Every stage op's CPU kernel is the reference; a body traced into the graph would let Inductor
recompile it with its own float rewrites (``x / s`` as ``x * (1 / s)``, fused SiLU, reordered
sums) and move fp8 / int8 rounding boundaries, so the CPU kernels stay opaque (the stage
declaration decomposes only non-CPU calls: :mod:`epmoe._stage`). Outputs are compared with
``torch.equal`` (1-byte payloads as bytes), all of them, the rows a kernel leaves unspecified too
(on CPU the reference defines them). Inductor's caches are off: a cached graph of older code
would answer instead of this one.
"""

import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config

from epmoe import ops, reference
from epmoe.ops import gemv
from epmoe.ops.ll_gather import ll_gather
from epmoe.ops.ll_scatter import ll_scatter
from tests._moe import SMALL, small_layer, tokens
from tests._routing import random_ids, random_weights

E, H, I, K = 8, 256, 128, 3  # noqa: E741 (the intermediate size)


@pytest.fixture(autouse=True)
def fresh_compile():
    torch._dynamo.reset()
    with inductor_config.patch(force_disable_caches=True):
        yield
    torch._dynamo.reset()


def _bytes(t):
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.bool else t


def _flat(out):
    if isinstance(out, torch.Tensor) or out is None:
        return [out]
    return [t for o in out for t in _flat(o)]


def assert_compiled_equal(fn, *args):
    """torch.compile(fn, fullgraph=True)(*args) == fn(*args), every output tensor, bit for bit."""
    got = _flat(torch.compile(fn, fullgraph=True)(*args))
    want = _flat(fn(*args))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is None:
            assert g is None, i
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, (i, g.dtype, w.dtype, g.shape, w.shape)
        assert torch.equal(_bytes(g), _bytes(w)), f"output {i} differs"


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _act(*shape, seed=0, scale=3.0):
    # a wide range of magnitudes (and exact zeros): many rounding boundaries per row
    x = torch.randn(shape, generator=_gen(seed)) * scale
    x = x * torch.rand(shape, generator=_gen(seed + 1)).pow(4) * 8
    x[..., :3] = 0.0
    return x.bfloat16()


def _permuted(seed=0, M=13):
    """A permute of M tokens (alignment 8): (x, ids, p)."""
    x = _act(M, H, seed=seed)
    ids = random_ids(M, K, E, 0.2, _gen(seed))
    return x, ids, ops.permute(x, ids, num_experts=E, alignment=8)


# ----------------------------------------------------------------------------------------- ops
@pytest.mark.parametrize("scheme", ["fp8", "int8"])
@pytest.mark.parametrize("layout", ["row", "deepgemm"])
@pytest.mark.parametrize("masked", [False, True])
def test_quantize(scheme, layout, masked):
    if masked:
        x, mm = _act(E, 6, H), torch.tensor([0, 6, 2, 1, 6, 3, 0, 5], dtype=torch.int32)
        assert_compiled_equal(lambda x, m: ops.quantize(x, scheme, 128, m, layout), x, mm)
    else:
        assert_compiled_equal(lambda x: ops.quantize(x, scheme, scale_layout=layout), _act(37, H))


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("layout", ["row", "deepgemm"])
def test_permute(scheme, layout):
    x = _act(21, H)
    ids = random_ids(21, K, E, 0.2, _gen(3))
    if scheme == "bf16":
        assert_compiled_equal(lambda x, i: tuple(ops.permute(x, i, E, 8, scale_layout=layout)),
                              x, ids)  # fmt: skip
        return
    q, s = ops.quantize(x, scheme)
    assert_compiled_equal(
        lambda q, i, s: tuple(ops.permute(q, i, E, 8, x_scales=s, scale_layout=layout)), q, ids, s
    )


def test_permute_and_gemm1_gathering():
    """permute of x[:, :0] (the index outputs alone) and GEMM1 reading x's rows through
    src_rows, compiled together as the layer's gathering HT path runs them."""
    w, ws = _weights("fp8", 2 * I, H, seed=12)
    x = _act(19, H, seed=4)
    ids = random_ids(19, K, E, 0.2, _gen(4))
    q, s = ops.quantize(x, "fp8")

    def gathering(q, i, s):
        p = ops.permute(q[:, :0], i, E, 8)
        y = ops.grouped_gemm(q, w, m_indices=p.m_indices, a_scales=s, w_scales=ws,
                             a_rows=p.src_rows)  # fmt: skip
        return (*p, y)

    assert_compiled_equal(gathering, q, ids, s)


@pytest.mark.parametrize("rows", ["plain", "masked", "m_indices", "offsets"])
def test_silu_and_mul(rows):
    if rows == "masked":
        y, mm = _act(E, 5, 2 * I), torch.tensor([5, 0, 2, 1, 5, 3, 0, 4], dtype=torch.int32)
        assert_compiled_equal(lambda y, m: ops.silu_and_mul(y, masked_m=m), y, mm)
        return
    _, _, p = _permuted()
    y = _act(p.x.shape[0], 2 * I, seed=5)
    if rows == "plain":
        assert_compiled_equal(ops.silu_and_mul, y)
    elif rows == "m_indices":
        assert_compiled_equal(lambda y, mi: ops.silu_and_mul(y, m_indices=mi), y, p.m_indices)
    else:
        assert_compiled_equal(
            lambda y, mi, eo: ops.silu_and_mul(y, m_indices=mi, expert_offsets=eo),
            y, p.m_indices, p.expert_offsets,
        )  # fmt: skip


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
@pytest.mark.parametrize("rows", ["plain", "masked", "m_indices+offsets"])
@pytest.mark.parametrize("layout", ["row", "deepgemm"])
def test_silu_and_mul_quant(scheme, rows, layout):
    if rows == "masked":
        y, mm = _act(E, 5, 2 * I), torch.tensor([5, 0, 2, 1, 5, 3, 0, 4], dtype=torch.int32)
        assert_compiled_equal(
            lambda y, m: ops.silu_and_mul_quant(y, scheme, masked_m=m, scale_layout=layout), y, mm
        )
        return
    _, _, p = _permuted()
    y = _act(p.x.shape[0], 2 * I, seed=7)
    if rows == "plain":
        assert_compiled_equal(lambda y: ops.silu_and_mul_quant(y, scheme, scale_layout=layout), y)
        return
    assert_compiled_equal(
        lambda y, mi, eo: ops.silu_and_mul_quant(
            y, scheme, m_indices=mi, scale_layout=layout, expert_offsets=eo
        ),
        y, p.m_indices, p.expert_offsets,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unpermute(dtype):
    _, _, p = _permuted(M=17)
    y = _act(p.x.shape[0], H, seed=9).to(dtype)
    w = random_weights(17, K, _gen(9))
    assert_compiled_equal(ops.unpermute, y, p.inv_perm, w)


def _weights(scheme, n, kd, seed=0):
    w = torch.randn((E, n, kd), generator=_gen(seed)) / kd**0.5
    return reference.quantize_weights(w, scheme)


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_grouped_gemm(scheme, layout):
    w, ws = _weights(scheme, 2 * I, H, seed=11)
    if layout == "contiguous":
        x, ids, _ = _permuted()
        a, a_s = (x, None) if scheme == "bf16" else ops.quantize(x, scheme)
        pp = ops.permute(a, ids, E, 8, x_scales=a_s)
        assert_compiled_equal(
            lambda a, mi, s, eo: ops.grouped_gemm(a, w, m_indices=mi, a_scales=s, w_scales=ws,
                                                  expert_offsets=eo),
            pp.x, pp.m_indices, pp.x_scales, pp.expert_offsets,
        )  # fmt: skip
    else:
        x = _act(E, 6, H, seed=13)
        a, a_s = (x, None) if scheme == "bf16" else ops.quantize(x, scheme)
        mm = torch.tensor([6, 0, 2, 1, 6, 3, 0, 5], dtype=torch.int32)
        assert_compiled_equal(
            lambda a, m, s: ops.grouped_gemm(a, w, masked_m=m, a_scales=s, w_scales=ws), a, mm, a_s
        )


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_grouped_gemm_masked_gate(scheme):
    """Masked GEMM1 + gate (the op the LL chain runs where a GPU's table fuses them)."""
    w, ws = _weights(scheme, 2 * I, H, seed=12)
    x = _act(E, 6, H, seed=14)
    a, a_s = (x, None) if scheme == "bf16" else ops.quantize(x, scheme)
    mm = torch.tensor([6, 0, 2, 1, 6, 3, 0, 5], dtype=torch.int32)
    assert_compiled_equal(
        lambda a, m, s: ops.grouped_gemm_masked_gate(a, w, m, s, ws, "gelu_tanh"), a, mm, a_s
    )


@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8"])
def test_ll_scatter_and_gather(quant):
    """The masked-layout ops of the one-rank LL chain (ll_scatter, ll_gather)."""
    x = _act(11, H, seed=15)
    ids = random_ids(11, K, E, 0.2, _gen(15))
    w = random_weights(11, K, _gen(15))
    assert_compiled_equal(lambda x, i: ll_scatter(x, i, E, 16, quant), x, ids)
    _, _, _, rows = ll_scatter(x, ids, E, 16, quant)
    y = _act(E, 16, H, seed=16)
    assert_compiled_equal(ll_gather, y, rows, w)


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_gemv(scheme):
    """The per-choice GEMVs: each op, the unchecked gemv_down of the layer's chain, the pair."""
    w1, s1 = _weights(scheme, 2 * I, H, seed=17)
    w2, s2 = _weights(scheme, H, I, seed=18)
    x = _act(4, H, seed=17)
    ids = random_ids(4, K, E, 0.2, _gen(17))
    ids[1] = 5  # one expert in every choice
    w = random_weights(4, K, _gen(17))
    assert_compiled_equal(lambda x, i: gemv.gemv_gate_up(x, i, w1, s1), x, ids)
    h = gemv.gemv_gate_up(x, ids, w1, s1)
    assert_compiled_equal(lambda h, i, w: gemv.gemv_down(h, i, w, w2, s2), h, ids, w)
    assert_compiled_equal(lambda h, i, w: gemv.gemv_down.chained(h, i, w, w2, s2), h, ids, w)
    assert_compiled_equal(
        lambda x, i, w: gemv.gemv_down(gemv.gemv_gate_up(x, i, w1, s1), i, w, w2, s2), x, ids, w
    )


# --------------------------------------------------------------------------------------- layer
@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize(
    "mode,worst", [("ht", False), ("ht", True), pytest.param("ll", False, marks=pytest.mark.slow)]
)
def test_layer(quant, mode, worst):
    layer = small_layer(quant, mode, worst, alignment=8, max_tokens_per_rank=16)
    x, ids, w = tokens(11, seed=1, **SMALL)
    assert_compiled_equal(layer, x, ids, w)


@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8"])
def test_layer_gemv_path(quant):
    """mode="auto" on one rank with a few tokens: the two GEMV ops (gemv_down unchecked)."""
    layer = small_layer(quant, "auto")
    x, ids, w = tokens(2, seed=2, **SMALL)
    assert layer.path(2) == "gemv"
    assert_compiled_equal(layer, x, ids, w)


def test_layer_two_token_counts_share_the_compiled_graph():
    """dynamic=True: one graph for several token counts, each call equal to eager."""
    layer = small_layer("fp8", "ht", True, alignment=8, max_tokens_per_rank=16)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for T in (5, 16, 9):
        x, ids, w = tokens(T, seed=T, **SMALL)
        assert torch.equal(compiled(x, ids, w), layer(x, ids, w)), T
