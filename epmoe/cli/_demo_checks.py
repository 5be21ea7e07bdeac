"""The per-stage checks of ``epmoe demo``: every stage output of the layer's real forward pass
(recorded with :meth:`epmoe.EPMoE.record_stages`) against a check that does not reuse the op.

Exact routing counts and order-free payload sums against all ranks' inputs for dispatch,
``reference.permute`` and the inverse property for permute, float32 math for the GEMMs and the
activation, a float64 sum for unpermute, the output against ``reference.quantized_moe`` and a probe
for combine (rows scaled by their local hit count must come home as x times its total hit count).
Each check reads the stage's inputs from the record too (the previous stage's output as the layer
passed it on), so the checked configuration is the one the layer runs.
"""

import math
from typing import Callable, Dict, List, NamedTuple, Optional

import torch

from epmoe import ops, quant, reference
from epmoe.ops.ll_gather import ll_gather

# Tolerances (relative L2 unless exact). The layer bounds are those of the core issue (also in
# tests/_tol.py, which the installed package cannot import).
TOL_LAYER_VS_DENSE = {quant.BF16: 1e-2, quant.FP8: 8e-2, quant.INT8: 3e-2}
TOL_LAYER_VS_QUANT_AWARE = 2e-2
TOL_BF16_OUT = 1e-2  # one bf16 rounding of the output (<= 2^-8 relative per element) plus sum order
TOL_SAME_VALUES = 1e-6  # float64 sums of the same values in another order
TOL_QUANT_CODES = 1e-3  # dequantized payload vs the reference quantizer: rare 1-ulp ties only
TOL_FP8_LL_PAYLOAD = 1e-2  # LL dispatch casts to fp8 itself (a backend may round ties differently)


class Row(NamedTuple):
    mode: str
    quant: str
    stage: str
    shape: str
    dtype: str
    check: str
    error: float
    tol: float
    ok: bool


class Inputs(NamedTuple):
    """One rank's call and every rank's routing, as the checks need them."""

    x: torch.Tensor  # bf16 [T, H], this rank's tokens
    ids: torch.Tensor  # int64 [T, K], global ids or -1
    w: torch.Tensor  # float32 [T, K]
    X: torch.Tensor  # float32 [world * T, H], all ranks' tokens
    IDS: torch.Tensor  # int64 [world * T, K]
    W: torch.Tensor  # float32 [world * T, K]
    qref: torch.Tensor  # float32 [T, H], reference.quantized_moe of this rank's tokens
    dense: torch.Tensor  # float32 [T, H], reference.dense_moe


# ------------------------------------------------------------------------------------------ helpers
def _deq(q: torch.Tensor, s: Optional[torch.Tensor]) -> torch.Tensor:
    if s is None:
        return q.float()
    return reference.dequantize(q, s)


def _as_sent(x: torch.Tensor, scheme: quant.QuantScheme) -> torch.Tensor:
    """float32 x as a ``scheme`` payload carries it: quantized and dequantized, or x itself."""
    return _deq(*scheme.quantize(x)) if scheme.quantized else x.float()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits as an integer tensor (exact comparison of any dtype, fp8 included)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if a.shape != b.shape:
        return math.inf
    if b.numel() == 0:
        return 0.0
    err = float((a - b).norm() / b.norm().clamp_min(1e-30))
    return err if math.isfinite(err) else math.inf


