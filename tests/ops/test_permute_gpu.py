"""permute on CUDA (Triton kernels): exact against the CPU reference (index outputs, payload and
scale rows), every specified element written (outputs poisoned first), deterministic, CUDA-graph
safe, opcheck on CUDA inputs."""

import pytest
import torch

import epmoe
from epmoe.ops import permute
from tests._opcheck import NO_VALUE_COMPARE, opcheck
from tests.ops import _stage_cases as C

pytestmark = pytest.mark.gpu


def _payload(m, h, dtype, gen):
    x = torch.randn((m, h), generator=gen) * 8
    if dtype == torch.int8:
        return x.clamp(-127, 127).to(torch.int8)
    return x.to(dtype)


def _check(x, ids, e, a, scales=None, layout="row"):
    """x: CPU or CUDA (a CUDA view keeps its strides; x.cuda() of a CPU view would not)."""
    ref = C.reference_permute(x.cpu(), ids, e, a, scales)
    sc = None if scales is None else scales.cuda()
    out = None
    for byte in C.POISON_BYTES:
        with C.poisoned_empty(byte):
            p = permute(x.cuda(), ids.cuda(), e, a, sc, scale_layout=layout)
        torch.cuda.synchronize()
        s = p.x_scales if p.x_scales is not None else torch.empty((p.x.shape[0], 0))
        out = (p.x, s, p.m_indices, p.inv_perm, p.expert_offsets, p.src_rows)
        C.assert_permute_equal(out, ref)
    return out


@pytest.mark.parametrize(
    "dtype,s,layout",
    [
        (torch.bfloat16, 0, "row"),
        (torch.float8_e4m3fn, 56, "row"),
        (torch.int8, 1, "row"),
        # 8192 entries: DeepGEMM-layout scales by destination row block, in the second kernel
        # with the column chunks past the first
        (torch.float8_e4m3fn, 56, "deepgemm"),
    ],
)
def test_workload_w_like(dtype, s, layout):
    """128 local experts, top-8 with half the choices local, H = 7168, alignment 128."""
    gen = torch.Generator().manual_seed(0)
    m, k, e, a, h = 1024, 8, 128, 128, 7168
    x = _payload(m, h, dtype, gen)
    scales = torch.rand((m, s), generator=gen) if s else None
    assert layout == "row" or m * k >= C.permute_mod.CONFIG.scales_by_row_min_entries
    _check(x, C.routing(m, k, e, gen, local=0.5), e, a, scales, layout)


@pytest.mark.parametrize(
    "m,k,e,a,kind",
    [
        (0, 8, 16, 128, "random"),
        (1, 1, 1, 1, "random"),
        (300, 8, 16, 128, "one_expert"),
        (300, 8, 16, 128, "all_neg"),
        (257, 4, 1, 64, "random"),
        (129, 6, 3, 8, "random"),  # K > E: repeated experts
        (2000, 8, 256, 128, "random"),  # E > BLOCK_N bins, 16000 entries
        (256, 8, 128, 128, "random"),  # W decode: the most entries the one kernel takes
    ],
)
@pytest.mark.parametrize("path", ["default", "chain"])
def test_edge_cases(m, k, e, a, kind, path, monkeypatch):
    """Up to permute.CONFIG.small_entries entries one kernel does it all by default; "chain"
    forces the count / scan / copy kernels."""
    if path == "chain":
        C.set_config(monkeypatch, C.permute_mod, small_entries=0)
    gen = torch.Generator().manual_seed(m + e)
    x = _payload(m, 300, torch.bfloat16, gen)  # H = 300: a partial copy chunk
    _check(x, C.routing(m, k, e, gen, kind, local=0.6), e, a, torch.rand((m, 3), generator=gen))


