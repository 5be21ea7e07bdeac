"""grouped_gemm CUDA backends (deep_gemm FP8/BF16, torch._grouped_mm, our Triton kernels for every
scheme and row blocks from 16, GEMM1 + gate fused) vs the quant-aware reference; layout invariants
(-1 rows, masked rows past the count, empty experts); opcheck; CUDA graphs.

Run on a GPU machine: pytest tests/ops/test_gemm_gpu.py  (the CPU-only helper tests run anywhere).
"""

import pytest
import torch
import triton

from benchmarks._baselines import raw_deep_gemm_contiguous, raw_deep_gemm_masked
from epmoe import quant, reference
from epmoe.ops import gemm
from epmoe.ops.gemm import _ops, grouped_gemm
from epmoe.ops.gemm._deepgemm import _deep_gemm_masked
from epmoe.ops.gemm._ops import _group_ends
from epmoe.ops.gemm._select import _SCHEME_DTYPE, _dg_role
from epmoe.ops.gemm._weights import _dummy_acts, _dummy_weights
from tests._opcheck import opcheck
from tests._tol import GEMM_VS_QUANT_AWARE, rel_l2

SCHEMES = ("bf16", "fp8", "int8")
ALIGN = 128  # a multiple of every backend's contiguous row block


def _operands(scheme, lead, E, N, K, device, gen):
    """(a, a_scales, w, w_scales) quantized like the layer does, on ``device``."""
    a = torch.randn(*lead, K, generator=gen).to(device)
    w = (torch.randn(E, N, K, generator=gen) / K**0.5).to(device)
    if scheme == "bf16":
        return a.bfloat16(), None, w.bfloat16(), None
    aq, as_ = reference.quantize(a, scheme)
    wq, ws = reference.quantize_weights(w, scheme)
    wq, ws = gemm.prepare_weights(wq, ws, scheme, device)
    return aq, as_, wq, ws


def needs_deep_gemm(scheme, layout="contiguous"):
    if not _dg_role(f"{scheme}_{layout}", torch.device("cuda")):
        pytest.skip(f"deep_gemm {scheme} {layout} not available on this GPU")


