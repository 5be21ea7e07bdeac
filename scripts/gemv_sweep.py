"""The per-choice GEMV path (epmoe.ops.gemv) on one GPU: launch configs and its crossover with LL.

    PYTHONPATH=.:benchmarks python scripts/gemv_sweep.py --out sweep.jsonl [--shapes qwen3-30b-a3b,
        dsv3-1gpu] [--schemes bf16,fp8,int8] [--tokens 1,2,4,8,16] [--sweep-tokens 1,4]
        [--budget-s 400]

Per shape (``_configs.CONFIGS``) and scheme, random weights in the layout the layer keeps, uniform
random top-k routing (seeded): at each ``--sweep-tokens`` T, each kernel alone under each of the
module's candidate configs that fits (``gemv.fits``; CUDA-graph replay, L2 flushed, median); then
at each ``--tokens`` T the two GEMVs with the best configs against the layer's LL path
(``mode="ll"``, ``max_tokens_per_rank=T``, same weights) and the read of the touched experts'
weights at the copy bandwidth of the run (``scripts/tune_gemm.py --layouts gemv_up,gemv_down``
keeps the best configs in the tuned table). One JSON line per measurement; a table at the end.
"""

import argparse
import itertools
import json
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import _configs  # noqa: E402
import _timing  # noqa: E402

import epmoe  # noqa: E402
from epmoe import quant, reference  # noqa: E402
from epmoe.ops import gemv  # noqa: E402

