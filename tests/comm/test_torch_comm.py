"""The torch.distributed backend on 2 and 4 gloo ranks (CPU): routing and whole-layer results."""

import pytest
import torch
import torch.distributed as dist

import epmoe
from epmoe import ops
from epmoe._multiproc import run_ranks
from tests._moe import SMALL, check_layer_output, global_weights, tokens

MODES = [("ht", False), ("ht", True), ("ll", False)]
QUANTS = ["bf16", "fp8", "int8"]


def _layer_rank(rank, world):
    w1, w2 = global_weights(**SMALL)
    checked = 0
    for mode, worst in MODES:
        for quant in QUANTS:
            layer = epmoe.EPMoE(
                **SMALL,
                quant=quant,
                mode=mode,
                group=dist.group.WORLD,
                backend="torch",
                alignment=8,
                max_tokens_per_rank=24,
                worst_case=worst,
                device="cpu",
            )
            layer.load_weights(w1, w2)
            assert layer.comm.name == "torch" and layer.num_local_experts == 8 // world
            # ranks hold different token counts (one holds none) to exercise uneven splits
            T = [5, 0, 24, 11][rank % 4] if mode == "ll" else [7, 0, 13, 3][rank % 4]
            x, ids, w = tokens(T, seed=100 + rank, **SMALL)
            out = layer(x, ids, w)
            check_layer_output(out, x, ids, w, w1, w2, quant)
            checked += 1
    # worst case without max_tokens_per_rank: N = world * T, the same T on every rank
    layer = epmoe.EPMoE(
        **SMALL,
        quant="int8",
        group=dist.group.WORLD,
        backend="torch",
        alignment=8,
        worst_case=True,
        device="cpu",
    )
    layer.load_weights(w1, w2)
    x, ids, w = tokens(9, seed=200 + rank, **SMALL)
    check_layer_output(layer(x, ids, w), x, ids, w, w1, w2, "int8")
    return checked


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_layer_matches_dense_on_every_rank(world):
    assert run_ranks(_layer_rank, world, "gloo") == [len(MODES) * len(QUANTS)] * world


def _routing_rank(rank, world):
    """Which rows arrive, with which local ids and weights: checked against every rank's tokens."""
    E_local = SMALL["num_experts"] // world
    layer = epmoe.EPMoE(
        **SMALL,
        group=dist.group.WORLD,
        backend="torch",
        alignment=8,
        device="cpu",
        max_tokens_per_rank=16,
    )
    all_tok = [tokens(6 + r, seed=7 * r, **SMALL) for r in range(world)]
    x, ids, w = all_tok[rank]
    lo = rank * E_local
    # (source token row, local ids, weights) for every token that has an expert here
    want = []
    for xs, ids_s, w_s in all_tok:
        for t in range(ids_s.shape[0]):
            mine = (ids_s[t] >= lo) & (ids_s[t] < lo + E_local)
            if mine.any():
                local = torch.where(mine, ids_s[t] - lo, -1)
                want.append((xs[t].float().tolist(), local.tolist(), w_s[t].tolist()))
    for worst in (False, True):
        d = ops.ht_dispatch(x, ids, w, layer.comm_key, worst_case=worst)
        got = [
            (d.x[i].float().tolist(), d.topk_ids[i].tolist(), d.topk_weights[i].tolist())
            for i in range(d.x.shape[0])
            if (d.topk_ids[i] >= 0).any()
        ]
        assert sorted(got) == sorted(want), f"worst_case={worst}"
        if worst:
            assert d.x.shape[0] == world * 16
        else:
            assert d.x.shape[0] == len(want)
        counts = torch.bincount(d.topk_ids[d.topk_ids >= 0], minlength=E_local)
        assert torch.equal(d.expert_counts, counts.int())
        # combine returns each row home and sums (unweighted): sending ones gives per-token
        # rank counts
        y = torch.ones((d.x.shape[0], SMALL["hidden_size"]), dtype=torch.bfloat16)
        back = ops.ht_combine(y, d.handle, layer.comm_key)
        nranks = torch.stack([((ids // E_local) == r).any(1) for r in range(world)], 1).sum(1)
        assert torch.equal(back[:, 0], nranks.bfloat16())
    return True


@pytest.mark.slow
def test_dispatch_routing_two_ranks():
    assert run_ranks(_routing_rank, 2, "gloo") == [True, True]
