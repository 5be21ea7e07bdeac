"""epmoe._launch: host size helpers and the direct-launch key (CPU; launches: test_launch_gpu)."""

import pytest
import torch

from epmoe import _launch


@pytest.mark.parametrize("n", [-3, 0, 1, 2, 3, 4, 5, 127, 128, 129, 4095, 4096, 4097])
def test_pow2_matches_definition(n):
    want = 1
    while want < n:
        want *= 2
    assert _launch.pow2(n) == want


@pytest.mark.parametrize("a,b", [(0, 4), (1, 4), (4, 4), (5, 4), (127, 128), (129, 128)])
def test_cdiv(a, b):
    assert _launch.cdiv(a, b) == -(-a // b)


def test_key_separates_what_triton_specializes_on():
    x = torch.zeros(64, dtype=torch.float32)
    base = _launch._key(0, (x, 7), {"BLOCK": 16})
    assert base == _launch._key(0, (torch.ones(64), 9), {"BLOCK": 16})  # same specialization
    assert base != _launch._key(1, (x, 7), {"BLOCK": 16})  # device
    assert base != _launch._key(0, (x, 7), {"BLOCK": 32})  # constexpr
    assert base != _launch._key(0, (x, 7), {"BLOCK": 16, "num_warps": 8})  # launch option
    assert base != _launch._key(0, (x.half(), 7), {"BLOCK": 16})  # dtype
    assert base != _launch._key(0, (x[1:], 7), {"BLOCK": 16})  # 16-byte alignment
    assert base != _launch._key(0, (x, 1), {"BLOCK": 16})  # == 1
    assert base != _launch._key(0, (x, 32), {"BLOCK": 16})  # multiple of 16
    assert base != _launch._key(0, (x, 2**31), {"BLOCK": 16})  # 64-bit int
    assert base != _launch._key(0, (x, True), {"BLOCK": 16})  # bool is not int
    assert base != _launch._key(0, (x, 7.0), {"BLOCK": 16})  # float
    p = torch.nn.Parameter(x)  # tensor subclasses keyed like tensors
    assert _launch._key(0, (p, 7), {"BLOCK": 16}) == base


def test_memo_caches_ints_and_recomputes_symbolic_sizes():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    calls = []

    @_launch.memo
    def plan(n, flag):
        calls.append(n)
        return (n * 2, flag)

    assert plan(3, True) is plan(3, True) and calls == [3]  # one computation per key
    assert plan(4, True) == (8, True) and calls == [3, 4]
    env = ShapeEnv()
    s = env.create_symintnode(
        env.create_symbol(5, torch._dynamo.source.ConstantSource("s")), hint=5
    )
    assert plan(s, True)[0] == 2 * s and plan(s, True) is not plan(s, True)  # never cached
    plan.cache_clear()
    plan(3, True)
    assert calls[-1] == 3 and len(calls) == 6  # (3 symbolic calls, then 3 again)


def test_prepared_pads_the_grid_and_keeps_its_arguments():
    p = _launch.Prepared(object(), (4,), [1, 2], {"BLOCK": 8})
    assert p.grid == (4, 1, 1) and p.tail == (1, 2) and p.meta == {"BLOCK": 8} and not p.hits


def test_prepared_untraced_launches_directly_whatever_the_wrap_flag(monkeypatch):
    """wrap_triton's flag is on by default outside a triton op: a Prepared called from a
    dispatcher kernel's body (untraced) launches directly; a plain call follows the flag."""
    seen = []

    class Door:
        def __init__(self, how):
            self.how = how

        def __getitem__(self, grid):
            return lambda *args, **meta: seen.append((self.how, grid, args, meta))

    monkeypatch.setattr(_launch, "_INTERPRET", False)
    monkeypatch.setattr(_launch, "_CACHED", False)  # (the direct door, not the compiled cache)
    monkeypatch.setattr(_launch, "wrap_triton", lambda k: Door("wrap"))
    monkeypatch.setattr(_launch, "direct", lambda k: Door("direct"))
    p = _launch.Prepared(object(), (4,), (1,), {"BLOCK": 8})
    assert torch._library.triton.is_wrap_triton_enabled()
    p.untraced("t")
    p("t")
    assert seen == [("direct", (4, 1, 1), ("t", 1), {"BLOCK": 8}),
                    ("wrap", (4, 1, 1), ("t", 1), {"BLOCK": 8})]  # fmt: skip


@pytest.mark.interpret
def test_prepared_launch_runs_the_kernel_under_the_interpreter(triton_interpret):
    if not triton_interpret:
        pytest.skip("needs TRITON_INTERPRET=1")
    from epmoe import _range

    x = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    for hi, want in ((10, True), (9, False)):
        ok = torch.zeros((), dtype=torch.bool)
        _launch.Prepared(_range._range_kernel, (1,), (x.numel(), 0, hi), {"BLOCK": 16})(x, ok)
        assert bool(ok) is want