def _layout(counts, align, trailing_blocks=1):
    """m_indices for expert row counts, blocks padded to ``align`` rows, plus trailing -1 blocks."""
    parts = []
    for e, c in enumerate(counts):
        pad = -(-c // align) * align - c
        parts += [torch.full((c,), e, dtype=torch.int32), torch.full((pad,), -1, dtype=torch.int32)]
    parts.append(torch.full((trailing_blocks * align,), -1, dtype=torch.int32))
    return torch.cat(parts)


def _configs(layout, code, block, key=None):
    """The candidate configs (dicts) of ``layout``'s kernel that fit ``block``, as the tuner and
    the autotuner take them (``_triton.candidates``); with ``key``, only those setting it."""
    from epmoe.ops.gemm import _triton

    cands = (dict(c.all_kwargs()) for c in _triton.candidates(layout, code, block))
    return [c for c in cands if key is None or c.get(key)]


def _poison_rows(a, a_scales, rows):
    """Fill ``rows`` (bool mask over the leading dims) with NaN (or int8 +127 and NaN scales)."""
    a = a.clone()
    if a.dtype == torch.int8:
        a[rows] = 127
    else:
        a.view(torch.uint8 if a.element_size() == 1 else torch.int16)[rows] = (
            0x7F if a.element_size() == 1 else 0x7FC0  # fp8 e4m3 NaN / bf16 NaN
        )
    if a_scales is not None:
        a_scales = a_scales.clone()
        a_scales[rows] = float("nan")
    return a, a_scales


def _mn_major(s):
    out = gemm.empty_fp8_act_scales(s.shape[:-1], s.shape[-1], s.device)
    out.copy_(s)
    return out


def _live(masked_m, T):
    return torch.arange(T, device=masked_m.device)[None, :] < masked_m[:, None]


def _block_store_model(block, calls=None):
    """CPU model of deep_gemm's masked kernel addressing (same signatures as its entry points).

    a and out are used as 2-D `[E * T, *]` tensors; expert e computes ceil(masked_m[e] / block)
    row blocks starting at row e * T + i * block with w[e] and stores each whole (clipped only at
    E * T), as the TMA store does: for T not a multiple of ``block`` the last block of expert e
    overwrites the first rows of expert e + 1. The GPU runs the blocks concurrently; the model
    runs the experts last to first, the race's worst outcome. ``calls`` (a list) records the
    (a, a_scales) passed in.
    """

    def fn(a_arg, w_arg, out, masked_m, expected_m):
        (a, a_s), (w, w_s) = (
            (a_arg, w_arg) if isinstance(a_arg, tuple) else ((a_arg, None), (w_arg, None))
        )
        if calls is not None:
            calls.append((a, a_s))
        E, T, K = a.shape
        rows = a.reshape(E * T, K)
        rows = (
            reference.dequantize(rows, a_s.reshape(E * T, -1)) if a_s is not None else rows.float()
        )
        wf = reference.dequantize_weights(w, w_s)
        flat = out.view(E * T, out.shape[-1])
        for e in reversed(range(E)):
            for i in range(-(-int(masked_m[e]) // block)):
                r0 = e * T + i * block
                r1 = min(r0 + block, E * T)
                flat[r0:r1] = (rows[r0:r1] @ wf[e].T).to(out.dtype)

    return fn


# ----------------------------------------------------------------------- CPU-side helpers (no GPU)
def test_group_ends_from_m_indices():
    m = torch.tensor([-1, -1, 1, 1, -1, -1, 3, -1], dtype=torch.int32)
    assert _group_ends(m, 5).tolist() == [0, 4, 4, 7, 7]


def test_cpu_row_block_and_prepare_identity():
    assert gemm.contiguous_row_block("fp8", torch.device("cpu")) == 1
    wq, ws = reference.quantize_weights(torch.randn(2, 128, 256), "fp8")
    pq, ps = gemm.prepare_weights(wq, ws, "fp8", "cpu")
    assert torch.equal(pq.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(ps, ws)
    with pytest.raises(ValueError, match="prepare_weights: w_q expected dtype"):
        gemm.prepare_weights(wq, ws, "int8", "cpu")


def test_expert_offsets_argument_cpu():
    gen = torch.Generator().manual_seed(20)
    m_idx = _layout([3, 0, 5], 4, trailing_blocks=1)
    a, as_, w, ws = _operands("int8", (m_idx.numel(),), 3, 32, 64, "cpu", gen)
    offs = torch.tensor([0, 4, 4, 12], dtype=torch.int32)
    y = grouped_gemm(a, w, m_indices=m_idx, a_scales=as_, w_scales=ws, expert_offsets=offs)
    assert torch.equal(y, reference.grouped_gemm_contiguous(a, w, m_idx, as_, ws))
    opcheck(torch.ops.epmoe.grouped_gemm_contiguous.default, (a, w, m_idx, as_, ws, offs))
    with pytest.raises(ValueError, match="grouped_gemm: expert_offsets expected shape"):
        grouped_gemm(a, w, m_indices=m_idx, a_scales=as_, w_scales=ws, expert_offsets=offs[:3])
    with pytest.raises(ValueError, match="grouped_gemm: expert_offsets expected dtype"):
        grouped_gemm(a, w, m_indices=m_idx, a_scales=as_, w_scales=ws, expert_offsets=offs.long())


@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
@pytest.mark.parametrize("T", [38, 96, 128, 130])
def test_deep_gemm_masked_padding_cpu_model(scheme, T):
    """The padding path against a model of deep_gemm's 2-D block stores: exact live rows for any
    T, while the same model run unpadded (block 1 = no padding) corrupts the next expert."""
    gen = torch.Generator().manual_seed(21)
    E, N, K, block = 3, 128, 256, 128
    a, as_, w, ws = _operands(scheme, (E, T), E, N, K, "cpu", gen)
    mm = torch.tensor([T, T, T - 1], dtype=torch.int32)
    live = _live(mm, T)
    want = reference.grouped_gemm_masked(a, w, mm, as_, ws)
    calls = []
    y = _deep_gemm_masked(_block_store_model(block, calls), a, w, mm, as_, ws, 1, block)
    assert y.shape == (E, T, N) and y.is_contiguous()
    assert rel_l2(y[live], want[live]) < GEMM_VS_QUANT_AWARE
    (pa, ps), t_pad = calls[0], -(-T // block) * block
    assert pa.shape == (E, t_pad, K)
    if T % block:
        assert torch.equal(pa[:, :T].view(torch.uint8), a.view(torch.uint8))
    if ps is not None and T % block:
        assert (
            ps.shape == (E, t_pad, K // 128) and ps.stride(1) == 1 and torch.equal(ps[:, :T], as_)
        )
    raw = _deep_gemm_masked(_block_store_model(block), a, w, mm, as_, ws, 1, 1)
    raw_ok = rel_l2(raw[live], want[live]) < GEMM_VS_QUANT_AWARE
    assert raw_ok == (T % block == 0)


def test_masked_row_block_cpu():
    assert gemm.masked_row_block("fp8", torch.device("cpu")) == 1
    with pytest.raises(ValueError, match="grouped_gemm: scheme expected"):
        gemm.masked_row_block("fp4", torch.device("cuda"))


def test_dummy_operands_keep_shapes():
    for scheme in SCHEMES:
        w, _ = _dummy_weights(scheme, 2, 128, 256, "cpu")
        a, _ = _dummy_acts(scheme, (3, 5), 256, "cpu", mn_major=True)
        assert w.shape == (2, 128, 256) and a.shape == (3, 5, 256)
        assert w.dtype == a.dtype == _SCHEME_DTYPE[scheme]


def test_empty_fp8_act_scales_layout():
    s = gemm.empty_fp8_act_scales((6,), 3, "cpu")
    assert s.shape == (6, 3) and s.stride() == (1, 8)
    s3 = gemm.empty_fp8_act_scales((2, 5), 4, "cpu")
    assert s3.shape == (2, 5, 4) and s3.stride() == (32, 1, 8)


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_contiguous_vs_reference(scheme):
    gen = torch.Generator().manual_seed(11)
    dev = torch.device("cuda")
    E, N, K = 6, 256, 512
    counts = [0, 1, 130, 128, 7, 0]  # empty experts first and last, partial and exact blocks
    m_idx = _layout(counts, ALIGN).to(dev)
    a, as_, w, ws = _operands(scheme, (m_idx.numel(),), E, N, K, dev, gen)
    want = reference.grouped_gemm_contiguous(a, w, m_idx, as_, ws)
    live = m_idx >= 0
    pa, pas = _poison_rows(a, as_, ~live)  # -1 rows are never used for live rows
    y = grouped_gemm(pa, w, m_indices=m_idx, a_scales=pas, w_scales=ws)
    assert y.dtype == torch.bfloat16 and y.shape == (m_idx.numel(), N)
    assert torch.isfinite(y[live]).all()
    assert rel_l2(y[live], want[live]) < GEMM_VS_QUANT_AWARE


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("expected_m", ["low", "high"])
def test_masked_vs_reference(scheme, expected_m):
    gen = torch.Generator().manual_seed(12)
    dev = torch.device("cuda")
    E, T, N, K = 5, 96, 256, 384
    masked_m = torch.tensor([0, 3, 96, 40, 64], dtype=torch.int32, device=dev)
    em = 1 if expected_m == "low" else 4 * T  # beyond T: clamped
    a, as_, w, ws = _operands(scheme, (E, T), E, N, K, dev, gen)
    want = reference.grouped_gemm_masked(a, w, masked_m, as_, ws)
    live = torch.arange(T, device=dev)[None, :] < masked_m[:, None]
    pa, pas = _poison_rows(a, as_, ~live)  # rows past the count: never read into live rows
    y = grouped_gemm(pa, w, masked_m=masked_m, a_scales=pas, w_scales=ws, expected_m=em)
    assert y.shape == (E, T, N)
    assert torch.isfinite(y[live]).all()
    assert rel_l2(y[live], want[live]) < GEMM_VS_QUANT_AWARE


@pytest.mark.gpu
def test_int8_tuned_config_launches_same_bytes():
    """The INT8 kernels' autotuned launch: the first call tunes through the autotuner, later calls
    launch the kept config directly; both write the same bytes."""
    gen = torch.Generator().manual_seed(13)
    dev = torch.device("cuda")
    E, T, N, K = 4, 64, 256, 512
    masked_m = torch.tensor([0, 5, 64, 33], dtype=torch.int32, device=dev)
    a, as_, w, ws = _operands("int8", (E, T), E, N, K, dev, gen)
    runs = [grouped_gemm(a, w, masked_m=masked_m, a_scales=as_, w_scales=ws) for _ in range(3)]
    live = torch.arange(T, device=dev)[None, :] < masked_m[:, None]
    for y in runs[1:]:
        assert torch.equal(y[live], runs[0][live])
    counts = [3, 130, 0, 128]
    m_idx = _layout(counts, ALIGN).to(dev)
    a, as_, w, ws = _operands("int8", (m_idx.numel(),), E, N, K, dev, gen)
    runs = [grouped_gemm(a, w, m_indices=m_idx, a_scales=as_, w_scales=ws) for _ in range(3)]
    rows = m_idx >= 0
    for y in runs[1:]:
        assert torch.equal(y[rows], runs[0][rows])
    want = reference.grouped_gemm_contiguous(a, w, m_idx, as_, ws)
    assert rel_l2(runs[-1][rows], want[rows]) < GEMM_VS_QUANT_AWARE


# (T, expected_m): T on and off deep_gemm's row blocks (64/128), expected_m regimes (0 = T); few
# distinct expected_m values, since deep_gemm JIT-compiles a kernel per heuristic choice.
ANY_T = [(1, 0), (38, 1), (38, 8), (96, 64), (130, 0), (256, 8), (256, 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("T,expected_m", ANY_T)
def test_masked_any_t(scheme, T, expected_m):
    """Full experts next to each other: the rows a row block that does not divide T overwrites."""
    gen = torch.Generator().manual_seed(22)
    dev = torch.device("cuda")
    E, N, K = 4, 256, 512  # the shape of the other masked tests: shares their compiled kernels
    mm = torch.tensor([T, T, max(T - 1, 0), T], dtype=torch.int32, device=dev)
    a, as_, w, ws = _operands(scheme, (E, T), E, N, K, dev, gen)
    want = reference.grouped_gemm_masked(a, w, mm, as_, ws)
    live = _live(mm, T)
    for _ in range(3):  # the overwrite was a race: repeat
        y = grouped_gemm(a, w, masked_m=mm, a_scales=as_, w_scales=ws, expected_m=expected_m)
        assert y.shape == (E, T, N) and y.is_contiguous()
        assert rel_l2(y[live], want[live]) < GEMM_VS_QUANT_AWARE


@pytest.mark.gpu
def test_masked_row_block_cuda():
    dev = torch.device("cuda")
    assert gemm.masked_row_block("int8", dev) == 1
    for scheme in ("bf16", "fp8"):
        block = gemm.masked_row_block(scheme, dev)
        if not _dg_role(f"{scheme}_masked", dev):
            assert block == 1
        elif torch.cuda.get_device_capability()[0] == 9:
            assert block == 128  # deep_gemm sm90 masked BLOCK_M candidates: 64, 128
        else:
            assert block % 128 == 0


@pytest.mark.gpu
def test_fp8_scale_layouts_agree():
    """Row-major scales (deep_gemm transposes them) and MN-major TMA-aligned scales: same result."""
    gen = torch.Generator().manual_seed(13)
    dev = torch.device("cuda")
    E, N, K = 4, 256, 512
    m_idx = _layout([100, 0, 200, 3], ALIGN).to(dev)
    a, as_, w, ws = _operands("fp8", (m_idx.numel(),), E, N, K, dev, gen)
    live = m_idx >= 0
    y1 = grouped_gemm(a, w, m_indices=m_idx, a_scales=as_, w_scales=ws)
    y2 = grouped_gemm(a, w, m_indices=m_idx, a_scales=_mn_major(as_), w_scales=ws)
    assert torch.equal(y1[live], y2[live])
    T = 38  # not a multiple of 4: the TMA-aligned layout pads
    a3, as3, _, _ = _operands("fp8", (E, T), E, N, K, dev, gen)
    mm = torch.tensor([38, 0, 5, 17], dtype=torch.int32, device=dev)
    live3 = torch.arange(T, device=dev)[None, :] < mm[:, None]
    z1 = grouped_gemm(a3, w, masked_m=mm, a_scales=as3, w_scales=ws, expected_m=8)
    z2 = grouped_gemm(a3, w, masked_m=mm, a_scales=_mn_major(as3), w_scales=ws, expected_m=8)
    assert torch.equal(z1[live3], z2[live3])


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["fp8", "bf16"])
def test_op_matches_raw_deep_gemm(scheme):
    """Our op adds no math: bitwise equal to deep_gemm called directly (both layouts)."""
    needs_deep_gemm(scheme)
    gen = torch.Generator().manual_seed(19)
    dev = torch.device("cuda")
    E, N, K = 4, 256, 512
    m_idx = _layout([300, 0, 128, 5], ALIGN).to(dev)
    a, as_, w, ws = _operands(scheme, (m_idx.numel(),), E, N, K, dev, gen)
    if as_ is not None:
        as_ = _mn_major(as_)
    live = m_idx >= 0
    y = grouped_gemm(a, w, m_indices=m_idx, a_scales=as_, w_scales=ws)
    raw = raw_deep_gemm_contiguous(scheme, a, as_, w, ws, m_idx, torch.empty_like(y))
    assert torch.equal(y[live], raw[live])
    block = gemm.masked_row_block(scheme, dev)
    T = block  # a multiple of the row block: deep_gemm runs on our tensors as they are
    a3, as3, _, _ = _operands(scheme, (E, T), E, N, K, dev, gen)
    mm = torch.tensor([T, 0, 9, 33], dtype=torch.int32, device=dev)
    live3 = _live(mm, T)
    z = grouped_gemm(a3, w, masked_m=mm, a_scales=as3, w_scales=ws, expected_m=16)
    raw3 = raw_deep_gemm_masked(scheme, a3, as3, w, ws, mm, 16, torch.empty_like(z))
    assert torch.equal(z[live3], raw3[live3])
    # other T: same as deep_gemm on a copy padded to a multiple of the block
    T = 38
    a4, as4, _, _ = _operands(scheme, (E, T), E, N, K, dev, gen)
    mm4 = torch.tensor([T, 0, 9, 33], dtype=torch.int32, device=dev)
    z4 = grouped_gemm(a4, w, masked_m=mm4, a_scales=as4, w_scales=ws, expected_m=16)
    pa = torch.zeros((E, block, K), dtype=a4.dtype, device=dev)
    pa[:, :T] = a4
    pas = None
    if as4 is not None:
        pas = gemm.empty_fp8_act_scales((E, block), K // 128, dev).fill_(1.0)
        pas[:, :T] = as4
    raw4 = raw_deep_gemm_masked(
        scheme, pa, pas, w, ws, mm4, 16, torch.empty((E, block, N), dtype=z4.dtype, device=dev)
    )
    live4 = _live(mm4, T)
    assert torch.equal(z4[live4], raw4[:, :T][live4])


@pytest.mark.gpu
@pytest.mark.parametrize("with_offsets", [False, True])
def test_bf16_grouped_mm_fallback(monkeypatch, with_offsets):
    if not hasattr(torch, "_grouped_mm") or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm needs sm90+")
    monkeypatch.setattr(
        _ops,
        "_backend",
        lambda scheme, layout, *a: {"contiguous": "grouped_mm", "masked": "bmm"}[layout],
    )
    gen = torch.Generator().manual_seed(14)
    dev = torch.device("cuda")
    E, N, K = 5, 256, 384
    counts = [0, 33, 0, 256, 1]
    m_idx = _layout(counts, ALIGN).to(dev)
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + -(-c // ALIGN) * ALIGN)
    offs = torch.tensor(offsets, dtype=torch.int32, device=dev) if with_offsets else None
    a, _, w, _ = _operands("bf16", (m_idx.numel(),), E, N, K, dev, gen)
    live = m_idx >= 0
    pa, _ = _poison_rows(a, None, ~live)
    y = grouped_gemm(pa, w, m_indices=m_idx, expert_offsets=offs)
    want = reference.grouped_gemm_contiguous(a, w, m_idx)
    assert torch.isfinite(y[live]).all()
    assert rel_l2(y[live], want[live]) < GEMM_VS_QUANT_AWARE
    mm = torch.tensor([0, 4, 16, 9, 1], dtype=torch.int32, device=dev)
    a3, _, _, _ = _operands("bf16", (E, 16), E, N, K, dev, gen)
    z = grouped_gemm(a3, w, masked_m=mm, expected_m=4)
    live3 = torch.arange(16, device=dev)[None, :] < mm[:, None]
    assert rel_l2(z[live3], reference.grouped_gemm_masked(a3, w, mm)[live3]) < GEMM_VS_QUANT_AWARE


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_zero_rows(scheme):
    gen = torch.Generator().manual_seed(15)
    dev = torch.device("cuda")
    a, as_, w, ws = _operands(scheme, (0,), 3, 128, 256, dev, gen)
    y = grouped_gemm(
        a, w, m_indices=torch.empty(0, dtype=torch.int32, device=dev), a_scales=as_, w_scales=ws
    )
    assert y.shape == (0, 128)
    a3, as3, _, _ = _operands(scheme, (3, 8), 3, 128, 256, dev, gen)
    zero = torch.zeros(3, dtype=torch.int32, device=dev)
    z = grouped_gemm(a3, w, masked_m=zero, a_scales=as3, w_scales=ws, expected_m=8)
    assert z.shape == (3, 8, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_opcheck_cuda(scheme):
    """Fully specified inputs (no -1 rows, masked_m == T): test_aot_dispatch_dynamic compares
    whole outputs, and unspecified rows (-1 / past the count) are uninitialized memory."""
    gen = torch.Generator().manual_seed(16)
    dev = torch.device("cuda")
    E, N, K = 3, 128, 256
    m_idx = _layout([ALIGN, 0, 2 * ALIGN], ALIGN, trailing_blocks=0).to(dev)
    assert bool((m_idx >= 0).all())
    a, as_, w, ws = _operands(scheme, (m_idx.numel(),), E, N, K, dev, gen)
    opcheck(torch.ops.epmoe.grouped_gemm_contiguous.default, (a, w, m_idx, as_, ws))
    T = 16  # deep_gemm: not a multiple of masked_row_block, so the padded path is checked
    a3, as3, _, _ = _operands(scheme, (E, T), E, N, K, dev, gen)
    mm = torch.full((E,), T, dtype=torch.int32, device=dev)
    opcheck(torch.ops.epmoe.grouped_gemm_masked.default, (a3, w, mm, as3, ws, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cuda_graph_replay_after_warmup(scheme):
    """warmup() compiles everything; captured GEMMs replay with new routing (no recompiles)."""
    gen = torch.Generator().manual_seed(17)
    dev = torch.device("cuda")
    E, T, N, K, M = 4, 32, 256, 256, 4 * ALIGN
    a, as_, w, ws = _operands(scheme, (M,), E, N, K, dev, gen)
    a3, as3, _, _ = _operands(scheme, (E, T), E, N, K, dev, gen)
    em = 8
    gemm.warmup(scheme, E, N, K, dev, contiguous_m=[M], masked_t=T, expected_m=em, w=w, w_scales=ws)
    m_idx = _layout([ALIGN, ALIGN, 0, ALIGN], ALIGN, trailing_blocks=1).to(dev)
    mm = torch.tensor([8, 0, 32, 3], dtype=torch.int32, device=dev)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = grouped_gemm(a, w, m_indices=m_idx, a_scales=as_, w_scales=ws)
        z = grouped_gemm(a3, w, masked_m=mm, a_scales=as3, w_scales=ws, expected_m=em)
    for new_counts, new_layout in (
        ([1, 2, 3, 4], [0, ALIGN, 2 * ALIGN, 0]),
        ([0, 32, 7, 0], [3 * ALIGN, 0, 0, 0]),
    ):
        mm.copy_(torch.tensor(new_counts, dtype=torch.int32))
        m_idx.copy_(_layout(new_layout, ALIGN, trailing_blocks=4 - sum(new_layout) // ALIGN))
        g.replay()
        torch.cuda.synchronize()
        live = m_idx >= 0
        want = reference.grouped_gemm_contiguous(a, w, m_idx, as_, ws)
        assert rel_l2(y[live], want[live]) < GEMM_VS_QUANT_AWARE
        live3 = torch.arange(T, device=dev)[None, :] < mm[:, None]
        want3 = reference.grouped_gemm_masked(a3, w, mm, as3, ws)
        assert rel_l2(z[live3], want3[live3]) < GEMM_VS_QUANT_AWARE


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_row_block_and_alignment_error(scheme):
    from epmoe import EPMoE

    dev = torch.device("cuda")
    block = gemm.contiguous_row_block(scheme, dev)
    if scheme == "int8":
        assert block == 128
    elif _dg_role(f"{scheme}_contiguous", dev):
        import deep_gemm

        assert block == deep_gemm.get_mk_alignment_for_contiguous_layout()
    smallest = gemm.smallest_row_block(scheme, dev)
    assert smallest == (1 if scheme == "bf16" else 16)  # (bf16: torch._grouped_mm takes any)
    if smallest > 1:
        with pytest.raises(ValueError, match="alignment expected a multiple of 16"):
            EPMoE(8, 256, 128, 2, quant=scheme, alignment=24, backend="local", device=dev)


# our Triton kernels at the row blocks deep_gemm cannot take, autotuned as the layer runs them
@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("align", [16, 32, 64])
def test_triton_contiguous_small_row_blocks(scheme, align):
    from epmoe.ops.gemm import _triton

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(30 + align)
    m_idx = _layout([37, 0, align, 5], align).to(dev)
    a, as_, w, ws = _operands(scheme, (m_idx.numel(),), 4, 256, 512, dev, gen)
    live = m_idx >= 0
    want = reference.grouped_gemm_contiguous(a, w, m_idx, as_, ws)
    code = quant.get(scheme).kernel_code
    # every candidate config that runs this alignment (what the autotuner and the tuner pick from)
    ran = 0
    for cfg in _configs("contiguous", code, align):
        try:
            y = _triton.contiguous_triton(a, w, m_idx, as_, ws, row_block=align, config=cfg)
        except triton.runtime.errors.OutOfResources:  # (shared memory: the autotuner drops it)
            continue
        ran += 1
        assert rel_l2(y[live], want[live]) < GEMM_VS_QUANT_AWARE, cfg
    assert ran >= 2
    if align == 16:  # the op at an alignment deep_gemm cannot take: ours (bf16: grouped_mm)
        y2 = grouped_gemm(a, w, m_indices=m_idx, a_scales=as_, w_scales=ws, alignment=align)
        assert rel_l2(y2[live], want[live]) < GEMM_VS_QUANT_AWARE


# the TMA-fed configs (one program per tile, or persistent), explicit and as the tuned table's
# choice: the prepared launch builds the descriptors per call, also inside a CUDA graph capture
@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_triton_contiguous_tma_configs(scheme, monkeypatch):
    from epmoe.ops.gemm import _triton, _tuned

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(40)
    m_idx = _layout([300, 0, 128, 5], ALIGN, trailing_blocks=2).to(dev)
    a, as_, w, ws = _operands(scheme, (m_idx.numel(),), 4, 384, 640, dev, gen)
    live = m_idx >= 0
    want = reference.grouped_gemm_contiguous(a, w, m_idx, as_, ws)
    code = quant.get(scheme).kernel_code
    tma = _configs("contiguous", code, ALIGN, "TMA")
    assert tma
    for cfg in tma:
        y = _triton.contiguous_triton(a, w, m_idx, as_, ws, row_block=ALIGN, config=cfg)
        assert rel_l2(y[live], want[live]) < GEMM_VS_QUANT_AWARE, cfg
    cfg = tma[-1]
    explicit = _triton.contiguous_triton(a, w, m_idx, as_, ws, row_block=ALIGN, config=cfg)
    monkeypatch.setattr(_tuned, "lookup", lambda *args, **kw: dict(cfg))
    _triton._contiguous_plan.cache_clear()
    # a or out not 16-byte aligned: the same tiles through pointers, cached beside the TMA launch
    shifted = torch.empty(a.numel() + 1, dtype=a.dtype, device=dev)[1:].view(a.shape)
    shifted.copy_(a)
    plans, launch = [], _triton._launch_plan
    monkeypatch.setattr(
        _triton, "_launch_plan", lambda plan, *args: (plans.append(plan), launch(plan, *args))
    )
    try:
        first = _triton.contiguous_triton(a, w, m_idx, as_, ws, row_block=ALIGN)
        pointers = _triton.contiguous_triton(shifted, w, m_idx, as_, ws, row_block=ALIGN)
        odd = torch.empty(want.numel() + 1, dtype=torch.bfloat16, device=dev)[1:]
        odd_out = _triton.contiguous_triton(a, w, m_idx, as_, ws, row_block=ALIGN,
                                            out=odd.view(want.shape))  # fmt: skip
        again = _triton.contiguous_triton(a, w, m_idx, as_, ws, row_block=ALIGN)
        out = torch.zeros_like(first)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _triton.contiguous_triton(a, w, m_idx, as_, ws, row_block=ALIGN, out=out)
        graph.replay()
        torch.cuda.synchronize()
    finally:
        _triton._contiguous_plan.cache_clear()
    for y in (first, again, out):
        assert torch.equal(y[live], explicit[live])
    assert rel_l2(pointers[live], want[live]) < GEMM_VS_QUANT_AWARE
    assert rel_l2(odd_out[live], want[live]) < GEMM_VS_QUANT_AWARE
    assert len({id(p) for p in plans}) == 1
    feeds = {key: bool(p.meta.get("TMA")) for key, p in plans[0].prepared.items()}
    assert feeds == {
        (torch.cuda.current_device(), False): False,
        (torch.cuda.current_device(), True): True,
    }


# the Gluon kernels (int8: asynchronous wgmma) write the Triton kernel's bytes in int8 (the
# same tiles' int32 sums and float ops) and fp8 (the same per-step wgmma sums and float ops;
# bf16: its float32 sums, in an order the two need not share, so against the reference); three
# multiprocessors, so each program loops over many tiles (stages and barrier phases carried
# across tiles), K = 576 a partial last step for K tiles of 128 (fp8: whole 128 x 128 blocks)
_FP8_NK = {"fp8": (384, 640)}


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["int8", "fp8", "bf16"])
def test_gluon_equals_triton_bytes(monkeypatch, scheme):
    from epmoe.ops.gemm import _triton

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(41)
    m_idx = _layout([700, 0, 1, 257, 130], ALIGN, trailing_blocks=3).to(dev)
    a, as_, w, ws = _operands(scheme, (m_idx.numel(),), 5, *_FP8_NK.get(scheme, (448, 576)), dev,
                              gen)  # fmt: skip
    live = m_idx >= 0
    want = reference.grouped_gemm_contiguous(a, w, m_idx, as_, ws)
    monkeypatch.setattr(_triton, "_multiprocessors", lambda device: 3)
    code = quant.get(scheme).kernel_code
    gluon = _configs("contiguous", code, ALIGN, "GLUON")
    assert len(gluon) >= (1 if scheme == "fp8" else 4)  # (fp8: the 64x128 tile two an SM)
    for cfg in gluon:
        y = _triton.contiguous_triton(a, w, m_idx, as_, ws, row_block=ALIGN, config=cfg)
        triton_cfg = {k: v for k, v in cfg.items() if k not in _triton._GLUON_KEYS}
        x = _triton.contiguous_triton(a, w, m_idx, as_, ws, row_block=ALIGN, config=triton_cfg)
        assert scheme == "bf16" or torch.equal(y[live], x[live]), cfg
        assert rel_l2(y[live], want[live]) < GEMM_VS_QUANT_AWARE, cfg


# the masked Gluon kernel: the Triton masked kernel's bytes on every live row (int8, fp8; bf16:
# the reference's values, as above), its count check set, and a CUDA-graph replay; three
# multiprocessors, so each program loops over many tiles. Slots of T = 200 rows (a multiple of
# neither row tile): rows past each count never written (a TMA-store config stores from
# registers); T = 256: a TMA-store config writes whole live row blocks, never a dead one
@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["int8", "fp8", "bf16"])
@pytest.mark.parametrize("T", [200, 256])
def test_gluon_masked_equals_triton_bytes(monkeypatch, scheme, T):
    from epmoe.ops.gemm import _triton

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(42)
    E, (N, K) = 5, _FP8_NK.get(scheme, (448, 576))
    a, as_, w, ws = _operands(scheme, (E, T), E, N, K, dev, gen)
    same = torch.equal if scheme != "bf16" else lambda y, x: rel_l2(y, x) < GEMM_VS_QUANT_AWARE
    mm = torch.tensor([T, 0, 1, 129, 64], dtype=torch.int32, device=dev)
    rows = torch.arange(T, device=dev)[None, :]
    live = rows < mm[:, None]
    want = reference.grouped_gemm_masked(a, w, mm, as_, ws)
    monkeypatch.setattr(_triton, "_multiprocessors", lambda device: 3)
    sentinel = torch.full((E, T, N), 3.0, dtype=torch.bfloat16, device=dev)
    code = quant.get(scheme).kernel_code
    gluon = _configs("masked", code, 16, "GLUON")
    assert len(gluon) >= 3 and any(c.get("STORE_TMA") for c in gluon)
    x = _triton.masked_triton(a, w, mm, as_, ws, 64, config=dict(BLOCK_N=64, BLOCK_K=128))
    for cfg in gluon:
        ok = torch.tensor(False, device=dev)
        y = _triton.masked_triton(a, w, mm, as_, ws, 64, config=cfg, out=sentinel.clone(), ok=ok)
        assert same(y[live], x[live]) and bool(ok), cfg
        bm = cfg["BLOCK_M"] if cfg.get("STORE_TMA") and T % cfg["BLOCK_M"] == 0 else 1
        kept = rows >= (mm[:, None] + bm - 1) // bm * bm  # (past the live row blocks)
        assert torch.equal(y[kept], sentinel[kept]), cfg
        assert bm == 1 or not torch.equal(y[~live & ~kept], sentinel[~live & ~kept]), cfg
        assert rel_l2(y[live], want[live]) < GEMM_VS_QUANT_AWARE, cfg
    for cfg in (gluon[0], next(c for c in gluon if c.get("STORE_TMA"))):
        out, counts = sentinel.clone(), mm.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _triton.masked_triton(a, w, counts, as_, ws, 64, config=cfg, out=out)
        counts.copy_(torch.tensor([3, T, 0, 0, 70], dtype=torch.int32))  # (new counts, same graph)
        graph.replay()
        now = rows < counts[:, None]
        x = _triton.masked_triton(a, w, counts, as_, ws, 64, config=dict(BLOCK_N=64, BLOCK_K=128))
        assert same(out[now], x[now]), cfg
        assert cfg.get("STORE_TMA") or torch.equal(out[~now], sentinel[~now]), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_triton_masked_every_scheme(scheme):
    from epmoe.ops.gemm import _triton

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(33)
    E, T = 4, 40
    a, as_, w, ws = _operands(scheme, (E, T), E, 256, 512, dev, gen)
    mm = torch.tensor([0, 7, 40, 16], dtype=torch.int32, device=dev)
    y = _triton.masked_triton(a, w, mm, as_, ws, expected_m=16)
    live = torch.arange(T, device=dev)[None, :] < mm[:, None]
    want = reference.grouped_gemm_masked(a, w, mm, as_, ws)
    assert rel_l2(y[live], want[live]) < GEMM_VS_QUANT_AWARE


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("spec,bias", [("silu", False), ("silu:alpha=1.702,limit=7.0,up_offset=1.0",
                                       True), ("relu2:glu=0", False)])  # fmt: skip
@pytest.mark.parametrize("align", [16, 128])
def test_gemm_gate_fused_kernel(scheme, spec, bias, align):
    """GEMM1 + gate in one kernel on the GPU (autotuned) vs the references, and its graph replay."""
    from epmoe import gate as G

    dev = torch.device("cuda")
    g = G.get(spec)
    gen = torch.Generator().manual_seed(40 + align)
    m_idx = _layout([37, 0, align, 5], align).to(dev)
    a, as_, w, ws = _operands(scheme, (m_idx.numel(),), 4, g.width(256), 512, dev, gen)
    b = torch.randn(4, g.width(256), generator=gen).to(dev) if bias else None
    y = reference.grouped_gemm_contiguous(a, w, m_idx, as_, ws)
    h, s = gemm.grouped_gemm_gate(a, w, m_idx, as_, ws, spec, b, "deepgemm", align)
    live = m_idx >= 0
    if scheme == "bf16":
        want = reference.silu_and_mul(y, g, b, m_idx)
        assert s.shape == (m_idx.numel(), 0) and rel_l2(h[live], want[live]) < 2e-2
    else:
        q, qs = reference.silu_and_mul_quant(y, scheme, 128, g, b, m_idx)
        got = reference.dequantize(h[live], s[live])
        assert rel_l2(got, reference.dequantize(q[live], qs[live])) < 3e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h2, s2 = gemm.grouped_gemm_gate(a, w, m_idx, as_, ws, spec, b, "deepgemm", align)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(h2[live].view(torch.uint8), h[live].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_triton_masked_tma_and_swap_configs(scheme):
    """Every TMA-fed or SWAP masked config (the decode weight stream) against the reference, in a
    graph, at row tiles of 32 and 16 (SWAP: wgmma's N)."""
    from epmoe.ops.gemm import _triton

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(42)
    E, T = 4, 128
    a, as_, w, ws = _operands(scheme, (E, T), E, 384, 640, dev, gen)
    mm = torch.tensor([0, 5, 77, 128], dtype=torch.int32, device=dev)
    live = _live(mm, T)
    want = reference.grouped_gemm_masked(a, w, mm, as_, ws)
    code = quant.get(scheme).kernel_code
    # (Gluon's: their own test)
    tma = [dict(c, BLOCK_M=bm) for bm in (32, 16) for c in _configs("masked", code, bm)
           if (c.get("TMA") or c.get("SWAP")) and not c.get("GLUON")]  # fmt: skip
    assert any(c.get("SWAP") for c in tma)
    for cfg in tma:
        eager = _triton.masked_triton(a, w, mm, as_, ws, 32, config=cfg)  # (compiles it)
        out = torch.zeros((E, T, 384), dtype=torch.bfloat16, device=dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _triton.masked_triton(a, w, mm, as_, ws, 32, config=cfg, out=out)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_l2(eager[live], want[live]) < GEMM_VS_QUANT_AWARE, cfg
        assert torch.equal(out[live], eager[live]) and (out[~live] == 0).all(), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_masked_gate_configs_are_the_unfused_pair(scheme):
    """Every masked GEMM1 + gate candidate that fits (pointers, TMA, SWAP) at row tiles of 16 /
    32 / 64: the masked GEMM1 of the same tile then the activation, byte for byte on the live
    rows, in a graph; gpt-oss's gate with biases; rows past the counts never written."""
    from epmoe import gate as G
    from epmoe.ops import activation
    from epmoe.ops.gemm import _triton

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(43)
    spec = "silu:alpha=1.702,limit=7.0,up_offset=1.0"
    g, E, T, I = G.get(spec), 4, 128, 256
    a, as_, w, ws = _operands(scheme, (E, T), E, g.width(I), 640, dev, gen)
    b = torch.randn((E, g.width(I)), generator=gen).to(dev)
    mm = torch.tensor([0, 5, 77, 128], dtype=torch.int32, device=dev)
    live = _live(mm, T)
    code = quant.get(scheme).kernel_code
    cfgs = [dict(c, BLOCK_M=bm) for bm in (64, 32, 16) for c in _configs("masked_gate", code, bm)]
    assert any(c.get("SWAP") for c in cfgs) and any(c.get("TMA") for c in cfgs)
    h_dtype = torch.bfloat16 if scheme != "fp8" else a.dtype
    for cfg in cfgs:
        y = _triton.masked_triton(a, w, mm, as_, ws, 32, config=cfg)
        if scheme == "fp8":
            want, want_s = activation.silu_and_mul_quant(y, "fp8", masked_m=mm, gate=spec, bias=b)
        else:
            want = activation.silu_and_mul(y, mm, gate=spec, bias=b)
        h = torch.full((E, T, I), 3.0, device=dev).to(h_dtype)
        hs = torch.full((E, T, I // 128), -1.0, device=dev)
        _triton.masked_gate_triton(a, w, mm, as_, ws, g, b, h, hs, 32, config=cfg)  # (compiles)
        h.fill_(3.0)
        hs.fill_(-1.0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _triton.masked_gate_triton(a, w, mm, as_, ws, g, b, h, hs, 32, config=cfg)
        graph.replay()
        torch.cuda.synchronize()
        if scheme == "fp8":
            assert torch.equal(h[live].view(torch.uint8), want[live].view(torch.uint8)), cfg
            assert torch.equal(hs[live], want_s[live]), cfg
        else:
            assert torch.equal(h[live], want[live]), cfg
        assert (h[~live].float() == 3.0).all() and (hs[~live] == -1.0).all(), cfg


# the Gluon GEMM1 + gate (bf16, the plain SiLU): the reference's values and the Triton gate
# kernel's within bf16 rounding (its float32 sums need not share the order), -1 blocks never
# written; three multiprocessors, so each program loops over many tiles (stages and barrier
# phases carried across tiles), K = 576 a partial last step
@pytest.mark.gpu
def test_gluon_gate_matches_triton(monkeypatch):
    from epmoe import gate as G
    from epmoe.ops.gemm import _triton

    dev = torch.device("cuda")
    g, I = G.get("silu"), 384  # (three column tiles of 128)
    gen = torch.Generator().manual_seed(43)
    m_idx = _layout([700, 0, 1, 257, 130], ALIGN, trailing_blocks=3).to(dev)
    a, _, w, _ = _operands("bf16", (m_idx.numel(),), 5, g.width(I), 576, dev, gen)
    live = m_idx >= 0
    want = g.reference(reference.grouped_gemm_contiguous(a, w, m_idx).float())
    monkeypatch.setattr(_triton, "_multiprocessors", lambda device: 3)
    gluon = _configs("gate", 0, ALIGN, "GLUON")
    assert len(gluon) >= 2

    def gate(cfg):
        h = torch.full((m_idx.numel(), I), 3.0, dtype=torch.bfloat16, device=dev)
        hs = torch.zeros((m_idx.numel(), I // 128), device=dev)
        _triton.contiguous_gate_triton(a, w, m_idx, None, None, g, None, h, hs, row_block=ALIGN,
                                       config=cfg)  # fmt: skip
        return h

    dead = (m_idx.view(-1, ALIGN)[:, :1] < 0).expand(-1, ALIGN).reshape(-1)  # (whole -1 blocks)
    x = gate(dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3))
    for cfg in gluon:
        y = gate(cfg)
        assert rel_l2(y[live].float(), x[live].float()) < 1e-2, cfg
        assert rel_l2(y[live].float(), want[live]) < GEMM_VS_QUANT_AWARE, cfg
        assert dead.any() and (y[dead] == 3.0).all(), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_gemm_gate_tma_configs(scheme):
    """Every TMA-fed GEMM1 + gate config against the pointer kernel of the same tiles."""
    from epmoe import gate as G
    from epmoe.ops.gemm import _triton

    dev = torch.device("cuda")
    g = G.get("silu:alpha=1.702,limit=7.0,up_offset=1.0")
    gen = torch.Generator().manual_seed(41)
    m_idx = _layout([300, 0, 128, 5], ALIGN, trailing_blocks=2).to(dev)
    a, as_, w, ws = _operands(scheme, (m_idx.numel(),), 4, g.width(256), 640, dev, gen)
    b = torch.randn(4, g.width(256), generator=gen).to(dev)
    live = m_idx >= 0
    code = quant.get(scheme).kernel_code
    tma = _configs("gate", code, ALIGN, "TMA")
    assert tma
    for cfg in tma:
        outs = []
        for c in (cfg, {k: v for k, v in cfg.items() if k not in ("TMA", "PERSISTENT")}):
            h = torch.zeros((m_idx.numel(), 256), device=dev,
                            dtype=torch.bfloat16 if scheme == "int8" else a.dtype)  # fmt: skip
            hs = torch.zeros((m_idx.numel(), 2), device=dev)
            _triton.contiguous_gate_triton(a, w, m_idx, as_, ws, g, b, h, hs, row_block=ALIGN,
                                           config=c)  # fmt: skip
            outs.append(h[live].float())
        assert rel_l2(outs[0], outs[1]) < 1e-2, cfg


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("align", [16, 64])
def test_layer_small_alignment_matches_reference(scheme, align):
    """The whole one-rank layer at a permute alignment deep_gemm cannot take (graph replay too)."""
    from epmoe import EPMoE
    from tests._moe import global_weights, tokens

    dev = torch.device("cuda")
    shape = dict(num_experts=8, hidden_size=256, intermediate_size=256, top_k=2)
    layer = EPMoE(**shape, quant=scheme, mode="ht", alignment=align, backend="local", device=dev)
    w1, w2 = global_weights(**shape)
    layer.load_weights(w1, w2)
    x, ids, w = (t.to(dev) for t in tokens(48, seed=align, **shape))
    layer.warmup([48])
    out = layer(x, ids, w)
    want = reference.quantized_moe(x, ids, w, w1.to(dev), w2.to(dev), scheme)
    assert rel_l2(out, want) < 2e-2
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        replayed = layer(x, ids, w)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)


@pytest.mark.gpu
def test_masked_counts_out_of_range_debug():
    from epmoe import _checks

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(18)
    a3, as3, w, ws = _operands("int8", (2, 8), 2, 64, 64, dev, gen)
    _checks.set_debug(True)
    try:
        with pytest.raises(ValueError, match="masked_m expected counts in"):
            grouped_gemm(
                a3,
                w,
                masked_m=torch.tensor([9, 0], dtype=torch.int32, device=dev),
                a_scales=as3,
                w_scales=ws,
            )
    finally:
        _checks.set_debug(False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "scheme,fused,gathered",
    [("bf16", True, False), ("fp8", True, False), ("int8", True, False), ("bf16", False, True),
     ("fp8", True, True), ("int8", False, True)],
)  # fmt: skip
def test_layer_measured_variants_warm_up_and_replay(scheme, fused, gathered, monkeypatch):
    """A layer whose table fuses GEMM1 and the gate and / or has GEMM1 gather its rows (permute
    copying none): warmup compiles those builds (nothing compiles inside the capture), the replay
    gives the eager bytes, the output is the plain layer's (int8 gathering alone: the same kernel,
    bit for bit)."""
    from epmoe import EPMoE
    from epmoe import layer as layer_mod
    from epmoe.ops.gemm import _weights
    from tests._moe import global_weights, tokens

    dev = torch.device("cuda")
    shape = dict(num_experts=8, hidden_size=256, intermediate_size=256, top_k=2)
    kw = dict(quant=scheme, mode="ht", alignment=32, backend="local", device=dev,
              gate="silu:alpha=1.702,limit=7.0,up_offset=1.0")  # fmt: skip
    w1, w2 = global_weights(**shape)
    x, ids, w = (t.to(dev) for t in tokens(40, seed=9, **shape))
    plain = EPMoE(**shape, **kw)
    plain.load_weights(w1, w2)
    want = plain(x, ids, w)
    for mod in (layer_mod, _weights):
        monkeypatch.setattr(mod, "fuses_gate", lambda *args: fused)
        monkeypatch.setattr(mod, "gathers", lambda *args: gathered)
    monkeypatch.setattr(layer_mod._tuned, "has", lambda *args: True)  # (a table with entries)
    layer = EPMoE(**shape, **kw)
    layer.load_weights(w1, w2)
    layer.warmup([40])
    with layer.record_stages() as rec:
        out = layer(x, ids, w)
    assert ("gemm1" in rec) is not fused and (rec["permute"].x.shape[1] == 0) is gathered
    if scheme == "int8" and not fused:
        assert torch.equal(out, want)
    else:
        assert rel_l2(out, want) < 2e-2
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        replayed = layer(x, ids, w)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)
