"""torch.compile(EPMoE, fullgraph=True) with Inductor on CUDA, at token counts on both sides of
the launch-path thresholds of the stage kernels (permute's one kernel up to SMALL_ENTRIES (t, k)
entries, its row-block scale copy from SCALES_BY_ROW_MIN_ENTRIES, the activation's looping
programs), compared with eager. tests/compile/test_fake_paths.py traces the same host code on
fake tensors without a GPU; this runs it.

K = 8: T = 256 is 2048 entries (the one-kernel permute), 300 the three-kernel chain, 1024 8192
entries (row-block DeepGEMM-layout scales for fp8), 4096 well above every threshold.
"""

import importlib

import pytest
import torch
import torch._dynamo
import torch.distributed as dist

import epmoe
import epmoe.compile
from epmoe._multiproc import run_ranks
from tests._moe import global_weights, tokens
from tests._tol import rel_l2

_p = importlib.import_module("epmoe.ops.permute")

MOE = dict(num_experts=16, hidden_size=512, intermediate_size=256, top_k=8)
TOKENS = (256, 300, 1024, 4096)
MAX_TOKENS = 4096
CONFIGS = [("ht", True), ("ht", False), ("ll", False)]


def test_token_counts_straddle_the_thresholds():
    k = MOE["top_k"]
    entries = [t * k for t in TOKENS]
    assert entries[0] <= _p.CONFIG.small_entries < entries[1]
    assert entries[1] < _p.CONFIG.scales_by_row_min_entries <= entries[2]


def _layer(quant, mode, worst, group=None, backend="local"):
    layer = epmoe.EPMoE(
        **MOE,
        quant=quant,
        mode=mode,
        group=group,
        backend=backend,
        max_tokens_per_rank=MAX_TOKENS,
        worst_case=worst,
        device="cuda",
    )
    layer.load_weights(*global_weights(**MOE))
    return layer


def _inputs(T, seed):
    return tuple(t.cuda() for t in tokens(T, seed=seed, **MOE))


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("mode,worst", CONFIGS)
def test_inductor_matches_eager_across_thresholds(quant, mode, worst):
    """One compiled layer (dynamic=True) called at every token count: recompiles where a guard on
    a threshold says so, never breaks the graph, and matches eager at each count."""
    torch._dynamo.reset()
    layer = _layer(quant, mode, worst)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for T in TOKENS:
        x, ids, w = _inputs(T, seed=T)
        out = compiled(x, ids, w)
        assert out.shape == x.shape and out.dtype == torch.bfloat16
        err = rel_l2(out, layer(x, ids, w))
        assert err < 1e-2, (quant, mode, worst, T, err)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["fp8", "int8"])
@pytest.mark.parametrize("T", TOKENS)
def test_static_shapes_each_path(quant, T):
    """The default (static-shape) compile of the HT layer at each count: every kernel path with
    its sizes as constants."""
    torch._dynamo.reset()
    layer = _layer(quant, "ht", True)
    x, ids, w = _inputs(T, seed=1)
    epmoe.compile.assert_no_graph_breaks(layer, x, ids, w)
    out = torch.compile(layer, fullgraph=True, dynamic=False)(x, ids, w)
    assert rel_l2(out, layer(x, ids, w)) < 1e-2


def _exact_rank(rank, world):
    """Exact-size HT on 2 ranks (torch backend): the received row count is an unbacked size in
    the compiled graph (permute's chain, the activation's capped looping programs)."""
    done = 0
    for quant in ("bf16", "fp8", "int8"):
        torch._dynamo.reset()
        layer = _layer(quant, "ht", False, group=dist.group.WORLD, backend="torch")
        compiled = torch.compile(layer, fullgraph=True)
        for T in TOKENS:
            x, ids, w = _inputs(T - rank, seed=10 * rank + T)  # (counts differ per rank)
            err = rel_l2(compiled(x, ids, w), layer(x, ids, w))
            assert err < 1e-2, (quant, T, err)
            done += 1
    return done


@pytest.mark.multi_gpu
def test_exact_ht_unbacked_rows_two_gpus():
    assert run_ranks(_exact_rank, 2, "nccl", timeout=900) == [12, 12]
