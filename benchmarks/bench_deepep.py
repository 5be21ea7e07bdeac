"""deep_ep dispatch/combine on 2 GPUs: our ops vs raw deep_ep calls on the same buffer, same run.

Cases at workload W (H = 7168, Et = 256, top-8), per rank:
- ``ht_dispatch_fp8_exact`` / ``ht_dispatch_fp8_worst``: 4096 fp8 tokens (1x128 scales), exact size
  (host sync) and worst case; raw = ``get_dispatch_layout`` + ``dispatch``.
- ``ht_combine_bf16_exact`` / ``ht_combine_bf16_worst``: combine of the received bf16 rows.
- ``ll_graph_fp8``: 128 tokens, LL dispatch (fp8) + combine (bf16) captured in one CUDA graph,
  timed by replay; raw = the same two deep_ep calls captured the same way.
- ``ll_eager_fp8``: the same pair without a graph.

GB/s as DeepEP reports it: bytes received by this rank / time. HT dispatch: N * (H + 4 * H / 128)
(fp8 row + float32 scales), HT combine: N * 2H (N = rows received by this rank); LL: per valid
(token, expert) selection sent by this rank, H + 4 * H / 128 + 16 bytes (dispatch) and 2H (combine).
Times are medians of CUDA-event timings of single launches (graph replays for LL), measured in
alternating rounds (ours, raw, ours, ...) so both sides see the same clocks; ``overhead_pct`` =
ours / raw - 1 (target: at most 3 %). Both ranks run the same sequence; the summary keeps the
slower rank.

Run on the GPU machine from the repository root (2 GPUs, deep_ep installed), then record it
(``python scripts/record_results.py --gpu h200x2 deepep.json``):
    python benchmarks/bench_deepep.py --out deepep.json
"""

import argparse
import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run as a script: make `epmoe` importable
    sys.path.insert(0, _ROOT)

import _timing  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from epmoe._multiproc import run_ranks  # noqa: E402

# Model shapes live here, not in the benchmark bodies.
WORKLOADS = {
    "W": dict(hidden=7168, experts=256, top_k=8, ht_tokens=4096, ll_tokens=128),
    "small": dict(hidden=2048, experts=16, top_k=4, ht_tokens=512, ll_tokens=64),
}
TARGET_OVERHEAD_PCT = 3.0
SEED = 0


# --------------------------------------------------------------------------------------- timing
def _paired_us(rounds: int, iters: int, **fns):
    """Median microseconds per launch of each fn, alternating rounds, ranks in step."""
    t = _timing.paired_ms(rounds, iters, warmup=2, after_warmup=dist.barrier, **fns)
    return {k: 1e3 * v for k, v in t.items()}


def _entry(t: dict, nbytes: float) -> dict:
    ours, raw = t["ours"], t["raw"]
    return {
        "ours_us": ours,
        "raw_us": raw,
        "overhead_pct": 100.0 * (ours / raw - 1.0),
        "bytes": nbytes,
        "ours_GBps": nbytes / ours / 1e3,
        "raw_GBps": nbytes / raw / 1e3,
    }


