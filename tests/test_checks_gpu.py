"""Value checks inside the kernels, on the GPU.

permute's and unpermute's kernels assert the ids / rows themselves on direct launches (the public
functions and the dispatcher: eager, and graph capture of either): no check kernel runs around
them. Checked here: graph replays equal eager results, no check kernel is captured, and a bad
value copied into a captured graph's input still trips the device assert (in a subprocess: a
device assert leaves the CUDA context unusable).
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


def _step(d, unperm=unpermute):
    p = permute(d["x"], d["ids"], E, A, d["xs"], scale_layout="deepgemm")
    out = unperm(d["y"], p.inv_perm, d["w"])
    return [p.x.view(torch.uint8), p.m_indices, p.inv_perm, p.expert_offsets, out]


@pytest.mark.parametrize(
    "path,via", [("chain", "public"), ("one_kernel", "public"), ("chain", "dispatcher")]
)
def test_capture_replays_equal_eager_and_captures_no_check(path, via, monkeypatch):
    """permute and unpermute (the public function or the dispatcher's op) captured into a graph
    replay to the eager results, and ask for no check after their kernels (check_values is for
    torch.compile and the interpreter). path: permute's count / scan / copy chain, or its one
    kernel for few entries (permute.CONFIG.small_entries)."""
    small = 0 if path == "chain" else 2048
    C.set_config(monkeypatch, C.permute_mod, small_entries=small)
    unperm = unpermute if via == "public" else torch.ops.epmoe.unpermute.default
    checks = []
    real = _checks.check_values

    def spy(*a, **kw):
        checks.append(a[1:3])
        return real(*a, **kw)

    monkeypatch.setattr(_checks, "check_values", spy)
    static = _inputs(0)
    _step(static, unperm)  # compiles the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _step(static, unperm)
    assert checks == [], checks
    for seed in (1, 2, 3):
        fresh = _inputs(seed)
        for k, v in fresh.items():
            static[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        want = _step(fresh, unperm)
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
P = importlib.import_module("epmoe.ops.permute")
P.CONFIG = P.PermuteConfig(small_entries={small})
x = torch.randn(64, 256, device="cuda").bfloat16()
ids = torch.randint(0, 4, (64, 2), device="cuda", dtype=torch.int32)
w = torch.rand(64, 2, device="cuda")
y = torch.randn(600, 256, device="cuda").bfloat16()
inv = torch.randint(-1, 600, (64, 2), device="cuda", dtype=torch.int32)
run = {{
    "permute": lambda: permute(x, ids, 4, 16),
    "unpermute": lambda: unpermute(y, inv, w),
    "unpermute_dispatcher": lambda: torch.ops.epmoe.unpermute.default(y, inv, w),
}}[op]
run()
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    run()
g.replay()
torch.cuda.synchronize()
print("good replay ok", flush=True)
(ids if op == "permute" else inv).fill_(9999)
g.replay()
torch.cuda.synchronize()
print("bad replay passed", flush=True)
"""


@pytest.mark.parametrize(
    "op,small",
    [("permute", 0), ("permute", 2048), ("unpermute", 2048), ("unpermute_dispatcher", 2048)],
    ids=["chain", "one", "un", "un_dispatcher"],
)
def test_bad_value_in_a_replay_trips_the_assert(op, small):
    """The kernels' own asserts: permute's (the chain's scan kernel, the one kernel for few
    entries: small is permute.CONFIG.small_entries) and unpermute's (the public function and the
    dispatcher's op)."""
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
