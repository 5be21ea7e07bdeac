"""GPU diagnostics of the compiled layer: where a torch.compile'd layer call spends its time
(prints; no files). For each case, the torch.profiler table of repeated calls of the layer under
``torch.compile`` (default mode) and ``mode="reduce-overhead"``, and of the eager layer: host
self time per op and device time per kernel, and the launches per call. With ``--host``, instead:
host µs per call of the eager and the compiled layer (the GPU kept busy behind a sleep kernel, so
no call waits for it; torch.profiler's per-event cost would hide the difference) and a cProfile
of those calls (top functions by self time).

    PYTHONPATH=. python scripts/diag_compile.py [--tokens 32] [--cases fp8:ht,int8:ht,...] [--host]
"""

import argparse
import cProfile
import io
import pstats
import time

import torch
from diag_layer import _layer  # (scripts/ is on sys.path when run as a script)
from torch.profiler import ProfilerActivity, profile

QWEN3 = dict(H=2048, I=768, E=128, K=8)


def _table(fn, n=20, rows=14):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    kernels = sum(e.count for e in ka if e.device_type == torch.autograd.DeviceType.CUDA)
    host = ka.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70)
    dev = ka.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70)
    return kernels / n, host, dev


def _host(fn, calls=40, repeats=7, rows=25):
    """Host µs per call (median of ``repeats`` passes behind a GPU sleep) and a cProfile of one
    more such pass."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    vals = []
    for _ in range(repeats):
        torch.cuda._sleep(200_000_000)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        vals.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    torch.cuda._sleep(200_000_000)
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(rows)
    return sorted(vals)[len(vals) // 2], buf.getvalue()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--cases", default="fp8:ht,int8:ht,bf16:ll,fp8:ll,int8:ll")
    p.add_argument("--host", action="store_true", help="host µs and cProfile, no torch.profiler")
    a = p.parse_args()
    for case in a.cases.split(","):
        quant, mode = case.split(":")
        layer, args = _layer(quant, mode, T=a.tokens, **QWEN3)
        layer.warmup([a.tokens])
        for name in ("default", "eager") if a.host else ("default", "reduce-overhead", "eager"):
            torch._dynamo.reset()
            fn = layer if name == "eager" else torch.compile(layer, mode=name, fullgraph=True)
            if a.host:
                us, table = _host(lambda fn=fn, args=args: fn(*args))
                print(f"=== {quant} {mode} T={a.tokens} {name}: host {us:.1f} us/call")
                print(table)
                continue
            try:
                launches, host, dev = _table(lambda fn=fn, args=args: fn(*args))
            except Exception as e:  # noqa: BLE001
                print(f"=== {quant} {mode} T={a.tokens} {name}: failed {e!r}")
                continue
            print(f"=== {quant} {mode} T={a.tokens} {name}: {launches:.1f} kernels/call")
            print(host)
            if name != "eager":
                print(dev)
        del layer
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
