"""Grouped GEMM benchmarks on one GPU at workload W per rank, next to ceilings from the same run.

- FP8 contiguous (prefill): our op vs deep_gemm called directly on the same inputs (``vs_raw``).
- INT8 contiguous (prefill): our Triton kernel vs raw deep_gemm FP8 at the same shape (``vs_fp8``)
  and cuBLAS INT8 (``torch._int_mm``) on the dense GEMM of the same rows, N and K (``vs_int_mm``).
- INT8 / FP8 masked (decode, few rows per expert): time vs the HBM weight-read floor, i.e. the
  weights' bytes over the device-to-device copy bandwidth measured here (``vs_floor``).
- BF16 contiguous: our op vs torch._grouped_mm on the same inputs (``vs_grouped_mm``).
- Our Triton contiguous kernel (fp8, bf16; autotuned as without a tuned table) vs deep_gemm on the
  same inputs at its 128-row blocks (``vs_raw``): where the tuned table can pick ours at prefill.

TFLOP/s count 2*N*K per live row; timings are medians of CUDA-event timings, measured alternately
for the two sides of a comparison. Needs CUDA and deep_gemm (skips otherwise).

Run on the GPU machine (then ``python scripts/record_results.py --gpu h200 gemm.json``):
  python -m pytest benchmarks/test_bench_gemm.py --benchmark-enable --benchmark-json=gemm.json
"""

import _timing
import pytest
import torch
from _baselines import raw_deep_gemm_contiguous, raw_deep_gemm_masked, raw_grouped_mm

from epmoe import _deps, reference
from epmoe.ops import gemm
from epmoe.ops.gemm._select import _backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and not _deps.available("deep_gemm"), reason="needs deep_gemm"
    ),
]

# Workload W per rank: hidden H, intermediate I, local experts E; prefill rows of the contiguous
# layout (all live, expert blocks of A rows); decode: rows per expert of a T-row masked slot.
W = {"name": "W", "H": 7168, "I": 2048, "E": 128, "M_sum": 32768, "A": 128, "T": 256, "rows": 8}
GEMMS = ("gemm1", "gemm2")  # gemm1: [*, H] x [2I, H]^T; gemm2: [*, I] x [H, I]^T
ROUNDS = 10  # alternating rounds per comparison
ITERS = 5  # timed launches per round
SEED = 0


# --------------------------------------------------------------------------------------- timing
def _paired_ms(**fns) -> dict:
    return _timing.paired_ms(ROUNDS, ITERS, **fns)


def _synced(fn):
    def run():
        out = fn()
        torch.cuda.synchronize()
        return out

    return run


@pytest.fixture(scope="module")
def copy_gbps() -> float:
    """The HBM copy ceiling of this run (GB/s read + written, ``_timing.copy_gbps``)."""
    return _timing.copy_gbps()


# ------------------------------------------------------------------------------------------ data
def _dims(which: str):
    """(N, K) of one GEMM of W."""
    hidden, inter = W["H"], W["I"]
    return (2 * inter, hidden) if which == "gemm1" else (hidden, inter)


_WEIGHTS = {}


def _weights(scheme: str, which: str):
    """Quantized expert weights of W (cached per scheme and GEMM), built expert-chunk by chunk."""
    key = (scheme, which)
    if key not in _WEIGHTS:
        E, (N, K) = W["E"], _dims(which)
        g = torch.Generator(device="cuda").manual_seed(SEED)
        qs, ss = [], []
        for e0 in range(0, E, 16):
            w = torch.randn((min(16, E - e0), N, K), device="cuda", generator=g) / K**0.5
            q, s = reference.quantize_weights(w, scheme)
            qs.append(q)
            ss.append(s)
            del w
        q = torch.cat(qs)
        s = torch.cat(ss) if ss[0] is not None else None
        _WEIGHTS[key] = gemm.prepare_weights(q, s, scheme, "cuda")
    return _WEIGHTS[key]


