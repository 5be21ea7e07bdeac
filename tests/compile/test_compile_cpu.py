"""torch.compile(EPMoE, fullgraph=True) on CPU: no graph breaks, same outputs as eager, one compile
per mode across token counts (dynamic=True); local backend here, torch backend on 2 gloo ranks."""

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend

from epmoe._multiproc import run_ranks
from tests._moe import SMALL, check_layer_output, global_weights, small_layer, tokens
from tests._tol import rel_l2

CONFIGS = [("ht", False), ("ht", True), ("ll", False)]


def make_layer(quant, mode, worst, group=None, backend="local"):
    return small_layer(
        quant, mode, worst, group=group, backend=backend, alignment=8, max_tokens_per_rank=16
    )


def _same(a, b):
    torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("mode,worst", CONFIGS)
def test_fullgraph_matches_eager_and_compiles_once(quant, mode, worst):
    torch._dynamo.reset()
    layer = make_layer(quant, mode, worst)
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=cnt, fullgraph=True, dynamic=True)
    for T in (5, 9, 16, 3):
        x, ids, w = tokens(T, seed=T, **SMALL)
        _same(compiled(x, ids, w), layer(x, ids, w))
    assert cnt.frame_count == 1, f"recompiled: {cnt.frame_count} compiles for 4 token counts"


@pytest.mark.parametrize("quant", ["bf16", "fp8"])
@pytest.mark.parametrize("mode", ["ht", "ll"])
def test_fused_gemm1_gate_compiles_to_the_eager_bytes(quant, mode, monkeypatch):
    """HT / LL with GEMM1 and the gate as one op (where a GPU's table fuses them): one graph, no
    break, the eager bytes at two token counts."""
    from epmoe import layer as layer_mod

    torch._dynamo.reset()
    monkeypatch.setattr(layer_mod._tuned, "has", lambda *args: True)
    monkeypatch.setattr(layer_mod, "fuses_gate", lambda *args: True)
    monkeypatch.setattr(layer_mod, "fuses_masked_gate", lambda *args: True)
    kw = dict(alignment=16) if mode == "ht" else dict(max_tokens_per_rank=40)
    layer = small_layer(quant, mode, gate="silu:alpha=1.702,limit=7.0", **kw)
    compiled = torch.compile(layer, fullgraph=True)
    for T in (20, 33):
        x, ids, w = tokens(T, seed=T, **SMALL)
        with layer.record_stages() as rec:
            eager = layer(x, ids, w)
        assert "gemm1" not in rec and torch.equal(compiled(x, ids, w), eager)


@pytest.mark.parametrize("mode,worst", CONFIGS)
def test_no_graph_breaks(mode, worst):
    torch._dynamo.reset()
    layer = make_layer("fp8", mode, worst)
    x, ids, w = tokens(6, seed=0, **SMALL)
    explain = torch._dynamo.explain(layer)(x, ids, w)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons


@pytest.mark.slow
@pytest.mark.parametrize(
    "quant,mode,worst", [("fp8", "ht", True), ("int8", "ll", False), ("bf16", "ht", False)]
)
def test_inductor_matches_eager(quant, mode, worst):
    torch._dynamo.reset()
    layer = make_layer(quant, mode, worst)
    compiled = torch.compile(layer, fullgraph=True)
    x, ids, w = tokens(11, seed=1, **SMALL)
    # Inductor reorders float math (e.g. x / s as x * (1 / s)), which moves some fp8/int8 rounding
    # boundaries: the compiled layer must meet the same bounds as eager, and stay close to it
    out = compiled(x, ids, w)
    check_layer_output(out, x, ids, w, *global_weights(**SMALL), quant)
    assert rel_l2(out, layer(x, ids, w)) < 2e-2


def _compile_rank(rank, world):
    for mode, worst in CONFIGS:
        torch._dynamo.reset()
        layer = make_layer("int8", mode, worst, group=dist.group.WORLD, backend="torch")
        cnt = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(layer, backend=cnt, fullgraph=True, dynamic=True)
        for T in (4, 7, 12):  # ranks hold different token counts (<= max_tokens_per_rank = 16)
            x, ids, w = tokens(T + rank, seed=rank * 10 + T, **SMALL)
            _same(compiled(x, ids, w), layer(x, ids, w))
        assert cnt.frame_count == 1, (mode, worst, cnt.frame_count)
    return True


@pytest.mark.slow
def test_fullgraph_torch_backend_two_ranks():
    assert run_ranks(_compile_rank, 2, "gloo") == [True, True]


def test_helpers_detect_graph_breaks_and_mark_dynamic():
    import epmoe.compile

    torch._dynamo.reset()
    layer = make_layer("int8", "ht", True)
    x, ids, w = tokens(6, seed=0, **SMALL)
    epmoe.compile.assert_no_graph_breaks(layer, x, ids, w)

    def breaks(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    with pytest.raises(AssertionError, match="1 graph break"):
        epmoe.compile.assert_no_graph_breaks(breaks, torch.ones(3))

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    f = torch.compile(layer, backend=cnt, fullgraph=True)
    for T in (4, 10):
        x, ids, w = tokens(T, seed=T, **SMALL)
        epmoe.compile.mark_dynamic_tokens(x, ids, w, min=1, max=16)
        f(x, ids, w)
    assert cnt.frame_count == 1
