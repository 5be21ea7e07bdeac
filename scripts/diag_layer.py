"""GPU diagnostics of the one-GPU layer as users call it (prints; no files):

1. which Triton kernels torch.compile believes mutate their inputs (``tensors_to_clone`` of each
   ``triton_kernel_wrapper_functional`` node: clones in the default mode, and the reason
   reduce-overhead skips CUDA graphs), per mode and scheme;
2. where the host time of an eager layer call goes: host µs of each stage's public call (the GPU
   kept busy, so nothing waits: ``_timing.host_us``, as bench_one_gpu measures it), of a bare
   Triton launch and of ``x + x``, and a cProfile of repeated layer calls (top functions).
3. the torch backend vs the local backend, eager and CUDA-graph ms (``_timing.time_cuda``).

    PYTHONPATH=. python scripts/diag_layer.py [--shape qwen3] [--tokens 32]
"""

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
)
import _timing  # noqa: E402  (benchmarks/_timing.py: the timing every benchmark uses)

import epmoe  # noqa: E402


def _layer(quant, mode, H, I, E, K, T, **kw):
    kw.setdefault("backend", "local")
    kw.update(dict(max_tokens_per_rank=T) if mode == "ll" else dict(worst_case=True))
    layer = epmoe.EPMoE(E, H, I, K, quant=quant, mode=mode, device="cuda", **kw)
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn((E, 2 * I, H), device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn((E, H, I), device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    layer.load_weights(w1, w2)
    x = torch.randn((T, H), device="cuda", generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
    w = torch.softmax(torch.randn((T, K), device="cuda"), -1)
    return layer, (x, ids, w)


def mutations(layer, args):
    from torch._functorch.aot_autograd import aot_module_simplified

    found = []

    def fw(gm, example_inputs):
        for n in gm.graph.nodes:
            if "triton_kernel_wrapper" in str(n.target):
                kid = n.kwargs.get("kernel_idx")
                from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

                k = kernel_side_table.get_kernel(kid)
                name = getattr(getattr(k, "fn", k), "__name__", str(k))
                found.append((name, n.kwargs.get("tensors_to_clone")))
        return gm.forward

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=fw)

    torch._dynamo.reset()
    torch.compile(layer, backend=backend, fullgraph=True)(*args)
    return found


def stage_costs(T=32, H=2048, I=768, E=128, K=8):
    """Host µs of each stage call of the fp8 chains, one by one, and of the bare launches."""
    from epmoe import _launch, ops
    from epmoe._range import _range_kernel
    from epmoe.ops.ll_gather import ll_gather
    from epmoe.ops.ll_scatter import ll_scatter

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn((T, H), device="cuda", generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
    w = torch.softmax(torch.randn((T, K), device="cuda"), -1)
    q, s = ops.quantize(x, "fp8")
    p = ops.permute(q, ids, E, 128, s, scale_layout="deepgemm")
    y = torch.randn((p.x.shape[0], 2 * I), device="cuda").bfloat16()
    y2 = torch.randn((p.x.shape[0], H), device="cuda").bfloat16()
    a, sa, mm, rows = ll_scatter(x, ids, E, 128, "fp8", scale_layout="deepgemm")
    ym = torch.randn((E, 128, H), device="cuda").bfloat16()
    flag = torch.empty((), dtype=torch.bool, device="cuda")
    out = {
        "x + x": lambda: x + x,
        "torch.empty x3": lambda: (torch.empty(8, device="cuda"),) * 3,
        "bare Triton launch (_range_kernel, 5 args)": lambda: _range_kernel[(1,)](
            ids, flag, ids.numel(), -1, E, BLOCK=1024
        ),
        "quantize fp8": lambda: ops.quantize(x, "fp8"),
        "permute fp8 (one kernel)": lambda: ops.permute(q, ids, E, 128, s, scale_layout="deepgemm"),
        "silu_and_mul_quant fp8 (m_indices)": lambda: ops.silu_and_mul_quant(
            y, "fp8", m_indices=p.m_indices, scale_layout="deepgemm",
            expert_offsets=p.expert_offsets,
        ),
        "unpermute": lambda: ops.unpermute(y2, p.inv_perm, w),
        "ll_scatter fp8": lambda: ll_scatter(x, ids, E, 128, "fp8", scale_layout="deepgemm"),
        "ll_gather": lambda: ll_gather(ym, rows, w),
    }  # fmt: skip
    out["direct Triton launch (_launch.direct(_range_kernel), 5 args)"] = lambda: _launch.direct(
        _range_kernel
    )[(1,)](ids, flag, ids.numel(), -1, E, BLOCK=1024)
    out.update(_gemm_costs(a, sa, mm, H, I, E, K))
    res = {}
    for k, fn in out.items():
        try:
            res[k] = _timing.host_us(fn)
        except Exception as e:  # noqa: BLE001
            print(f"host {k}: failed {e!r}")
    return res


def _gemm_costs(a, sa, mm, H, I, E, K):
    """The masked fp8 GEMM1 of the LL chain: epmoe's op (public, trusted) and deep_gemm's own call
    on the same operands (the library's host cost, which no wrapper can remove)."""
    from _baselines import raw_deep_gemm_masked

    from epmoe.ops import gemm

    layer, _ = _layer("fp8", "ll", H, I, E, K, a.shape[1])
    w, ws = layer.w1, layer.w1_scale
    em = layer.expected_m()
    out = torch.empty((E, a.shape[1], 2 * I), dtype=torch.bfloat16, device="cuda")
    kw = dict(masked_m=mm, a_scales=sa, w_scales=ws, expected_m=em)
    return {
        "grouped_gemm masked fp8 (public)": lambda: gemm.grouped_gemm(a, w, **kw),
        "grouped_gemm masked fp8 (trusted)": lambda: gemm.grouped_gemm(a, w, trusted=True, **kw),
        "raw deep_gemm masked fp8 call": lambda: raw_deep_gemm_masked(
            "fp8", a, sa, w, ws, mm, em, out
        ),
    }


def host(layer, args, n=60):
    for _ in range(5):
        layer(*args)
    torch.cuda.synchronize()
    us = _timing.host_us(lambda: layer(*args))
    torch.cuda._sleep(int(2e9))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        layer(*args)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    return us, s.getvalue()


def _ms(fn, graph: bool) -> float:
    """Median ms of fn: eager launches, or replays of a CUDA graph of one call."""
    t = _timing.time_cuda(fn, iters=30, use_graph=graph)
    if graph and t.method != "cuda_graph":
        raise RuntimeError("CUDA graph capture failed")
    return t.ms


def torch_backend(H=2048, I=768, E=128, K=8):
    """The torch backend on a world-1 NCCL group (its packing kernels and collectives) against
    the local backend, same layer and tokens."""
    import torch.distributed as dist

    from epmoe._multiproc import free_port

    if not dist.is_initialized():
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    for quant, mode, T in (("fp8", "ll", 128), ("bf16", "ll", 32), ("fp8", "ht", 4096)):
        res = {}
        for backend in ("local", "torch"):
            group = dist.group.WORLD if backend == "torch" else None
            layer, args = _layer(quant, mode, H, I, E, K, T, backend=backend, group=group)

            def call(layer=layer, args=args):
                return layer(*args)

            res[backend] = (call(), _ms(call, False), _ms(call, True))
            del layer
        same = torch.equal(res["local"][0], res["torch"][0])
        print(
            f"backend torch vs local {quant} {mode} T={T}: eager {res['torch'][1]:.3f} / "
            f"{res['local'][1]:.3f} ms, graph {res['torch'][2]:.3f} / {res['local'][2]:.3f} ms, "
            f"same bytes {same}"
        )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--parts", default="stages,torch,layers,mutations", help="comma-separated")
    a = p.parse_args()
    parts = set(a.parts.split(","))
    H, I, E, K = 2048, 768, 128, 8
    if "stages" in parts:
        for name, us in stage_costs(a.tokens).items():
            print(f"host {us:8.1f} us  {name}")
    if "torch" in parts:
        try:
            torch_backend()
        except Exception as e:  # noqa: BLE001
            print(f"torch backend failed: {e!r}")
    for quant in ("bf16", "fp8", "int8") if parts & {"layers", "mutations"} else ():
        for mode in ("ht", "ll"):
            layer, args = _layer(quant, mode, H, I, E, K, a.tokens)
            try:
                us, prof = host(layer, args) if "layers" in parts else (None, "")
                if us is not None:
                    print(f"=== {quant} {mode} T={a.tokens}: host {us:.1f} us/call")
                if quant == "fp8":
                    print(prof)
            except Exception as e:  # noqa: BLE001
                print(f"=== {quant} {mode}: host failed {e!r}")
            try:
                for name, clone in mutations(layer, args) if "mutations" in parts else ():
                    print(f"  kernel {name}: tensors_to_clone={clone}")
            except Exception as e:  # noqa: BLE001
                print(f"  mutation analysis failed: {e!r}")
            del layer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
