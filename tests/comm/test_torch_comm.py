"""The torch.distributed backend on 2 and 4 gloo ranks (CPU): routing and whole-layer results."""

import math

import pytest
import torch
import torch.distributed as dist

import epmoe
from epmoe import ops, reference
from epmoe._multiproc import run_ranks
from tests._moe import SMALL, check_layer_output, global_weights, tokens
from tests._opcheck import opcheck

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


def _ll_and_col_major_rank(rank, world):
    """LL dispatch == reference.ll_scatter of every rank's padded tokens (this rank's experts),
    combine returns each token's weighted sum; HT and LL take column-major ids (any strides)."""
    from epmoe.ops.ll_scatter import ll_scatter

    E, H, K, maxT = SMALL["num_experts"], SMALL["hidden_size"], SMALL["top_k"], 8
    comm = epmoe.comm.create("torch", dist.group.WORLD, E, H, max_tokens_per_rank=maxT)
    E_local = E // world
    Ts = [5, 0, 8, 3][:world]
    all_tok = [tokens(Ts[r], seed=40 + r, **SMALL) for r in range(world)]
    x, ids, w = all_tok[rank]
    ids = ids.t().contiguous().t()  # column-major
    w = w.t().contiguous().t()
    gx = torch.zeros((world * maxT, H), dtype=torch.bfloat16)
    gids = torch.full((world * maxT, K), -1, dtype=torch.int64)
    for r, (xs, ids_s, _) in enumerate(all_tok):
        gx[r * maxT : r * maxT + xs.shape[0]] = xs
        gids[r * maxT : r * maxT + xs.shape[0]] = ids_s
    for use_fp8 in (False, True):
        d = ops.ll_dispatch(x, ids, comm.key, use_fp8=use_fp8)
        quant = "fp8" if use_fp8 else "bf16"
        want = ll_scatter(gx, gids, E_local, world * maxT, quant, rank * E_local, E)
        assert torch.equal(d.masked_m, want[2]) and torch.equal(d.handle[0], want[3])
        live = torch.arange(world * maxT)[None, :] < want[2][:, None]
        assert torch.equal(d.x[live].view(torch.uint8), want[0][live].view(torch.uint8))
        if use_fp8:
            assert torch.equal(d.x_scales[live], want[1][live])
        # identity experts: combine gives each token's weighted sum of its (quantized) row
        y = d.x.float() if not use_fp8 else reference.dequantize(d.x, d.x_scales)
        out = ops.ll_combine(y.bfloat16(), ids, w, d.handle, comm.key)
        src = x.float() if not use_fp8 else reference.dequantize(*reference.quantize(x, "fp8"))
        src = src.bfloat16().float()
        want_out = (src.unsqueeze(1) * torch.where(ids >= 0, w, 0.0).unsqueeze(-1)).sum(1)
        torch.testing.assert_close(out, want_out.bfloat16(), atol=1e-2, rtol=1.6e-2)
        into = torch.empty_like(out)
        assert ops.ll_combine(y.bfloat16(), ids, w, d.handle, comm.key, out=into) is into
        assert torch.equal(into, out)
    for worst in (False, True):
        d = ops.ht_dispatch(x, ids, w, comm.key, worst_case=worst)
        back = ops.ht_combine(d.x, d.handle, comm.key)
        nranks = torch.stack([((ids // E_local) == r).any(1) for r in range(world)], 1).sum(1)
        assert torch.equal(back, (x.float() * nranks.unsqueeze(1)).bfloat16())
    return True


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ll_dispatch_combine_and_column_major_ids(world):
    assert run_ranks(_ll_and_col_major_rank, world, "gloo") == [True] * world


# ------------------------------------------------------------------ the previous HT implementation
def _old_pack(comm, x, topk_ids, topk_weights, x_scales):
    """The torch-index-op packing TorchComm used before the ll_scatter rebuild: one uint8 row per
    (peer, token) = payload | scales | local ids int32 | weights (the oracle of the new path)."""
    P, E = comm.world_size, comm.num_local_experts
    T, K = topk_ids.shape
    s = x_scales if x_scales is not None else x.new_empty((T, 0), dtype=torch.float32)

    def as_bytes(t):
        t = t.contiguous()
        return t.reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)

    dest = torch.where(topk_ids >= 0, topk_ids // E, -1)
    peers = torch.arange(P)
    hit = dest.unsqueeze(0) == peers.view(P, 1, 1)
    local_ids = torch.where(hit, topk_ids.unsqueeze(0) - peers.view(P, 1, 1) * E, -1)
    common = torch.cat([as_bytes(x), as_bytes(s)], dim=1)
    packed = torch.cat(
        [
            common.unsqueeze(0).expand(P, -1, -1),
            as_bytes(local_ids.to(torch.int32).reshape(P * T, K)).reshape(P, T, 4 * K),
            as_bytes(topk_weights.float()).unsqueeze(0).expand(P, -1, -1),
        ],
        dim=2,
    )
    return packed, hit.any(dim=2).t().contiguous(), x.shape[1] * x.element_size(), s.shape[1]


def _old_ht(comm, x, topk_ids, topk_weights, x_scales, worst_case, y_fn):
    """(dispatch rows as bytes: x | scales | ids | weights, counts, is_in_rank, combine of
    y_fn(recv x)) the way the previous implementation computed them."""
    P, K = comm.world_size, topk_ids.shape[1]
    T = x.shape[0]
    packed, in_rank, xb, S = _old_pack(comm, x, topk_ids, topk_weights, x_scales)
    width = packed.shape[2]
    if worst_case:
        cap = comm.ht_capacity(T)
        slot = torch.where(in_rank, torch.cumsum(in_rank.long(), dim=0) - 1, -1)
        send = torch.zeros((P, cap + 1, width), dtype=torch.uint8)
        send[:, :, xb + 4 * S : xb + 4 * S + 4 * K] = 255
        p_idx = torch.arange(P).view(1, P).expand(T, P)
        send[p_idx, torch.where(in_rank, slot, cap)] = packed.permute(1, 0, 2)
        send = send[:, :cap].reshape(P * cap, width)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
    else:
        counts = in_rank.sum(dim=0)
        pt = in_rank.t().nonzero()
        send = packed[pt[:, 0], pt[:, 1]]
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)
        in_s, out_s = counts.tolist(), recv_counts.tolist()
        recv = send.new_empty((sum(out_s), width))
        dist.all_to_all_single(recv, send, out_s, in_s)
    rx = recv[:, :xb].contiguous().view(x.dtype)
    y = y_fn(rx)
    yb = y.contiguous().view(torch.uint8)
    if worst_case:
        back = torch.empty_like(yb)
        dist.all_to_all_single(back, yb)
        back = back.view(torch.bfloat16).view(P, cap, -1)
        rows = back[p_idx, slot.clamp(min=0)].float()
        out = (rows * in_rank.unsqueeze(-1)).sum(dim=1)
    else:
        back = yb.new_empty((sum(in_s), yb.shape[1]))
        dist.all_to_all_single(back, yb, in_s, out_s)
        out = torch.zeros((T, y.shape[1]))
        out.index_add_(0, pt[:, 1], back.view(torch.bfloat16).float())
    return recv, in_rank, out.bfloat16()


def _new_rows(d, K):
    """The new dispatch result in the old packed byte layout."""
    s = d.x_scales if d.x_scales is not None else torch.empty((d.x.shape[0], 0))
    parts = [d.x.view(torch.uint8), s.view(torch.uint8)]
    parts += [d.topk_ids.int().view(torch.uint8), d.topk_weights.view(torch.uint8)]
    return torch.cat(parts, dim=1)


def _same_as_before_rank(rank, world):
    E, H, K = SMALL["num_experts"], SMALL["hidden_size"], SMALL["top_k"]
    maxT = 12
    comm = epmoe.comm.create("torch", dist.group.WORLD, E, H, max_tokens_per_rank=maxT)
    comm9 = epmoe.comm.create("torch", dist.group.WORLD, E, H)  # worst case N = P * T
    E_local = E // world
    checked = 0
    for case in range(4):
        T = 9 if case == 3 else [7, 0, 12, 4][(rank + case) % 4]
        x, ids, w = tokens(T, seed=300 + 10 * case + rank, **SMALL)
        if T > 2:
            ids[1] = -1  # a token routed nowhere
            ids[2] = torch.tensor([rank * E_local, rank * E_local + 1, -1])[:K]  # 2 on one peer
        if case % 2:
            ids = ids.t().contiguous().t()  # column-major ids and weights
            w = w.t().contiguous().t()
        for payload, with_scales in [
            ("bf16", False),
            ("bf16", True),
            ("fp8", True),
            ("fp8", False),
            ("int8", True),
            ("int8", False),
        ]:
            if payload == "bf16":
                px, sc = x, torch.rand((T, 3)) if with_scales else None
            else:
                px, sc = reference.quantize(x, payload)
                sc = sc if with_scales else None
            for worst in (True, False):
                c = comm9 if case == 3 else comm
                want, want_in_rank, want_back = _old_ht(
                    c, px, ids, w, sc, worst, lambda rx: _y_of(rx, rank)
                )
                d = ops.ht_dispatch(px, ids, w, c.key, x_scales=sc, worst_case=worst)
                got = _new_rows(d, K)
                assert got.shape == want.shape, (payload, worst, got.shape, want.shape)
                assert torch.equal(got, want), (payload, with_scales, worst, case)
                assert torch.equal(d.handle[0], want_in_rank)
                counts = torch.bincount(d.topk_ids[d.topk_ids >= 0], minlength=E_local)
                assert torch.equal(d.expert_counts, counts.int())
                back = ops.ht_combine(_y_of(d.x, rank), d.handle, c.key)
                assert torch.equal(back, want_back), (payload, worst, case)
                checked += 1
    # fakes match (static N worst case; the exact variant declares its dynamic N)
    px, sc = reference.quantize(x, "fp8")
    for name in ("ht_dispatch", "ht_dispatch_exact"):
        opcheck(getattr(torch.ops.epmoe, name).default, (px, ids, w, comm.key, sc))
        d = ops.ht_dispatch(px, ids, w, comm.key, x_scales=sc, worst_case=name == "ht_dispatch")
        y = _y_of(d.x, rank)
        opcheck(torch.ops.epmoe.ht_combine.default, (y, list(d.handle), comm.key))
    return checked


def _y_of(rx, rank):
    """Deterministic expert outputs of the received rows (distinct per rank and row)."""
    n = rx.shape[0]
    base = torch.arange(n * SMALL["hidden_size"], dtype=torch.float32).view(n, SMALL["hidden_size"])
    return (torch.sin(base * 0.37 + rank) * (rank + 1)).bfloat16()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ht_dispatch_same_rows_as_before(world):
    """ll_scatter-based HT dispatch and combine == the previous torch-index-op implementation,
    byte for byte (every row, padding included on CPU): bf16 / fp8 / int8 payloads with and
    without scales, column-major ids, -1 routing, tokens routed to no peer, T = 0 ranks."""
    assert run_ranks(_same_as_before_rank, world, "gloo") == [4 * 6 * 2] * world


def _cuda_vs_cpu_rank(rank, world):
    """The torch backend's HT on CUDA tensors (NCCL, the ll_scatter / ll_gather kernels) == the same
    calls on CPU (gloo, their references): every specified byte (padding payload rows are
    unspecified on CUDA; their ids are -1 and weights / scales 0 on both)."""
    E, H = SMALL["num_experts"], SMALL["hidden_size"]
    cpu_group = dist.new_group(backend="gloo")
    gpu = epmoe.comm.create("torch", dist.group.WORLD, E, H, max_tokens_per_rank=64)
    cpu = epmoe.comm.create("torch", cpu_group, E, H, max_tokens_per_rank=64)
    checked = 0
    for T in (0, 37, 64):
        x, ids, w = tokens(T, seed=500 + T + rank, **SMALL)
        ids = ids.t().contiguous().t()
        for payload in ("bf16", "fp8", "int8"):
            px, sc = (x, None) if payload == "bf16" else reference.quantize(x, payload)
            for worst in (True, False):
                args = (px, ids, w)
                dc = ops.ht_dispatch(*args, cpu.key, x_scales=sc, worst_case=worst)
                dg = ops.ht_dispatch(
                    *(t.cuda() for t in args),
                    gpu.key,
                    x_scales=None if sc is None else sc.cuda(),
                    worst_case=worst,
                )
                live = (dc.topk_ids >= 0).any(1)
                assert torch.equal(dg.x.cpu()[live].view(torch.uint8), dc.x[live].view(torch.uint8))
                for a, b in zip(dg[1:5], dc[1:5], strict=True):
                    assert (a is None and b is None) or torch.equal(a.cpu(), b)
                for a, b in zip(dg.handle, dc.handle, strict=True):
                    assert torch.equal(a.cpu(), b)
                y = _y_of(dc.x, rank)
                back = ops.ht_combine(y.cuda(), dg.handle, gpu.key)
                assert torch.equal(back.cpu(), ops.ht_combine(y, dc.handle, cpu.key))
                checked += 1
    return checked


@pytest.mark.gpu
def test_ht_cuda_equals_cpu_one_gpu():
    """A world-1 NCCL group: the collectives run, the kernels pack and unpack."""
    assert run_ranks(_cuda_vs_cpu_rank, 1, "nccl") == [18]


@pytest.mark.multi_gpu
def test_ht_cuda_equals_cpu_two_gpus():
    assert run_ranks(_cuda_vs_cpu_rank, 2, "nccl") == [18, 18]
