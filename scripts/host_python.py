"""Python host µs of one eager EPMoE call per path, on CPU, with every launch stubbed out.

The eager layer on a GPU is host-bound at small T: its time is the Python of the layer's glue and
of each stage's launch code, plus the launches and allocations themselves. This script measures
the first part on any machine: it runs the layer's direct-path chain (the stages' trusted entries,
as an eager CUDA call runs them) on CPU tensors with the Triton launches, the deep_gemm calls and
the device-side checks replaced by no-ops, and a CUDA-like backend choice (sm90, deep_gemm
present). Tensors live on the "meta" device: allocations cost their Python call only (CPU memory
would add malloc's cost, larger and less steady than the CUDA caching allocator's; a CUDA
`torch.empty` took 0.7 to 3.4 µs on the H200 host, by session). Compare trees with it; confirm on
the GPU with ``--device cuda``.

With ``--stages`` it also prints each stage's trusted call (the chain's entries, one at a time).
With ``--device cuda`` nothing is stubbed: the same calls launch for real on the GPU (kept busy
behind a sleep kernel, so no call waits), which splits a call's host time into its Python (the
stubbed figure) and its launches (the difference).

With ``--against DIR`` (another checkout, e.g. ``git worktree add /tmp/base REV``) each tree's
own copy of this script runs in its own process, the two alternating for ``--rounds`` rounds with
the same options; it prints each case's best µs per tree and their ratio (trees compare within one
run only: the host's speed moves between runs).

  python scripts/host_python.py [--iters 500] [--repeats 7] [--profile PATH] [--stages]
                                [--device cpu|cuda] [--tokens 32] [--shape tiny|qwen3]
                                [--quant bf16,fp8,int8] [--against DIR [--rounds 3]]
"""

import argparse
import cProfile
import functools
import importlib
import os
import pathlib
import pstats
import subprocess
import sys
import time
from typing import Callable, Dict, List

import torch

from epmoe import _checks, _eager, _launch
from epmoe import layer as L
from epmoe.ops.gemm import _ops, _select, _triton

SHAPE = dict(num_experts=8, hidden_size=128, intermediate_size=128, top_k=8)  # (any shape)
QWEN3 = dict(num_experts=128, hidden_size=2048, intermediate_size=768, top_k=8)  # (--shape qwen3)
CASES = tuple((q, path, t) for q in ("bf16", "fp8", "int8") for path, t in
              (("gemv", 1), ("ll", 32), ("ht", 32)))  # fmt: skip


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **meta: None


def stub_launches() -> None:
    """Every kernel launch and deep_gemm call becomes a no-op, on a :func:`cuda_like_host`."""
    _launch.kernel = _launch.direct = lambda k: _NoLaunch()
    _launch.Prepared.__call__ = lambda self, *tensors: None
    _triton._launch_plan = lambda *args, **kwargs: None  # (the autotuner's first call benchmarks)
    cuda_like_host()


def cuda_like_host() -> None:
    """CPU tensors take the CUDA chain: the backend choice is sm90's with deep_gemm (its calls
    no-ops), an H200's multiprocessors, and direct launches assert in the kernel (no flag read
    back). Launches themselves are left as they are."""
    noop = lambda *a, **k: None  # noqa: E731
    _select._cap = lambda device: (9, 0)
    _launch._pdl_device = lambda dev: True  # (sm90's: kernels with PDL launch with it)
    _select._deps.available = lambda name: True
    importlib.import_module("epmoe.ops.permute")._sm_count = lambda index: 132  # (H200's)
    for cached in (_select._backend, _select.masked_row_block):  # (cached per process)
        getattr(cached, "cache_clear", lambda: None)()
    fns = {role: noop for role in _select._DG_NAMES}
    fns["alignment"] = lambda: 128  # (deep_gemm's contiguous row block)
    _select._dg_functions = _ops._dg_functions = lambda: fns
    tracing = _checks._tracing
    wrapped = torch._library.triton.is_wrap_triton_enabled
    _checks.direct_launch = lambda t: not tracing(t) and not wrapped()


def build(quant: str, device: str = "cpu", shape: Dict[str, int] = SHAPE, tokens: int = 32):
    layer = L.EPMoE(**shape, quant=quant, mode="auto", device=device,
                    max_tokens_per_rank=max(tokens, 32))  # fmt: skip
    E, H, I = shape["num_experts"], shape["hidden_size"], shape["intermediate_size"]
    g = torch.Generator().manual_seed(0)
    layer.load_weights(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g))
    return layer