# ------------------------------------------------------------------------------------ one rank
def _bench_rank(rank, world, workload: dict, rounds: int, iters: int, num_sms: int):
    from _baselines import raw_ht_combine, raw_ht_dispatch, raw_ll_combine, raw_ll_dispatch

    from epmoe import comm as epcomm
    from epmoe import ops
    from epmoe.comm import deepep

    H, Et, K = workload["hidden"], workload["experts"], workload["top_k"]
    T, T_ll = workload["ht_tokens"], workload["ll_tokens"]
    dev = torch.device("cuda", rank)
    g = torch.Generator(device=dev).manual_seed(SEED + rank)

    def routing(n):
        scores = torch.rand((n, Et), device=dev, generator=g)
        return scores.topk(K, dim=1).indices.contiguous(), torch.rand(
            (n, K), device=dev, generator=g
        )

    res = {}
    # ---------------------------------------------------------------------------------------- HT
    c = epcomm.create("deepep", dist.group.WORLD, Et, H, num_sms=num_sms)
    buf, (dcfg, ccfg) = c.buffer("ht"), c.ht_configs()
    x = torch.randn((T, H), device=dev, generator=g).bfloat16()
    xq, xs = ops.quantize(x, "fp8")
    ids, w = routing(T)
    for worst in (False, True):
        nw = world * T if worst else 0
        name = "worst" if worst else "exact"
        d = ops.ht_dispatch(xq, ids, w, c.key, x_scales=xs, worst_case=worst)
        n_recv = int((d.topk_ids >= 0).any(dim=1).sum())
        t = _paired_us(
            rounds,
            iters,
            ours=lambda worst=worst: ops.ht_dispatch(
                xq, ids, w, c.key, x_scales=xs, worst_case=worst
            ),
            raw=lambda nw=nw: raw_ht_dispatch(buf, dcfg, xq, xs, ids, w, Et, nw),
        )
        res[f"ht_dispatch_fp8_{name}"] = _entry(t, n_recv * (H + 4 * H / 128))
        y = torch.randn((d.x.shape[0], H), device=dev, generator=g).bfloat16()
        dh = d.handle
        raw_handle = (dh[1], dh[2], dh[3], dh[4], dh[0], dh[5])  # deep_ep's own order
        t = _paired_us(
            rounds,
            iters,
            ours=lambda y=y, dh=dh: ops.ht_combine(y, dh, c.key),
            raw=lambda y=y, rh=raw_handle: raw_ht_combine(buf, ccfg, y, rh),
        )
        res[f"ht_combine_bf16_{name}"] = _entry(t, n_recv * 2 * H)
        del d, y, dh, raw_handle
    # ---------------------------------------------------------------------------------------- LL
    cl = epcomm.create("deepep", dist.group.WORLD, Et, H, max_tokens_per_rank=T_ll)
    lbuf = cl.buffer("ll")
    xl = torch.randn((T_ll, H), device=dev, generator=g).bfloat16()
    ids_l, w_l = routing(T_ll)
    El, C = Et // world, world * T_ll
    y_l = torch.randn((El, C, H), device=dev, generator=g).bfloat16()  # stands for the experts

    def ours_pair():
        d = ops.ll_dispatch(xl, ids_l, cl.key, use_fp8=True)
        return ops.ll_combine(y_l, ids_l, w_l, d.handle, cl.key)

    def raw_pair():
        _, _, handle = raw_ll_dispatch(lbuf, xl, ids_l, T_ll, Et, True)
        return raw_ll_combine(lbuf, y_l, ids_l, w_l, handle)

    sel = int((ids_l >= 0).sum())
    ll_bytes = sel * (H + 4 * H / 128 + 16) + sel * 2 * H
    res["ll_eager_fp8"] = _entry(_paired_us(rounds, iters, ours=ours_pair, raw=raw_pair), ll_bytes)
    graphs = {}
    for k, fn in (("ours", ours_pair), ("raw", raw_pair)):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up pairs keep deep_ep's two LL buffers in step
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graphs[k] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[k]):
            fn()
    t = _paired_us(rounds, iters, ours=graphs["ours"].replay, raw=graphs["raw"].replay)
    res["ll_graph_fp8"] = _entry(t, ll_bytes)
    del graphs
    torch.cuda.synchronize()
    dist.barrier()
    deepep.release_buffers()
    return res


# ------------------------------------------------------------------------------------- driver
def run(workload: str = "W", rounds: int = 10, iters: int = 20, num_sms: int = 20) -> dict:
    """Benchmark on 2 GPUs; returns the JSON-able report (see the module docstring)."""
    import importlib.metadata as md

    cfg = WORKLOADS[workload]
    ranks = run_ranks(_bench_rank, 2, "nccl", cfg, rounds, iters, num_sms, timeout=1800.0)
    summary = {}
    for case in ranks[0]:
        per = [r[case] for r in ranks]
        slow = max(per, key=lambda e: e["ours_us"])
        summary[case] = dict(
            slow,
            overhead_pct=max(e["overhead_pct"] for e in per),
            target_overhead_pct=TARGET_OVERHEAD_PCT,
        )
    try:
        deep_ep_version = md.version("tokenspeed-deepep")
    except md.PackageNotFoundError:
        deep_ep_version = "unknown"
    return {
        "workload": dict(cfg, name=workload),
        "world_size": 2,
        "num_sms": num_sms,
        "rounds": rounds,
        "iters": iters,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "deep_ep": deep_ep_version,
        "summary": summary,
        "ranks": ranks,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON report path")
    p.add_argument("--workload", default="W", choices=sorted(WORKLOADS))
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--num-sms", type=int, default=20)
    args = p.parse_args(argv)
    report = run(args.workload, args.rounds, args.iters, args.num_sms)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    for case, e in report["summary"].items():
        print(
            f"{case:26s} ours {e['ours_us']:9.1f} us  raw {e['raw_us']:9.1f} us  "
            f"overhead {e['overhead_pct']:+6.2f} %  {e['ours_GBps']:7.1f} GB/s"
        )


if __name__ == "__main__":
    main()
