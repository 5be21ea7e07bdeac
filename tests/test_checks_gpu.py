"""Value checks as a side branch of a captured CUDA graph (epmoe._checks.branch), on the GPU.

While a graph is captured, unpermute's row check runs on a side stream: the graph gets it as a
parallel branch instead of nodes between the op's kernels. permute's kernels assert the ids
themselves (on direct launches: eager, the dispatcher, graph capture of either). Checked here: the
branch is taken under capture (and only then), replays equal eager results, and a bad value
copied into a captured graph's input still trips the device assert (in a subprocess: a device
assert leaves the CUDA context unusable).
"""

import subprocess
import sys

import pytest
import torch

from epmoe import _checks, reference
from epmoe.ops import permute, unpermute
from tests.ops import _stage_cases as C

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E, A, M, K, H = 4, 16, 64, 2, 256


def _inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((M, H), generator=gen).to(torch.bfloat16)
    ids = torch.randint(-1, E, (M, K), generator=gen, dtype=torch.int32)
    w = torch.rand((M, K), generator=gen)
    xq, xs = reference.quantize(x, "fp8")
    y = torch.randn((reference.permuted_rows(M, K, E, A), H), generator=gen).to(torch.bfloat16)
    return {k: v.cuda() for k, v in dict(x=xq, xs=xs, ids=ids, w=w, y=y).items()}


def _step(d):
    p = permute(d["x"], d["ids"], E, A, d["xs"], scale_layout="deepgemm")
    out = unpermute(d["y"], p.inv_perm, d["w"])
    return [p.x.view(torch.uint8), p.m_indices, p.inv_perm, p.expert_offsets, out]


@pytest.mark.parametrize("path", ["chain", "one_kernel"])
def test_checks_branch_under_capture_and_replays_equal_eager(path, monkeypatch):
    """unpermute branches for its check under capture; permute's kernels assert the ids
    themselves and never do. path: permute's count / scan / copy chain, or its one kernel for few
    entries (permute.SMALL_ENTRIES)."""
    monkeypatch.setattr(C.permute_mod, "SMALL_ENTRIES", 0 if path == "chain" else 2048)
    taken = []
    real = _checks.branch

    def spy(t, **kw):
        side = real(t, **kw)
        taken.append(side is not None)
        return side

    monkeypatch.setattr(_checks, "branch", spy)
    static = _inputs(0)
    _step(static)  # compiles the kernels
    torch.cuda.synchronize()
    assert taken == [False], taken  # eager: no branch (and permute never asks for one)
    taken.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _step(static)
    assert taken == [True], taken  # unpermute branched
    for seed in (1, 2, 3):
        fresh = _inputs(seed)
        for k, v in fresh.items():
            static[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        want = _step(fresh)
        for i, (a, b) in enumerate(zip(outs, want, strict=True)):
            if i == 0:  # permuted rows: only the used ones are specified
                live = want[1] >= 0
                a, b = a[live], b[live]
            C.assert_equal(a, b, f"output {i}, seed {seed}")


_BAD_REPLAY = """
import importlib
import torch
from epmoe.ops import permute, unpermute
op = {op!r}
importlib.import_module("epmoe.ops.permute").SMALL_ENTRIES = {small}
x = torch.randn(64, 256, device="cuda").bfloat16()
ids = torch.randint(0, 4, (64, 2), device="cuda", dtype=torch.int32)
w = torch.rand(64, 2, device="cuda")
y = torch.randn(600, 256, device="cuda").bfloat16()
inv = torch.randint(-1, 600, (64, 2), device="cuda", dtype=torch.int32)
run = {{
    "permute": lambda: permute(x, ids, 4, 16),
    "unpermute": lambda: unpermute(y, inv, w),
}}[op]
run()
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    run()
g.replay()
torch.cuda.synchronize()
print("good replay ok", flush=True)
{{"permute": ids, "unpermute": inv}}[op].fill_(9999)
g.replay()
torch.cuda.synchronize()
print("bad replay passed", flush=True)
"""


@pytest.mark.parametrize(
    "op,small", [("permute", 0), ("permute", 2048), ("unpermute", 2048)], ids=["chain", "one", "un"]
)
def test_bad_value_in_a_replay_trips_the_assert(op, small):
    """permute's kernels' own asserts (the chain's copy kernel, the one kernel for few entries:
    small is permute.SMALL_ENTRIES) and unpermute's branch assert."""
    res = subprocess.run(
        [sys.executable, "-c", _BAD_REPLAY.format(op=op, small=small)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "good replay ok" in res.stdout, res.stderr[-3000:]
    assert "bad replay passed" not in res.stdout
    assert res.returncode != 0
    assert "assert" in res.stderr.lower(), res.stderr[-3000:]
