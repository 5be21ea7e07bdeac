"""GPU diagnostics of the one-GPU layer as users call it (prints; no files):

1. which Triton kernels torch.compile believes mutate their inputs (``tensors_to_clone`` of each
   ``triton_kernel_wrapper_functional`` node: clones in the default mode, and the reason
   reduce-overhead skips CUDA graphs), per mode and scheme;
2. where the host time of an eager layer call goes (cProfile of repeated calls, top functions).

    PYTHONPATH=. python scripts/diag_layer.py [--shape qwen3] [--tokens 32]
"""

import argparse
import cProfile
import io
import pstats
import time

import torch

import epmoe


def _layer(quant, mode, H, I, E, K, T):
    kw = dict(max_tokens_per_rank=T) if mode == "ll" else {}
    layer = epmoe.EPMoE(E, H, I, K, quant=quant, mode=mode, backend="local", device="cuda", **kw)
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


def host(layer, args, n=200):
    for _ in range(5):
        layer(*args)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # keep the GPU busy: the host never waits
    t0 = time.perf_counter()
    for _ in range(n):
        layer(*args)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        layer(*args)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    return (t1 - t0) / n * 1e6, s.getvalue()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32)
    a = p.parse_args()
    H, I, E, K = 2048, 768, 128, 8
    for quant in ("bf16", "fp8", "int8"):
        for mode in ("ht", "ll"):
            layer, args = _layer(quant, mode, H, I, E, K, a.tokens)
            try:
                us, prof = host(layer, args)
                print(f"=== {quant} {mode} T={a.tokens}: host {us:.1f} us/call")
                if quant == "fp8":
                    print(prof)
            except Exception as e:  # noqa: BLE001
                print(f"=== {quant} {mode}: host failed {e!r}")
            try:
                for name, clone in mutations(layer, args):
                    print(f"  kernel {name}: tensors_to_clone={clone}")
            except Exception as e:  # noqa: BLE001
                print(f"  mutation analysis failed: {e!r}")
            del layer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
