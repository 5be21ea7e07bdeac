"""silu_and_mul(_quant) Triton kernels on CPU tensors under TRITON_INTERPRET=1.

silu_and_mul is compared with the reference at the dtype tolerance (exp may differ in the last
bit between backends), for every gate kind and with the expert bias. The fused kernel is
compared byte for byte with the reference quantizer applied to the unfused kernel's output: same
activation bits, then exactly the reference quantization.
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)

import torch  # noqa: E402

from epmoe import reference  # noqa: E402
from tests.ops import _stage_cases as C  # noqa: E402

pytestmark = [
    pytest.mark.interpret,
    # (exp(-z) of a large negative gate is inf under numpy, as on the GPU: h = g / inf = -0.0)
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]
A = C.activation_mod


def _live(y, masked_m=None, m_indices=None):
    if y.dim() == 3:
        return C.masked_rows(y.shape[0], y.shape[1], masked_m)
    if m_indices is not None:
        return m_indices >= 0
    return torch.ones(y.shape[0], dtype=torch.bool)


def _check_silu(y, masked_m=None, m_indices=None, gate="silu", bias=None, offsets=None):
    live = _live(y, masked_m, m_indices)
    ref = reference.silu_and_mul(y, gate, bias, m_indices)
    for byte in C.POISON_BYTES:
        with C.poisoned_empty(byte):
            h = A._silu_and_mul_triton(y, masked_m, m_indices, offsets, gate, bias)
        assert h.dtype == y.dtype and h.shape == ref.shape
        C.assert_close(h[live], ref[live])
    return h


def _check_quant(
    y, scheme, masked_m=None, group_size=128, m_indices=None, layout="row", gate="silu", bias=None
):
    live = _live(y, masked_m, m_indices)
    h = A._silu_and_mul_triton(y, masked_m, m_indices, None, gate, bias)
    C.assert_close(h[live], reference.silu_and_mul(y, gate, bias, m_indices)[live])
    rq, rs = reference.quantize(h, scheme, group_size)
    for byte in C.POISON_BYTES:
        with C.poisoned_empty(byte):
            q, s = A._silu_and_mul_quant_triton(
                y, scheme, masked_m, group_size, m_indices, layout, None, gate, bias
            )
        C.assert_equal(q[live], rq[live], "q")
        C.assert_equal(s[live], rs[live], "s")
    return q, s


GATES = C.ACT_GATES


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_2d(dtype, monkeypatch):
    C.set_config(monkeypatch, A, silu_tile=64)  # I = 200: four column chunks, the last one masked
    y = (torch.randn((5, 400), generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    _check_silu(y)


def test_silu_masked_and_m_indices(monkeypatch):
    # one slot per expert: each masked program loops over row blocks; 4-row blocks over 6 rows
    C.set_config(monkeypatch, C.quantize_mod, min_slots=1)
    C.set_config(monkeypatch, C.quantize_mod, masked_programs=1)
    C.set_config(monkeypatch, A, silu_block_m=4)
    C.set_config(monkeypatch, A, row_programs=1)  # m_indices: one program loops, prefetching ids
    gen = torch.Generator().manual_seed(1)
    y3 = torch.randn((3, 4, 96), generator=gen).to(torch.bfloat16)
    _check_silu(y3, masked_m=torch.tensor([0, 4, 2], dtype=torch.int32))
    y2 = torch.randn((6, 96), generator=gen).to(torch.bfloat16)
    _check_silu(y2, m_indices=torch.tensor([0, -1, 1, -1, -1, 0], dtype=torch.int32))
    _check_silu(torch.zeros((0, 96), dtype=torch.bfloat16))


@pytest.mark.parametrize("layout", ["row", "deepgemm"])
@pytest.mark.parametrize("scheme", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quant_2d(scheme, dtype, layout):
    y = (torch.randn((5, 768), generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    _, s = _check_quant(y, scheme, layout=layout)
    if layout == "deepgemm":
        assert s.stride() == (1, 8)


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_quant_masked_and_m_indices(scheme, monkeypatch):
    C.set_config(monkeypatch, C.quantize_mod, min_slots=2)  # masked: programs loop over rows
    C.set_config(monkeypatch, C.quantize_mod, masked_programs=1)
    C.set_config(monkeypatch, A, fp8_block_m=4)  # 7 rows: a partial second block of rows
    C.set_config(monkeypatch, A, int8_row_tile=1024)  # int8: 4-row blocks too (I = 128)
    C.set_config(monkeypatch, A, row_programs=1)  # m_indices: one program loops over both blocks
    gen = torch.Generator().manual_seed(3)
    y3 = torch.randn((4, 5, 512), generator=gen).to(torch.bfloat16)
    mm = torch.tensor([5, 0, 2, 7], dtype=torch.int32)
    _check_quant(y3, scheme, masked_m=mm, layout="deepgemm")
    y2 = torch.randn((7, 256), generator=gen).to(torch.bfloat16)
    mi = torch.tensor([1, 1, -1, 0, -1, -1, 2], dtype=torch.int32)
    _check_quant(y2, scheme, m_indices=mi)


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_quant_edges(scheme):
    gen = torch.Generator().manual_seed(4)
    _check_quant(torch.zeros((0, 256), dtype=torch.bfloat16), scheme)
    _check_quant(torch.randn((1, 256), generator=gen).to(torch.bfloat16), scheme)
    _check_quant(torch.zeros((2, 256), dtype=torch.bfloat16), scheme)  # amax 0: s = 1e-10, q = 0


def test_quant_odd_group_and_two_pass(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    _check_quant(torch.randn((3, 384), generator=gen), "fp8", group_size=96)  # I = 192
    C.set_config(monkeypatch, A, int8_single_pass_max=64)
    C.set_config(monkeypatch, A, int8_chunk=32)
    _check_quant(torch.randn((3, 200), generator=gen).to(torch.bfloat16), "int8")
    y3 = torch.randn((2, 3, 200), generator=gen).to(torch.bfloat16)
    _check_quant(y3, "int8", masked_m=torch.tensor([3, 1]))


def test_strided_input():
    gen = torch.Generator().manual_seed(6)
    y = torch.randn((4, 1024), generator=gen).to(torch.bfloat16)[:, ::2]
    _check_silu(y)
    _check_quant(y, "fp8")


def test_op_cpu_deepgemm_layout():
    y = torch.randn((3, 2, 256), generator=torch.Generator().manual_seed(7))
    for scheme in ("fp8", "int8"):
        rq, rs = reference.silu_and_mul_quant(y, scheme)
        q, s = A.silu_and_mul_quant(y, scheme, scale_layout="deepgemm")
        C.assert_equal(q, rq, "q")
        C.assert_equal(s, rs, "s")
        assert s.stride() == (s.shape[-1] * 4, 1, 4)


def test_bad_m_indices():
    with pytest.raises(ValueError, match="silu_and_mul: m_indices expected None for a 3-D y"):
        A.silu_and_mul(torch.zeros(2, 2, 8), m_indices=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="silu_and_mul_quant: m_indices expected dtype"):
        A.silu_and_mul_quant(torch.zeros(2, 256), "fp8", m_indices=torch.zeros(2))


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_expert_offsets_skip_the_tail(scheme, monkeypatch):
    """Rows >= expert_offsets[-1] are never touched (they keep the poison); the rest as usual."""
    C.set_config(monkeypatch, A, offsets_programs=2)  # two programs loop over the row blocks
    gen = torch.Generator().manual_seed(9)
    y = torch.randn((12, 256), generator=gen).to(torch.bfloat16)
    mi = torch.tensor([0, 0, -1, -1, 1, 1, 1, -1, -1, -1, -1, -1], dtype=torch.int32)
    offs = torch.tensor([0, 4, 8], dtype=torch.int32)  # used rows: 8
    live = (mi >= 0) & (torch.arange(12) < 8)
    for byte in C.POISON_BYTES:
        with C.poisoned_empty(byte):
            if scheme == "bf16":
                out = A._silu_and_mul_triton(y, None, mi, offs)
                C.assert_close(out[live], reference.silu_and_mul(y)[live])
            else:
                out, s = A._silu_and_mul_quant_triton(y, scheme, None, 128, mi, "row", offs)
                h = A._silu_and_mul_triton(y, None, mi)
                rq, rs = reference.quantize(h, scheme)
                C.assert_equal(out[live], rq[live], "q")
                C.assert_equal(s[live], rs[live], "s")
        tail = out[8:].reshape(-1).view(torch.uint8)
        assert bool((tail == byte).all()), "a row past expert_offsets[-1] was written"


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gates_2d(gate, dtype, monkeypatch):
    C.set_config(monkeypatch, A, silu_tile=64)  # I = 100: two column chunks, the last one masked
    y = torch.randn((5, C.gate_width(gate, 100)), generator=torch.Generator().manual_seed(10)) * 4
    _check_silu(y.to(dtype), gate=gate)


@pytest.mark.parametrize("gate", ["silu", *GATES])
def test_gate_bias_rows(gate, monkeypatch):
    """The bias row of each row's expert: m_indices on a 2-D y (with expert_offsets: the HT path),
    e on a 3-D masked y; float32 and bf16 biases."""
    C.set_config(monkeypatch, A, silu_block_m=4)  # 4-row blocks over 6 rows, ids prefetched
    C.set_config(monkeypatch, A, row_programs=1)
    C.set_config(monkeypatch, A, offsets_programs=1)
    gen = torch.Generator().manual_seed(11)
    w = C.gate_width(gate, 64)
    y2 = (torch.randn((6, w), generator=gen) * 3).to(torch.bfloat16)
    b = torch.randn((3, w), generator=gen) * 2
    mi = torch.tensor([2, -1, 0, 0, 1, -1], dtype=torch.int32)
    _check_silu(y2, m_indices=mi, gate=gate, bias=b)
    offs = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    _check_silu(y2, m_indices=mi, gate=gate, bias=b.to(torch.bfloat16), offsets=offs)
    y3 = (torch.randn((3, 4, w), generator=gen) * 3).to(torch.bfloat16)
    mm = torch.tensor([0, 4, 2], dtype=torch.int32)
    _check_silu(y3, masked_m=mm, gate=gate, bias=b.to(torch.bfloat16))


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
@pytest.mark.parametrize("gate", GATES)
def test_gate_bias_quant(scheme, gate, monkeypatch):
    C.set_config(monkeypatch, A, fp8_block_m=4)
    C.set_config(monkeypatch, A, int8_row_tile=256)  # int8: 2-row blocks (I = 128)
    C.set_config(monkeypatch, A, row_programs=1)
    gen = torch.Generator().manual_seed(12)
    w = C.gate_width(gate, 128)
    b = torch.randn((4, w), generator=gen)
    y2 = (torch.randn((7, w), generator=gen) * 3).to(torch.bfloat16)
    mi = torch.tensor([1, 1, -1, 0, -1, 3, 2], dtype=torch.int32)
    _check_quant(y2, scheme, m_indices=mi, gate=gate, bias=b)
    y3 = (torch.randn((4, 3, w), generator=gen) * 3).to(torch.bfloat16)
    mm = torch.tensor([3, 0, 2, 1], dtype=torch.int32)
    _check_quant(y3, scheme, masked_m=mm, layout="deepgemm", gate=gate, bias=b.to(torch.float16))
    _check_quant(y3, scheme, masked_m=mm, gate=gate)  # no bias


@pytest.mark.parametrize("gate", ["silu:alpha=1.702,limit=7,up_offset=1", "relu2:glu=0"])
def test_gate_bias_int8_two_pass(gate, monkeypatch):
    C.set_config(monkeypatch, A, int8_single_pass_max=64)
    C.set_config(monkeypatch, A, int8_chunk=32)
    gen = torch.Generator().manual_seed(13)
    w = C.gate_width(gate, 100)
    y3 = (torch.randn((2, 3, w), generator=gen) * 3).to(torch.bfloat16)
    b = torch.randn((2, w), generator=gen).to(torch.bfloat16)
    _check_quant(y3, "int8", masked_m=torch.tensor([3, 1]), gate=gate, bias=b)
    y2 = (torch.randn((3, w), generator=gen) * 3).to(torch.bfloat16)
    mi = torch.tensor([1, -1, 0], dtype=torch.int32)
    _check_quant(y2, "int8", m_indices=mi, gate=gate, bias=b)


def test_no_glu_reads_only_its_columns():
    """Without a gate half, y [.., I] is read as the up values alone: a y view narrower than
    its rows (the next columns poisoned) gives the result of its own columns."""
    gen = torch.Generator().manual_seed(14)
    base = torch.randn((5, 256), generator=gen).to(torch.bfloat16)
    base[:, 128:] = float("nan")
    y = base[:, :128]
    h = _check_silu(y, gate="relu2:glu=0")
    assert not h.isnan().any()
    q, _ = _check_quant(y, "fp8", gate="relu2:glu=0")
    assert q.shape == (5, 128)
