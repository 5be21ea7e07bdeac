"""No stage kernel looks, to torch.compile, as if it wrote one of its inputs (no GPU needed).

Inductor reads each user Triton kernel's TTIR to find the tensors it mutates, and clones them
(default mode: copy kernels; reduce-overhead: no CUDA graph, "mutated inputs"). It walks back from
every store's pointer through every op but ``tt.load``, a ``tt.call``'s result included, into all
of that call's arguments: a pointer passed to a ``@triton.jit`` helper whose result feeds a store's
address reads as written. So every load of a kernel's pointer argument sits in the kernel body,
and the helpers take offsets, masks and loaded values only.

The TTIR is made as scripts/compile_kernels.py compiles each stage's recorded launches (sm90, in a
subprocess without TRITON_INTERPRET; PDL and the L2 prefetches off, as under torch.compile), and
read with torch's own ``ttir_to_functions``. Two checks per
launch: the walk above (torch's rule) reports only the kernel's outputs (``OUTPUTS``), and no
helper call takes a value that a walk from an input pointer reaches without a load (the stricter
rule the kernels follow). The int8 GEMM kernels run inside a custom op, opaque to Inductor.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# one xdist worker (--dist loadgroup): the module fixture's subprocess runs once, not per worker
pytestmark = pytest.mark.xdist_group("kernel_mutations")

# Pointer arguments each kernel writes (every other tensor argument is read only).
OUTPUTS = {
    "_quant_fp8_kernel": {"q_ptr", "s_ptr"},
    "_quant_int8_kernel": {"q_ptr", "s_ptr"},
    "_silu_mul_kernel": {"h_ptr"},
    "_silu_mul_fp8_kernel": {"q_ptr", "s_ptr"},
    "_silu_mul_int8_kernel": {"q_ptr", "s_ptr"},
    "_small_permute_kernel": {
        "inv_ptr", "out_ptr", "outs_ptr", "m_idx_ptr", "offsets_ptr", "src_ptr", "ok_ptr",
    },
    "_count_tokens_kernel": {"counts_ptr", "bad_ptr"},
    "_scan_kernel": {"counts_ptr", "totals_ptr", "ok_ptr"},
    "_place_copy_kernel": {
        "inv_ptr", "src_ptr", "out_ptr", "outs_ptr", "m_idx_ptr", "offsets_ptr",
    },
    "_rest_scales_kernel": {"out_ptr", "outs_ptr"},
    "_topk_gather_kernel": {"out_ptr", "ok_ptr"},
    "_range_kernel": {"ok_ptr"},
    "_ll_scatter_kernel": {"xo_ptr", "s_ptr", "mm_ptr", "rows_ptr", "ok_ptr"},
    "_block_counts_kernel": {"cnt_ptr"},
    "_gemv_gate_up_kernel": {"h_ptr", "ok_ptr"},
    "_gemv_down_kernel": {"out_ptr", "ok_ptr"},
}  # fmt: skip

_WRITE_OPS = {"tt.store", "tt.atomic_cas", "tt.atomic_rmw", "tt.descriptor_store"}
_POINTER_ONLY_OPS = {"tt.make_tensor_ptr", "tt.advance", "tt.make_tensor_descriptor"}


def _reached(ops, start):
    """Param indices that a walk back from the values ``start`` reaches, through every op but
    tt.load (a tt.call's result included: into all of its arguments)."""
    from torch._higher_order_ops.triton_kernel_wrap import Param

    out, seen, stack = set(), set(), list(start)
    while stack:
        a = stack.pop()
        if a in seen:
            continue
        seen.add(a)
        if isinstance(a, Param):
            out.add(a.idx)
        elif a.idx >= 0:  # (negative: loop induction variables, scf.if block arguments)
            for op in ops.get(a, ()):
                if op.name != "tt.load":
                    stack.extend(op.args[:1] if op.name in _POINTER_ONLY_OPS else op.args)
    return out


def _written(functions, name, memo):
    """Param indices of function ``name`` that Inductor's rule reports written."""
    if name not in memo:
        memo[name] = set()  # (no recursion in Triton)
        ops, start = functions[name], []
        for op_list in ops.values():
            for op in op_list:
                if op.name in _WRITE_OPS:
                    start.append(op.args[0])
                elif op.name == "tt.call":
                    callee = _written(functions, op.fn_call_name, memo)
                    start.extend(a for i, a in enumerate(op.args) if i in callee)
                elif op.name == "tt.elementwise_inline_asm" and not getattr(op, "is_pure", 0):
                    raise RuntimeError("impure inline asm: Inductor assumes every input mutated")
        memo[name] = _reached(ops, start)
    return memo[name]


def _ttir(ck, fn, args, kwargs):
    """(ASTSource, TTIR module) of one recorded launch, as compile_launch compiles it."""
    import triton
    from triton._C.libtriton import ir

    seen = {}
    compile_ = triton.compile
    triton.compile = lambda src, target=None, options=None: seen.update(src=src, opts=options)
    try:
        ck.compile_launch(fn, args, kwargs)
    finally:
        triton.compile = compile_
    backend = triton.compiler.compiler.make_backend(ck.TARGET)
    options = backend.parse_options(seen["opts"] or {})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    codegen = backend.get_codegen_implementation(options)
    module = seen["src"].make_ir(ck.TARGET, options, codegen, backend.get_module_map(), context)
    return seen["src"], module


def _jit_fn(fn):
    while not hasattr(fn, "arg_names") or hasattr(fn, "values"):  # (a Heuristics wraps it)
        fn = fn.fn
    return fn


def analyse():
    """One record per distinct launch: kernel, tensors reported written (Inductor's rule),
    tensors reaching a helper call's arguments without a load."""
    from torch._higher_order_ops.triton_kernel_wrap import ttir_to_functions

    path = ROOT / "scripts" / "compile_kernels.py"
    spec = importlib.util.spec_from_file_location("compile_kernels", path)
    ck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ck)
    with ck.P.override(scales_by_row_min_entries=0):  # (as compile_kernels: that kernel too)
        launches = [ck.record(launch) for launch in ck.cases().values()]
    records, seen = [], set()
    for calls in launches:
        for fn, args, kwargs in calls:
            jf = _jit_fn(fn)
            if jf.fn.__module__ in ("epmoe.ops.gemm._triton", "epmoe.ops.gemm._gluon"):
                continue  # (the GEMM kernels: inside a custom op, opaque to Inductor)
            key = (jf.fn.__name__, repr(sorted(kwargs.items())), tuple(map(ck._arg_type, args)))
            if key in seen:
                continue
            seen.add(key)
            src, module = _ttir(ck, fn, args, kwargs)
            functions = ttir_to_functions(module)
            kernel = next(iter(functions))
            names = [n for n in jf.arg_names if src.signature[n] != "constexpr"]
            tensors = {i for i, n in enumerate(names) if src.signature[n].startswith("*")}
            writes = _written(functions, kernel, {})
            # which tensor object each pointer parameter is bound to in this launch
            given = dict(zip(jf.arg_names[: len(args)], args, strict=True))  # (positional)
            bound = {n: id(a) for n, a in given.items() if src.signature[n].startswith("*")}
            written = sorted(names[i] for i in writes & tensors)
            calls = [
                a for ops in functions[kernel].values() for op in ops if op.name == "tt.call"
                for a in op.args
            ]  # fmt: skip
            helper_args = _reached(functions[kernel], calls)
            records.append(
                dict(
                    kernel=jf.fn.__name__,
                    kwargs=repr(sorted(kwargs.items())),
                    written=written,
                    into_calls=sorted(names[i] for i in helper_args & tensors),
                    aliased_written=sorted(
                        n for n in written if any(m != n and bound[m] == bound[n] for m in bound)
                    ),
                )
            )
    return records