def test_int32_ids_deepgemm_scales():
    gen = torch.Generator().manual_seed(1)
    m, k, e, a = 500, 8, 32, 128
    ids = C.routing(m, k, e, gen).to(torch.int32)
    out = _check(
        _payload(m, 1024, torch.float8_e4m3fn, gen),
        ids,
        e,
        a,
        torch.rand((m, 8), generator=gen),
        "deepgemm",
    )
    m_sum = out[0].shape[0]
    assert out[1].stride() == (1, (m_sum + 3) // 4 * 4)


def test_deterministic():
    gen = torch.Generator().manual_seed(2)
    x = _payload(4096, 512, torch.bfloat16, gen).cuda()
    ids = C.routing(4096, 8, 8, gen, local=0.9).cuda()  # heavy load per expert
    a = permute(x, ids, 8, 128)
    b = permute(x, ids, 8, 128)
    live = a.m_indices >= 0  # padding rows are unspecified (never written on CUDA)
    assert torch.equal(a.x[live], b.x[live])
    for u, v in zip(a[2:], b[2:], strict=True):
        assert torch.equal(u, v)


def test_bad_ids_raise_in_debug_mode():
    x = torch.zeros((4, 64), dtype=torch.bfloat16, device="cuda")
    ids = torch.tensor([[0, 1], [2, 3], [1, 9], [-1, 0]], device="cuda")
    epmoe.set_debug(True)
    try:
        with pytest.raises(ValueError, match=r"permute: topk_ids expected ids in \[0, 4\) or -1"):
            permute(x, ids, 4, 8)
    finally:
        epmoe.set_debug(False)


# padding rows of p.x are unspecified on CUDA (see tests/_opcheck.NO_VALUE_COMPARE)
_UTILS = NO_VALUE_COMPARE


def test_opcheck_cuda():
    gen = torch.Generator().manual_seed(3)
    x = _payload(40, 256, torch.bfloat16, gen).cuda()
    ids = C.routing(40, 4, 6, gen).cuda()
    scales = torch.rand((40, 2), generator=gen).cuda()
    opcheck(torch.ops.epmoe.permute.default, (x, ids, 6, 16, scales, "row"), utils=_UTILS)
    opcheck(
        torch.ops.epmoe.permute.default,
        (x, ids.to(torch.int32), 6, 16, None, "deepgemm"),
        utils=_UTILS,
    )
    # 1-byte payload (int8: opcheck's own input comparisons have no float8 kernels)
    x8 = _payload(40, 256, torch.int8, gen).cuda()
    opcheck(torch.ops.epmoe.permute.default, (x8, ids, 6, 16, scales, "deepgemm"), utils=_UTILS)


@pytest.mark.parametrize(
    "m,h",
    [
        (512, 1024),  # DeepGEMM-layout scales per source token (4096 entries), one column chunk
        (1024, 7168),  # per destination row block (8192 entries), two chunks: the split kernels
        (256, 7168),  # 2048 entries: the one kernel (permute.CONFIG.small_entries)
    ],
)
def test_cuda_graph_replay(m, h):
    """Captured once at a static shape; new routings (new counts per expert) replay correctly."""
    gen = torch.Generator().manual_seed(4)
    k, e, a = 8, 16, 128
    x = _payload(m, h, torch.float8_e4m3fn, gen).cuda()
    ids = C.routing(m, k, e, gen).cuda()
    scales = torch.rand((m, h // 128), generator=gen).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # (compiles the kernels outside the capture)
        permute(x, ids, e, a, scales, scale_layout="deepgemm")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p = permute(x, ids, e, a, scales, scale_layout="deepgemm")
    for local in (0.3, 0.95):
        ids.copy_(C.routing(m, k, e, gen, local=local))
        x.copy_(_payload(m, h, torch.float8_e4m3fn, gen))
        graph.replay()
        torch.cuda.synchronize()
        ref = C.reference_permute(x, ids, e, a, scales)
        C.assert_permute_equal(tuple(p), ref)


@pytest.mark.parametrize(
    "m,h,dtype,s,layout,view",
    [
        (1024, 7168, torch.float8_e4m3fn, 56, "deepgemm", False),  # split: scales, both kernels
        (1024, 7168, torch.bfloat16, 0, "row", False),
        (1024, 7168, torch.int8, 1, "row", False),  # 4-byte scale rows: no prefetch of them
        (600, 1040, torch.bfloat16, 0, "row", False),  # one chunk of 2080 bytes
        (600, 1040, torch.int8, 1, "row", True),  # x[:, 1:] rows off 16 bytes: prefetch off
    ],
)
@pytest.mark.parametrize("waves,per_sm", [(0, 12), (2, 2), (3, 1000)])
def test_l2_prefetch(m, h, dtype, s, layout, view, waves, per_sm, monkeypatch):
    """The copy kernel's L2 prefetches (hints) change no output, wherever they point (1000
    programs an SM: past the grid, none issued), and are left off where the rows are not 16-byte
    aligned."""
    P = C.permute_mod
    pf = dict(pf_waves=waves, pf_per_sm=per_sm, pf_rest_waves=waves, pf_rest_per_sm=per_sm)
    C.set_config(monkeypatch, P, small_entries=0, **pf)
    gen = torch.Generator().manual_seed(m + h)
    k, e, a = 8, 128, 128
    x = _payload(m, h + view, dtype, gen).cuda()[:, view:]
    scales = torch.rand((m, s), generator=gen) if s else None
    sc = None if scales is None else scales.cuda()
    meta = P._prefetch_meta(x, sc, True, layout == "deepgemm", 4096 // x.element_size(), P.CONFIG)
    assert meta["PF_WAVES"] == (0 if view else waves)
    assert meta["PF_SCALES"] == (layout == "deepgemm")
    rest = P._rest_prefetch(x, True, 4096 // x.element_size(), P.CONFIG)
    assert rest["PF_WAVES"] == meta["PF_WAVES"]
    _check(x, C.routing(m, k, e, gen, local=0.5), e, a, scales, layout)
