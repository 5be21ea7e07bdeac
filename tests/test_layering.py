"""The package's import graph: floors (low to high) base modules, quant, gate and reference ->
kernels (shared by stages and backends) -> comm -> ops -> layer / compile / graphs -> integrations
/ cli / the package itself; no import goes up a floor and there is no cycle."""

import ast
import pathlib

import pytest

import epmoe

ROOT = pathlib.Path(epmoe.__file__).parent


def _graph():
    files = {}
    for f in ROOT.rglob("*.py"):
        parts = ("epmoe",) + f.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = f
    graph = {}
    for name, f in files.items():
        deps = set()
        for n in ast.walk(ast.parse(f.read_text())):
            ours = isinstance(n, ast.ImportFrom) and (n.module or "").startswith("epmoe")
            if ours and n.level == 0:
                subs = {f"{n.module}.{a.name}" for a in n.names} & files.keys()
                deps |= subs if len(subs) == len(n.names) else subs | {n.module}
            elif isinstance(n, ast.Import):
                deps |= {a.name for a in n.names if a.name.startswith("epmoe")}
            elif isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "import_module":
                if n.args and isinstance(n.args[0], ast.Constant):
                    deps.add(n.args[0].value)
        graph[name] = (deps & files.keys()) - {name}
    return graph


def floor(name: str) -> int:
    parts = name.split(".")
    if name in ("epmoe.reference", "epmoe.quant", "epmoe.gate") or (
        len(parts) == 2 and parts[1].startswith("_")
    ):
        return 0 if parts[1] != "__main__" else 5
    return {"kernels": 1, "comm": 2, "ops": 3, "layer": 4, "compile": 4, "graphs": 4}.get(
        parts[1] if len(parts) > 1 else "", 5
    )


def test_no_import_goes_up_a_floor():
    up = [(m, d) for m, deps in _graph().items() for d in deps if floor(d) > floor(m)]
    assert up == []


def test_no_import_cycle():
    graph, state, cycles = _graph(), {}, []

    def visit(u, stack):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v) :] + [v])
            elif v not in state:
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert cycles == []


def test_the_graph_sees_the_floors():
    g = _graph()
    assert "epmoe._checks" in g["epmoe.ops.permute"]  # a real edge is found
    assert "epmoe.kernels.gather" in g["epmoe.ops.unpermute"]
    assert floor("epmoe._launch") < floor("epmoe.kernels.gather") < floor("epmoe.comm.local")
    assert floor("epmoe.comm.local") < floor("epmoe.ops.permute")
    assert floor("epmoe.ops.permute") < floor("epmoe.layer") < floor("epmoe.integrations.x")


# --------------------------------------------------------------------------- the layer's call path
MAX_CLIMBS = 6  # calls back up a floor on the way from EPMoE.forward to the kernels, per call


def _route(quant: str, path: str, monkeypatch):
    """(caller module, callee module) of every call into epmoe code while the layer's direct path
    (what an eager call on plain CUDA tensors runs) handles its second call, with the launches,
    library GEMMs and device-side checks stubbed out, so that CPU tensors take the CUDA chain."""
    import importlib
    import sys

    import torch

    from epmoe import _checks, _eager, _launch
    from epmoe import layer as L

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **meta: None

    monkeypatch.setattr(_launch, "kernel", lambda k: NoLaunch())
    monkeypatch.setattr(_launch, "direct", lambda k: NoLaunch())
    monkeypatch.setattr(_launch.Prepared, "__call__", lambda self, *tensors: None)
    monkeypatch.setattr(_checks, "direct_launch", lambda t: True)  # (asserts in the kernels)
    gemm_ops = importlib.import_module("epmoe.ops.gemm._ops")
    monkeypatch.setattr(gemm_ops, "_backend", lambda *args: "reference")  # (a library GEMM)
    torch.manual_seed(0)
    E, H, I, K, T = 8, 128, 128, 2, {"gemv": 2, "ll": 16, "ht": 600}[path]
    layer = L.EPMoE(E, H, I, K, quant=quant, mode="auto", device="cpu", max_tokens_per_rank=16)
    layer.load_weights(torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    assert layer.path(T) == path
    x = torch.randn(T, H).bfloat16()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    calls = []

    def module(frame):
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            if name.startswith("epmoe"):
                return name
            frame = frame.f_back
        return None

    def profile(frame, event, arg):
        if event == "call" and frame.f_globals.get("__name__", "").startswith("epmoe"):
            calls.append((module(frame.f_back), frame.f_globals["__name__"]))

    with torch.no_grad(), _eager.no_wrap():
        layer._forward(L._TRUSTED, x, ids, w)  # (first calls fill the launch caches)
        sys.setprofile(profile)
        try:
            layer._forward(L._TRUSTED, x, ids, w)
        finally:
            sys.setprofile(None)
    return calls[1:]  # (the first call is _forward itself)


@pytest.mark.parametrize("path", ["gemv", "ll", "ht"])
@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8"])
def test_the_layer_path_goes_down(quant, path, monkeypatch):
    """Following x from the layer to its kernels call by call, a call goes up a floor (layer ->
    ops -> base and back up) at most MAX_CLIMBS times: one declaration per stage, the layer calls
    each stage's launch, which calls the floors below it."""
    calls = _route(quant, path, monkeypatch)
    climbs = [(a, b) for a, b in calls if a is not None and floor(b) > floor(a)]
    assert calls, "nothing was traced"
    assert len(climbs) <= MAX_CLIMBS, climbs
