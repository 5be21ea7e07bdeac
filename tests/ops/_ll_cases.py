"""Inputs, a loop-by-loop oracle and comparisons shared by the ll_scatter / ll_gather tests (CPU,
interpreter, GPU)."""

from typing import Optional

import torch

from epmoe import reference
from tests._routing import random_ids


def tokens(T: int, H: int, gen: torch.Generator, stride_pad: int = 0) -> torch.Tensor:
    """bf16 `[T, H]`; with stride_pad > 0 rows of a wider tensor (row stride H + stride_pad)."""
    x = (torch.randn((T, H + stride_pad), generator=gen) * 4).to(torch.bfloat16)
    return x[:, :H]


def ids(T: int, K: int, NG: int, gen, p_none=0.2, dtype=torch.int64, col_major=False):
    """`[T, K]` global ids in [0, NG) or -1 (distinct per token), in ``dtype``, optionally
    column-major (strides (1, T))."""
    out = random_ids(T, K, NG, p_none, gen).to(dtype)
    return out.t().contiguous().t() if col_major else out


def naive_slots(topk_ids: torch.Tensor, E: int, C: int, lo: int = 0, NG: Optional[int] = None):
    """The contract, one entry at a time in flat (t, k) order: (rows int32 `[T, K]`, counts
    int64 `[E]` before clamping)."""
    NG = E if NG is None else NG
    T, K = topk_ids.shape
    rows = torch.full((T, K), -1, dtype=torch.int32)
    counts = [0] * E
    for t in range(T):
        for k in range(K):
            g = int(topk_ids[t, k])
            e = g - lo
            if 0 <= g < NG and 0 <= e < E:
                if counts[e] < C:
                    rows[t, k] = e * C + counts[e]
                counts[e] += 1
    return rows, torch.tensor(counts, dtype=torch.int64)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def check_scatter(out, x, topk_ids, E, C, quant, lo=0, NG=None, width=None) -> None:
    """Exact: rows and masked_m against the oracle; every written slot of xo and scales against
    reference.quantize of its source token (bytes; with ``width``: the token zero-extended to
    width columns). Rows past masked_m are not compared."""
    xo, s, mm, rows = (t.cpu() for t in out)
    x, topk_ids = x.cpu(), topk_ids.cpu()
    want_rows, counts = naive_slots(topk_ids, E, C, lo, NG)
    assert torch.equal(rows, want_rows), (rows, want_rows)
    assert mm.dtype == torch.int32 and torch.equal(mm, counts.clamp(max=C).int()), (mm, counts)
    H = x.shape[1] if width is None else width
    G = {"bf16": 0, "fp8": H // 128, "int8": 1}[quant]
    assert xo.shape == (E, C, H) and s.shape == (E, C, G)
    if width is not None:  # zero-extended by hand (not reference.widen: an oracle of its own)
        x = torch.cat([x, torch.zeros((x.shape[0], width - x.shape[1]), dtype=x.dtype)], dim=1)
    if quant == "bf16":
        q, qs = x, torch.empty((x.shape[0], 0))
    else:
        q, qs = reference.quantize(x, quant)
    T, K = topk_ids.shape
    for t in range(T):
        for k in range(K):
            r = int(rows[t, k])
            if r < 0:
                continue
            e, c = divmod(r, C)
            assert torch.equal(as_bytes(xo[e, c]), as_bytes(q[t])), (quant, t, k, e, c)
            assert torch.equal(s[e, c], qs[t]), (quant, t, k, e, c)


def gather_oracle(y, rows, w=None, bias=None, hidden=None) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * (y.view(E*C, H)[r, :Ho] + bias[r // C, :Ho]), r = rows[t,k],
    float32 in k order, one loop (Ho = hidden or H)."""
    E, C, H = y.shape
    Ho = H if hidden is None else hidden
    flat = y.cpu().reshape(E * C, H).float()[:, :Ho]
    rows = rows.cpu()
    out = torch.zeros((rows.shape[0], Ho))
    for t in range(rows.shape[0]):
        for k in range(rows.shape[1]):
            r = int(rows[t, k])
            if r >= 0:
                v = flat[r] if bias is None else flat[r] + bias.cpu()[r // C, :Ho].float()
                out[t] += v * (1.0 if w is None else float(w[t, k]))
    return out.to(torch.bfloat16)


RAW_DTYPES = (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.int32, torch.float32)


def raw_tokens(T: int, H: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes (NaN / inf patterns included) as dtype `[T, H]`, rows of a wider tensor."""
    n = torch.empty((), dtype=dtype).element_size()
    b = torch.randint(0, 256, (T, (H + 3) * n), generator=gen, dtype=torch.uint8)
    return b.view(dtype)[:, 1 : H + 1]


def check_raw_scatter(out, x, topk_ids, E, C) -> None:
    """quant="bf16" on a non-bf16 x: rows / masked_m as for bf16, xo of x's dtype, every written
    slot holds its token's bytes."""
    xo, s, mm, rows = (t.cpu() for t in out)
    x, topk_ids = x.cpu(), topk_ids.cpu()
    want_rows, counts = naive_slots(topk_ids, E, C)
    assert torch.equal(rows, want_rows) and torch.equal(mm, counts.clamp(max=C).int())
    assert xo.dtype == x.dtype and xo.shape == (E, C, x.shape[1]) and s.shape == (E, C, 0)
    for t in range(rows.shape[0]):
        for k in range(rows.shape[1]):
            if rows[t, k] < 0:
                continue
            e, c = divmod(int(rows[t, k]), C)
            assert torch.equal(xo[e, c].view(torch.uint8), x[t].view(torch.uint8)), (t, k)
