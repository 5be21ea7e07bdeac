"""Local-stage benchmarks (one GPU): permute, unpermute, quantize, silu_and_mul_quant, ll_scatter,
ll_gather.

Every benchmark reports in ``extra_info`` the achieved GB/s (bytes the op must read + write, per
stage below) next to the HBM copy ceiling measured in the same run (``ceiling_gbps``) and the
torch-eager baseline, the reference implementation of :mod:`epmoe.reference` timed the same way
(``eager_ms``, ``speedup_vs_eager``). Times are medians of CUDA events around CUDA-graph replays
with the L2 flushed before each call (see ``_timing``). Shapes come from ``_configs`` (default:
workload W; ``EPMOE_BENCH_CONFIGS=W,small`` for more):

- prefill: the tokens one rank receives in HT mode (``prefill_tokens`` rows, top-k, about half of
  the choices local), the contiguous layout of ``permuted_rows`` rows, ``alignment`` 128;
- decode: the LL masked layout ``[E, decode_capacity, *]`` with about ``decode_rows_per_expert``
  live rows per expert (and, for permute / unpermute / ll_scatter / ll_gather, ``decode_capacity``
  received tokens, their choices routed as in prefill: the one-rank LL path's two data movers).

Bytes counted: permute reads each token that has a local choice once (+ its scales and the ids)
and writes each live copy (+ scales, m_indices, inv_perm, offsets); unpermute reads the live rows
(+ ids, weights) and writes one row per token; quantize / silu_and_mul_quant read the live rows
and write their payload and scales (rows skipped by masked_m / m_indices are neither read nor
counted); ll_scatter reads each token with a local choice once (+ the ids) and writes each live
slot (+ scales, masked_m, rows); ll_gather moves unpermute's bytes. The eager baseline is
charged the same bytes (same work, its time).

Run on the GPU machine (then ``python scripts/record_results.py --gpu h200 stages.json``):
  python -m pytest benchmarks/test_bench_stages.py --benchmark-enable --benchmark-json=stages.json
"""

import functools

import _bytes
import _configs
import _timing
import pytest
import torch

from epmoe import reference
from epmoe.ops import ll_gather, ll_scatter, permute, quantize, silu_and_mul_quant, unpermute

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CONFIGS = _configs.selected()
TARGETS = {"permute": 0.80, "unpermute": 0.75, "quantize": 0.80, "silu_and_mul_quant": 0.75}
TARGETS.update(ll_scatter=TARGETS["permute"], ll_gather=TARGETS["unpermute"])  # (the LL twins)
PERMUTE_VS_EAGER = 4.0  # permute must also be >= 4x the eager reference
SEED = 0


@pytest.fixture(params=CONFIGS, ids=[c.name for c in CONFIGS])
def cfg(request):
    return request.param


# ------------------------------------------------------------------------------------------ data
@functools.cache
def _routing(cfg: _configs.ModelConfig, tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED)
    return _configs.received_routing(cfg, tokens, gen).cuda()


@functools.cache
def _payload(cfg: _configs.ModelConfig, tokens: int, scheme: str):
    """Received rows `[tokens, H]` (bf16, or quantized with row-layout scales as dispatch sends)."""
    gen = torch.Generator(device="cuda").manual_seed(SEED + 1)
    x = torch.randn((tokens, cfg.hidden), generator=gen, device="cuda").to(torch.bfloat16)
    if scheme == "bf16":
        return x, None
    return reference.quantize(x, scheme, cfg.quant_group)


@functools.cache
def _layout(cfg: _configs.ModelConfig, tokens: int):
    """(m_indices, inv_perm, expert_offsets) of permute for this routing (any payload)."""
    ids = _routing(cfg, tokens)
    x = torch.empty((tokens, 16), dtype=torch.uint8, device="cuda")
    p = permute(x, ids, cfg.local_experts, cfg.alignment)
    return p.m_indices, p.inv_perm, p.expert_offsets


