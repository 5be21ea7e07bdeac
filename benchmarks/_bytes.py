"""Bytes a local stage must move (read + written), counted from the actual routing: the numerator
of every GB/s that ``test_bench_stages.py`` and ``scripts/stage_sweep.py`` report.

- permute reads each token with a local choice once and its ids; it writes each live copy (row and
  scales), m_indices, inv_perm and expert_offsets;
- unpermute reads the live rows, inv_perm and the weights, and writes one row per token;
- quantize / silu_and_mul_quant read the live rows and write their payload and scales;
- ll_scatter reads each token with a local choice once and its ids; it writes each live copy
  (payload and scales), masked_m and the rows; ll_gather moves unpermute's bytes (the live rows,
  the rows and the weights read, one row per token written).
"""


def permute_bytes(
    sources: int, copies: int, ids_numel: int, ids_itemsize: int, row_bytes: int, m_sum: int, E: int
) -> int:
    """sources: tokens with a local choice; copies: live (t, k) entries; row_bytes: payload + scales
    of one row; m_sum: permuted rows; E: local experts."""
    read = sources * row_bytes + ids_numel * ids_itemsize
    written = copies * row_bytes + 4 * (m_sum + ids_numel + E + 1)
    return read + written


def ll_scatter_bytes(
    sources: int, copies: int, ids_numel: int, ids_itemsize: int, in_row: int, out_row: int, E: int
) -> int:
    """sources: tokens with a local choice; copies: live (t, k) entries; in_row: bytes of one input
    row; out_row: payload + scales of one slot; E: local experts (int32 masked_m), int32 rows."""
    read = sources * in_row + ids_numel * ids_itemsize
    written = copies * out_row + 4 * (E + ids_numel)
    return read + written


def unpermute_bytes(copies: int, tokens: int, hidden: int, inv_numel: int, elem: int = 2) -> int:
    """copies: live (t, k) entries; int32 inv_perm + float32 weights: 8 bytes an entry."""
    return copies * hidden * elem + inv_numel * 8 + tokens * hidden * elem


def quant_bytes(rows: int, width: int, in_size: int, scheme: str, group: int) -> int:
    """rows of ``width`` outputs from ``in_size`` bytes of input each (2 for quantize of bf16, 4
    for silu_and_mul_quant: gate and up); int8/fp8 payload plus float32 scales."""
    scales = width // group if scheme == "fp8" else 1
    return rows * (width * in_size + width + 4 * scales)
