"""Pure-torch specification of every stage, and the CPU kernels of the ``epmoe`` ops.

Everything here is sync-free with static output shapes (it also runs on CUDA and traces under
torch.compile), written for clarity rather than speed. Shape legend: ``T`` tokens (``M`` received
rows), ``K`` top-k, ``H`` hidden, ``E`` local experts, ``A`` alignment, ``N``/``Kd`` GEMM
output/reduction dims, ``S`` scale groups per row.
"""

from typing import Optional, Tuple

import torch

from epmoe import _checks, quant
from epmoe import gate as _gate

# one source: the schemes' constants and quantizers live in epmoe.quant (re-exported here)
FP8_DTYPE, FP8_MAX, INT8_MAX = quant.FP8_DTYPE, quant.FP8_MAX, quant.INT8_MAX
SCALE_EPS, FP8_WEIGHT_BLOCK = quant.SCALE_EPS, quant.FP8_WEIGHT_BLOCK
QUANT_SCHEMES = tuple(quant.SCHEMES)
SCHEME_OF_DTYPE = {s.act_dtype: s.name for s in quant.SCHEMES.values()}  # GEMM operands
quantize_fp8, quantize_int8 = quant.quantize_fp8, quant.quantize_int8
dequantize, dequantize_weights = quant.dequantize, quant.dequantize_weights


def round_up(x, m: int):
    return (x + m - 1) // m * m


def permuted_rows(num_rows: int, top_k: int, num_experts: int, alignment: int) -> int:
    """Static bound M_sum = round_up(M*K + E*(A-1), A) on the rows of the permuted layout."""
    return round_up(num_rows * top_k + num_experts * (alignment - 1), alignment)


# ----------------------------------------------------------------------------------------- quantize
# The quantizers' math is in epmoe.quant (quantize_fp8, quantize_int8, dequantize, the weight
# quantizers, dequantize_weights): each scheme object carries its own.
def quantize(x: torch.Tensor, scheme, group_size: int = 128, width: Optional[int] = None):
    """x float `[..., H]` -> (codes, float32 scales) of the quantized ``scheme`` (a name or a
    :class:`~epmoe.quant.QuantScheme`): fp8 groups of ``group_size`` channels, int8 per row.
    ``width``: the codes' columns Wd >= H (None: H), x zero-extended to them first (codes
    `[..., Wd]`, scales over the zero-extended groups)."""
    qs = quant.SCHEMES.get(scheme) if isinstance(scheme, str) else scheme
    if qs not in quant.QUANTIZED:
        names = " or ".join(repr(q.name) for q in quant.QUANTIZED)
        raise _checks.fail("quantize", "scheme", names, repr(scheme))
    return qs.quantize(widen(x, width), group_size)


def widen(x: torch.Tensor, width: Optional[int]) -> torch.Tensor:
    """x `[..., H]` zero-extended to `[..., width]` (any dtype; x itself when width is None or
    H)."""
    if width is None or width == x.shape[-1]:
        return x
    out = x.new_zeros((*x.shape[:-1], width))
    out[..., : x.shape[-1]] = x
    return out


def pad_experts(w: torch.Tensor, halves: int, n: int, n_p: int, k_p: int) -> torch.Tensor:
    """Expert weights w `[E, halves * n, K]` zero-padded to `[E, halves * n_p, k_p]`: each half's
    n rows first, zeros after (w itself when nothing is padded). A bias `[E, N]` pads as
    `[E, N, 1]`."""
    if n == n_p and w.shape[2] == k_p:
        return w
    out = w.new_zeros((w.shape[0], halves * n_p, k_p))
    for j in range(halves):
        out[:, j * n_p : j * n_p + n, : w.shape[2]] = w[:, j * n : (j + 1) * n]
    return out


