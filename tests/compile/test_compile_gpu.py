"""torch.compile on CUDA: fullgraph layer (no graph breaks, == eager), the model-level example where
Inductor fuses the router and the residual around the MoE ops, exact-size HT under
reduce-overhead."""

import pathlib
import subprocess
import sys

import pytest
import torch
import torch._dynamo
import torch.distributed as dist

import epmoe
import epmoe.compile
from epmoe._multiproc import run_ranks
from tests._moe import check_layer_output, global_weights, tokens
from tests._tol import rel_l2

GPU_MOE = dict(num_experts=16, hidden_size=2048, intermediate_size=256, top_k=4)


class RoutedMoE(torch.nn.Module):
    """router (linear + softmax + topk + renormalize) -> EPMoE -> residual add."""

    def __init__(self, layer):
        super().__init__()
        self.moe = layer
        g = torch.Generator().manual_seed(5)
        self.gate = torch.nn.Parameter(
            torch.randn(layer.num_experts, layer.hidden_size, generator=g).cuda() / 40,
            requires_grad=False,  # inference: the epmoe ops have no autograd formulas
        )

    def forward(self, x):
        logits = torch.nn.functional.linear(x.float(), self.gate.float())
        probs = torch.softmax(logits, dim=-1)
        w, ids = torch.topk(probs, self.moe.top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        return x + self.moe(x, ids, w)


def _layer(quant, mode, worst=False, group=None, backend="local"):
    layer = epmoe.EPMoE(
        **GPU_MOE,
        quant=quant,
        mode=mode,
        group=group,
        backend=backend,
        max_tokens_per_rank=64,
        worst_case=worst,
        device="cuda",
    )
    layer.load_weights(*global_weights(**GPU_MOE))
    return layer


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("mode,worst", [("ht", False), ("ht", True), ("ll", False)])
def test_fullgraph_cuda_local(quant, mode, worst):
    torch._dynamo.reset()
    layer = _layer(quant, mode, worst)
    x, ids, w = (t.cuda() for t in tokens(48, seed=1, **GPU_MOE))
    epmoe.compile.assert_no_graph_breaks(layer, x, ids, w)
    out = torch.compile(layer, fullgraph=True)(x, ids, w)
    check_layer_output(out.cpu(), x.cpu(), ids.cpu(), w.cpu(), *global_weights(**GPU_MOE), quant)
    assert rel_l2(out, layer(x, ids, w)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("mode,T", [("ht", 48), ("ll", 48), ("auto", 2)])
def test_static_launch_of_epmoe_kernels_gives_the_eager_bytes(quant, mode, T):
    """Inductor's static launcher for user-defined Triton kernels (the option the docs give for
    compiled decode without CUDA graphs) launches every epmoe kernel, the eager bytes out."""
    torch._dynamo.reset()
    layer = _layer(quant, mode)
    x, ids, w = (t.cuda() for t in tokens(T, seed=2, **GPU_MOE))
    opts = {"static_launch_user_defined_triton_kernels": True}
    compiled = torch.compile(layer, fullgraph=True, options=opts)
    for _ in range(2):  # (the second call runs the launchers the first one built)
        assert torch.equal(compiled(x, ids, w), layer(x, ids, w))
    torch._dynamo.reset()


@pytest.mark.gpu
def test_router_and_residual_fuse_around_moe():
    """Generated code: the softmax/topk-normalization and the residual add appear as Triton kernels
    fused by Inductor next to the epmoe ops (not as separate eager calls)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = RoutedMoE(_layer("fp8", "ht", worst=True))
    x = torch.randn(32, GPU_MOE["hidden_size"], device="cuda").bfloat16()
    eager = model(x)
    out, codes = run_and_get_code(torch.compile(model, fullgraph=True), x)
    code = "\n".join(codes)
    assert rel_l2(out, eager) < 1e-2
    # the stage ops stay visible in the compiled graph (the GEMM custom ops called from the
    # wrapper; the triton_op stages may be inlined as their Triton kernels). One rank with the
    # local backend sends nothing: no dispatch or combine op
    assert "torch.ops.epmoe.grouped_gemm_contiguous" in code
    assert "ht_dispatch" not in code and "ht_combine" not in code
    # Inductor generated its own fused Triton kernels around them: the router's softmax and the
    # residual add (kernel names carry the fused aten ops)
    fused = [line.split("(")[0] for line in code.splitlines() if line.startswith("def triton_")]
    assert any("softmax" in name for name in fused), fused
    assert any("add" in name for name in fused), fused


def _exact_ht_reduce_overhead():
    torch._dynamo.reset()
    layer = _layer("bf16", "ht", worst=False)
    x, ids, w = (t.cuda() for t in tokens(40, seed=2, **GPU_MOE))
    with epmoe.compile.graph_partition():
        f = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):
            out = f(x, ids, w)
    check_layer_output(out.cpu(), x.cpu(), ids.cpu(), w.cpu(), *global_weights(**GPU_MOE), "bf16")


@pytest.mark.gpu
def test_exact_ht_reduce_overhead_with_graph_partition():
    """In a fresh process, as a user's first call: the layer's first GEMM (deep_gemm's runtime
    allocating its workspace) then runs inside the CUDA-graph warmup."""
    code = "from tests.compile.test_compile_gpu import _exact_ht_reduce_overhead as f; f()"
    root = pathlib.Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, cwd=root)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]


def _compile_rank(rank, world):
    done = []
    for mode, worst in (("ht", False), ("ht", True), ("ll", False)):
        for quant in ("bf16", "fp8", "int8"):
            torch._dynamo.reset()
            layer = _layer(quant, mode, worst, group=dist.group.WORLD, backend="deepep")
            x, ids, w = (t.cuda() for t in tokens(32 + rank, seed=rank, **GPU_MOE))
            explain = torch._dynamo.explain(layer)(x, ids, w)
            assert explain.graph_break_count == 0, explain.break_reasons
            out = torch.compile(layer, fullgraph=True)(x, ids, w)
            check_layer_output(
                out.cpu(), x.cpu(), ids.cpu(), w.cpu(), *global_weights(**GPU_MOE), quant
            )
            done.append((mode, worst, quant))
    return len(done)


@pytest.mark.multi_gpu
def test_fullgraph_deepep_two_gpus():
    pytest.importorskip("deep_ep")
    assert run_ranks(_compile_rank, 2, "nccl") == [9, 9]