def inputs(layer, tokens: int):
    """(x, topk_ids, topk_weights) on "meta" (CPU layer) or the layer's CUDA device."""
    g = torch.Generator().manual_seed(1)
    dev = "meta" if layer.device.type == "cpu" else layer.device
    x = torch.randn(tokens, layer.hidden_size, generator=g).bfloat16().to(dev)
    ids = torch.stack([torch.randperm(layer.num_experts, generator=g)[: layer.top_k]
                       for _ in range(tokens)]).to(dev)  # fmt: skip
    w = torch.rand(tokens, layer.top_k, generator=g).to(dev)
    return x, ids, w


def call_of(layer, path: str, tokens: int) -> Callable[[], object]:
    """One eager call as forward() runs it on the direct path: the boundary check, then the path."""
    x, ids, w = inputs(layer, tokens)
    run = {"gemv": layer._forward_gemv, "ll": layer._forward_ll, "ht": layer._forward_ht}[path]
    if path == "ll":  # (its expected rows per expert: what forward's per-size plan holds)
        run = functools.partial(layer._forward_ll, em=layer.expected_m(tokens))
    args = (x, ids, w, layer.hidden_size, layer.top_k, layer.device)
    ok, st = L.FORWARD.ok, L._TRUSTED

    def call():
        ok(*args)
        with _eager.no_wrap(), _eager.on_device(x):  # (as forward's direct path)
            return run(st, x, ids, w)

    return call


def stage_calls(layer, tokens: int) -> Dict[str, Callable[[], object]]:
    """Each stage's trusted call as the chains run it, on inputs of the right shapes."""
    st, b, q = L._TRUSTED, layer._buffers, layer.quant
    x, ids, w = inputs(layer, tokens)
    dev, E, C = x.device, layer.num_local_experts, layer.ll_capacity
    lay = layer._scale_layout
    I2, H = 2 * layer.intermediate_size, layer.hidden_size
    xq, xs = st.quantize(x, q) if q != "bf16" else (x, None)
    p = st.permute(xq, ids, E, layer.alignment, xs, scale_layout=lay)
    pkw = dict(m_indices=p.m_indices, expert_offsets=p.expert_offsets)
    ckw = dict(pkw, trusted=True, alignment=layer.alignment)  # (as _experts_ht calls them)
    yp1 = torch.zeros(p.x.shape[0], I2, dtype=torch.bfloat16, device=dev)
    hp, hps = layer._act(st, yp1, **pkw)
    yp2 = torch.zeros(p.x.shape[0], H, dtype=torch.bfloat16, device=dev)
    out = {
        "permute": lambda: st.permute(xq, ids, E, layer.alignment, xs, scale_layout=lay),
        "ht gemm1": lambda: st.grouped_gemm_contiguous(
            p.x, b["w1"], a_scales=p.x_scales, w_scales=b["w1_scale"], **ckw
        ),
        "ht act": lambda: layer._act(st, yp1, **pkw),
        "ht gemm2": lambda: st.grouped_gemm_contiguous(
            hp, b["w2"], a_scales=hps, w_scales=b["w2_scale"], **ckw
        ),
        "unpermute": lambda: st.unpermute(yp2, p.inv_perm, w),
    }
    if q != "bf16":
        out["quantize"] = lambda: st.quantize(x, q)
    if tokens > layer.ll_max_tokens:  # (past the LL capacity: HT stages only)
        return _direct(out, x)
    a, s, mm, rows = st.ll_scatter(x, ids, E, C, q, scale_layout=lay)
    s = s if q != "bf16" else None
    kw = dict(masked_m=mm, expected_m=layer.expected_m(tokens), trusted=True)
    gm = st.grouped_gemm_masked
    y1 = torch.zeros(E, C, I2, dtype=torch.bfloat16, device=dev)
    h, hs = layer._act(st, y1, mm)
    y2 = torch.zeros(E, C, H, dtype=torch.bfloat16, device=dev)
    out.update({
        "ll_scatter": lambda: st.ll_scatter(x, ids, E, C, q, scale_layout=lay),
        "ll gemm1": lambda: gm(a, b["w1"], a_scales=s, w_scales=b["w1_scale"], **kw),
        "ll act": lambda: layer._act(st, y1, mm),
        "ll gemm2": lambda: gm(h, b["w2"], a_scales=hs, w_scales=b["w2_scale"], **kw),
        "ll_gather": lambda: st.ll_gather(y2, rows, w),
    })  # fmt: skip
    return _direct(out, x)


def _direct(calls: Dict[str, Callable[[], object]], x) -> Dict[str, Callable[[], object]]:
    """Each call as the layer's direct path makes it: wrap_triton off, x's device current."""

    def direct(fn):
        def call():
            with _eager.no_wrap(), _eager.on_device(x):
                return fn()

        return call

    return {name: direct(fn) for name, fn in calls.items()}


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