def quantize_weights(w: torch.Tensor, scheme) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Expert weights w: float `[E, N, Kd]` -> quantized weights and scales (``scheme``: a name
    or a :class:`~epmoe.quant.QuantScheme`).

    fp8: float8_e4m3fn `[E, N, Kd]`, float32 `[E, N/128, Kd/128]` (128x128 blocks).
    int8: int8 `[E, N, Kd]`, float32 `[E, N]` (per output channel).
    bf16: bf16 copy, None.
    """
    return quant.get(scheme, "quantize_weights", "scheme").quantize_weights(w)


# ------------------------------------------------------------------------------------------ permute
def permute(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    alignment: int,
    x_scales: Optional[torch.Tensor] = None,
):
    """Scatter rows into expert-contiguous, ``alignment``-aligned blocks.

    Args:
        x: any dtype `[M, H]`. topk_ids: int32/int64 `[M, K]`, local expert id in [0, E) or -1.
        x_scales: float32 `[M, S]` or None.
    Returns:
        (x_perm `[M_sum, H]`, scales `[M_sum, S]` (S = 0 when None), m_indices int32 `[M_sum]`,
        inv_perm int32 `[M, K]`, expert_offsets int32 `[E + 1]`, src_rows int32 `[M_sum]`: the
        row of x each row holds, -1 where m_indices is -1).
    """
    _checks.check_ids(topk_ids, num_experts, "permute", "topk_ids")
    M, K = topk_ids.shape
    E, A = num_experts, alignment
    M_sum = permuted_rows(M, K, E, A)
    dev = x.device
    flat = topk_ids.reshape(-1).long()
    valid = flat >= 0
    bucket = torch.where(valid, flat, E)  # -1 goes to a dump bucket after the last expert
    counts_all = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add_(
        0, bucket, torch.ones_like(bucket)
    )
    counts = counts_all[:E]
    offsets = torch.zeros(E + 1, dtype=torch.long, device=dev)
    offsets[1:] = torch.cumsum(round_up(counts, A), 0)
    # stable sort keeps (t, k) order inside each expert: deterministic rows
    order = torch.sort(bucket, stable=True).indices
    sorted_bucket = bucket[order]
    starts = torch.zeros(E + 2, dtype=torch.long, device=dev)
    starts[1:] = torch.cumsum(counts_all, 0)
    rank_sorted = torch.arange(M * K, device=dev) - starts[sorted_bucket]
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    row = torch.where(valid, offsets[bucket.clamp(max=E - 1)] + rank, M_sum)  # M_sum = dump row
    inv_perm = torch.where(valid, row, -1).to(torch.int32).reshape(M, K)

    src = torch.arange(M, device=dev).repeat_interleave(K)
    xr = x.view(torch.uint8) if x.element_size() == 1 else x  # fp8 has no index_copy kernel
    x_out = xr.new_zeros((M_sum + 1, x.shape[1]))
    x_out.index_copy_(0, row, xr[src])
    x_out = x_out.view(x.dtype)
    if x_scales is not None:
        s_out = x_scales.new_zeros((M_sum + 1, x_scales.shape[1]))
        s_out.index_copy_(0, row, x_scales[src])
        s_out = s_out[:M_sum]
    else:
        s_out = torch.empty((M_sum, 0), dtype=torch.float32, device=dev)

    r = torch.arange(M_sum, device=dev)
    e_of_row = torch.searchsorted(offsets[1:], r, right=True)
    e_c = e_of_row.clamp(max=E - 1)
    used = (e_of_row < E) & (r < offsets[e_c] + counts[e_c])
    m_indices = torch.where(used, e_of_row, -1).to(torch.int32)
    src_rows = torch.full((M_sum + 1,), -1, dtype=torch.int32, device=dev)
    src_rows.index_copy_(0, row, src.to(torch.int32))
    return x_out[:M_sum], s_out, m_indices, inv_perm, offsets.to(torch.int32), src_rows[:M_sum]


# -------------------------------------------------------------------------------------------- gemm
def take_rows(t: Optional[torch.Tensor], rows: torch.Tensor) -> Optional[torch.Tensor]:
    """t any dtype `[M, ...]` (any strides; None -> None) at rows int `[R]` -> contiguous
    `[R, ...]`: row r is t[rows[r]], zeros where rows[r] is -1 (a gathering GEMM's a_rows)."""
    if t is None:
        return None
    tr = t.view(torch.uint8) if t.element_size() == 1 else t  # (fp8: no index kernel)
    if t.shape[0] == 0:
        return tr.new_zeros((rows.shape[0], *t.shape[1:])).view(t.dtype)
    live = (rows >= 0).view(-1, *(1,) * (t.dim() - 1))
    return torch.where(live, tr[rows.long().clamp(min=0)], 0).view(t.dtype)


def _dequant_rows(a: torch.Tensor, a_scales: Optional[torch.Tensor]) -> torch.Tensor:
    if a_scales is None:
        return a.float()
    return dequantize(a, a_scales)


def grouped_gemm_contiguous(
    a: torch.Tensor,
    w: torch.Tensor,
    m_indices: torch.Tensor,
    a_scales: Optional[torch.Tensor] = None,
    w_scales: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """out[r] = deq(a[r]) @ deq(w[m_indices[r]]).T in float32 -> bf16 `[M_sum, N]`.

    Rows with m_indices == -1 are zero.
    """
    af = _dequant_rows(a, a_scales)
    wf = dequantize_weights(w, w_scales)
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float32, device=a.device)
    for e in range(w.shape[0]):  # static loop over experts; masked so shapes never depend on data
        sel = (m_indices == e).unsqueeze(1)
        out = torch.where(sel, af @ wf[e].t(), out)
    return out.to(torch.bfloat16)


def grouped_gemm_masked(
    a: torch.Tensor,
    w: torch.Tensor,
    masked_m: torch.Tensor,
    a_scales: Optional[torch.Tensor] = None,
    w_scales: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """a `[E, T, Kd]`, w `[E, N, Kd]` -> bf16 `[E, T, N]`; rows t >= masked_m[e] are zero here."""
    af = _dequant_rows(a, a_scales)
    wf = dequantize_weights(w, w_scales)
    out = torch.bmm(af, wf.transpose(1, 2))
    live = torch.arange(a.shape[1], device=a.device)[None, :] < masked_m.to(a.device)[:, None]
    return torch.where(live.unsqueeze(-1), out, 0.0).to(torch.bfloat16)


# -------------------------------------------------------------------------------------- activation
def silu_and_mul(
    y: torch.Tensor,
    gate=None,
    bias: Optional[torch.Tensor] = None,
    rows_expert: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """y `[..., W]` -> `[..., I]` in y.dtype: the gate's h in float32 math (``gate`` a
    :class:`~epmoe.gate.Gate`, its spec, or None: silu(gate) * up, W = 2I, gate columns first).

    bias float `[E_b, W]` is added to y in float32 first: for 2-D y `[M, W]` row r adds
    bias[rows_expert[r]] (int `[M]`, -1: no bias, the row is padding), for 3-D y `[E, T, W]`
    y[e] adds bias[e].
    """
    g = _gate.get(gate, "silu_and_mul", "gate")
    yf = y.float()
    if bias is not None:
        b = bias.float()
        if y.dim() == 3:
            yf = yf + b[:, None, :]
        else:
            if rows_expert is None:
                want = "int32 [M] (each row's expert) with a bias on a 2-D y"
                raise _checks.fail("silu_and_mul", "m_indices", want, None)
            _checks.check_ids(rows_expert, bias.shape[0], "silu_and_mul", "m_indices")
            ids = rows_expert.long()
            yf = yf + torch.where((ids >= 0)[:, None], b[ids.clamp(min=0)], 0.0)
    return g.reference(yf).to(y.dtype)


def silu_and_mul_quant(
    y: torch.Tensor,
    scheme,
    group_size: int = 128,
    gate=None,
    bias: Optional[torch.Tensor] = None,
    rows_expert: Optional[torch.Tensor] = None,
):
    """silu_and_mul then :func:`quantize`; the activation is rounded to y.dtype first (as the
    unfused pair does)."""
    return quantize(silu_and_mul(y, gate, bias, rows_expert), scheme, group_size)


# ---------------------------------------------------------------------------------------- unpermute
def unpermute(
    y: torch.Tensor,
    inv_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    m_indices: Optional[torch.Tensor] = None,
    hidden: Optional[int] = None,
) -> torch.Tensor:
    """out[t] = sum_k [inv_perm[t,k] >= 0] * w[t,k] * (y[r, :Ho] + bias[m_indices[r], :Ho]),
    r = inv_perm[t,k].

    float32 sum, y.dtype `[M, Ho]` out; Ho = ``hidden`` (None: y's columns). bias: float
    `[E, Hb >= Ho]` or None; m_indices: int32 `[M_sum]`, the expert of each row of y (rows of
    -1, or any id outside [0, E), add no bias), needed with a bias.
    """
    _checks.check_ids(inv_perm, y.shape[0], "unpermute", "inv_perm")
    cols = y.shape[1] if hidden is None else hidden
    valid = inv_perm >= 0
    r = inv_perm.clamp(min=0).long()
    rows = y[r, :cols].float()  # [M, K, Ho]
    if bias is not None:
        rows = rows + _expert_bias(bias, m_indices[r].long(), cols)
    rows = torch.where(valid.unsqueeze(-1), rows, 0.0)  # (a -1 entry reads nothing)
    w = torch.where(valid, topk_weights.float(), 0.0)
    return (rows * w.unsqueeze(-1)).sum(dim=1).to(y.dtype)


def _expert_bias(bias: torch.Tensor, e: torch.Tensor, cols: int) -> torch.Tensor:
    """float32 rows bias[e, :cols] for expert ids ``e`` (any shape), zero where e is outside
    [0, E)."""
    E = bias.shape[0]
    has = (e >= 0) & (e < E)
    b = bias[e.clamp(0, max(E - 1, 0)), :cols].float() if E else e.new_zeros((*e.shape, cols))
    return torch.where(has.unsqueeze(-1), b.float(), 0.0)


# ---------------------------------------------------------------------------- per-choice GEMVs
def _quantized_rows(x: torch.Tensor, scheme: quant.QuantScheme) -> torch.Tensor:
    """x bf16 `[..., D]` as the scheme's GEMM reads it, in float32 (quantized and dequantized)."""
    return scheme.dequantize(*scheme.quantize(x)) if scheme.quantized else x.float()


def _choice_weights(w: torch.Tensor, s: Optional[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """float32 `[T, K, N, Kd]`: the weights of each choice's expert (expert 0 for -1)."""
    e = ids.clamp(min=0).long().flatten()
    wf = dequantize_weights(w[e], None if s is None else s[e])
    return wf.reshape(*ids.shape, *w.shape[1:])


def _plus_bias(y: torch.Tensor, bias: Optional[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """y float32 `[T, K, N]` plus each choice's expert's bias row `[N]` (expert 0 for -1); y
    itself without a bias (no + 0.0: it would turn -0.0 into 0.0)."""
    return y if bias is None else y + bias.float()[ids.clamp(min=0).long()]


def gemv_gate_up(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w1: torch.Tensor,
    w1_scales: Optional[torch.Tensor] = None,
    gate="silu",
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x bf16 `[T, H]` (H <= w1.shape[2]: zero-extended to it), topk_ids `[T, K]` local expert or
    -1, w1 `[E, W, Hp]` (W = 2I gate rows then up rows, or I without glu; bf16, or fp8 / int8
    with their scales), gate a :mod:`epmoe.gate` spec or Gate, bias float `[E, W]` or None ->
    bf16 `[T, K, I]`: the gate of the bf16-rounded products of x, quantized per the weights'
    scheme, with each choice's expert, plus the bias in float32; rows of -1 choices zero."""
    g = _gate.get(gate, "gemv_gate_up")
    scheme = quant.of_dtype(w1.dtype)
    xf = _quantized_rows(widen(x, w1.shape[2]), scheme)  # [T, Hp]
    wf = _choice_weights(w1, w1_scales, topk_ids)  # [T, K, W, Hp]
    y = torch.einsum("th,tknh->tkn", xf, wf).to(torch.bfloat16).float()
    h = g.reference(_plus_bias(y, bias, topk_ids))
    return torch.where((topk_ids >= 0).unsqueeze(-1), h, 0.0).to(torch.bfloat16)


def gemv_down(
    h: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    hidden: Optional[int] = None,
) -> torch.Tensor:
    """h bf16 `[T, K, I]`, topk_ids `[T, K]` local expert or -1, topk_weights float `[T, K]`, w2
    `[E, Hw, I]`, bias float `[E, Hw]` or None, hidden None (Hw) or <= Hw -> bf16 `[T, hidden]`:
    sum_k w[t,k] * (bf16(h^[t,k] . W2[e]^T) + bias[e]) over live choices in float32 (k order),
    h^ = h quantized per the weights' scheme; the first ``hidden`` columns."""
    scheme = quant.of_dtype(w2.dtype)
    hf = _quantized_rows(h, scheme)  # [T, K, I]
    wf = _choice_weights(w2, w2_scales, topk_ids)  # [T, K, Hw, I]
    y = torch.einsum("tki,tkni->tkn", hf, wf).to(torch.bfloat16).float()
    y = _plus_bias(y, bias, topk_ids)[..., :hidden]
    live = topk_ids >= 0
    y = torch.where(live.unsqueeze(-1), y, 0.0)  # a -1 row of h is never read (NaN * 0 is NaN)
    w = torch.where(live, topk_weights.float(), 0.0)
    out = torch.zeros((h.shape[0], y.shape[-1]), dtype=torch.float32, device=h.device)
    for k in range(h.shape[1]):  # k ascending, as unpermute sums
        out = out + w[:, k : k + 1] * y[:, k]
    return out.to(torch.bfloat16)


# ------------------------------------------------------------------------------------- whole layer
def dense_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    gate=None,
    b1: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The MoE layer in float32, no EP and no quantization.

    x `[T, H]`; topk_ids int `[T, K]` global ids or -1; topk_weights float `[T, K]`;
    w1 `[E, 2I, H]` (gate rows first; `[E, I, H]` for a gate without a gate half); w2 `[E, H, I]`;
    gate: a :class:`epmoe.gate.Gate` or spec (default SiLU); b1 `[E, 2I]`, b2 `[E, H]` optional
    biases -> float32 `[T, H]`.
    """
    return _moe(x, topk_ids, topk_weights, w1, w2, gate, b1, b2, None)


def quantized_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    scheme,
    gate=None,
    b1: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Quant-aware reference: what an exact ``scheme`` layer computes, in float32 `[T, H]`.

    x is quantized per token before GEMM1 and the bf16 gate output before GEMM2, weights with
    :func:`quantize_weights`; everything is dequantized and multiplied in float32. Sizes the scheme
    does not run as they are are zero-padded first, as the layer pads them.
    """
    qs = quant.get(scheme, "quantized_moe", "scheme")
    return _moe(x, topk_ids, topk_weights, w1, w2, gate, b1, b2, qs)


def _moe(x, topk_ids, topk_weights, w1, w2, gate, b1, b2, qs) -> torch.Tensor:
    g = _gate.get(gate, "dense_moe")
    H, I = x.shape[-1], w2.shape[-1]
    xf, w1f, w2f = x.float(), w1.float(), w2.float()
    if qs is not None:  # zero-pad to the scheme's sizes, quantize, dequantize
        Hp, Ip = round_up(H, qs.size_multiple), round_up(I, qs.size_multiple)
        halves = g.width(1)
        xf = qs.dequantize(*qs.quantize(widen(x, Hp)))  # (bf16: x rounded to bf16)
        w1f = dequantize_weights(*qs.quantize_weights(pad_experts(w1f, halves, I, Ip, Hp)))
        w2f = dequantize_weights(*qs.quantize_weights(pad_experts(w2f, 1, H, Hp, Ip)))
        if b1 is not None:
            b1 = pad_experts(b1.float()[:, :, None], halves, I, Ip, 1)[..., 0]
        if b2 is not None:
            b2 = widen(b2.float(), Hp)
    out = torch.zeros(xf.shape, dtype=torch.float32, device=x.device)
    for e in range(w1.shape[0]):
        coef = ((topk_ids == e).float() * topk_weights.float()).sum(dim=1, keepdim=True)
        y = xf @ w1f[e].t()
        if qs is not None:
            y = y.to(torch.bfloat16).float()
        if b1 is not None:
            y = y + b1[e].float()
        h = g.reference(y)
        if qs is not None:
            h = qs.dequantize(*qs.quantize(h.to(torch.bfloat16)))
        o = h @ w2f[e].t()
        if b2 is not None:
            o = (o.to(torch.bfloat16).float() if qs is not None else o) + b2[e].float()
        out = out + coef * o
    return out[:, :H]


# ------------------------------------------------------------------------- LL masked layout (comm)
def _scheme(name, op: str) -> quant.QuantScheme:
    return quant.get(name, op)  # (for functions whose ``quant`` argument hides the module)


def ll_scatter(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    capacity: int,
    quant: str = "bf16",
    expert_lo: int = 0,
    num_global_experts: Optional[int] = None,
    width: Optional[int] = None,
):
    """Scatter tokens into the masked `[E, C, Wd]` layout, quantized per ``quant``.

    Args:
        x: bf16 `[T, H]`. topk_ids: int32/int64 `[T, K]`, global id in [0, num_global_experts)
            or -1. Entry (t, k) goes to local expert id - expert_lo when that lies in [0, E),
            else nowhere (another rank's expert).
        num_experts: E. capacity: C, slots per expert. quant: "bf16", "fp8" (1x128 groups) or
            "int8" (per token). num_global_experts: defaults to E. width: Wd >= H (None: H), x
            zero-extended to Wd columns first (a zero-padded hidden).
    Returns:
        (xo `[E, C, Wd]` (bf16 / float8_e4m3fn / int8), scales float32 `[E, C, G]` (G = Wd/128,
        1, 0), masked_m int32 `[E]` = min(entries, C), rows int32 `[T, K]` = e*C + slot or -1).
        Slots inside an expert follow the flat (t, k) order; entries past C are dropped (and an
        error); rows of xo / scales past masked_m are zero here (unspecified in the contract).
    """
    E, C = num_experts, capacity
    NG = num_experts if num_global_experts is None else num_global_experts
    T, K = topk_ids.shape
    x = widen(x, width)
    H = x.shape[1]
    dev = x.device
    ids = topk_ids.long()
    ok = ((ids >= -1) & (ids < NG)).all()
    _checks.check_values(ok, "ll_scatter", "topk_ids", f"ids in [0, {NG}) or -1")
    loc = ids - expert_lo
    live = (ids >= 0) & (ids < NG) & (loc >= 0) & (loc < E)
    flat = torch.where(live, loc, E).reshape(-1)  # bucket E: skipped entries
    onehot = flat.unsqueeze(1) == torch.arange(E + 1, device=dev)  # [T*K, E+1]
    slot = (torch.cumsum(onehot.long(), dim=0) - 1).gather(1, flat.unsqueeze(1)).squeeze(1)
    counts = onehot[:, :E].sum(dim=0)
    _checks.check_values(
        (counts <= C).all(),
        "ll_scatter",
        "topk_ids",
        f"at most capacity={C} entries per expert",
        "an expert over capacity",
    )
    kept = (flat < E) & (slot < C)
    dst = torch.where(kept, flat * C + slot, E * C)  # E*C: a dump row
    rows = torch.where(kept, dst, -1).to(torch.int32).reshape(T, K)
    scheme = _scheme(quant, "ll_scatter")
    if scheme.quantized:
        q, s = scheme.quantize(x)
    else:  # any dtype, copied as is
        q, s = x, torch.empty((T, 0), dtype=torch.float32, device=dev)
    src = torch.arange(T, device=dev).repeat_interleave(K)
    qr = q.view(torch.uint8) if q.element_size() == 1 else q  # fp8 has no index_copy kernel
    xo = qr.new_zeros((E * C + 1, H))
    xo.index_copy_(0, dst, qr[src])
    so = s.new_zeros((E * C + 1, s.shape[1]))
    so.index_copy_(0, dst, s[src])
    xo = xo[: E * C].view(q.dtype).view(E, C, H)
    masked_m = counts.clamp(max=C).to(torch.int32)
    return xo, so[: E * C].view(E, C, s.shape[1]), masked_m, rows


def ll_gather(
    y: torch.Tensor,
    rows: torch.Tensor,
    topk_weights: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    hidden: Optional[int] = None,
) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * (y.view(E*C, H)[r, :Ho] + bias[r // C, :Ho]), r = rows[t,k] (rows
    -1 skipped; w = 1 when topk_weights is None, no bias when None), float32 sum in k order,
    rounded once to bf16 `[T, Ho]`; Ho = ``hidden`` (None: H).

    y bf16 `[E, C, H]`; rows int32/int64 `[T, K]` in [0, E*C) or -1; topk_weights float32 `[T, K]`;
    bias float `[E, Hb >= Ho]`.
    """
    E, C, H = y.shape
    cols = H if hidden is None else hidden
    R = E * C
    ok = ((rows >= -1) & (rows < R)).all()
    _checks.check_values(ok, "ll_gather", "rows", f"rows in [0, {R}) or -1")
    live = (rows >= 0) & (rows < R)
    r = rows.clamp(0, max(R - 1, 0)).long()
    g = y.reshape(R, H)[r, :cols].float()  # [T, K, Ho]
    if bias is not None:
        g = g + _expert_bias(bias, r // C, cols)
    g = torch.where(live.unsqueeze(-1), g, 0.0)  # rows past masked_m may hold anything
    if topk_weights is not None:
        g = g * torch.where(live, topk_weights.float(), 0.0).unsqueeze(-1)
    out = torch.zeros((rows.shape[0], cols), dtype=torch.float32, device=y.device)
    for k in range(rows.shape[1]):  # k ascending, as the kernel sums
        out = out + g[:, k]
    return out.to(torch.bfloat16)
