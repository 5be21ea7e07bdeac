"""epmoe._launch: host size helpers and the direct-launch key (CPU; launches: test_launch_gpu)."""

import os
import pathlib

import pytest
import torch

from epmoe import _launch

REPO = pathlib.Path(__file__).resolve().parents[1]


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


def _recorded_kernel(monkeypatch, body):
    """JITFunction ``body`` on a CUDA-like CPU host (not triton.jit: under TRITON_INTERPRET=1
    that is no JITFunction): its Triton run records the keywords it is given (``tuned``), its
    compiled kernel's launches their arguments (``launched``)."""
    from triton.runtime.jit import JITFunction

    k, tuned, launched = JITFunction(body), [], []

    class Compiled:
        function, packed_metadata = "f", "p"

        @staticmethod
        def run(*a):
            launched.append(a)

    def triton_run(*args, grid, warmup, **meta):
        tuned.append(meta)
        return Compiled()

    monkeypatch.setattr(k, "run", triton_run)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 0, raising=False)
    monkeypatch.setattr(_launch, "_hooked", lambda: False)
    return k, tuned, launched


def test_direct_caches_a_runtime_scalar_passed_by_keyword(monkeypatch):
    """A runtime int given by keyword (permute's PF_DIST) is cached per value: before, such a
    launch never hit the cache and went through Triton's own run on every call."""
    import triton.language as tl

    def body(x_ptr, n, dist, BLOCK: tl.constexpr):
        pass

    k, tuned, launched = _recorded_kernel(monkeypatch, body)
    d = _launch._Direct(k)
    x = torch.zeros(4)
    for dist in (5, 5, 5, 6):
        d[(2,)](x, 3, dist=dist, BLOCK=8)
    assert len(tuned) == 2 and len(d.cache) == 2  # (one entry per value of dist)
    assert launched[-1][-3:] == (3, 5, 8)  # positional n, then dist and BLOCK in signature order


