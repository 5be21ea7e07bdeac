"""CUDA-graph runners on GPU: replay == eager for every capture size (incl. all-padding batches),
20 replays hash-stable. One GPU with the local backend; two GPUs with deepep (and torch/NCCL)."""

import hashlib

import pytest
import torch

import epmoe
from epmoe._multiproc import run_ranks
from epmoe.graphs import DecodeGraphRunner, PrefillGraphRunner
from tests._moe import check_layer_output, global_weights, tokens

# DeepEP LL supports a fixed set of hidden sizes; 2048 is the smallest.
GPU_MOE = dict(num_experts=16, hidden_size=2048, intermediate_size=256, top_k=4)
SIZES = (1, 2, 4, 8, 16, 32)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _close(a, b):
    torch.testing.assert_close(a.float(), b.float(), atol=0, rtol=0)


def _decode_checks(layer, runner, rank, quant):
    w1, w2 = global_weights(**GPU_MOE)
    for n in SIZES:
        for T in sorted({max(1, n - 1), n}):
            x, ids, w = (t.cuda() for t in tokens(T, seed=1000 * rank + T, **GPU_MOE))
            got = runner(x, ids, w)
            want = layer(x, ids, w)
            _close(got, want)  # same kernels, same inputs: bitwise equal
            check_layer_output(got.cpu(), x.cpu(), ids.cpu(), w.cpu(), w1, w2, quant)
    # an all-padding batch
    x, ids, w = (t.cuda() for t in tokens(3, seed=rank, **GPU_MOE))
    assert (runner(x, torch.full_like(ids, -1), w) == 0).all()
    # 20 replays of the same inputs are hash-identical
    x, ids, w = (t.cuda() for t in tokens(SIZES[-1], seed=77 + rank, **GPU_MOE))
    digests = {_digest(runner(x, ids, w)) for _ in range(20)}
    assert len(digests) == 1


def _make(quant, mode, group=None, backend="local", worst_case=False, max_tokens=32):
    layer = epmoe.EPMoE(
        **GPU_MOE,
        quant=quant,
        mode=mode,
        group=group,
        backend=backend,
        max_tokens_per_rank=max_tokens,
        worst_case=worst_case,
        device="cuda",
    )
    layer.load_weights(*global_weights(**GPU_MOE))
    return layer


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8"])
def test_decode_runner_local(quant):
    torch.manual_seed(0)
    layer = _make(quant, "ll")
    runner = DecodeGraphRunner(layer, capture_sizes=SIZES)
    _decode_checks(layer, runner, 0, quant)


@pytest.mark.gpu
def test_prefill_runner_local():
    layer = _make("fp8", "ht", worst_case=True, max_tokens=None)
    runner = PrefillGraphRunner(layer, num_tokens=64)
    w1, w2 = global_weights(**GPU_MOE)
    for T in (64, 40, 1):
        x, ids, w = (t.cuda() for t in tokens(T, seed=T, **GPU_MOE))
        got = runner(x, ids, w)
        check_layer_output(got.cpu(), x.cpu(), ids.cpu(), w.cpu(), w1, w2, "fp8")
    x, ids, w = (t.cuda() for t in tokens(64, seed=5, **GPU_MOE))
    assert len({_digest(runner(x, ids, w)) for _ in range(20)}) == 1


@pytest.mark.gpu
def test_decode_runner_compiled_layer():
    layer = _make("int8", "ll")
    runner = DecodeGraphRunner(layer, capture_sizes=(4, 8), fn=torch.compile(layer, fullgraph=True))
    x, ids, w = (t.cuda() for t in tokens(6, seed=3, **GPU_MOE))
    check_layer_output(
        runner(x, ids, w).cpu(), x.cpu(), ids.cpu(), w.cpu(), *global_weights(**GPU_MOE), "int8"
    )


def _two_rank_decode(rank, world, backend):
    import torch.distributed as dist

    out = []
    for quant in ("bf16", "fp8", "int8"):
        layer = _make(quant, "ll", group=dist.group.WORLD, backend=backend)
        runner = DecodeGraphRunner(layer, capture_sizes=SIZES)
        _decode_checks(layer, runner, rank, quant)
        out.append(quant)
    for quant in ("fp8", "bf16"):
        layer = _make(
            quant, "ht", group=dist.group.WORLD, backend=backend, worst_case=True, max_tokens=64
        )
        runner = PrefillGraphRunner(layer, num_tokens=64)
        w1, w2 = global_weights(**GPU_MOE)
        for T in (64, 17):
            x, ids, w = (t.cuda() for t in tokens(T, seed=10 * rank + T, **GPU_MOE))
            got = runner(x, ids, w)
            _close(got, layer(x, ids, w))
            check_layer_output(got.cpu(), x.cpu(), ids.cpu(), w.cpu(), w1, w2, quant)
        out.append("ht-" + quant)
    return out


@pytest.mark.multi_gpu
@pytest.mark.parametrize("backend", ["deepep", "torch"])
def test_runners_two_gpus(backend):
    if backend == "deepep":
        pytest.importorskip("deep_ep")
    res = run_ranks(_two_rank_decode, 2, "nccl", backend)
    assert res[0] == res[1] == ["bf16", "fp8", "int8", "ht-fp8", "ht-bf16"]
