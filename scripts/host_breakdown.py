"""Host µs of the pieces of an eager public op call on this machine (one GPU): where the
public - raw overhead of benchmarks/test_bench_overhead.py goes. Not a test; prints / writes JSON.

Each piece runs N times in a tight loop (timeit, best of 5), with the GPU drained between
repeats, so the numbers are the host's best case for that piece, for comparing pieces with each
other and with the same pieces on another host.

  PYTHONPATH=.:benchmarks python3 scripts/host_breakdown.py --out host.json
"""

import argparse
import importlib
import json
import sys
import timeit

import torch

sys.path.insert(0, "benchmarks")
import _configs  # noqa: E402

from epmoe import _checks, _eager, reference  # noqa: E402
from epmoe.ops import gemm, permute  # noqa: E402

P = importlib.import_module("epmoe.ops.permute")
G = importlib.import_module("epmoe.ops.gemm._ops")
GV = importlib.import_module("epmoe.ops.gemm._validate")
CFG = _configs.CONFIGS["small"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="host.json")
    ap.add_argument("--number", type=int, default=2000)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    E, H, T = CFG.local_experts, CFG.hidden, CFG.decode_capacity
    x = torch.randn((T, H), generator=gen).to(torch.bfloat16).cuda()
    ids = _configs.received_routing(CFG, T, gen).cuda()
    xq, xs = reference.quantize(x, "fp8")
    y3 = torch.randn((E, T, H), generator=gen).to(torch.bfloat16).cuda()
    a8, a8s = reference.quantize(y3, "int8")
    w8, w8s = reference.quantize_weights(torch.randn((E, H, H), generator=gen), "int8")
    w8, w8s = w8.cuda(), w8s.cuda()
    mm = _configs.decode_masked_m(CFG, gen).cuda()
    ones = torch.ones(1024, device="cuda")
    A = CFG.alignment

    def nothing():
        pass

    pieces = {
        "empty python call": nothing,
        "x + x": lambda: ones + ones,
        "is_compiling": torch.compiler.is_compiling,
        "len torch function stack": torch._C._len_torch_function_stack,
        "len torch dispatch stack": torch._C._len_torch_dispatch_stack,
        "profiler enabled": torch.autograd._profiler_enabled,
        "functorch active": torch._C._are_functorch_transforms_active,
        "t.is_cuda": lambda: xq.is_cuda,
        "t.requires_grad": lambda: xq.requires_grad,
        "t.shape": lambda: xq.shape,
        "t.get_device()": lambda: xq.get_device(),
        "_eager.plain (3 tensors)": lambda: _eager.plain(xq, ids, xs),
        "_eager.run(no-op)": lambda: _eager.run(nothing),
        "permute direct check": lambda: P.CONTRACT.direct(xq, ids, E, A, xs, "deepgemm"),
        "PermuteResult(...)": lambda: P.PermuteResult(xq, xs, ids, ids, ids),
        "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "_checks._tracing": lambda: _checks._tracing(xq),
        "torch.empty (1 tensor)": lambda: torch.empty((64,), dtype=torch.int32, device="cuda"),
        "permute raw (_permute_triton)": lambda: _eager.run(
            P._permute_triton, xq, ids, E, A, xs, "deepgemm"
        ),
        "permute _permute_impl": lambda: _eager.run(P._permute_impl, xq, ids, E, A, xs, "deepgemm"),
        "permute public": lambda: permute(xq, ids, E, A, xs, "deepgemm"),
        "gemm int8 masked direct check": lambda: GV.MASKED.direct(a8, w8, mm, a8s, w8s),
        "gemm int8 masked raw": lambda: _eager.run(G._masked_cuda_impl, a8, w8, mm, a8s, w8s, 0),
        "gemm int8 masked public": lambda: gemm.grouped_gemm(
            a8, w8, masked_m=mm, a_scales=a8s, w_scales=w8s
        ),
    }
    LAUNCHING = {n for n in pieces if n.endswith(("raw", "public", "_permute_impl", "x + x"))}
    LAUNCHING |= {"permute raw (_permute_triton)"}
    out = {"gpu": torch.cuda.get_device_name(), "number": args.number, "us": {}}
    for name, fn in pieces.items():
        for _ in range(20):
            fn()
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            # launching pieces: 200 calls a repeat, well below the launch queue's depth
            n = 200 if name in LAUNCHING else args.number
            best = min(best, timeit.timeit(fn, number=n) / n * 1e6)
        out["us"][name] = round(best, 3)
        print(f"{name:36s} {best:8.3f} us", flush=True)
    torch.cuda.synchronize()
    # the same calls interleaved with their kernel launches, as the overhead benchmark times them
    # (per-iteration differences against raw, medians): each layer of the public path in turn
    from test_bench_overhead import host_us

    perm_args = (xq, ids, E, A, xs, "deepgemm")
    gemm_args = (a8, w8, mm, a8s, w8s, 0)
    layers = {
        "permute": dict(
            raw=lambda: _eager.run(P._permute_triton, *perm_args),
            impl=lambda: _eager.run(P._permute_impl, *perm_args),
            direct_impl=lambda: (
                _eager.direct(xq, ids, xs) and _eager.run(P._permute_impl, *perm_args)
            ),
            public=lambda: permute(*perm_args),
        ),
        "gemm int8 masked": dict(
            raw=lambda: _eager.run(G._masked_cuda_impl, *gemm_args),
            impl=lambda: GV.MASKED.check(a8, w8, mm, a8s, w8s) or G._masked_cuda(*gemm_args),
            direct_impl=lambda: _eager.direct(a8, w8, mm, a8s, w8s) and G._masked_cuda(*gemm_args),
            public=pieces["gemm int8 masked public"],
        ),
    }
    out["interleaved"] = {}
    for name, fns in layers.items():
        res = host_us(**fns)
        out["interleaved"][name] = res
        print(name, {k: round(v, 2) for k, v in res.items()}, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
