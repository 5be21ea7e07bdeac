"""End-to-end EPMoE layer on 2 GPUs (deepep backend): eager vs compiled vs CUDA graph, against the
sum of its best stages measured in the same run, plus the eager op-dispatch overhead of every stage.

    python benchmarks/bench_layer.py --out layer.json [--config W] [--quant fp8]

Per rank, the same sequence runs on both ranks; each figure is the median of ``--iters`` timed calls
(CUDA events; every call is preceded by a barrier-free warm loop), the JSON keeps the slower rank.
Targets (issue 6): LL layer in a graph <= 1.10 x (LL dispatch+combine graph + two masked GEMMs);
HT layer <= 1.15 x (dispatch + two contiguous GEMMs + combine); eager dispatch overhead <= 15
us/stage.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._configs import CONFIGS  # noqa: E402
from epmoe._multiproc import run_ranks  # noqa: E402


def _time_ms(fn, iters=30, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    dist.barrier()
    return statistics.median(times)


def _graph(fn, warmup=3):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g.replay


def _host_us_per_call(fn, n=200):
    """Host time per eager call (what op dispatch + validation + launch cost the CPU)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def _rank(rank, world, cfg_name, quant, ll_tokens, ht_tokens):
    import epmoe
    from epmoe import ops
    from epmoe.graphs import DecodeGraphRunner, PrefillGraphRunner

    cfg = CONFIGS[cfg_name]
    E, H, I, K = cfg.num_experts, cfg.hidden, cfg.intermediate, cfg.top_k
    dev = torch.device("cuda", rank)
    g = torch.Generator(device=dev).manual_seed(0)
    w1 = torch.randn((E, 2 * I, H), generator=g, device=dev, dtype=torch.bfloat16) / H**0.5
    w2 = torch.randn((E, H, I), generator=g, device=dev, dtype=torch.bfloat16) / I**0.5
    res = {}

    def tokens(T, seed):
        gg = torch.Generator(device=dev).manual_seed(seed)
        x = torch.randn((T, H), generator=gg, device=dev).bfloat16()
        ids = torch.rand((T, E), generator=gg, device=dev).argsort(dim=1)[:, :K]
        w = torch.rand((T, K), generator=gg, device=dev) + 0.1
        return x, ids.long(), (w / w.sum(1, keepdim=True)).float()

    # ------------------------------------------------------------------------------------ LL
    ll = epmoe.EPMoE(
        E,
        H,
        I,
        K,
        quant=quant,
        mode="ll",
        group=dist.group.WORLD,
        backend="deepep",
        max_tokens_per_rank=ll_tokens,
        device=dev,
    )
    ll.load_weights(w1, w2)
    x, ids, w = tokens(ll_tokens, 10 + rank)
    res["ll_eager_ms"] = _time_ms(lambda: ll(x, ids, w))
    runner = DecodeGraphRunner(ll, capture_sizes=(ll_tokens,))
    res["ll_graph_ms"] = _time_ms(lambda: runner(x, ids, w))
    compiled = torch.compile(ll, fullgraph=True)
    res["ll_compiled_ms"] = _time_ms(lambda: compiled(x, ids, w))
    # stages: dispatch+combine in one graph, then the two masked GEMMs on the real layout
    d = ops.ll_dispatch(x, ids, ll.comm_key, use_fp8=quant == "fp8")
    y_static = torch.zeros(
        (ll.num_local_experts, ll.comm.ll_capacity, H), dtype=torch.bfloat16, device=dev
    )

    def dc():
        dd = ops.ll_dispatch(x, ids, ll.comm_key, use_fp8=quant == "fp8")
        return ops.ll_combine(y_static, ids, w, dd.handle, ll.comm_key)

    ops.ll_combine(y_static, ids, w, d.handle, ll.comm_key)  # keep DeepEP's dispatch/combine pairs
    res["ll_dispatch_combine_graph_ms"] = _time_ms(_graph(dc))
    a, s = d.x, d.x_scales
    if quant == "int8":
        a, s = ops.quantize(a, "int8", masked_m=d.masked_m)
    em = ll.expected_m()
    res["ll_gemm1_ms"] = _time_ms(
        lambda: ops.grouped_gemm(
            a, ll.w1, masked_m=d.masked_m, a_scales=s, w_scales=ll.w1_scale, expected_m=em
        )
    )
    y1 = ops.grouped_gemm(
        a, ll.w1, masked_m=d.masked_m, a_scales=s, w_scales=ll.w1_scale, expected_m=em
    )
    h, hs = ll._act(y1, d.masked_m)
    res["ll_gemm2_ms"] = _time_ms(
        lambda: ops.grouped_gemm(
            h, ll.w2, masked_m=d.masked_m, a_scales=hs, w_scales=ll.w2_scale, expected_m=em
        )
    )
    res["ll_stage_sum_ms"] = (
        res["ll_dispatch_combine_graph_ms"] + res["ll_gemm1_ms"] + res["ll_gemm2_ms"]
    )
    res["ll_graph_over_stages"] = res["ll_graph_ms"] / res["ll_stage_sum_ms"]
    runner = compiled = None  # free the LL graphs before HT
    torch.cuda.synchronize()

    # ------------------------------------------------------------------------------------ HT
    ht = epmoe.EPMoE(
        E,
        H,
        I,
        K,
        quant=quant,
        mode="ht",
        group=dist.group.WORLD,
        backend="deepep",
        max_tokens_per_rank=ht_tokens,
        worst_case=True,
        device=dev,
    )
    ht.load_weights(w1, w2)
    del w1, w2
    x, ids, w = tokens(ht_tokens, 20 + rank)
    ht.warmup([ht_tokens])
    res["ht_eager_ms"] = _time_ms(lambda: ht(x, ids, w), iters=10)
    xq, xs = (x, None) if quant == "bf16" else ops.quantize(x, quant)
    res["ht_dispatch_ms"] = _time_ms(
        lambda: ops.ht_dispatch(xq, ids, w, ht.comm_key, xs, worst_case=True), iters=10
    )
    d = ops.ht_dispatch(xq, ids, w, ht.comm_key, xs, worst_case=True)
    p = ops.permute(d.x, d.topk_ids, ht.num_local_experts, ht.alignment, d.x_scales)
    res["ht_gemm1_ms"] = _time_ms(
        lambda: ops.grouped_gemm(
            p.x,
            ht.w1,
            m_indices=p.m_indices,
            a_scales=p.x_scales,
            w_scales=ht.w1_scale,
            expert_offsets=p.expert_offsets,
        ),
        iters=10,
    )
    y1 = ops.grouped_gemm(
        p.x,
        ht.w1,
        m_indices=p.m_indices,
        a_scales=p.x_scales,
        w_scales=ht.w1_scale,
        expert_offsets=p.expert_offsets,
    )
    h, hs = ht._act(y1)
    res["ht_gemm2_ms"] = _time_ms(
        lambda: ops.grouped_gemm(
            h,
            ht.w2,
            m_indices=p.m_indices,
            a_scales=hs,
            w_scales=ht.w2_scale,
            expert_offsets=p.expert_offsets,
        ),
        iters=10,
    )
    y = torch.zeros((d.x.shape[0], H), dtype=torch.bfloat16, device=dev)
    res["ht_combine_ms"] = _time_ms(lambda: ops.ht_combine(y, d.handle, ht.comm_key), iters=10)
    res["ht_stage_sum_ms"] = (
        res["ht_dispatch_ms"] + res["ht_gemm1_ms"] + res["ht_gemm2_ms"] + res["ht_combine_ms"]
    )
    res["ht_eager_over_stages"] = res["ht_eager_ms"] / res["ht_stage_sum_ms"]
    prunner = PrefillGraphRunner(ht, num_tokens=ht_tokens)
    res["ht_graph_ms"] = _time_ms(lambda: prunner(x, ids, w), iters=10)
    res["ht_graph_over_stages"] = res["ht_graph_ms"] / res["ht_stage_sum_ms"]
    res["ht_recv_rows"] = int(d.x.shape[0])

    # ------------------------------------------------------------- eager dispatch overhead (host)
    tx = torch.randn((8, 256), device=dev).bfloat16()
    tids = torch.randint(0, 4, (8, 2), device=dev)
    tw = torch.rand((8, 2), device=dev)
    tp = ops.permute(tx, tids, 4, 128)
    res["host_us"] = {
        "quantize": _host_us_per_call(lambda: ops.quantize(tx, "fp8")),
        "permute": _host_us_per_call(lambda: ops.permute(tx, tids, 4, 128)),
        "silu_and_mul": _host_us_per_call(lambda: ops.silu_and_mul(tx)),
        "silu_and_mul_quant": _host_us_per_call(lambda: ops.silu_and_mul_quant(tx, "fp8")),
        "unpermute": _host_us_per_call(lambda: ops.unpermute(tp.x, tp.inv_perm, tw)),
        "torch_add_baseline": _host_us_per_call(lambda: tx + tx),
    }
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="W", choices=sorted(CONFIGS))
    ap.add_argument("--quant", default="fp8", choices=["bf16", "fp8", "int8"])
    ap.add_argument("--ll-tokens", type=int, default=128)
    ap.add_argument("--ht-tokens", type=int, default=4096)
    a = ap.parse_args(argv)
    per_rank = run_ranks(_rank, 2, "nccl", a.config, a.quant, a.ll_tokens, a.ht_tokens, timeout=560)
    worst = {}
    for k in per_rank[0]:
        if isinstance(per_rank[0][k], dict):
            worst[k] = {s: max(r[k][s] for r in per_rank) for s in per_rank[0][k]}
        else:
            worst[k] = max(r[k] for r in per_rank)
    report = {
        "command": "python benchmarks/bench_layer.py " + " ".join(argv or sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d"),
        "config": a.config,
        "quant": a.quant,
        "ll_tokens_per_rank": a.ll_tokens,
        "ht_tokens_per_rank": a.ht_tokens,
        "slower_rank": worst,
        "per_rank": per_rank,
    }
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(worst, indent=1))


if __name__ == "__main__":
    main()