def _mismatches(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    return float((_bits(a) != _bits(b)).sum()) if a.dtype == b.dtype else math.inf


def perturb(t: torch.Tensor) -> torch.Tensor:
    """A wrong-but-plausible version of a stage output (selftest)."""
    if t.dtype in (torch.int32, torch.int64):
        return torch.roll(t.reshape(-1), 1).reshape(t.shape)
    if t.dtype == torch.int8:
        return (t.to(torch.int16) // 2).to(torch.int8)
    if t.dtype == torch.float8_e4m3fn:
        return (t.float() * 1.5).clamp(-448.0, 448.0).to(t.dtype)
    return t * 1.5


# which part of each recorded stage output the selftest perturbs
_CORRUPT: Dict[str, Callable] = {
    "quantize": lambda v: (v[0], perturb(v[1])),
    "dispatch": lambda d: d._replace(x=perturb(d.x)),
    "ll_dispatch": lambda d: d._replace(x=perturb(d.x)),
    "ll_scatter": lambda v: (perturb(v[0]),) + tuple(v[1:]),
    "permute": lambda p: p._replace(inv_perm=perturb(p.inv_perm)),
    "act": lambda v: (perturb(v[0]), v[1]),
}


def corrupt_hook(stage: Optional[str]) -> Dict[str, Callable]:
    """``record_stages(replace=...)`` that perturbs ``stage``'s output inside the layer's run."""
    if stage is None or stage == "layer":
        return {}
    return {stage: _CORRUPT.get(stage, perturb)}


def _expert_sums(xf: torch.Tensor, ids: torch.Tensor, w: Optional[torch.Tensor], E: int):
    """float64 `[E, H]`: sum over rows n and choices k with ids[n, k] == e of w[n, k] * xf[n].

    Rows and weights without a hit are never read (padding rows may hold any bytes, NaN included).
    """
    hit = ids.unsqueeze(-1) == torch.arange(E, device=ids.device)  # [N, K, E]
    coef = hit.double() if w is None else torch.where(hit, w.double().unsqueeze(-1), 0.0)
    xf = torch.where(hit.any(dim=2).any(dim=1, keepdim=True), xf.double(), 0.0)
    return coef.sum(dim=1).t() @ xf


def _gemm_expected(a, a_scales, w, w_scales, m_indices=None, masked_m=None):
    """float32 reference of a grouped GEMM."""
    af = _deq(a, a_scales)
    wf = reference.dequantize_weights(w, w_scales)
    if m_indices is not None:
        out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float32, device=a.device)
        for e in range(w.shape[0]):
            sel = m_indices == e
            out[sel] = af[sel] @ wf[e].t()
        return out
    return torch.bmm(af, wf.transpose(1, 2))


class Checks:
    """The rows of one (mode, scheme): each check's error against its tolerance."""

    def __init__(self, mode: str, scheme, corrupt: Optional[str]):
        self.scheme = quant.get(scheme)
        self.mode, self.quant, self.corrupt = mode, self.scheme.name, corrupt
        self.rows: List[Row] = []

    def out(self, stage: str, t: torch.Tensor) -> torch.Tensor:
        """A probe's output, perturbed when this stage is the selftest target."""
        return perturb(t) if stage == self.corrupt else t

    def add(self, stage: str, t: torch.Tensor, check: str, error: float, tol: float) -> None:
        ok = math.isfinite(error) and error <= tol
        dtype = str(t.dtype).replace("torch.", "")
        self.rows.append(
            Row(self.mode, self.quant, stage, str(list(t.shape)), dtype, check, error, tol, ok)
        )


# ------------------------------------------------------------------------------------------- stages
def check_quantize(chk, src, xq, xs, live=None):
    """A quantize stage's codes and scales against ``reference.quantize`` of its input."""
    got, want = _deq(xq, xs), _deq(*chk.scheme.quantize(src))
    if live is not None:
        got, want = got[live], want[live]
    chk.add("quantize", xq, "deq == deq(reference.quantize)", _rel(got, want), TOL_QUANT_CODES)


def check_ht_dispatch(chk, d, inp: Inputs, lo: int, E: int):
    # Every rank's sent payload, as the receiver should see it (dequantized).
    Xq = _as_sent(inp.X, chk.scheme)
    want = _expert_sums(torch.ones_like(Xq[:, :1]), inp.IDS - lo, None, E).reshape(-1)
    got = _expert_sums(torch.ones_like(d.x[:, :1], dtype=torch.float32), d.topk_ids, None, E)
    bad_ids = ((d.topk_ids < -1) | (d.topk_ids >= E)).sum()
    err = float(
        (got.reshape(-1) - want).abs().sum()
        + (d.expert_counts.double() - want).abs().sum()
        + bad_ids
    )
    chk.add("dispatch", d.topk_ids, "local ids, expert_counts == routing", err, 0)
    err = _rel(
        _expert_sums(_deq(d.x, d.x_scales), d.topk_ids, d.topk_weights, E),
        _expert_sums(Xq, inp.IDS - lo, inp.W, E),
    )
    chk.add("dispatch", d.x, "sum_k w*x per expert == all ranks'", err, TOL_SAME_VALUES)


def check_permute(chk, p, x, ids, scales, E: int, alignment: int):
    """permute's result against ``reference.permute`` and its inverse property."""
    r_x, r_s, r_m, r_inv, r_off, r_src = reference.permute(x, ids, E, alignment, scales)
    used = r_m >= 0  # padding rows of x / scales are unspecified
    err = (
        _mismatches(p.m_indices, r_m)
        + _mismatches(p.inv_perm, r_inv)
        + _mismatches(p.expert_offsets, r_off)
        + _mismatches(p.src_rows, r_src)
    )
    if p.x.shape == r_x.shape and p.m_indices.shape == r_m.shape:
        err += _mismatches(p.x[used], r_x[used])
        if scales is not None:
            err += _mismatches(p.x_scales[used], r_s[used])
    else:
        err = math.inf
    chk.add("permute", p.x, "== reference.permute (exact)", err, 0)
    valid = ids >= 0
    rows = p.inv_perm.long()[valid]
    src = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(ids)[valid]
    inv_ok = bool(((p.inv_perm >= 0) == valid).all()) and (
        rows.numel() == 0 or (int(rows.min()) >= 0 and int(rows.max()) < p.x.shape[0])
    )
    if inv_ok:
        err = float(
            (_bits(p.x)[rows] != _bits(x)[src]).any(dim=1).sum()
            + (p.m_indices.long()[rows] != ids[valid]).sum()
            + abs(int((p.m_indices >= 0).sum()) - rows.numel())
            + rows.numel()
            - rows.unique().numel()
        )
    else:
        err = math.inf
    chk.add("permute", p.inv_perm, "x[inv_perm] == x, m_indices == ids", err, 0)


def check_gemm(chk, stage, y, a, s, w, ws, live, m_indices=None, masked_m=None):
    ref = _gemm_expected(a, s, w, ws, m_indices=m_indices, masked_m=masked_m)
    name = "w1" if stage == "gemm1" else "w2"
    what = f"vs fp32 deq({'a' if stage == 'gemm1' else 'h'}) @ deq({name}[e]).T"
    chk.add(stage, y, what, _rel(y[live], ref[live]), TOL_BF16_OUT)


def check_act(chk, y, h, hs, live):
    if not chk.scheme.quantized:
        inter = y.shape[-1] // 2
        ref = torch.nn.functional.silu(y[..., :inter].float()) * y[..., inter:].float()
        chk.add("act", h, "vs fp32 silu(gate) * up", _rel(h[live], ref[live]), TOL_BF16_OUT)
        return
    ref = _deq(*reference.silu_and_mul_quant(y, chk.scheme))
    err = _rel(_deq(h, hs)[live], ref[live])
    chk.add("act", h, "deq vs reference.silu_and_mul_quant", err, TOL_BF16_OUT)


def check_unpermute(chk, u, y2, inv_perm, w):
    inv = inv_perm.long()
    coef = torch.where(inv >= 0, w.double(), 0.0)
    rows = y2.double()[inv.clamp(min=0)]  # [M, K, H]; rows of -1 entries are never read
    ref = torch.where((inv >= 0).unsqueeze(-1), rows * coef.unsqueeze(-1), 0.0).sum(dim=1)
    chk.add("unpermute", u, "vs fp64 sum_k w * y[inv_perm]", _rel(u, ref), TOL_BF16_OUT)


def check_experts_ht(chk, layer, rec, x, scales, ids, w):
    """permute -> gemm1 -> act -> gemm2 -> unpermute of the record, each from its recorded input."""
    p = rec["permute"]
    if p.x.shape[1] == 0 and x.shape[1]:  # (GEMM1 read x's rows through src_rows: no copy made)
        p = p._replace(x=reference.take_rows(x, p.src_rows),
                       x_scales=reference.take_rows(scales, p.src_rows))  # fmt: skip
    alignment = layer.plan(x.shape[0])[1]  # (the call size's: this GPU's measured one may differ)
    check_permute(chk, p, x, ids, scales, layer.num_local_experts, alignment)
    live = p.m_indices >= 0
    if "gemm1" in rec:
        y1 = rec["gemm1"]
        check_gemm(chk, "gemm1", y1, p.x, p.x_scales, layer.w1, layer.w1_scale, live, p.m_indices)
    else:  # GEMM1 and the gate ran as one kernel (grouped_gemm_gate): act vs GEMM1's reference
        y1 = _gemm_expected(p.x, p.x_scales, layer.w1, layer.w1_scale, m_indices=p.m_indices)
        y1 = y1.to(torch.bfloat16)
    h, hs = rec["act"]
    check_act(chk, y1, h, hs, live)
    y2 = rec["gemm2"]
    check_gemm(chk, "gemm2", y2, h, hs, layer.w2, layer.w2_scale, live, p.m_indices)
    check_unpermute(chk, rec["unpermute"], y2, p.inv_perm, w)


def run_ht(chk, layer, rec, inp: Inputs, rank: int):
    """The HT stages of the record (dispatch and combine only where the layer sends)."""
    q, E = quant.get(layer.quant), layer.num_local_experts
    xq, xs = rec["quantize"] if q.quantized else (inp.x, None)
    if q.quantized:
        check_quantize(chk, inp.x, xq, xs)
    if "dispatch" not in rec:  # one rank, local backend: permute reads the caller's tensors
        check_experts_ht(chk, layer, rec, xq, xs, inp.ids, inp.w)
        return
    d = rec["dispatch"]
    check_ht_dispatch(chk, d, inp, rank * E, E)
    check_experts_ht(chk, layer, rec, d.x, d.x_scales, d.topk_ids, d.topk_weights)
    out = rec["combine"]
    err = _rel(out, inp.qref)
    chk.add("combine", out, "vs reference.quantized_moe", err, TOL_LAYER_VS_QUANT_AWARE)
    hits_here = (d.topk_ids >= 0).sum(dim=1, keepdim=True)
    probe = torch.where(hits_here > 0, _deq(d.x, d.x_scales) * hits_here, 0.0).to(torch.bfloat16)
    back = chk.out("combine", ops.ht_combine(probe, d.handle, layer.comm_key))
    xl = _as_sent(inp.x, q)
    want = xl * (inp.ids >= 0).sum(dim=1, keepdim=True)
    chk.add("combine", back, "probe: rows*hits come home as x*hits", _rel(back, want), TOL_BF16_OUT)


def _check_ll_received(chk, stage, a, s, masked_m, inp: Inputs, lo, E, payload_tol):
    """Masked-layout rows a rank received: counts == routing, live rows sum to all ranks'."""
    want = _expert_sums(torch.ones_like(inp.X[:, :1]), inp.IDS - lo, None, E).reshape(-1)
    err = float((masked_m.double() - want).abs().sum())
    chk.add(stage, masked_m, "masked_m == routing", err, 0)
    live = torch.arange(a.shape[1], device=a.device)[None, :] < masked_m[:, None]  # [E, C]
    got = torch.where(live.unsqueeze(-1), _deq(a, s).double(), 0.0).sum(dim=1)
    # (LL dispatch sends int8 calls in bf16)
    Xq = _as_sent(inp.X, quant.BF16 if a.dtype == torch.bfloat16 else chk.scheme)
    err = _rel(got, _expert_sums(Xq, inp.IDS - lo, None, E))
    chk.add(stage, a, "sum of live rows per expert == all ranks'", err, payload_tol)
    return live


def check_experts_ll(chk, layer, rec, a, s, masked_m, live):
    if "gemm1" in rec:
        y1 = rec["gemm1"]
        check_gemm(chk, "gemm1", y1, a, s, layer.w1, layer.w1_scale, live, masked_m=masked_m)
    else:  # masked GEMM1 and the gate ran as one kernel: act vs GEMM1's reference
        y1 = _gemm_expected(a, s, layer.w1, layer.w1_scale, masked_m=masked_m).to(torch.bfloat16)
    h, hs = rec["act"]
    check_act(chk, y1, h, hs, live)
    y2 = rec["gemm2"]
    check_gemm(chk, "gemm2", y2, h, hs, layer.w2, layer.w2_scale, live, masked_m=masked_m)


def _run_ll_local(chk, layer, rec, inp: Inputs):
    """One rank, local backend: ll_scatter (quantization fused) -> experts -> ll_gather."""
    a, s, masked_m, rows = rec["ll_scatter"]
    s = s if chk.scheme.quantized else None
    E = layer.num_local_experts
    live = _check_ll_received(chk, "ll_scatter", a, s, masked_m, inp, 0, E, TOL_QUANT_CODES)
    check_experts_ll(chk, layer, rec, a, s, masked_m, live)
    out = rec["ll_gather"]
    err = _rel(out, inp.qref)
    chk.add("ll_gather", out, "vs reference.quantized_moe", err, TOL_LAYER_VS_QUANT_AWARE)
    probe = torch.where(live.unsqueeze(-1), _deq(a, s), 0.0).to(torch.bfloat16)
    back = chk.out("ll_gather", ll_gather(probe, rows, inp.w))
    return back


def run_ll(chk, layer, rec, inp: Inputs, rank: int):
    """The LL stages of the record, then the combine probe (its own dispatch: deep_ep's LL kernels
    expect dispatch/combine pairs, and the record is read before that dispatch reuses buffers)."""
    q, E, key = quant.get(layer.quant), layer.num_local_experts, layer.comm_key
    x, ids, w = inp.x, inp.ids, inp.w
    if "ll_scatter" in rec:
        back, stage = _run_ll_local(chk, layer, rec, inp), "ll_gather"
    else:
        d = rec["ll_dispatch"]
        tol = TOL_FP8_LL_PAYLOAD if q is quant.FP8 else TOL_SAME_VALUES
        live = _check_ll_received(
            chk, "ll_dispatch", d.x, d.x_scales, d.masked_m, inp, rank * E, E, tol
        )
        a, s = d.x, d.x_scales
        if q is quant.INT8:
            a, s = rec["quantize"]
            check_quantize(chk, d.x, a, s, live)
        check_experts_ll(chk, layer, rec, a, s, d.masked_m, live)
        out = rec["ll_combine"]
        err = _rel(out, inp.qref)
        chk.add("ll_combine", out, "vs reference.quantized_moe", err, TOL_LAYER_VS_QUANT_AWARE)
        d2 = ops.ll_dispatch(x, ids, key, use_fp8=q is quant.FP8)
        d2 = d2._replace(x=chk.out("ll_dispatch", d2.x))
        live2 = torch.arange(d2.x.shape[1], device=x.device)[None, :] < d2.masked_m[:, None]
        probe = torch.where(live2.unsqueeze(-1), _deq(d2.x, d2.x_scales), 0.0).to(torch.bfloat16)
        back = chk.out("ll_combine", ops.ll_combine(probe, ids, w, d2.handle, key))
        stage = "ll_combine"
    xl = _as_sent(x, q)
    if stage == "ll_combine" and q is quant.INT8:
        xl = x.float()  # LL dispatch sends int8 calls in bf16 (the layer quantizes after it)
    want = xl * torch.where(ids >= 0, w, 0.0).sum(dim=1, keepdim=True)
    chk.add(stage, back, "probe: rows come home as x*sum_k w", _rel(back, want), TOL_BF16_OUT)


def check_layer(chk, out, plain, inp: Inputs):
    """The layer's recorded run against its run without a record and both references."""
    chk.add("layer", out, "== run without record (exact)", _mismatches(out, plain), 0)
    err = _rel(out, inp.qref)
    chk.add("layer", out, "vs reference.quantized_moe", err, TOL_LAYER_VS_QUANT_AWARE)
    err = _rel(out, inp.dense)
    chk.add("layer", out, "vs reference.dense_moe", err, TOL_LAYER_VS_DENSE[chk.scheme])