DT = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def weights(E, N, Kd, scheme, gen):
    """Random weights `[E, N, Kd]` and scales in the layer's layout (quantized-looking codes)."""
    dev = "cuda"
    w = torch.empty((E, N, Kd), dtype=DT[scheme], device=dev)
    for e in range(E):  # per expert: no float32 copy of the whole tensor
        v = torch.randn((N, Kd), device=dev, generator=gen) * (0.02 if scheme == "bf16" else 60)
        w[e] = v.clamp(-127, 127).to(DT[scheme]) if scheme == "int8" else v.to(DT[scheme])
    if scheme == "fp8":
        s = torch.rand((E, N // 128, Kd // 128), device=dev, generator=gen) * 1e-3
    elif scheme == "int8":
        s = torch.rand((E, N), device=dev, generator=gen) * 1e-3
    else:
        s = None
    return w, s


def routing(T, E, K, gen):
    probs = torch.rand((T, E), device="cuda", generator=gen)
    w, ids = probs.topk(K, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).float()


def _pair(x, ids, tw, w1, s1, w2, s2, hidden):
    return gemv.gemv_down(gemv.gemv_gate_up(x, ids, w1, s1), ids, tw, w2, s2, hidden=hidden)


def emit(f, rec):
    line = json.dumps(rec)
    print(line, flush=True)
    f.write(line + "\n")
    f.flush()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="qwen3-30b-a3b,dsv3-1gpu")
    ap.add_argument("--schemes", default="bf16,fp8,int8")
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--sweep-tokens", default="1,4")
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args(argv)
    t0 = time.time()
    copy_gbps = max(_timing.copy_timings().values())
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    with open(a.out, "w") as f:
        emit(f, dict(kind="env", gpu=torch.cuda.get_device_name(), copy_gbps=copy_gbps,
                     torch=torch.__version__))  # fmt: skip
        for shape, scheme in itertools.product(a.shapes.split(","), a.schemes.split(",")):
            if time.time() - t0 > a.budget_s:
                emit(f, dict(kind="skipped", shape=shape, scheme=scheme))
                continue
            cfg = _configs.CONFIGS[shape]
            E, H, I, K = cfg.num_experts, cfg.hidden, cfg.intermediate, cfg.top_k
            # weights zero-padded as the layer keeps them (fp8: H, I multiples of 128); x of H
            of = quant.get(scheme).size_multiple
            Hp, Ip = reference.round_up(H, of), reference.round_up(I, of)
            w1, s1 = weights(E, 2 * Ip, Hp, scheme, gen)
            w2, s2 = weights(E, Hp, Ip, scheme, gen)
            per_expert = (3 * Hp * Ip) * w1.element_size()
            best = {}
            for T in [int(t) for t in a.sweep_tokens.split(",")]:
                x = torch.randn((T, H), device="cuda", generator=gen).bfloat16()
                ids, tw = routing(T, E, K, gen)
                h = gemv.gemv_gate_up(x, ids, w1, s1)
                down = partial(gemv._gemv_down_triton, h, ids, tw, w2, s2, False, None, H)
                up_fn = partial(gemv._gemv_gate_up_triton, x, ids, w1, s1, False)
                for up, grid, fn in (
                    (True, gemv.UP_CANDIDATES, up_fn),
                    (False, gemv.DOWN_CANDIDATES, down),
                ):
                    part_bytes = T * K * (2 if up else 1) * Hp * Ip * w1.element_size()
                    field = gemv.field_name("up" if up else "down", scheme, T)
                    for vals in grid:
                        if not gemv.fits("up" if up else "down", scheme, vals, Hp if up else Ip, K):
                            continue
                        over = {field: vals if up else (*vals, K)}
                        with gemv.override(**over):
                            try:
                                ms = _timing.time_cuda(fn, iters=a.iters).ms
                            except Exception as e:  # a config that does not compile / launch
                                emit(f, dict(kind="error", over=over, error=repr(e)[:300]))
                                continue
                        emit(f, dict(kind="config", shape=shape, scheme=scheme, T=T,
                                     kernel="up" if up else "down", over=over, ms=ms,
                                     gbps=part_bytes / ms / 1e6))  # fmt: skip
                        key = (T, up)
                        if key not in best or ms < best[key][1]:
                            best[key] = (over, ms)
            conf = {}  # per field (one token / several), the best at the smallest swept T
            for _key, (over, _) in sorted(best.items(), key=lambda kv: -kv[0][0]):
                conf.update(over)
            emit(f, dict(kind="best", shape=shape, scheme=scheme, best={str(k): v for k, v in
                                                                        best.items()}))  # fmt: skip
            ll = None
            for T in [int(t) for t in a.tokens.split(",")]:
                x = torch.randn((T, H), device="cuda", generator=gen).bfloat16()
                ids, tw = routing(T, E, K, gen)
                hit = int(torch.unique(ids).numel())
                floor_ms = hit * per_expert / (copy_gbps * 1e6)
                pair = partial(_pair, x, ids, tw, w1, s1, w2, s2, H)
                with gemv.override(**conf):
                    g_ms = _timing.time_cuda(pair, iters=a.iters).ms
                g_def = _timing.time_cuda(pair, iters=a.iters).ms
                ll = epmoe.EPMoE(E, H, I, K, quant=scheme, mode="ll", backend="local",
                                 max_tokens_per_rank=T, device="cuda")  # fmt: skip
                ll.w1, ll.w1_scale, ll.w2, ll.w2_scale = w1, s1, w2, s2
                ll.warmup([T])
                l_ms = _timing.time_cuda(partial(ll, x, ids, tw), iters=a.iters).ms
                rec = dict(kind="crossover", shape=shape, scheme=scheme, T=T, experts_hit=hit,
                           gemv_best_ms=g_ms, gemv_default_ms=g_def, ll_ms=l_ms,
                           floor_ms=floor_ms, config=conf)  # fmt: skip
                emit(f, rec)
                rows.append(rec)
            del w1, w2, s1, s2, ll
            torch.cuda.empty_cache()
    print("\nshape scheme T | gemv best / default | ll | floor (ms)")
    for r in rows:
        print(f"{r['shape']} {r['scheme']} {r['T']} | {r['gemv_best_ms']:.4f} / "
              f"{r['gemv_default_ms']:.4f} | {r['ll_ms']:.4f} | {r['floor_ms']:.4f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
