"""Tiny CPU benchmarks of the stage ops (reference kernels) and the EPMoE layer (local backend).

They keep the stage suite runnable on a CPU-only CI machine: every stage and the layer run on one
tiny shape, and the bandwidth-bound stages report ``gbps`` against a host-memory copy
measured in the same run (``ceiling_gbps``), the GEMM ``tflops`` against a dense float32
``torch.mm`` with the same useful FLOPs (``ceiling_tflops``). CPU numbers say nothing about GPU
performance.

Run: ``pytest benchmarks/test_bench_cpu.py --benchmark-enable``.
"""

import statistics

import _timing
import pytest
import torch

import epmoe
from epmoe import ops

# The tiny CPU shape (a named config, like the GPU suite's): tokens, global experts, hidden,
# intermediate, top-k, permute alignment.
TINY_CPU = {"name": "tiny-cpu", "T": 64, "E": 8, "H": 256, "I": 128, "K": 2, "A": 16}
SHAPE = TINY_CPU


def _median_seconds(fn, reps: int = 7) -> float:
    return statistics.median(_timing.wall_ms(fn, reps)) / 1e3


@pytest.fixture(scope="module")
def copy_gbps() -> float:
    """Host-memory copy bandwidth (read + write) of a 64 MiB tensor: the bandwidth ceiling."""
    src = torch.empty(16 * 2**20, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    sec = _median_seconds(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / sec / 1e9


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    T, E, H, inter, K = (SHAPE[k] for k in "TEHIK")
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    w = torch.softmax(torch.randn(T, K, generator=g), dim=1)
    w1 = torch.randn(E, 2 * inter, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter**0.5
    return x, ids, w, w1, w2


def _report_gbps(benchmark, nbytes: int, ceiling: float) -> None:
    benchmark.extra_info.update(shape=SHAPE["name"], bytes=nbytes)
    if benchmark.stats is not None:  # None when benchmarks are disabled (plain pytest run)
        benchmark.extra_info["gbps"] = nbytes / benchmark.stats.stats.median / 1e9
        benchmark.extra_info["ceiling_gbps"] = ceiling


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_quantize(benchmark, data, copy_gbps, scheme):
    x = data[0]
    q, s = benchmark(ops.quantize, x, scheme)
    assert q.shape == x.shape
    nbytes = x.numel() * (x.element_size() + q.element_size()) + s.numel() * 4
    _report_gbps(benchmark, nbytes, copy_gbps)


def test_permute(benchmark, data, copy_gbps):
    x, ids = data[0], data[1]
    p = benchmark(ops.permute, x, ids, SHAPE["E"], SHAPE["A"])
    assert p.inv_perm.shape == ids.shape
    nbytes = x.numel() * x.element_size() * (1 + ids.shape[1])  # read each row, write it K times
    _report_gbps(benchmark, nbytes, copy_gbps)


def test_grouped_gemm_contiguous(benchmark, data):
    x, ids, _, w1, _ = data
    p = ops.permute(x, ids, SHAPE["E"], SHAPE["A"])
    wq = w1.to(torch.bfloat16)
    y = benchmark(ops.grouped_gemm, p.x, wq, m_indices=p.m_indices)
    assert y.shape == (p.x.shape[0], wq.shape[1])
    rows = ids.numel()
    N, Kd = wq.shape[1], wq.shape[2]
    flops = 2 * rows * N * Kd
    benchmark.extra_info.update(shape=SHAPE["name"], flops=flops)
    if benchmark.stats is not None:
        a, b = torch.randn(rows, Kd), torch.randn(Kd, N)
        benchmark.extra_info["tflops"] = flops / benchmark.stats.stats.median / 1e12
        benchmark.extra_info["ceiling_tflops"] = flops / _median_seconds(lambda: a @ b) / 1e12


def test_silu_and_mul(benchmark, data, copy_gbps):
    ids = data[1]
    y = torch.randn(ids.numel(), 2 * SHAPE["I"]).to(torch.bfloat16)
    h = benchmark(ops.silu_and_mul, y)
    _report_gbps(benchmark, (y.numel() + h.numel()) * y.element_size(), copy_gbps)


def test_unpermute(benchmark, data, copy_gbps):
    x, ids, w = data[0], data[1], data[2]
    p = ops.permute(x, ids, SHAPE["E"], SHAPE["A"])
    out = benchmark(ops.unpermute, p.x, p.inv_perm, w)
    assert out.shape == x.shape
    _report_gbps(benchmark, x.numel() * x.element_size() * (1 + ids.shape[1]), copy_gbps)


@pytest.mark.parametrize("mode", ["ht", "ll"])
def test_epmoe_layer_local(benchmark, data, mode):
    x, ids, w, w1, w2 = data
    layer = epmoe.EPMoE(
        SHAPE["E"],
        SHAPE["H"],
        SHAPE["I"],
        SHAPE["K"],
        quant="bf16",
        mode=mode,
        backend="local",
        alignment=SHAPE["A"],
        max_tokens_per_rank=SHAPE["T"],
        worst_case=True,
        device="cpu",
    )
    layer.load_weights(w1, w2)
    with torch.no_grad():
        out = benchmark(layer, x, ids, w)
    assert out.shape == x.shape
    benchmark.extra_info.update(shape=SHAPE["name"], mode=mode)


def test_stage_byte_counts():
    """The GB/s numerators of the GPU stage benchmarks and scripts/stage_sweep.py (_bytes)."""
    import _bytes

    # 3 sources, 5 copies of a 100-byte row, 8 int64 ids, 32 permuted rows, 2 experts
    assert _bytes.permute_bytes(3, 5, 8, 8, 100, 32, 2) == (300 + 64) + (500 + 4 * (32 + 8 + 3))
    # 5 live rows of H = 4 bf16, 8 entries of (int32 row, float32 weight), 3 output rows
    assert _bytes.unpermute_bytes(5, 3, 4, 8) == 5 * 8 + 64 + 3 * 8
    # 3 sources of 100 bytes, 8 int64 ids, 5 slots of 60 bytes, 2 masked_m and 8 rows (int32)
    assert _bytes.ll_scatter_bytes(3, 5, 8, 8, 100, 60, 2) == (300 + 64) + (300 + 4 * (2 + 8))
    # fp8: 2 rows of 256 outputs from bf16 input, 2 float32 scales a row; int8: one scale a row
    assert _bytes.quant_bytes(2, 256, 2, "fp8", 128) == 2 * (512 + 256 + 8)
    assert _bytes.quant_bytes(2, 256, 4, "int8", 128) == 2 * (1024 + 256 + 4)


def test_device_call_spans():
    """_timing.call_spans, behind device_time: each call's span from its activities between
    flushes (overlapping kernels: PDL), the flush's own activities left out."""
    import _timing

    flush = {"reduce_kernel", "Memset (Device)"}
    acts = [
        ("Memset (Device)", 0.0, 1.0),
        ("reduce_kernel", 1.0, 150.0),
        ("count", 152.0, 154.0),
        ("scan", 153.0, 157.0),  # overlaps count (started early)
        ("copy", 155.0, 240.0),
        ("rest", 200.0, 238.0),  # ends before copy: the span ends with copy
        ("Memset (Device)", 241.0, 242.0),
        ("reduce_kernel", 242.0, 390.0),
        ("one", 392.0, 402.5),
    ]
    assert _timing.call_spans(acts, flush) == [88.0, 10.5]
    assert _timing.call_spans([], flush) == []


def test_per_kernel_us():
    """_timing.per_kernel_us, behind kernel_us: the n-th launch of a name in a call keyed "name
    #n", the median over calls, a call without a key counting 0, names cut to KERNEL_NAME_CHARS
    (launches whose names differ past the cut count as one name's launches)."""
    import _timing

    long = "g" * (_timing.KERNEL_NAME_CHARS + 5)
    cut = long[: _timing.KERNEL_NAME_CHARS]
    calls = [
        [("a", 0.0, 2.0), ("a", 3.0, 4.0), (long + "x", 4.0, 14.0), (long + "y", 14.0, 15.0)],
        [("a", 0.0, 5.0), ("a", 5.0, 8.0), (long + "y", 8.0, 12.0), ("b", 12.0, 13.0)],
        [("a", 0.0, 1.0), (long, 1.0, 2.0), (long, 2.0, 9.0)],
    ]
    got = _timing.per_kernel_us(calls)
    assert got == {"a": 2.0, "a #2": 1.0, cut: 4.0, cut + " #2": 1.0, "b": 0.0}
    assert _timing.per_kernel_us([]) == {}
    # PDL: a kernel that starts before the one ahead ends counts from that end
    pdl = [[("a", 0.0, 5.0), ("b", 1.0, 7.0), ("c", 2.0, 6.5), ("d", 9.0, 10.0)]]
    assert _timing.per_kernel_us(pdl) == {"a": 5.0, "b": 2.0, "c": 0.0, "d": 1.0}