def _busy_us(fn: Callable[[], object], iters: int, repeats: int) -> float:
    """best_us on the GPU: each pass behind a sleep kernel long enough that no launch waits (at
    most 100 calls a pass: more would fill the launch queue, and the host would wait for it)."""
    iters = min(iters, 100)
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda._sleep(int(1e8))
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
        torch.cuda.synchronize()
    return best


def run_tree(tree: pathlib.Path, args: List[str]) -> Dict[str, float]:
    """{case: µs} of ``tree``'s own copy of this script, run with ``args`` in a process whose
    import path starts at ``tree`` (the rest of PYTHONPATH kept: e.g. the wheels' site dir)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
    res = subprocess.run([sys.executable, "scripts/host_python.py", *args], cwd=tree, env=env,
                         capture_output=True, text=True, check=False)  # fmt: skip
    if res.returncode:
        raise RuntimeError(f"host_python in {tree} failed:\n{res.stderr[-2000:]}")
    rows = (line.rsplit(None, 2) for line in res.stdout.splitlines() if line.endswith(" us"))
    return {name: float(us) for name, us, _ in rows}


def compare(against: str, rounds: int, args: List[str]) -> Dict[str, Dict[str, float]]:
    """Best µs per case of ``against`` ("base") and this tree ("this"), alternating processes."""
    trees = {"base": pathlib.Path(against).resolve(), "this": pathlib.Path(__file__).parents[1]}
    best: Dict[str, Dict[str, float]] = {name: {} for name in trees}
    for r in range(rounds):
        for name, tree in trees.items():
            for case, us in run_tree(tree, args).items():
                best[name][case] = min(us, best[name].get(case, float("inf")))
                # (each process's figures on stderr as they come: a cut run keeps them)
                print(f"round {r + 1} {name:4s} {case:22s} {us:7.1f}", file=sys.stderr, flush=True)
    print(f"{'case':22s} {'base':>7s} {'this':>7s}  this/base   (best of {rounds} rounds)")
    for case in best["this"]:
        if case in best["base"]:
            b, t = best["base"][case], best["this"][case]
            print(f"{case:22s} {b:7.1f} {t:7.1f}  {t / b:9.3f}")
    return best


def _passed_on(argv: List[str]) -> List[str]:
    """The options both trees run with: all but --against / --rounds / --profile (and values)."""
    drop, out, skip = ("--against", "--rounds", "--profile"), [], False
    for v in argv:
        if skip:
            skip = False
        elif v in drop:
            skip = True
        elif not v.startswith(tuple(d + "=" for d in drop)):
            out.append(v)
    return out


def main(argv=None) -> Dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--profile", default=None, help="write a cProfile of the fp8 LL call here")
    p.add_argument("--stages", action="store_true", help="each stage's trusted call too")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: real launches")
    p.add_argument("--tokens", type=int, default=32, help="T of the LL and HT cases")
    p.add_argument("--shape", default="tiny", choices=("tiny", "qwen3"))
    p.add_argument("--quant", default="bf16,fp8,int8", help="comma-separated schemes")
    p.add_argument("--against", default=None, help="another checkout: both trees, alternating")
    p.add_argument("--rounds", type=int, default=3, help="with --against: rounds per tree")
    a = p.parse_args(argv)
    if a.against:
        return compare(a.against, a.rounds, _passed_on(sys.argv[1:] if argv is None else argv))
    shape = QWEN3 if a.shape == "qwen3" else SHAPE
    cases = [(q, path, t if path == "gemv" else a.tokens) for q, path, t in CASES
             if q in a.quant.split(",")]  # fmt: skip
    if a.device == "cpu":
        stub_launches()
        timed = best_us
    else:
        timed = lambda fn, iters, repeats: _busy_us(fn, iters, repeats)  # noqa: E731
    out = {}
    for quant, path, tokens in cases:
        layer = build(quant, a.device, shape, a.tokens)
        if path == "ll" and tokens > layer.ll_max_tokens:
            continue
        call = call_of(layer, path, tokens)
        out[f"{quant} {path} T={tokens}"] = timed(call, a.iters, a.repeats)
        if a.stages and path == "ht":
            for name, fn in stage_calls(layer, tokens).items():
                out[f"{quant} {name} T={tokens}"] = timed(fn, a.iters, a.repeats)
        if a.profile and (quant, path) == ("fp8", "ll"):
            prof = cProfile.Profile()
            prof.runcall(best_us, call, a.iters, 1)
            pstats.Stats(prof).dump_stats(a.profile)
    dev = "meta" if a.device == "cpu" else a.device
    out[f"torch.empty ({dev})"] = timed(
        lambda: torch.empty((8, 32, 128), dtype=torch.bfloat16, device=dev), a.iters, a.repeats
    )
    for name, us in out.items():
        print(f"{name:22s} {us:7.1f} us")
    return out


if __name__ == "__main__":
    main()