@pytest.fixture(scope="module")
def records():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if "No module named" in proc.stderr and "triton.backends" in proc.stderr:
        pytest.skip("this Triton build has no CUDA backend")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_stage_kernel_analysed(records):
    assert {r["kernel"] for r in records} == set(OUTPUTS)


def _inputs_in(records, field):
    """{kernel: input pointers found in ``field`` of any of its launches}."""
    bad = {}
    for r in records:
        extra = set(r[field]) - OUTPUTS[r["kernel"]]
        if extra:
            bad.setdefault(r["kernel"], set()).update(extra)
    return {k: sorted(v) for k, v in bad.items()}


def test_no_written_pointer_shares_its_tensor(records):
    """A pointer the kernel writes (by Inductor's rule) is bound to a tensor no other argument
    gets: torch.compile's functionalization clones each written argument on its own, so an
    output also passed as a placeholder comes back from a clone the kernel never wrote."""
    bad = sorted({(r["kernel"], p) for r in records for p in r["aliased_written"]})
    assert not bad, f"written pointers sharing their tensor with another argument: {bad}"


def test_no_input_reported_mutated(records):
    bad = _inputs_in(records, "written")
    assert not bad, f"inputs torch.compile would clone as mutated: {bad}"


def test_no_input_pointer_passed_to_a_helper(records):
    bad = _inputs_in(records, "into_calls")
    assert not bad, f"input pointers reaching a jit helper's arguments: {bad}"


if __name__ == "__main__":
    print(json.dumps(analyse()))