def _pdl_probe(monkeypatch, sm90: bool):
    """A JITFunction with a PDL constexpr, its Triton run recording the keywords it is given."""
    import triton.language as tl

    def body(x_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pass

    k, seen, _ = _recorded_kernel(monkeypatch, body)
    monkeypatch.setattr(_launch, "_pdl_device", lambda dev: sm90)
    monkeypatch.setattr(_launch, "_INTERPRET", False)
    monkeypatch.setattr(_launch, "_CACHED", True)
    _launch._DIRECT.pop(id(k), None)
    return k, seen


@pytest.mark.parametrize("sm90", [True, False])
def test_direct_launches_of_a_pdl_kernel_set_pdl_on_sm90(monkeypatch, sm90):
    """A kernel with a PDL constexpr is launched directly with PDL and launch_pdl (sm90+ only),
    through a Prepared (its cached launches keep the compiled kernel's PDL launch) or a direct
    launch, with a profiler's launch hooks too; a caller's own PDL stands (permute's first
    kernel must launch in stream order); a traced launch (wrap_triton) gives PDL off
    (Inductor's wrapper wants every argument)."""
    k, seen = _pdl_probe(monkeypatch, sm90)
    want = {"BLOCK": 8, "PDL": sm90, **({"launch_pdl": True} if sm90 else {})}
    p = _launch.Prepared(k, (2,), (), {"BLOCK": 8})
    x = torch.zeros(4)
    p.untraced(x)
    _launch.direct(k)[(2,)](x, BLOCK=8)
    _launch.direct(k)[(2,)](x, BLOCK=16, PDL=False)
    assert seen[0] == want and seen[-1] == {"BLOCK": 16, "PDL": False}
    assert len(seen) == 3 - sm90  # (sm90: the second launch is the first's, cached)
    assert len(p.hits) == 1 and p.meta == {"BLOCK": 8, "PDL": False}
    monkeypatch.setattr(_launch, "_hooked", lambda: True)  # (a profiler's hooks: Triton's run)
    p.untraced(x)
    assert seen[-1] == want
    wrapped = []
    monkeypatch.setattr(
        _launch, "wrap_triton", lambda fn: {(2, 1, 1): lambda *a, **m: wrapped.append(m)}
    )
    p(x)  # (the wrap_triton flag is on outside a triton op)
    assert wrapped == [{"BLOCK": 8, "PDL": False}]


def test_every_pdl_kernel_waits_before_anything_else():
    """A kernel launched with PDL may start while the kernel before it runs: each one with a
    PDL constexpr defaulting to False (the ones _launch sets) starts with pdl(PDL), the docstring
    aside, so no program loads or stores before the wait."""
    import ast
    import importlib
    import inspect

    mods = ("epmoe.ops.gemv", "epmoe.ops.gemm._triton", "epmoe.ops.quantize",
            "epmoe.ops._activation_kernels", "epmoe.kernels.scatter",
            "epmoe.kernels.gather")  # fmt: skip
    found = []
    for name in mods:
        tree = ast.parse(inspect.getsource(importlib.import_module(name)))
        for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
            names, values = [a.arg for a in fn.args.args], fn.args.defaults
            defaults = dict(zip(names[len(names) - len(values) :], values, strict=True))
            if "PDL" not in defaults:
                continue
            assert ast.literal_eval(defaults["PDL"]) is False, fn.name
            body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
            assert ast.unparse(body[0]) == "pdl(PDL)", f"{name}.{fn.name}"
            found.append(fn.name)
    assert len(found) == 14, found


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


def _probe_triton_runs() -> None:
    """(Run in a subprocess: it patches the launch modules process-wide.) The layer's eager chain
    on a CUDA-like host (sm90, deep_gemm present, the launch caches real, Triton's own run
    replaced by a counter returning a stand-in compiled kernel): prints, per path, the kernels that
    still went through Triton's run after two warm-up calls."""
    import json
    import sys

    import triton

    sys.path.insert(0, str(REPO / "scripts"))
    import host_python as hp

    class Compiled:
        function, packed_metadata = None, None

        @staticmethod
        def run(*args):
            pass

    runs = []

    def triton_run(self, *args, grid, warmup, **meta):
        runs.append(self.__name__)
        return Compiled()

    def tuner_run(self, *args, **kwargs):
        self.best_config = self.configs[0]
        runs.append("autotune")

    triton.runtime.jit.JITFunction.run = triton_run
    triton.runtime.autotuner.Autotuner.run = tuner_run
    torch._C._cuda_getDevice = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    torch.Tensor.data_ptr = lambda self: 0  # (meta tensors: 16-byte aligned)
    _launch._INTERPRET, _launch._CACHED = False, True
    hp.cuda_like_host()
    from epmoe import layer as layer_mod

    layer_mod.gathers = lambda *args: True  # (the "gather" case: as a table measuring it would)
    out = {}
    for quant in ("bf16", "fp8", "int8"):
        for path, tokens in (("gemv", 1), ("ll", 32), ("ht", 32), ("ht", 4096), ("gather", 4096)):
            layer = hp.build(quant, tokens=32)
            layer._may_gather = path == "gather"  # (GEMM1 reads x's rows through src_rows)
            call = hp.call_of(layer, "ht" if path == "gather" else path, tokens)
            call(), call()
            runs.clear()
            for _ in range(3):
                call()
            out[f"{quant} {path} T={tokens}"] = sorted(set(runs))
    print(json.dumps(out))


def test_every_eager_launch_hits_the_cache_after_warmup():
    """After two calls, no launch of the layer's eager chain goes through Triton's own run (each
    costs tens of µs of host time: the permute chain's copy kernels did, through a runtime
    argument given by keyword; the INT8 GEMMs did, through wrap_triton), on every path and
    scheme, the one-kernel permute and the permute chain both, GEMM1 gathering its rows too."""
    import json
    import subprocess
    import sys

    code = "import tests.test_launch as t; t._probe_triton_runs()"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TRITON_INTERPRET": "0"})  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(seen) == 15
    assert {case: kernels for case, kernels in seen.items() if kernels} == {}
