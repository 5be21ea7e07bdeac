"""permute Triton kernels on CPU tensors under TRITON_INTERPRET=1: exact against the reference."""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)

import torch  # noqa: E402

from epmoe import reference  # noqa: E402
from tests.ops import _stage_cases as C  # noqa: E402

pytestmark = pytest.mark.interpret
P = C.permute_mod


@pytest.fixture(params=["chain", "one_kernel"])
def small_blocks(request, monkeypatch):
    """Tiny blocks so a few dozen entries span several count / scan / copy blocks; every test
    that uses them runs twice: through the count / scan / copy chain, and through the one kernel
    that small inputs take (permute.CONFIG.small_entries)."""
    small = 0 if request.param == "chain" else 256
    tiny = dict(small_entries=small, block_n=8, block_scan=2, block_rows=16, fill_split=2)
    C.set_config(monkeypatch, P, copy_bytes=64, **tiny)


def _payload(m, h, dtype, gen):
    x = torch.randn((m, h), generator=gen) * 8
    if dtype == torch.int8:
        return x.clamp(-127, 127).to(torch.int8)
    return x.to(dtype)


def _run(x, ids, e, a, scales=None, layout="row"):
    ref = reference.permute(x, ids, e, a, scales)
    out = None
    for byte in C.POISON_BYTES:
        with C.poisoned_empty(byte):
            out = P._permute_triton(x, ids, e, a, scales, layout)
        C.assert_permute_equal(out, ref)
    return out


@pytest.mark.parametrize(
    "dtype,s", [(torch.bfloat16, 3), (torch.float8_e4m3fn, 2), (torch.int8, 1), (torch.float32, 0)]
)
def test_random_routing(dtype, s, small_blocks):
    gen = torch.Generator().manual_seed(0)
    m, k, e, a, h = 10, 4, 6, 8, 40  # 40 entries: 5 count blocks; H = 40: 2 copy chunks (bf16)
    x = _payload(m, h, dtype, gen)
    scales = torch.rand((m, s), generator=gen) if s else None
    _run(x, C.routing(m, k, e, gen), e, a, scales)


@pytest.mark.parametrize("layout", ["row", "deepgemm"])
def test_no_columns(layout, small_blocks):
    """x[:, :0]: the index outputs alone (src_rows included), exact; nothing else written."""
    gen = torch.Generator().manual_seed(1)
    m, k, e, a = 10, 4, 6, 8
    x = _payload(m, 24, torch.bfloat16, gen)[:, :0]
    _run(x, C.routing(m, k, e, gen), e, a, None, layout)


@pytest.mark.parametrize(
    "m,k,e,a,kind",
    [
        (0, 4, 3, 8, "random"),  # no tokens: only padding rows
        (1, 1, 1, 1, "random"),  # one token, one expert, no alignment
        (9, 3, 4, 4, "one_expert"),  # every choice on the last expert
        (9, 3, 4, 4, "all_neg"),  # nothing local
        (11, 2, 1, 16, "random"),  # E = 1
        (7, 5, 3, 1, "random"),  # K > E: repeated experts per token
    ],
)
def test_edge_cases(m, k, e, a, kind, small_blocks):
    gen = torch.Generator().manual_seed(m * 31 + k)
    x = _payload(m, 24, torch.bfloat16, gen)
    _run(x, C.routing(m, k, e, gen, kind, local=0.7), e, a, torch.rand((m, 2), generator=gen))


def test_default_blocks_many_experts():
    """Default launch constants, E = 40 (padded bins), entries spanning two count blocks."""
    gen = torch.Generator().manual_seed(5)
    m, k, e = 20, 8, 40
    ids = C.routing(m, k, e, gen, local=0.6)
    _run(_payload(m, 16, torch.bfloat16, gen), ids, e, 16, None)


