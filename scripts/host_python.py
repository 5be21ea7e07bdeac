"""Python host µs of one eager EPMoE call per path, on CPU, with every launch stubbed out.

The eager layer on a GPU is host-bound at small T: its time is the Python of the layer's glue and
of each stage's launch code, plus the launches and allocations themselves. This script measures
the first part on any machine: it runs the layer's direct-path chain (the stages' trusted entries,
as an eager CUDA call runs them) on CPU tensors with the Triton launches, the deep_gemm calls and
the device-side checks replaced by no-ops, and a CUDA-like backend choice (sm90, deep_gemm
present). Tensors live on the "meta" device: allocations cost their Python call only (CPU memory
would add malloc's cost, larger and less steady than the CUDA caching allocator's; a CUDA
`torch.empty` is ~0.7 µs on the H200 host, `diag_layer.txt`). Compare trees with it; confirm on
the GPU with `scripts/diag_layer.py`.

  python scripts/host_python.py [--iters 500] [--repeats 7] [--profile PATH]
"""

import argparse
import cProfile
import pstats
import time
from typing import Callable, Dict

import torch

from epmoe import _checks, _launch
from epmoe import layer as L
from epmoe.ops.gemm import _int8, _ops, _select

SHAPE = dict(num_experts=8, hidden_size=128, intermediate_size=128, top_k=8)  # (any shape)
CASES = tuple((q, path, t) for q in ("bf16", "fp8", "int8") for path, t in
              (("gemv", 1), ("ll", 32), ("ht", 32)))  # fmt: skip


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **meta: None


def stub_launches() -> None:
    """Every kernel launch and deep_gemm call becomes a no-op; the backend choice is sm90's with
    deep_gemm; direct launches assert in the kernel (no flag read back)."""
    _launch.kernel = _launch.direct = lambda k: _NoLaunch()
    _int8._launch_tuned = lambda *args, **kwargs: None  # (the autotuner's first call benchmarks)
    noop = lambda *a, **k: None  # noqa: E731
    _select._cap = lambda device: (9, 0)
    _select._deps.available = lambda name: True
    for cached in (_select._backend, _select.masked_row_block):  # (cached per process)
        getattr(cached, "cache_clear", lambda: None)()
    fns = {role: noop for role in _select._DG_NAMES}
    _select._dg_functions = _ops._dg_functions = lambda: fns
    tracing = _checks._tracing
    wrapped = torch._library.triton.is_wrap_triton_enabled
    _checks.direct_launch = lambda t: not tracing(t) and not wrapped()


def build(quant: str):
    layer = L.EPMoE(**SHAPE, quant=quant, mode="auto", device="cpu", max_tokens_per_rank=32)
    E, H, I = SHAPE["num_experts"], SHAPE["hidden_size"], SHAPE["intermediate_size"]
    g = torch.Generator().manual_seed(0)
    layer.load_weights(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g))
    return layer


def call_of(layer, path: str, tokens: int) -> Callable[[], object]:
    """One eager call as forward() runs it on the direct path: the boundary check, then the path."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, layer.hidden_size, generator=g).bfloat16().to("meta")
    ids = torch.randint(0, layer.num_experts, (tokens, layer.top_k), generator=g).to("meta")
    w = torch.rand(tokens, layer.top_k, generator=g).to("meta")
    run = {"gemv": layer._forward_gemv, "ll": layer._forward_ll, "ht": layer._forward_ht}[path]
    args = (x, ids, w, layer.hidden_size, layer.top_k, layer.device)
    ok, st = L.FORWARD.ok, L._TRUSTED

    def call():
        ok(*args)
        return run(st, x, ids, w)

    return call


def best_us(fn: Callable[[], object], iters: int, repeats: int) -> float:
    for _ in range(min(iters, 100)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
    return best


def main(argv=None) -> Dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--profile", default=None, help="write a cProfile of the fp8 LL call here")
    a = p.parse_args(argv)
    stub_launches()
    out = {}
    for quant, path, tokens in CASES:
        call = call_of(build(quant), path, tokens)
        out[f"{quant} {path} T={tokens}"] = best_us(call, a.iters, a.repeats)
        if a.profile and (quant, path) == ("fp8", "ll"):
            prof = cProfile.Profile()
            prof.runcall(best_us, call, a.iters, 1)
            pstats.Stats(prof).dump_stats(a.profile)
    out["torch.empty (meta)"] = best_us(
        lambda: torch.empty((8, 32, 128), dtype=torch.bfloat16, device="meta"), a.iters, a.repeats
    )
    for name, us in out.items():
        print(f"{name:22s} {us:7.1f} us")
    return out


if __name__ == "__main__":
    main()
