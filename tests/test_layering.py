"""The package's import graph: floors (low to high) base modules and reference -> kernels (shared
by stages and backends) -> comm -> ops -> layer / compile / graphs -> integrations / cli / the
package itself; no import goes up a floor and there is no cycle."""

import ast
import pathlib

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
    if name == "epmoe.reference" or (len(parts) == 2 and parts[1].startswith("_")):
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