def _acts(scheme: str, lead, K: int):
    """Quantized activations `[*lead, K]`; fp8 scales in deep_gemm's MN-major layout."""
    g = torch.Generator(device="cuda").manual_seed(SEED + 1)
    x = torch.randn((*lead, K), device="cuda", generator=g)
    if scheme == "bf16":
        return x.bfloat16(), None
    q, s = reference.quantize(x, scheme)
    if scheme == "fp8":
        s_mn = gemm.empty_fp8_act_scales(lead, K // 128, "cuda")
        s = s_mn.copy_(s)
    return q, s


def _prefill_layout():
    """(m_indices int32 `[M_sum]`, expert_offsets int32 `[E + 1]`): M_sum live rows in blocks of A
    rows spread over the experts at random (some empty), as permute lays them out."""
    E, M, A = W["E"], W["M_sum"], W["A"]
    g = torch.Generator().manual_seed(SEED + 2)
    blocks = torch.multinomial(torch.ones(E), M // A, replacement=True, generator=g)
    counts = torch.bincount(blocks, minlength=E) * A
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts, 0)
    m_idx = torch.repeat_interleave(torch.arange(E, dtype=torch.int32), counts)
    return m_idx.cuda(), offsets.cuda()


def _tflops(rows: int, N: int, K: int, ms: float) -> float:
    return 2.0 * rows * N * K / ms / 1e9


def _record(benchmark, fn, **info):
    benchmark.extra_info.update(shape=W["name"], **info)
    benchmark.pedantic(_synced(fn), rounds=ROUNDS, iterations=1, warmup_rounds=1)


# ------------------------------------------------------------------------------------ benchmarks
@pytest.mark.parametrize("which", GEMMS)
def test_fp8_contiguous_vs_raw_deep_gemm(benchmark, which):
    N, K = _dims(which)
    w, ws = _weights("fp8", which)
    m_idx, _ = _prefill_layout()
    a, a_s = _acts("fp8", (m_idx.numel(),), K)
    out = torch.empty((m_idx.numel(), N), dtype=torch.bfloat16, device="cuda")
    gemm.warmup("fp8", W["E"], N, K, "cuda", contiguous_m=[m_idx.numel()], w=w, w_scales=ws)

    def ours():
        return gemm.grouped_gemm(a, w, m_indices=m_idx, a_scales=a_s, w_scales=ws)

    def raw():
        return raw_deep_gemm_contiguous("fp8", a, a_s, w, ws, m_idx, out)

    t = _paired_ms(ours=ours, raw=raw)
    rows = m_idx.numel()
    _record(
        benchmark,
        ours,
        gemm=which,
        tflops=_tflops(rows, N, K, t["ours"]),
        raw_tflops=_tflops(rows, N, K, t["raw"]),
        vs_raw=t["raw"] / t["ours"],
        target_vs_raw=0.97,
    )


@pytest.mark.parametrize("which", GEMMS)
def test_int8_contiguous_vs_fp8(benchmark, which):
    N, K = _dims(which)
    w8, ws8 = _weights("int8", which)
    wf, wsf = _weights("fp8", which)
    m_idx, _ = _prefill_layout()
    rows = m_idx.numel()
    a8, as8 = _acts("int8", (rows,), K)
    af, asf = _acts("fp8", (rows,), K)
    out = torch.empty((rows, N), dtype=torch.bfloat16, device="cuda")
    gemm.warmup("int8", W["E"], N, K, "cuda", contiguous_m=[rows], w=w8, w_scales=ws8)
    gemm.warmup("fp8", W["E"], N, K, "cuda", contiguous_m=[rows], w=wf, w_scales=wsf)

    def ours():
        return gemm.grouped_gemm(a8, w8, m_indices=m_idx, a_scales=as8, w_scales=ws8)

    def fp8_raw():
        return raw_deep_gemm_contiguous("fp8", af, asf, wf, wsf, m_idx, out)

    # cuBLAS INT8 on the dense equivalent (one weight for all rows, int32 out, no scales)
    dense = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")

    def int_mm():
        return torch._int_mm(a8, dense.t())

    t = _paired_ms(ours=ours, fp8=fp8_raw, int_mm=int_mm)
    _record(
        benchmark,
        ours,
        gemm=which,
        tflops=_tflops(rows, N, K, t["ours"]),
        fp8_tflops=_tflops(rows, N, K, t["fp8"]),
        int_mm_tflops=_tflops(rows, N, K, t["int_mm"]),
        vs_fp8=t["fp8"] / t["ours"],
        vs_int_mm=t["int_mm"] / t["ours"],
        target_vs_fp8=0.95,
        target_vs_int_mm=0.9,
    )


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("which", GEMMS)
def test_masked_decode_vs_weight_floor(benchmark, copy_gbps, scheme, which):
    N, K = _dims(which)
    E, T, rows = W["E"], W["T"], W["rows"]
    w, ws = _weights(scheme, which)
    a, a_s = _acts(scheme, (E, T), K)
    masked_m = torch.full((E,), rows, dtype=torch.int32, device="cuda")
    gemm.warmup(scheme, E, N, K, "cuda", masked_t=T, expected_m=rows, w=w, w_scales=ws)

    def ours():
        return gemm.grouped_gemm(
            a, w, masked_m=masked_m, a_scales=a_s, w_scales=ws, expected_m=rows
        )

    fns = {"ours": ours}
    padded = T % gemm.masked_row_block(scheme, "cuda") != 0  # deep_gemm on a row-padded copy
    if scheme == "fp8":
        # raw deep_gemm is only right for T a multiple of its row block (W's T = 256 is)
        assert not padded, "raw deep_gemm masked needs T % masked_row_block == 0"
        out = torch.empty((E, T, N), dtype=torch.bfloat16, device="cuda")
        fns["raw"] = lambda: raw_deep_gemm_masked("fp8", a, a_s, w, ws, masked_m, rows, out)
    t = _paired_ms(**fns)
    weight_bytes = w.numel() * w.element_size()
    floor_ms = weight_bytes / copy_gbps / 1e6
    info = dict(
        gemm=which,
        rows_per_expert=rows,
        padded=padded,
        weight_gbps=weight_bytes / t["ours"] / 1e6,
        copy_gbps=copy_gbps,
        floor_ms=floor_ms,
        vs_floor=floor_ms / t["ours"],
        tflops=_tflops(E * rows, N, K, t["ours"]),
    )
    if scheme == "int8":
        info["target_vs_floor"] = 0.80
    else:
        info["raw_vs_floor"] = floor_ms / t["raw"]
        info["vs_raw"] = t["raw"] / t["ours"]
    _record(benchmark, ours, **info)


@pytest.mark.parametrize("which", GEMMS)
def test_bf16_contiguous_vs_grouped_mm(benchmark, which):
    if not hasattr(torch, "_grouped_mm") or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm needs sm90+")
    N, K = _dims(which)
    w, _ = _weights("bf16", which)
    m_idx, offsets = _prefill_layout()
    rows = m_idx.numel()
    a, _ = _acts("bf16", (rows,), K)
    gemm.warmup("bf16", W["E"], N, K, "cuda", contiguous_m=[rows], w=w)

    def ours():
        return gemm.grouped_gemm(a, w, m_indices=m_idx, expert_offsets=offsets)

    t = _paired_ms(ours=ours, grouped_mm=lambda: raw_grouped_mm(a, w, offsets))
    _record(
        benchmark,
        ours,
        gemm=which,
        backend=_backend("bf16", "contiguous", torch.device("cuda"), N, K),
        tflops=_tflops(rows, N, K, t["ours"]),
        grouped_mm_tflops=_tflops(rows, N, K, t["grouped_mm"]),
        vs_grouped_mm=t["grouped_mm"] / t["ours"],
    )


@pytest.mark.parametrize("scheme", ["fp8", "bf16"])
@pytest.mark.parametrize("which", GEMMS)
def test_triton_contiguous_vs_deep_gemm(benchmark, scheme, which):
    from epmoe.ops.gemm import _triton

    N, K = _dims(which)
    w, ws = _weights(scheme, which)
    m_idx, _ = _prefill_layout()
    rows = m_idx.numel()
    a, a_s = _acts(scheme, (rows,), K)
    out = torch.empty((rows, N), dtype=torch.bfloat16, device="cuda")
    mine = torch.empty_like(out)

    def ours():
        return _triton.contiguous_triton(a, w, m_idx, a_s, ws, W["A"], out=mine)

    ours()  # (the autotuner's first call)

    def raw():
        return raw_deep_gemm_contiguous(scheme, a, a_s, w, ws, m_idx, out)

    t = _paired_ms(ours=ours, raw=raw)
    live = m_idx >= 0
    _record(
        benchmark,
        ours,
        gemm=which,
        scheme=scheme,
        tflops=_tflops(rows, N, K, t["ours"]),
        raw_tflops=_tflops(rows, N, K, t["raw"]),
        vs_raw=t["raw"] / t["ours"],
        rel_l2_vs_raw=float(
            (mine[live].float() - out[live].float()).norm() / out[live].float().norm()
        ),  # fmt: skip
    )
