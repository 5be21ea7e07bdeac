"""House rule: no ``@triton.jit`` (or ``@gluon.jit``) function of the package (kernel or helper) is
over 80 lines, from its ``def`` to its last line (docs/kernels.md says how the GEMV kernels stay
within it)."""

import ast
import pathlib

import epmoe

ROOT = pathlib.Path(epmoe.__file__).parent
MAX_LINES = 80


def _jit_functions():
    """(file, ast.FunctionDef) of every function decorated with triton.jit or gluon.jit."""
    for f in sorted(ROOT.rglob("*.py")):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.FunctionDef) and any(
                ast.unparse(d).startswith(("triton.jit", "gluon.jit")) for d in n.decorator_list
            ):
                yield f.relative_to(ROOT.parent), n


def test_no_kernel_over_80_lines():
    lines = {f"{f}:{n.name}": n.end_lineno - n.lineno + 1 for f, n in _jit_functions()}
    assert {k: n for k, n in lines.items() if n > MAX_LINES} == {}


def test_the_kernels_are_found():
    names = {n.name for _, n in _jit_functions()}
    assert {"_gemv_gate_up_kernel", "_silu_mul_int8_kernel", "gate_h",
            "_contiguous_gluon_kernel"} <= names  # fmt: skip