@pytest.mark.parametrize(
    "seed,empty,s",
    [
        (0, False, 8),
        (1, True, 5),
        (2, True, 8),
        (3, True, 12),
    ],
)
def test_scale_rows_many_blocks(seed, empty, s, small_blocks, monkeypatch):
    """Row-block scale copy across many count blocks (2 tokens each), experts with no entries
    between used ones (empty: only even ids), programs spanning experts and padding; with the
    column chunks past the first copied by the scale kernel (3 chunks of 64 bytes, the last
    partial), its scale programs spread among those copies. s scales a row: 16-byte
    rows (8, 12) take the vector copy (permute._scale_vec), 20-byte ones (5) the plain one."""
    # 4 rows of 8 (padded) scales per program
    C.set_config(monkeypatch, P, scales_by_row_min_entries=0, scale_tile=32)
    gen = torch.Generator().manual_seed(seed)
    m, k, e, a = 37, 3, 7, 4
    ids = C.routing(m, k, e, gen, local=0.7)
    if empty:
        ids = torch.where(ids >= 0, ids // 2 * 2, ids)  # (may repeat an expert within a token)
    x = _payload(m, 150, torch.float8_e4m3fn, gen)
    scales = torch.rand((m, s), generator=gen)
    out = _run(x, ids, e, a, scales, "deepgemm")
    assert out[1].stride()[0] == 1
    assert P._scale_vec(scales, out[1])["VEC"] == (s % 4 == 0)


@pytest.mark.parametrize("by_row", [True, False])
def test_deepgemm_scale_layout(by_row, small_blocks, monkeypatch):
    """Both scale copies: per destination row block (from scales_by_row_min_entries: this small
    case takes it too) and per source token (below it)."""
    min_entries = 0 if by_row else 1 << 30
    # 4 rows of 4 (padded) scales per program
    C.set_config(monkeypatch, P, scales_by_row_min_entries=min_entries, scale_tile=16)
    gen = torch.Generator().manual_seed(8)
    m, k, e, a = 9, 3, 4, 8
    x = _payload(m, 16, torch.float8_e4m3fn, gen)
    out = _run(x, C.routing(m, k, e, gen), e, a, torch.rand((m, 3), generator=gen), "deepgemm")
    m_sum = out[0].shape[0]
    assert out[1].stride() == (1, (m_sum + 3) // 4 * 4)
    # the CPU op (reference) gives the same layout and values
    ids = C.routing(m, k, e, gen)
    scales = torch.rand((m, 3), generator=gen)
    p = C.permute_mod.permute(x, ids, e, a, scales, scale_layout="deepgemm")
    ref = reference.permute(x, ids, e, a, scales)
    assert p.x_scales.stride() == out[1].stride()
    C.assert_equal(p.x_scales, ref[1], "scales")


def test_int32_and_strided_ids(small_blocks):
    gen = torch.Generator().manual_seed(6)
    ids = C.routing(10, 3, 5, gen).to(torch.int32)
    strided = ids.t().contiguous().t()  # same values, column-major
    x = _payload(10, 20, torch.bfloat16, gen)
    out = _run(x, strided, 5, 4)
    assert out[3].is_contiguous()


def test_unit_weight_round_trip(small_blocks):
    """K = 1: unpermute(permute(x)) with unit weights restores x (tokens with id -1 give 0)."""
    gen = torch.Generator().manual_seed(7)
    x = _payload(12, 24, torch.float32, gen)
    ids = C.routing(12, 1, 4, gen, local=0.75)
    p = P._permute_triton(x, ids, 4, 8)
    back = C.unpermute_mod._unpermute_triton(p[0], p[3], torch.ones((12, 1)))
    want = torch.where(ids >= 0, x, 0.0)
    C.assert_equal(back, want, "round trip")


def test_bad_ids_raise(small_blocks):
    ids = torch.tensor([[0, 1], [2, 7]])
    with pytest.raises(ValueError, match=r"permute: topk_ids expected ids in \[0, 3\) or -1"):
        P._permute_triton(torch.zeros((2, 8)), ids, 3, 4)
    with pytest.raises(ValueError, match="permute: topk_ids expected"):
        P._permute_triton(torch.zeros((2, 8)), torch.tensor([[0, -2], [1, 1]]), 3, 4)


def test_zero_width_rows_still_place(small_blocks):
    """H = 0: no payload to copy, but inv_perm, m_indices and the offsets are still written."""
    gen = torch.Generator().manual_seed(9)
    ids = C.routing(6, 2, 3, gen)
    _run(torch.zeros((6, 0), dtype=torch.bfloat16), ids, 3, 4)
