"""ll_scatter / ll_gather on CUDA: against the contract and the reference, eager / dispatcher /
compiled alike, in a CUDA graph, and their value checks (debug mode, in-kernel device asserts)."""

import subprocess
import sys

import pytest
import torch

import epmoe
from epmoe import reference
from epmoe.ops.ll_gather import ll_gather
from epmoe.ops.ll_scatter import ll_scatter
from tests._opcheck import ALL, NO_VALUE_COMPARE, opcheck
from tests._routing import random_weights
from tests._tol import assert_close
from tests.ops import _ll_cases as L

pytestmark = pytest.mark.gpu
QUANTS = ("bf16", "fp8", "int8")


def _inputs(T, K, H, NG, seed, dtype=torch.int64, col_major=False, p_none=0.2):
    gen = torch.Generator().manual_seed(seed)
    x = L.tokens(T, H, gen)
    topk = L.ids(T, K, NG, gen, p_none=p_none, dtype=dtype, col_major=col_major)
    w = random_weights(T, K, gen)
    return x.cuda(), topk.cuda(), w.cuda()


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize(
    "T,K,H,E,P,layout,dtype,col_major",
    [
        (128, 8, 7168, 256, 1, "deepgemm", torch.int64, False),  # W decode on one rank
        (128, 8, 7168, 128, 2, "row", torch.int32, True),  # rank 1 of 2, column-major ids
        (37, 6, 2176, 16, 1, "row", torch.int64, True),  # K padded to 8, partial column chunks
        (512, 8, 1024, 8, 1, "deepgemm", torch.int32, False),  # 4096 entries: long slot counts
        (2100, 8, 1024, 64, 1, "deepgemm", torch.int32, False),  # 5 blocks of 512 tokens counted
        (9000, 1, 512, 4, 2, "row", torch.int64, True),  # one id a token: 3 blocks of 4096
    ],
)
def test_scatter_matches_contract(quant, T, K, H, E, P, layout, dtype, col_major):
    x, topk, _ = _inputs(T, K, H, E * P, seed=T + H, dtype=dtype, col_major=col_major)
    lo = (P - 1) * E
    C = T  # distinct experts per token: at most T entries each
    out = ll_scatter(x, topk, E, C, quant, lo, E * P, layout)
    L.check_scatter(out, x, topk, E, C, quant, lo, E * P)
    if layout == "deepgemm" and quant != "bf16":
        _, s_ref, _, _ = reference.ll_scatter(x.cpu(), topk.cpu(), E, C, quant, lo, E * P)
        mm = out[2].cpu()
        live = torch.arange(C)[None, :] < mm[:, None]
        assert torch.equal(out[1].cpu()[live], s_ref[live])
        pad = -(-C // 4) * 4
        G = s_ref.shape[2]
        assert out[1].stride() == (G * pad, 1, pad)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("T", [64, 1100])  # 1100 x 8 ids: the blocked slot count
def test_dispatcher_and_compiled_give_the_same_bytes(quant, T):
    x, topk, w = _inputs(T, 8, 2048, 32, seed=1)
    eager = ll_scatter(x, topk, 32, T, quant)
    disp = torch.ops.epmoe.ll_scatter.default(x, topk, 32, T, quant, 0, None, "row")

    def step(x, topk, w):
        xo, s, mm, rows = ll_scatter(x, topk, 32, T, quant)
        return xo, s, mm, rows

    torch._dynamo.reset()
    comp = torch.compile(step, fullgraph=True)(x, topk, w)
    for other in (disp, comp):
        assert torch.equal(other[2], eager[2]) and torch.equal(other[3], eager[3])
        live = torch.arange(T, device="cuda")[None, :] < eager[2][:, None]
        assert torch.equal(L.as_bytes(other[0])[live], L.as_bytes(eager[0])[live])
        assert torch.equal(other[1][live], eager[1][live])


def test_roundtrip_at_w_decode():
    """scatter -> gather with unit weights: (#local entries) * x, exactly (bf16)."""
    x, topk, _ = _inputs(128, 8, 7168, 256, seed=3)
    xo, _, _, rows = ll_scatter(x, topk, 256, 128)
    n = (topk >= 0).sum(1, keepdim=True).float()
    assert torch.equal(ll_gather(xo, rows), (x.float() * n).bfloat16())


@pytest.mark.parametrize("quant", QUANTS)
def test_cuda_graph_replay(quant):
    """Captured once; new routings and tokens replay into the same static outputs."""
    T, K, H, E = 128, 8, 7168, 64
    x, topk, w = _inputs(T, K, H, E, seed=4)
    layout = "deepgemm" if quant == "fp8" else "row"

    def step():
        xo, s, mm, rows = ll_scatter(x, topk, E, T, quant, scale_layout=layout)
        y = xo if quant == "bf16" else torch.zeros((E, T, H), dtype=torch.bfloat16, device="cuda")
        return xo, s, mm, rows, ll_gather(y, rows, w)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # (compiles the kernels outside the capture)
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (5, 6):
        x2, topk2, w2 = _inputs(T, K, H, E, seed=seed, p_none=0.5 if seed == 6 else 0.1)
        x.copy_(x2)
        topk.copy_(topk2)
        w.copy_(w2)
        graph.replay()
        torch.cuda.synchronize()
        L.check_scatter(outs[:4], x, topk, E, T, quant)
        if quant == "bf16":
            assert_close(outs[4], reference.ll_gather(outs[0], outs[3], w))


def test_debug_mode_raises():
    x = torch.zeros((5, 128), dtype=torch.bfloat16, device="cuda")
    over = torch.tensor([[0], [1], [0], [0], [0]], device="cuda")
    epmoe.set_debug(True)
    try:
        with pytest.raises(ValueError, match="ll_scatter: topk_ids expected at most capacity=3"):
            ll_scatter(x, over, 2, 3)
        with pytest.raises(ValueError, match=r"ll_scatter: topk_ids expected ids in \[0, 4\)"):
            ll_scatter(x, over + 3, 2, 5, expert_lo=2, num_global_experts=4)  # id 4 == NG
        y = torch.zeros((2, 3, 128), dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match=r"ll_gather: rows expected rows in \[0, 6\)"):
            ll_gather(y, torch.tensor([[0, 6]], dtype=torch.int32, device="cuda"))
    finally:
        epmoe.set_debug(False)


def test_overflow_without_checks_stays_in_bounds(monkeypatch):
    """The kernel itself (its check disabled): masked_m clamped to C, nothing past capacity."""
    import epmoe.kernels.scatter as M

    monkeypatch.setattr(M._checks, "assert_in_kernel", lambda direct: False)
    monkeypatch.setattr(M._checks, "check_codes", lambda *a, **k: None)
    x = L.tokens(5, 128, torch.Generator().manual_seed(7)).cuda()
    topk = torch.tensor([[0, 1], [0, -1], [0, 1], [1, -1], [0, -1]], device="cuda")
    out = ll_scatter(x, topk, 2, 3)
    assert out[2].tolist() == [3, 3]
    L.check_scatter(out, x, topk, 2, 3, "bf16")


def test_opcheck_cuda():
    x, topk, w = _inputs(24, 4, 256, 8, seed=8, col_major=True)
    for quant in QUANTS:
        args = (x, topk, 8, 24, quant, 0, None, "deepgemm" if quant == "fp8" else "row")
        opcheck(torch.ops.epmoe.ll_scatter.default, args, utils=NO_VALUE_COMPARE)
    xo, _, _, rows = ll_scatter(x, topk, 8, 24)
    y = torch.randn_like(xo)
    opcheck(torch.ops.epmoe.ll_gather.default, (y, rows, w), utils=ALL)
    out = torch.empty((24, 256), dtype=torch.bfloat16, device="cuda")
    opcheck(torch.ops.epmoe.ll_gather_out.default, (y, rows, w, out), utils=ALL)


_BAD = """
import torch
from epmoe.ops.ll_gather import ll_gather
from epmoe.ops.ll_scatter import ll_scatter
case = {case!r}
x = torch.randn(64, 256, device="cuda").bfloat16()
ids = torch.randint(0, 4, (64, 1), device="cuda")
ids[:, 0] = torch.arange(64, device="cuda") % 4  # 16 entries per expert
y = torch.randn(4, 16, 256, device="cuda").bfloat16()
rows = torch.randint(-1, 64, (64, 2), device="cuda", dtype=torch.int32)
run = {{
    "scatter": lambda: ll_scatter(x, ids, 4, 16, "fp8"),
    "scatter_dispatcher": lambda: torch.ops.epmoe.ll_scatter.default(x, ids, 4, 16, "int8"),
    "gather": lambda: ll_gather(y, rows),
}}[case.split("-")[0]]
run()
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    run()
g.replay()
torch.cuda.synchronize()
print("good replay ok", flush=True)
if case == "gather":
    rows.fill_(64)  # == E*C
elif case.endswith("-id"):
    ids[3, 0] = 4  # == num_global_experts
else:
    ids[3, 0] = 0  # a 17th entry on expert 0
g.replay()
torch.cuda.synchronize()
print("bad replay passed", flush=True)
"""


@pytest.mark.parametrize(
    "case", ["scatter-over", "scatter-id", "scatter_dispatcher-over", "gather"]
)
def test_bad_value_in_a_replay_trips_the_assert(case):
    """The kernels' own device asserts (direct launches, in a captured graph): capacity
    overflow, an id == num_global_experts, a row == E*C."""
    res = subprocess.run(
        [sys.executable, "-c", _BAD.format(case=case)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "good replay ok" in res.stdout, res.stderr[-3000:]
    assert "bad replay passed" not in res.stdout
    assert res.returncode != 0
    assert "assert" in res.stderr.lower(), res.stderr[-3000:]


@pytest.mark.parametrize("dtype", L.RAW_DTYPES)
@pytest.mark.parametrize("H", [7168, 3 * 8 + 5])  # an fp8 payload row; a packed metadata row
def test_scatter_raw_copies(dtype, H):
    """quant="bf16" on 1- and 4-byte payloads: raw bytes (NaN / inf patterns kept)."""
    gen = torch.Generator().manual_seed(H)
    T, K, E, P = 96, 4, 8, 2
    x = L.raw_tokens(T, H, dtype, gen).cuda()
    topk = L.ids(T, K, E, gen, col_major=True).cuda()
    out = ll_scatter(x, topk, E, T)
    L.check_raw_scatter(out, x, topk, E, T)
    peers = torch.where(topk[:, :P] >= 0, torch.arange(P, device="cuda"), -1)  # ranks as experts
    L.check_raw_scatter(ll_scatter(x, peers, P, T), x, peers, P, T)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize(
    "T,K,H,width,E,layout",
    [
        (128, 8, 2880, 2944, 32, "deepgemm"),  # a padded hidden: a partial fp8 group
        (37, 6, 160, 256, 16, "row"),  # K padded to 8, one chunk
        (64, 4, 16000, 16384, 8, "deepgemm"),  # many chunks; int8 the two-read path
    ],
)
def test_scatter_width_matches_contract(quant, T, K, H, width, E, layout):
    """A layout wider than x: each slot x's row zero-extended, quantized as such, byte-exact."""
    x, topk, _ = _inputs(T, K, H, E, seed=T + H, col_major=True)
    out = ll_scatter(x, topk, E, T, quant, scale_layout=layout, width=width)
    L.check_scatter(out, x, topk, E, T, quant, width=width)
    _, s_ref, _, _ = reference.ll_scatter(x.cpu(), topk.cpu(), E, T, quant, 0, None, width)
    live = torch.arange(T)[None, :] < out[2].cpu()[:, None]
    assert torch.equal(out[1].cpu()[live], s_ref[live])
    assert (out[0].cpu()[live][:, H:].float() == 0).all()
    disp = torch.ops.epmoe.ll_scatter.default(x, topk, E, T, quant, 0, None, layout, width)

    def written(t):  # (xo / scales: the live slots; masked_m, rows: all)
        return L.as_bytes(t.cpu()[live] if t.dim() == 3 else t.cpu())

    for a, b in zip(out, disp, strict=True):
        assert torch.equal(written(a), written(b))
