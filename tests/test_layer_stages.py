"""EPMoE.record_stages: the recorded stage outputs of a real forward pass are the public ops'
results on the same inputs, byte for byte (HT and LL, bf16 / fp8 / int8; local backend here,
torch backend on 2 gloo ranks); recording off records nothing and leaves the output unchanged;
recording under torch.compile(fullgraph=True) traces the same graph without a break."""

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend

from epmoe import layer as layer_mod
from epmoe import ops, reference
from epmoe._multiproc import run_ranks
from epmoe.ops.ll_gather import ll_gather
from epmoe.ops.ll_scatter import ll_scatter
from tests._moe import SMALL, global_weights, small_layer, tokens
from tests._tol import LAYER_VS_QUANT_AWARE, rel_l2

QUANTS = ["bf16", "fp8", "int8"]


def _tensors(v):
    """The tensors of a stage output (tensor, tuple or NamedTuple; handles and None skipped)."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [t for o in v for t in _tensors(o)]
    return []


def _same_bytes(got, want, what):
    g, w = _tensors(got), _tensors(want)
    assert len(g) == len(w), what
    for i, (a, b) in enumerate(zip(g, w, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, i, a.dtype, b.dtype)
        assert a.stride() == b.stride(), (what, i, a.stride(), b.stride())
        ab = a.view(torch.uint8) if a.element_size() == 1 and a.dtype != torch.bool else a
        bb = b.view(torch.uint8) if b.element_size() == 1 and b.dtype != torch.bool else b
        assert torch.equal(ab, bb), f"{what}: output {i} differs"


def _act_by_hand(layer, y, masked_m=None, m_indices=None, expert_offsets=None):
    if layer.quant == "bf16":
        return ops.silu_and_mul(y, masked_m, m_indices, expert_offsets), None
    return ops.silu_and_mul_quant(
        y,
        layer.quant,
        masked_m=masked_m,
        m_indices=m_indices,
        scale_layout="row",
        expert_offsets=expert_offsets,
    )


def _check_experts_ht(layer, rec, x, s, ids, w):
    """permute -> gemm1 -> act -> gemm2 -> unpermute by hand on the recorded inputs."""
    E, A = layer.num_local_experts, layer.alignment
    p = ops.permute(x, ids, E, A, s, scale_layout="row")
    _same_bytes(rec["permute"], p, "permute")
    p = rec["permute"]
    gk = dict(m_indices=p.m_indices, expert_offsets=p.expert_offsets)
    y1 = ops.grouped_gemm(p.x, layer.w1, a_scales=p.x_scales, w_scales=layer.w1_scale, **gk)
    _same_bytes(rec["gemm1"], y1, "gemm1")
    h, hs = _act_by_hand(layer, rec["gemm1"], **gk)
    _same_bytes(rec["act"], (h, hs), "act")
    h, hs = rec["act"]
    y2 = ops.grouped_gemm(h, layer.w2, a_scales=hs, w_scales=layer.w2_scale, **gk)
    _same_bytes(rec["gemm2"], y2, "gemm2")
    u = ops.unpermute(rec["gemm2"], p.inv_perm, w)
    _same_bytes(rec["unpermute"], u, "unpermute")
    return u


def _check_experts_ll(layer, rec, a, s, masked_m, num_tokens):
    kw = dict(masked_m=masked_m, expected_m=layer.expected_m(num_tokens))
    y1 = ops.grouped_gemm(a, layer.w1, a_scales=s, w_scales=layer.w1_scale, **kw)
    _same_bytes(rec["gemm1"], y1, "gemm1")
    h, hs = _act_by_hand(layer, rec["gemm1"], masked_m=masked_m)
    _same_bytes(rec["act"], (h, hs), "act")
    h, hs = rec["act"]
    y2 = ops.grouped_gemm(h, layer.w2, a_scales=hs, w_scales=layer.w2_scale, **kw)
    _same_bytes(rec["gemm2"], y2, "gemm2")
    return rec["gemm2"]


def _record(layer, x, ids, w):
    plain = layer(x, ids, w)
    with torch.no_grad(), layer.record_stages() as rec:
        out = layer(x, ids, w)
    assert torch.equal(out, plain)  # recording does not change the bytes
    return rec, out


# ------------------------------------------------------------------------------------ local backend
@pytest.mark.parametrize("quant", QUANTS)
def test_local_ht_stages_are_the_ops(quant):
    torch.manual_seed(0)
    layer = small_layer(quant, "ht", alignment=8)
    x, ids, w = tokens(11, seed=1, **SMALL)
    rec, out = _record(layer, x, ids, w)
    want = layer_mod.LOCAL_HT_STAGES if quant != "bf16" else layer_mod.LOCAL_HT_STAGES[1:]
    assert rec.names == want
    s = None
    xq = x
    if quant != "bf16":
        _same_bytes(rec["quantize"], ops.quantize(x, quant), "quantize")
        xq, s = rec["quantize"]
    u = _check_experts_ht(layer, rec, xq, s, ids, w)
    assert torch.equal(u, out)


@pytest.mark.parametrize("quant", QUANTS)
def test_local_ll_stages_are_the_ops(quant):
    torch.manual_seed(0)
    layer = small_layer(quant, "ll", max_tokens_per_rank=16)
    x, ids, w = tokens(11, seed=2, **SMALL)
    rec, out = _record(layer, x, ids, w)
    assert rec.names == layer_mod.LOCAL_LL_STAGES
    sc = ll_scatter(x, ids, layer.num_local_experts, layer.ll_capacity, quant, scale_layout="row")
    _same_bytes(rec["ll_scatter"], sc, "ll_scatter")
    a, s, masked_m, rows = rec["ll_scatter"]
    y = _check_experts_ll(layer, rec, a, s if quant != "bf16" else None, masked_m, x.shape[0])
    _same_bytes(rec["ll_gather"], ll_gather(y, rows, w), "ll_gather")
    assert torch.equal(rec["ll_gather"], out)


@pytest.mark.parametrize("quant", QUANTS)
def test_local_auto_gemv_stages_are_the_ops(quant):
    """mode="auto" on one rank: up to layer.gemv_max_tokens tokens the two per-choice GEMVs
    (their outputs the public ops' bytes, the layer's output within the quant-aware bound), one
    token more the LL chain."""
    torch.manual_seed(0)
    layer = small_layer(quant, "auto")
    w1, w2 = global_weights(**SMALL)
    n = layer.gemv_max_tokens
    assert n == layer_mod.gemv_max_tokens(layer.scheme, SMALL["num_experts"], SMALL["top_k"]) > 1
    for T in (1, n):
        x, ids, w = tokens(T, seed=6 + T, **SMALL)
        assert layer.path(T) == "gemv"
        rec, out = _record(layer, x, ids, w)
        assert rec.names == layer_mod.GEMV_STAGES
        h = ops.gemv_gate_up(x, ids, layer.w1, layer.w1_scale)
        _same_bytes(rec["gemv_gate_up"], h, "gemv_gate_up")
        y = ops.gemv_down(h, ids, w, layer.w2, layer.w2_scale)
        _same_bytes(rec["gemv_down"], y, "gemv_down")
        assert torch.equal(rec["gemv_down"], out)
        err = rel_l2(out, reference.quantized_moe(x, ids, w, w1, w2, quant))
        assert err < LAYER_VS_QUANT_AWARE, (T, err)
    assert layer.path(n + 1) == "ll"
    x, ids, w = tokens(n + 1, seed=7, **SMALL)
    rec, _ = _record(layer, x, ids, w)
    assert rec.names == layer_mod.LOCAL_LL_STAGES


def test_gemv_replace_feeds_gemv_down():
    layer = small_layer("fp8", "auto")
    x, ids, w = tokens(layer.gemv_max_tokens, seed=8, **SMALL)
    with layer.record_stages(replace={"gemv_gate_up": lambda h: h * 2}) as rec:
        out = layer(x, ids, w)
    assert torch.equal(rec["gemv_gate_up"], 2 * ops.gemv_gate_up(x, ids, layer.w1, layer.w1_scale))
    assert torch.equal(out, ops.gemv_down(rec["gemv_gate_up"], ids, w, layer.w2, layer.w2_scale))


def test_recording_off_records_nothing():
    layer = small_layer("fp8", "ht", alignment=8)
    x, ids, w = tokens(7, seed=3, **SMALL)
    with layer.record_stages() as rec:
        pass
    layer(x, ids, w)  # after the block: nothing more is recorded
    assert len(rec) == 0 and rec.names == ()
    assert layer._stage_record is None
    with pytest.raises(KeyError, match="'permute' was not recorded"):
        rec["permute"]


def test_record_stages_rejects_unknown_stage_and_nesting():
    layer = small_layer("bf16", "ht", alignment=8)
    with pytest.raises(ValueError, match="record_stages: replace expected one of"):
        with layer.record_stages(replace={"nope": lambda v: v}):
            pass
    with layer.record_stages():
        with pytest.raises(RuntimeError, match="already recording"):
            with layer.record_stages():
                pass
    assert layer._stage_record is None


def test_replace_feeds_the_next_stage():
    """A replaced stage output is what the next stage consumes (the demo's selftest hook)."""
    layer = small_layer("bf16", "ht", alignment=8)
    x, ids, w = tokens(9, seed=4, **SMALL)
    plain = layer(x, ids, w)
    with layer.record_stages(replace={"gemm2": lambda y: y * 2}) as rec:
        out = layer(x, ids, w)
    assert not torch.equal(out, plain)
    assert torch.equal(rec["unpermute"], ops.unpermute(rec["gemm2"], rec["permute"].inv_perm, w))


# ------------------------------------------------------------------------------------------ compile
@pytest.mark.parametrize("mode", ["ht", "ll"])
def test_recording_under_compile_keeps_the_graph(mode):
    torch._dynamo.reset()
    layer = small_layer("int8", mode, alignment=8, max_tokens_per_rank=16)
    x, ids, w = tokens(6, seed=5, **SMALL)
    plain = CompileCounterWithBackend("eager")
    want = torch.compile(layer, backend=plain, fullgraph=True)(x, ids, w)
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("eager")
    compiled = torch.compile(layer, backend=cnt, fullgraph=True)
    with layer.record_stages() as rec:
        got = compiled(x, ids, w)
    assert len(rec) == 0  # nothing emitted while compiled
    assert cnt.frame_count == 1 and cnt.op_count == plain.op_count
    assert torch.equal(got, want)
    explain = torch._dynamo.explain(layer)
    with layer.record_stages():
        res = explain(x, ids, w)
    assert res.graph_break_count == 0 and res.graph_count == 1, res.break_reasons


# ------------------------------------------------------------------- torch backend, 2 gloo ranks
def _ranks_rank(rank, world):
    for quant in QUANTS:
        x, ids, w = tokens(9 + rank, seed=10 + rank, **SMALL)
        ht = small_layer(quant, "ht", group=dist.group.WORLD, backend="torch", alignment=8)
        rec, out = _record(ht, x, ids, w)
        want = layer_mod.HT_STAGES if quant != "bf16" else layer_mod.HT_STAGES[1:]
        assert rec.names == want, rec.names
        xq, s = (x, None) if quant == "bf16" else rec["quantize"]
        d = rec["dispatch"]
        again = ops.ht_dispatch(xq, ids, w, ht.comm_key, s, False)
        _same_bytes(d, again, "dispatch")
        ops.ht_combine(
            torch.zeros_like(again.x, dtype=torch.bfloat16), again.handle, ht.comm_key
        )  # pairs, as a layer
        _check_experts_ht(ht, rec, d.x, d.x_scales, d.topk_ids, d.topk_weights)
        _same_bytes(rec["combine"], ops.ht_combine(rec["unpermute"], d.handle, ht.comm_key), "ht")
        assert torch.equal(rec["combine"], out)

        ll = small_layer(
            quant, "ll", group=dist.group.WORLD, backend="torch", max_tokens_per_rank=16
        )
        rec, out = _record(ll, x, ids, w)
        want = (
            layer_mod.LL_STAGES
            if quant == "int8"
            else tuple(n for n in layer_mod.LL_STAGES if n != "quantize")
        )
        assert rec.names == want, rec.names
        d = rec["ll_dispatch"]
        again = ops.ll_dispatch(x, ids, ll.comm_key, use_fp8=quant == "fp8")
        _same_bytes(d, again, "ll_dispatch")
        ops.ll_combine(
            torch.zeros_like(d.x, dtype=torch.bfloat16), ids, w, again.handle, ll.comm_key
        )
        a, s = d.x, d.x_scales
        if quant == "int8":
            _same_bytes(rec["quantize"], ops.quantize(a, "int8", masked_m=d.masked_m), "quantize")
            a, s = rec["quantize"]
        y = _check_experts_ll(ll, rec, a, s, d.masked_m, x.shape[0])
        assert torch.equal(rec["ll_combine"], out) and y is rec["gemm2"]
    return True


def test_two_rank_stages_are_the_ops():
    assert run_ranks(_ranks_rank, 2, "gloo") == [True, True]