def _masked(cfg, gen_seed: int = SEED + 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(gen_seed)
    return _configs.decode_masked_m(cfg, gen).cuda()


def _count(t: torch.Tensor) -> int:
    return int(t.sum().item())  # setup only, never inside a timed call


# ---------------------------------------------------------------------------------------- permute
def _permute_case(benchmark, cfg, tokens: int, scheme: str, shape: str):
    ids = _routing(cfg, tokens)
    x, s = _payload(cfg, tokens, scheme)
    E, A, H, K = cfg.local_experts, cfg.alignment, cfg.hidden, cfg.top_k
    layout = "deepgemm" if scheme == "fp8" else "row"
    S = 0 if s is None else s.shape[1]
    valid = ids >= 0
    copies, sources = _count(valid), _count(valid.any(dim=1))
    m_sum = reference.permuted_rows(tokens, K, E, A)
    row = H * x.element_size() + 4 * S
    nbytes = _bytes.permute_bytes(sources, copies, ids.numel(), ids.element_size(), row, m_sum, E)
    _timing.record(
        benchmark,
        lambda: permute(x, ids, E, A, s, scale_layout=layout),
        nbytes,
        baseline=lambda: reference.permute(x, ids, E, A, s),
        target=TARGETS["permute"],
        target_vs_baseline=PERMUTE_VS_EAGER,
        config=cfg.name,
        shape=shape,
        payload=scheme,
        tokens=tokens,
        live_copies=copies,
    )


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_permute_prefill(benchmark, cfg, scheme):
    _permute_case(benchmark, cfg, cfg.prefill_tokens, scheme, "prefill")


def test_permute_decode(benchmark, cfg):
    _permute_case(benchmark, cfg, cfg.decode_capacity, "fp8", "decode")


# -------------------------------------------------------------------------------------- unpermute
def _unpermute_case(benchmark, cfg, tokens: int, shape: str):
    ids = _routing(cfg, tokens)
    _, inv, _ = _layout(cfg, tokens)
    m_sum = reference.permuted_rows(tokens, cfg.top_k, cfg.local_experts, cfg.alignment)
    gen = torch.Generator(device="cuda").manual_seed(SEED + 3)
    y = torch.randn((m_sum, cfg.hidden), generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.rand(ids.shape, generator=gen, device="cuda")
    copies = _count(inv >= 0)
    nbytes = _bytes.unpermute_bytes(copies, tokens, cfg.hidden, inv.numel())
    _timing.record(
        benchmark,
        lambda: unpermute(y, inv, w),
        nbytes,
        baseline=lambda: reference.unpermute(y, inv, w),
        target=TARGETS["unpermute"],
        config=cfg.name,
        shape=shape,
        tokens=tokens,
        live_copies=copies,
    )


def test_unpermute_prefill(benchmark, cfg):
    _unpermute_case(benchmark, cfg, cfg.prefill_tokens, "prefill")


def test_unpermute_decode(benchmark, cfg):
    _unpermute_case(benchmark, cfg, cfg.decode_capacity, "decode")


# --------------------------------------------------------------------------------------- quantize
@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_quantize_prefill(benchmark, cfg, scheme):
    x, _ = _payload(cfg, cfg.prefill_tokens, "bf16")
    nbytes = _bytes.quant_bytes(x.shape[0], cfg.hidden, 2, scheme, cfg.quant_group)
    _timing.record(
        benchmark,
        lambda: quantize(x, scheme, cfg.quant_group),
        nbytes,
        baseline=lambda: reference.quantize(x, scheme, cfg.quant_group),
        target=TARGETS["quantize"],
        config=cfg.name,
        shape="prefill",
        scheme=scheme,
        rows=x.shape[0],
    )


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_quantize_decode(benchmark, cfg, scheme):
    E, T = cfg.local_experts, cfg.decode_capacity
    gen = torch.Generator(device="cuda").manual_seed(SEED + 4)
    x = torch.randn((E, T, cfg.hidden), generator=gen, device="cuda").to(torch.bfloat16)
    mm = _masked(cfg)
    rows = _count(mm.clamp(max=T))
    nbytes = _bytes.quant_bytes(rows, cfg.hidden, 2, scheme, cfg.quant_group)
    layout = "deepgemm" if scheme == "fp8" else "row"
    _timing.record(
        benchmark,
        lambda: quantize(x, scheme, cfg.quant_group, mm, scale_layout=layout),
        nbytes,
        baseline=lambda: reference.quantize(x, scheme, cfg.quant_group),
        target=TARGETS["quantize"],
        config=cfg.name,
        shape="decode",
        scheme=scheme,
        rows=rows,
    )


# ----------------------------------------------------------------------------- silu_and_mul_quant
@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_silu_and_mul_quant_prefill(benchmark, cfg, scheme):
    m_idx, _, offs = _layout(cfg, cfg.prefill_tokens)
    gen = torch.Generator(device="cuda").manual_seed(SEED + 5)
    y = torch.randn((m_idx.numel(), 2 * cfg.intermediate), generator=gen, device="cuda")
    y = y.to(torch.bfloat16)
    rows = _count(m_idx >= 0)
    nbytes = (
        _bytes.quant_bytes(rows, cfg.intermediate, 4, scheme, cfg.quant_group) + 4 * m_idx.numel()
    )
    layout = "deepgemm" if scheme == "fp8" else "row"
    _timing.record(
        benchmark,
        lambda: silu_and_mul_quant(y, scheme, None, cfg.quant_group, m_idx, layout, offs),
        nbytes,
        baseline=lambda: reference.silu_and_mul_quant(y, scheme, cfg.quant_group),
        target=TARGETS["silu_and_mul_quant"],
        config=cfg.name,
        shape="prefill",
        scheme=scheme,
        rows=rows,
        m_sum=m_idx.numel(),
    )


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_silu_and_mul_quant_decode(benchmark, cfg, scheme):
    E, T = cfg.local_experts, cfg.decode_capacity
    gen = torch.Generator(device="cuda").manual_seed(SEED + 6)
    y = torch.randn((E, T, 2 * cfg.intermediate), generator=gen, device="cuda")
    y = y.to(torch.bfloat16)
    mm = _masked(cfg)
    rows = _count(mm.clamp(max=T))
    nbytes = _bytes.quant_bytes(rows, cfg.intermediate, 4, scheme, cfg.quant_group)
    layout = "deepgemm" if scheme == "fp8" else "row"
    _timing.record(
        benchmark,
        lambda: silu_and_mul_quant(y, scheme, mm, cfg.quant_group, scale_layout=layout),
        nbytes,
        baseline=lambda: reference.silu_and_mul_quant(y, scheme, cfg.quant_group),
        target=TARGETS["silu_and_mul_quant"],
        config=cfg.name,
        shape="decode",
        scheme=scheme,
        rows=rows,
    )


# ------------------------------------------------------------------------ ll_scatter / ll_gather
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_ll_scatter_decode(benchmark, cfg, scheme):
    T, E, H = cfg.decode_capacity, cfg.local_experts, cfg.hidden
    ids = _routing(cfg, T)
    x, _ = _payload(cfg, T, "bf16")
    layout = "deepgemm" if scheme == "fp8" else "row"
    valid = ids >= 0
    copies, sources = _count(valid), _count(valid.any(dim=1))
    xo, s = ll_scatter(x, ids, E, T, scheme, scale_layout=layout)[:2]  # (a slot's bytes)
    slot = H * xo.element_size() + 4 * s.shape[-1]
    n_ids = ids.numel()
    nbytes = _bytes.ll_scatter_bytes(sources, copies, n_ids, ids.element_size(), 2 * H, slot, E)
    _timing.record(
        benchmark,
        lambda: ll_scatter(x, ids, E, T, scheme, scale_layout=layout),
        nbytes,
        baseline=lambda: reference.ll_scatter(x, ids, E, T, scheme),
        target=TARGETS["ll_scatter"],
        config=cfg.name,
        shape="decode",
        scheme=scheme,
        tokens=T,
        live_copies=copies,
    )


def test_ll_gather_decode(benchmark, cfg):
    T, E, H = cfg.decode_capacity, cfg.local_experts, cfg.hidden
    ids = _routing(cfg, T)
    x = torch.empty((T, 16), dtype=torch.uint8, device="cuda")
    rows = ll_scatter(x, ids, E, T)[3]
    gen = torch.Generator(device="cuda").manual_seed(SEED + 7)
    y = torch.randn((E, T, H), generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.rand(ids.shape, generator=gen, device="cuda")
    copies = _count(rows >= 0)
    nbytes = _bytes.unpermute_bytes(copies, T, H, rows.numel())
    _timing.record(
        benchmark,
        lambda: ll_gather(y, rows, w, check=False),
        nbytes,
        baseline=lambda: reference.ll_gather(y, rows, w),
        target=TARGETS["ll_gather"],
        config=cfg.name,
        shape="decode",
        tokens=T,
        live_copies=copies,
    )
