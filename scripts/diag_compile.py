"""GPU diagnostics of the compiled layer: where a torch.compile'd layer call spends its time
(prints; no files). For each case, the torch.profiler table of repeated calls of the layer under
``torch.compile`` (default mode) and ``mode="reduce-overhead"``, and of the eager layer: host
self time per op and device time per kernel, and the launches per call. With ``--host``, instead:
host µs per call of the eager and the compiled layer (the GPU kept busy behind a sleep kernel, so
no call waits for it; torch.profiler's per-event cost would hide the difference), the compiled
call split into Dynamo's frame and the code it calls, a GEMM op call through the dispatcher
against the eager chain's, torch.compile's fixed cost on a one-kernel function, and cProfiles.

    PYTHONPATH=. python scripts/diag_compile.py [--tokens 32] [--cases fp8:ht,int8:ht,...] [--host]
"""

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import torch
from diag_layer import _layer  # (scripts/ is on sys.path when run as a script)
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _timing import host_us  # noqa: E402  (host µs per call, the GPU kept busy)

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


def _cprofile(fn, calls=40, rows=22):
    """cProfile of ``calls`` calls behind a GPU sleep: per-function µs per call (self, with
    callees), top ``rows`` by self time (cProfile's own cost inflates Python-heavy rows)."""
    prof = cProfile.Profile()
    torch.cuda._sleep(200_000_000)
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof).stats
    out = ["    self µs   total µs  calls  function"]
    top = sorted(st.items(), key=lambda kv: -kv[1][2])[:rows]  # (by self time)
    for (file, line, name), (_, nc, tt, ct, _) in top:
        where = f"{file.split('site-packages/')[-1].removeprefix(str(ROOT) + '/')}:{line}({name})"
        out.append(f"{tt / calls * 1e6:11.1f}{ct / calls * 1e6:11.1f}{nc / calls:7.1f}  {where}")
    return "\n".join(out)


def _capturing_backend(holder):
    """Inductor (default mode) that keeps its compiled callable and the graph's first inputs:
    calling those directly times the AOT wrapper + Inductor's code without Dynamo's frame."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        inner = compile_fx(gm, example_inputs)

        def run(*args):
            holder.setdefault("args", args)
            return inner(*args)

        holder["inner"] = inner
        return run

    return backend


def _host_case(layer, args, quant, mode, tokens):
    """Host µs of the eager and the compiled layer call and where the compiled call's time goes."""
    from epmoe import layer as L

    eager = host_us(lambda: layer(*args))
    holder = {}
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=_capturing_backend(holder), fullgraph=True)
    full = host_us(lambda: compiled(*args))
    inner = host_us(lambda: holder["inner"](*holder["args"]))
    print(f"=== {quant} {mode} T={tokens}: host µs per call: eager {eager:.1f}, compiled (default) "
          f"{full:.1f} = Dynamo frame + guards {full - inner:.1f} + AOT wrapper and Inductor's "
          f"code {inner:.1f}")  # fmt: skip
    if mode == "ll" and args[0].is_cuda:
        st, b, E, C = L._TRUSTED, layer._buffers, layer.num_local_experts, layer.ll_capacity
        a, s, mm, _ = st.ll_scatter(
            args[0], args[1], E, C, quant, scale_layout=layer._scale_layout()
        )
        s = s if quant != "bf16" else None
        em = layer.expected_m()
        op = torch.ops.epmoe.grouped_gemm_masked.default
        w, ws = b["w1"], b["w1_scale"]
        us_op = host_us(lambda: op(a, w, mm, s, ws, em, True))
        us_st = host_us(lambda: st.grouped_gemm_masked(a, w, mm, s, ws, em, True))
        print(f"    GEMM1 through the dispatcher (as the compiled graph calls it) {us_op:.1f} µs, "
              f"the eager chain's trusted call {us_st:.1f} µs")  # fmt: skip
    print("--- compiled, cProfile:")
    print(_cprofile(lambda: compiled(*args)))
    print("--- eager, cProfile:")
    print(_cprofile(lambda: layer(*args)))
    torch._dynamo.reset()


def _torch_floor():
    """Host µs of torch.compile's fixed cost: a compiled one-kernel function against eager."""
    x = torch.randn(32, 2048, device="cuda")
    torch._dynamo.reset()
    f = torch.compile(lambda t: t + 1, fullgraph=True)
    print(f"=== x + 1 ([32, 2048] fp32): host µs per call: eager {host_us(lambda: x + 1):.1f}, "
          f"compiled (default) {host_us(lambda: f(x)):.1f}")  # fmt: skip
    torch._dynamo.reset()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--cases", default="fp8:ht,int8:ht,bf16:ll,fp8:ll,int8:ll")
    p.add_argument("--host", action="store_true", help="host µs and cProfile, no torch.profiler")
    a = p.parse_args()
    if a.host:
        import torch._inductor.config as ic

        flag = getattr(ic, "static_launch_user_defined_triton_kernels", None)
        print(f"Inductor static_launch_user_defined_triton_kernels: {flag}")
        _torch_floor()
    for case in a.cases.split(","):
        quant, mode = case.split(":")
        layer, args = _layer(quant, mode, T=a.tokens, **QWEN3)
        layer.warmup([a.tokens])
        if a.host:
            _host_case(layer, args, quant, mode, a.tokens)
            del layer
            torch.cuda.empty_cache()
            continue
        for name in ("default", "reduce-overhead", "eager"):
            torch._dynamo.reset()
            fn = layer if name == "eager" else torch.compile(layer, mode=name, fullgraph=True)
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
