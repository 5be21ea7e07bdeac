"""Compile every Triton kernel of the local stages for sm90 (H100/H200) without a GPU.

The interpreter (TRITON_INTERPRET=1, what CI runs the kernels with) does not type-check the way
the compiler does, so a kernel can pass every CPU test and still fail to compile on the GPU. This
script runs each stage's real host-side launch code on CPU tensors with the launches recorded
instead of run, then compiles each recorded launch (its argument types, constexprs, num_warps and
the launcher's specialization: ints equal to 1 as constants, divisibility-by-16 hints) to a cubin
for sm90 with the local Triton and its bundled ptxas. Exit code 1 on any failure.

With --dump-ptx DIR it writes each compiled variant's PTX (``compiled.asm["ptx"]`` without its
``.loc`` / ``.file`` lines and debug sections) to DIR/<kernel>-<hash of the launch key>.ptx, e.g. to
check that a refactor leaves every kernel's code unchanged (compare the two folders' contents).

With --resources it also prints each kernel's registers per thread, spills and shared memory
(``cuobjdump -res-usage`` of the cubin, and the dynamic shared memory its launch asks for), e.g. to
see how many programs fit on an SM. A kernel that asks for more shared memory than an sm90 block
may take is a failure (it compiles, then fails OutOfResources at its first launch on the GPU).
With --sass it prints each kernel's SASS instruction count and its most frequent opcodes
(``nvdisasm``): the fused SiLU kernels were issue-limited enough that cutting instructions was the
gain. With --wgmma it runs ptxas -v on the PTX of each build that issues wgmma and marks the
builds whose wgmmas ptxas serializes (its C7510-C7519 "Potential Performance Loss" notes: each
wgmma then waits for the one before, whatever the kernel's waits say), e.g. an accumulator read
between an MMA's issue and its wait, or too few registers (not a failure: with --every-config
13 builds have it under Triton 3.6, 24 with their PDL-on twins, CONTRIBUTING.md says which).

The GEMM kernels' candidate configs build once each, the sweep's variants (schemes' row copies
or gathers, gates, biases, PDL) in turn; --every-config builds each config in every variant (about
twice the builds: the device's test step runs it, tests/ops/test_kernels_compile.py). --shard I/N
builds every N-th launch from the I-th (0-based): N processes share the work.

  python scripts/compile_kernels.py [--resources] [--sass] [--wgmma] [--dump-ptx DIR]
      [--only SUBSTRING] [--every-config] [--shard I/N]
(do not set TRITON_INTERPRET; --only: the cases whose name contains SUBSTRING, e.g. "ll_")

Use the device's Triton (3.6; `pip install torch==2.13.0 triton==3.6.0` in a separate venv): a
newer one accepts code that 3.6 rejects (a module-level string passed from one jit function to
another compiled under 3.9 and failed on the GPU).
"""

import contextlib
import importlib
import os
import sys
from typing import Any, Callable, Dict, List, Tuple

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_kernels: unset TRITON_INTERPRET (the interpreter replaces the kernels)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from epmoe import _checks, _launch, gate, reference  # noqa: E402

Q = importlib.import_module("epmoe.ops.quantize")
A = importlib.import_module("epmoe.ops.activation")
P = importlib.import_module("epmoe.ops.permute")
U = importlib.import_module("epmoe.ops.unpermute")
G = importlib.import_module("epmoe.ops.gemm._triton")
R = importlib.import_module("epmoe._range")
KS = importlib.import_module("epmoe.kernels.scatter")
KG = importlib.import_module("epmoe.kernels.gather")
GV = importlib.import_module("epmoe.ops.gemv")

TARGET = GPUTarget("cuda", 90, 32)
_DTYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8e4nv", torch.int8: "i8", torch.uint8: "u8", torch.int32: "i32",
    torch.int64: "i64", torch.bool: "i1",
}  # fmt: skip
Launch = Tuple[Any, tuple, dict]


class _Recorder:
    def __init__(self, fn, calls: List[Launch]):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, args, kwargs))


def record(launch: Callable[[], object]) -> List[Launch]:
    """The kernel launches ``launch()`` makes, with their arguments (nothing runs)."""
    calls: List[Launch] = []
    saved = (_launch.kernel, _checks.check_values, _checks.check_codes, G._masked_kernel,
             G._contiguous_kernel, G._contiguous_gate_kernel, G._gluon_kernel,
             G._masked_gate_kernel)  # fmt: skip
    _launch.kernel = lambda fn: _Recorder(fn, calls)  # every stage launches through it
    _checks.check_values = _checks.check_codes = lambda *a, **k: None
    # the GEMM kernels are launched directly (with an explicit config: no autotuner)
    G._masked_kernel = _Recorder(G._masked_kernel, calls)
    G._contiguous_kernel = _Recorder(G._contiguous_kernel, calls)
    G._contiguous_gate_kernel = _Recorder(G._contiguous_gate_kernel, calls)
    G._masked_gate_kernel = _Recorder(G._masked_gate_kernel, calls)
    gluon = {lay: _Recorder(saved[6](lay), calls) for lay in ("contiguous", "masked", "gate")}
    G._gluon_kernel = gluon.__getitem__
    try:
        launch()
    finally:
        _launch.kernel, _checks.check_values, _checks.check_codes = saved[:3]
        G._masked_kernel, G._contiguous_kernel, G._contiguous_gate_kernel = saved[3:6]
        G._gluon_kernel, G._masked_gate_kernel = saved[6:8]
    return calls


def _within(*managers):
    """Yields once inside the context managers (the one-pass loops of cases() below)."""
    with contextlib.ExitStack() as stack:
        for m in managers:
            stack.enter_context(m)
        yield


@contextlib.contextmanager
def _asserting():
    """Launches build the kernels that assert their values inside, as direct CUDA launches do
    (on CPU tensors _checks.assert_in_kernel says no)."""
    saved = _checks.assert_in_kernel
    _checks.assert_in_kernel = lambda direct: True
    try:
        yield
    finally:
        _checks.assert_in_kernel = saved


def _arg_type(v) -> str:
    if v is None:  # (an argument the variant does not use: Triton makes it a constexpr)
        return "constexpr"
    if isinstance(v, torch.Tensor):
        return "*" + _DTYPES[v.dtype]
    if isinstance(v, TensorDescriptor):  # (a TMA-fed GEMM's operands)
        return f"tensordesc<{_DTYPES[v.base.dtype]}[{','.join(map(str, v.block_shape))}]>"
    if isinstance(v, GluonDescriptor):  # (its shared layout in the type)
        return mangle_type(v)
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -(2**31) <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"unsupported kernel argument {type(v).__name__}")


def _jit_fn(fn):
    """The jit function a launch's ``fn`` wraps (a Heuristics unwrapped)."""
    while not hasattr(fn, "params") and hasattr(fn, "fn"):
        fn = fn.fn
    return fn


def _pdl_switch(fn) -> bool:
    """Whether kernel ``fn`` takes the PDL constexpr _launch sets."""
    return _launch._has_pdl(_jit_fn(fn))


def compile_launch(fn, args: tuple, kwargs: dict):
    kwargs = dict(kwargs)
    opts = ("num_warps", "num_stages", "launch_pdl", "debug", "sanitize_overflow")
    options = {k: kwargs.pop(k) for k in opts if k in kwargs}
    if isinstance(fn, triton.runtime.Heuristics):  # its meta-parameters come from the arguments
        values = dict(zip(fn.arg_names, args, strict=False), **kwargs)
        kwargs.update({k: h(values) for k, h in fn.values.items()})
        fn = fn.fn
    names = fn.arg_names
    sig: Dict[str, str] = {}
    constexprs = {}
    attrs = {}
    values = dict(zip(names, args, strict=False))  # trailing constexprs may come as kwargs
    values.update(kwargs)
    if "num_warps" in names:  # (a Gluon kernel's constexpr: Triton passes the launch option)
        values["num_warps"] = options.get("num_warps", 4)
    # the launcher's own specialization (what the GPU compiles): ints equal to 1 become constants,
    # tensors and ints divisible by 16 get the divisibility hint that lets loads and stores
    # vectorize; not for do_not_specialize arguments
    keep = {names[d] if isinstance(d, int) else d for d in fn.do_not_specialize}
    defaults = {p.name: p.default for p in fn.params}
    for i, name in enumerate(names):
        v = values[name] if name in values else defaults[name]
        is_int = isinstance(v, int) and not isinstance(v, bool)
        if i in fn.constexprs or v is None:
            sig[name] = "constexpr"
            constexprs[(i,)] = v
        elif is_int and v == 1 and name not in keep:
            sig[name] = "constexpr"
            constexprs[(i,)] = 1
        else:
            sig[name] = _arg_type(v)
            if name not in keep and (isinstance(v, torch.Tensor) or (is_int and v % 16 == 0)):
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = GluonASTSource if fn.is_gluon() else ASTSource
    src = source(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options=options)


def cases(every: bool = False) -> Dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(0)
    bf = torch.randn((64, 512), generator=g).to(torch.bfloat16)
    y3 = torch.randn((4, 16, 512), generator=g).to(torch.bfloat16)
    mm = torch.tensor([3, 0, 16, 7], dtype=torch.int32)
    mm256 = torch.zeros(256, dtype=torch.int32)
    ids = torch.randint(-1, 8, (64, 4), generator=g)
    q8, s8 = reference.quantize(bf, "fp8")
    qi, si = reference.quantize(bf, "int8")
    p = P._permute_triton  # outputs below are only shapes: nothing runs
    m_sum = reference.permuted_rows(64, 4, 8, 128)
    mi = torch.zeros(m_sum, dtype=torch.int32)
    offs = torch.zeros(9, dtype=torch.int32)
    y2 = torch.randn((m_sum, 512), generator=g).to(torch.bfloat16)
    inv = torch.zeros((64, 4), dtype=torch.int32)
    w = torch.rand((64, 4), generator=g)
    ids_w = torch.zeros((8192, 8), dtype=torch.int64)
    w_payloads = [
        (torch.bfloat16, None, "row"),
        (torch.float8_e4m3fn, torch.empty((8192, 56)), "deepgemm"),
        (torch.int8, torch.empty((8192, 1)), "row"),
    ]
    ll_y = torch.randn((8, 128, 512), generator=g).to(torch.bfloat16)
    ll_rows = torch.zeros((64, 4), dtype=torch.int32)
    ll_b = torch.randn((8, 512), generator=g).to(torch.bfloat16)
    return {
        "ll_scatter bf16/fp8/int8 (row, deepgemm, two-pass int8), ll_gather": lambda: (
            [
                KS._ll_scatter_triton(xx, ids, 8, 128, q, 0, None, lay)
                for xx in (bf, torch.randn((64, 20000)).to(torch.bfloat16)[:, :16384])
                for q in ("bf16", "fp8", "int8")
                for lay in ("row", "deepgemm")
            ]
            + [KG._ll_gather_launch(ll_y, ll_rows, ww, bf[:, :512].clone()) for ww in (w, None)]
            + [KG._ll_gather_launch(ll_y, ll_rows, w, bf[:, :512].clone(), check=False)]
        ),
        # a down-projection bias (bf16, fp32) and a padded hidden (the first 320 of 512 columns)
        "ll_gather with a bias / narrower output": lambda: [
            KG._ll_gather_launch(ll_y, ll_rows, ww, bf[:, :320].clone(), b, check)
            for ww, b, check in ((w, ll_b, True), (None, ll_b.float(), True), (w, ll_b, False))
        ],
        # a layout wider than x (a zero-padded hidden): one chunk, and two-pass int8 / many chunks
        "ll_scatter bf16/fp8/int8 into a wider layout": lambda: [
            KS._ll_scatter_triton(xx, ids, 8, 128, q, 0, None, "deepgemm", wd)
            for xx, wd in (
                (bf[:, :160], 256),
                (torch.empty((64, 16000), dtype=torch.bfloat16), 16384),
            )
            for q in ("bf16", "fp8", "int8")
        ],  # fmt: skip
        # past 2 x SCAN_IDS ids: the block count kernel, then the scatter's blocked slot counts
        "ll_scatter with blocked slot counts": lambda: [
            KS._ll_scatter_triton(
                xx, torch.zeros((2400, 4), dtype=torch.int64), 8, 2400, q, 0, None, "deepgemm"
            )  # fmt: skip
            for xx in (torch.empty((2400, 512), dtype=torch.bfloat16),)
            for q in ("bf16", "fp8", "int8")
        ],
        "ll_scatter / ll_gather, asserting": lambda: [
            (
                KS._ll_scatter_triton(bf, ids, 8, 128, "fp8", 0, None, "deepgemm"),
                KG._ll_gather_launch(ll_y, ll_rows, w, bf[:, :512].clone()),
            )
            for _ in _within(_asserting())
        ],
        "quantize fp8 2d/3d masked": lambda: (
            Q._quantize_triton(bf, "fp8", 128, None, "deepgemm"),
            Q._quantize_triton(y3, "fp8", 128, mm, "deepgemm"),
        ),
        "quantize fp8/int8 into wider codes 2d/3d masked/two-pass": lambda: [
            Q._quantize_triton(xx, sch, 128, m, "deepgemm", wd)
            for xx, m, wd in (
                (bf[:, :160], None, 256),
                (y3[..., :160], mm, 256),
                (torch.empty((3, 20000), dtype=torch.bfloat16), None, 20096),
            )
            for sch in ("fp8", "int8")
        ],  # fmt: skip
        "quantize int8 2d/3d masked/two-pass": lambda: (
            Q._quantize_triton(bf, "int8"),
            Q._quantize_triton(y3, "int8", 128, mm),
            Q._quantize_triton(torch.randn((3, 20000)).to(torch.bfloat16), "int8"),
        ),
        "silu_and_mul 2d/masked/m_indices+offsets": lambda: (
            A._silu_and_mul_triton(y2),
            A._silu_and_mul_triton(y3, mm),
            A._silu_and_mul_triton(y2, None, mi, offs),
        ),
        "silu_and_mul_quant fp8/int8 all layouts": lambda: [
            A._silu_and_mul_quant_triton(yy, s, m, 128, i, lay, o)
            for s in ("fp8", "int8")
            for yy, m, i, o, lay in (
                (y2, None, mi, offs, "deepgemm"),
                (y3, mm, None, None, "deepgemm"),
                (y2, None, mi, None, "row"),
                (y2, None, None, None, "row"),
            )
        ],  # fmt: skip
        # every activation and gate field, the bias on both row layouts, int8's two passes
        "silu_and_mul(_quant) gates and bias": lambda: _gate_launches(y2, y3, mm, mi, offs),
        "silu_and_mul(_quant) gpt-oss HT with biases": _gpt_oss_ht_launches,
        "permute bf16/fp8 (deepgemm scales)/int8, one kernel and chain": lambda: [
            (p(bf, ids, 8, 128), p(q8, ids, 8, 128, s8, "deepgemm"), p(qi, ids, 8, 128, si, "row"))
            for small in (P.CONFIG.small_entries, 0)
            for _ in _within(P.override(small_entries=small))
        ],
        # the one kernel as a CUDA launch makes it: the id check asserted inside (debug build)
        "permute one kernel at W decode, asserting": lambda: [
            p(
                torch.empty((256, 7168), dtype=torch.float8_e4m3fn),
                ids_w[:256],
                128,
                128,
                torch.empty((256, 56)),
                "deepgemm",
            )
            for _ in _within(
                _asserting(),
                P.override(scales_by_row_min_entries=8192),  # (as on the GPU: main() sets 0)
            )
        ],  # fmt: skip
        # workload W's sizes (registers depend on them: K_PAD 8, 128 experts, 4 KiB chunks);
        # torch.empty: nothing is touched
        # (asserting the ids inside the scan kernel, as CUDA launches do; the small cases above
        # compile the build without the assert, as torch.compile's launches use)
        "permute at W: bf16/fp8 (deepgemm scales)/int8, asserting": lambda: [
            p(torch.empty((8192, 7168), dtype=dt), ids_w, 128, 128, sc, layout)
            for dt, sc, layout in w_payloads
            for _ in _within(_asserting())
        ],
        "unpermute": lambda: U._unpermute_triton(y2, inv, w),
        "unpermute, no row check": lambda: U._unpermute_triton(y2, inv, w, False),
        # a down-projection bias (bf16, fp32) by permute's m_indices, a padded hidden
        "unpermute with a bias / narrower output": lambda: [
            U._unpermute_triton(y2, inv, w, check, b, mi, 320)
            for check, b in ((False, ll_b), (True, ll_b.float()))
        ],
        # as a CUDA launch makes it: the rows asserted inside (debug build)
        "unpermute, asserting": lambda: [
            U._unpermute_triton(y2, inv, w) for _ in _within(_asserting())
        ],
        # qwen3-sized decode weights (torch.empty: nothing is touched), every scheme, with and
        # without the id check, and asserting as CUDA launches do
        "gemv gate_up / down bf16/fp8/int8": lambda: [
            _gemv_pair(sch, check, T)
            for sch in ("bf16", "fp8", "int8")
            for check in (True, False)
            for T in (1, 4)
        ],
        # Mixtral's top-2 (2 of its 8 experts) and a top-4 at gpt-oss's padded 2944: the down
        # kernel's longer K steps
        "gemv gate_up / down at top-2 and top-4": lambda: [
            _gemv_pair(sch, False, T, sizes=sizes)
            for sch in ("bf16", "fp8", "int8")
            for T in (1, 4)
            for sizes in ((2, 4096, 14336, 2), (4, 2944, 2944, 4))
        ],
        "gemv gate_up / down, asserting": lambda: [
            _gemv_pair(sch, True, 1)
            for sch in ("bf16", "fp8", "int8")
            for _ in _within(_asserting())
        ],
        # every gate kind on bf16, gpt-oss's and a gate without a gate half on fp8 / int8 (the
        # gate math is one code for every scheme), with biases, x narrower than the padded
        # weights and an output of its first columns
        "gemv gate_up / down, gates + biases, padded H": lambda: [
            _gemv_pair(sch, False, 4, spec, padded=True)
            for sch, specs in (
                ("bf16", GEMV_GATES),
                ("fp8", GEMV_GATES[::5]),
                ("int8", GEMV_GATES[::5]),
            )
            for spec in specs
        ],  # fmt: skip
        "range check": lambda: _launch.kernel(R._range_kernel)[(1,)](
            ids, torch.empty((), dtype=torch.bool), ids.numel(), -1, 8, BLOCK=R.BLOCK, num_warps=4
        ),
        # every scheme x every candidate config that fits (the autotuner may pick any of them), the
        # rows of a copied by permute or read through its src_rows (the gathering HT path)
        "contiguous GEMMs (every scheme and candidate config; copied or gathered rows)": lambda: [
            G.contiguous_triton(*args, row_block=128, config=_launch_options(c), **kw)
            for sch in ("bf16", "fp8", "int8")
            for c, g in _sweep(G.candidates("contiguous", _code(sch), 128), (False, True), every)
            for args, kw in [_contiguous_operands(sch, 256, g)]
        ],  # fmt: skip
        "GEMM1 + gate (every scheme and candidate config; gpt-oss's gate, biases)": lambda: [
            G.contiguous_gate_triton(
                *args,
                gate.get(spec),
                torch.zeros((4, gate.get(spec).width(256))) if bias else None,
                torch.empty((256, 256), dtype=torch.float8_e4m3fn if sch == "fp8" else bf.dtype),
                torch.empty((2, 256)).t() if sch == "fp8" else torch.empty((256, 0)),
                row_block=128,
                config=_launch_options(c),
                **kw,
            )
            for sch in ("bf16", "fp8", "int8")
            for c, (spec, bias, gathered) in _sweep(
                G.candidates("gate", _code(sch), 128),
                (
                    ("silu", False, False),
                    ("silu:alpha=1.702,limit=7.0,up_offset=1.0", True, False),
                    ("relu2:glu=0", False, False),
                    ("silu", False, True),
                ),
                every,
            )
            for args, kw in [_contiguous_operands(sch, gate.get(spec).width(256), gathered)]
        ],  # fmt: skip
        "masked GEMM1 + gate (every scheme and candidate config; gpt-oss's gate, biases)": lambda: [
            G.masked_gate_triton(
                *_gemm_operands(sch, (4, t), 4, gate.get(spec).width(256), 512, counts=mm),
                gate.get(spec),
                torch.zeros((4, gate.get(spec).width(256))) if bias else None,
                torch.empty((4, t, 256), dtype=torch.float8_e4m3fn if sch == "fp8" else bf.dtype),
                torch.empty((4, t, 2)) if sch == "fp8" else torch.empty((4, t, 0)),
                em,
                config=_launch_options(c),
            )
            for sch in ("bf16", "fp8", "int8")
            for t, em in ((16, 0), (64, 32))
            for c, (spec, bias) in _sweep(
                G.candidates("masked_gate", _code(sch), G.masked_gate_tiling(t, em, _code(sch))[0]),
                (("silu", False), ("silu:alpha=1.702,limit=7.0,up_offset=1.0", True)),
                every,
            )
        ],  # fmt: skip
        # (row tiles of 16 and, with 64-row slots at 32 rows per expert, of 64: the largest; the
        # expected_m values of one slot count share its row tile, so one candidate list serves them)
        "masked GEMMs with their count check (bf16 / fp8 / int8, every candidate config)": lambda: [
            G.masked_triton(
                *_gemm_operands(sch, (4, t), 4, 256, 512, counts=mm),
                em,
                config=_launch_options(c),
                ok=torch.empty((), dtype=torch.bool),
            )
            for sch in ("bf16", "fp8", "int8")
            for t, ems in ((16, (0, 200)), (64, (32,)))
            for c, em in _sweep(
                G.candidates("masked", _code(sch), G._masked_tiling(t, ems[0])[0]), ems, every
            )
        ],  # fmt: skip
        # the Gluon int8 masked kernel at 256 experts: its running sum over E_PAD = 256 counts
        "masked Gluon int8 GEMMs at 256 experts": lambda: [
            G.masked_triton(
                *_gemm_operands("int8", (256, 128), 256, 256, 512, counts=mm256),
                8,
                config=_launch_options(c),
                ok=torch.empty((), dtype=torch.bool),
            )
            for c in _kinds([c for c in G._MASKED_CONFIGS if c.kwargs.get("GLUON")], every)
        ],
    }


def _sweep(configs, variants, every: bool) -> list:
    """(config, variant) pairs of a candidate sweep: with ``every`` each config in each variant,
    else each config once, the variants in turn (every config and every variant still builds)."""
    configs, variants = list(configs), list(variants)
    if every:
        return [(c, v) for c in configs for v in variants]
    n = max(len(configs), len(variants))
    return [(configs[i % len(configs)], variants[i % len(variants)]) for i in range(n)]


def _kinds(configs, every: bool) -> list:
    """``configs``, or without ``every`` the first of each set of switches (tiles aside)."""
    tiles = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
    seen, kept = set(), []
    for c in configs:
        kind = tuple(sorted((k, v) for k, v in c.kwargs.items() if k not in tiles))
        if every or kind not in seen:
            seen.add(kind)
            kept.append(c)
    return kept


def _gemm_kernel(fn) -> bool:
    """Whether a launch's ``fn`` is a GEMM kernel (:mod:`epmoe.ops.gemm`'s, Triton or Gluon)."""
    return getattr(_jit_fn(fn), "__module__", "").startswith("epmoe.ops.gemm.")


def _code(scheme: str) -> int:
    from epmoe import quant

    return quant.get(scheme).kernel_code


def _launch_options(c) -> dict:
    return dict(c.all_kwargs())  # (the meta-parameters plus num_warps / num_stages)


def _gemm_operands(scheme, lead, E, N, K, mn_major=False, counts=None):
    """Zero operands of a grouped GEMM (a, w, rows, a_scales, w_scales): nothing runs."""
    from epmoe import quant

    qs = quant.get(scheme)
    a = torch.zeros((*lead, K), dtype=qs.act_dtype)
    w = torch.zeros((E, N, K), dtype=qs.act_dtype)
    rows = counts if counts is not None else torch.zeros(lead[0], dtype=torch.int32)
    if not qs.quantized:
        return a, w, rows, None, None
    cols = qs.act_scale_cols(K)
    a_s = torch.zeros((*lead, cols))
    if mn_major:  # (deep_gemm's fp8 layout, which the kernels read as it is)
        a_s = a_s.transpose(-1, -2).contiguous().transpose(-1, -2)
    return a, w, rows, a_s, torch.zeros(qs.weight_scale_shape(E, N, K))


def _contiguous_operands(scheme, N, gathered: bool):
    """((a, w, m_indices, a_scales, w_scales), keywords) of a contiguous GEMM of 256 rows and
    N outputs; ``gathered``: a of 64 rows, which the keywords' a_rows names."""
    a, w, rows, a_s, w_s = _gemm_operands(scheme, (64 if gathered else 256,), 4, N, 512,
                                          mn_major=True)  # fmt: skip
    if not gathered:
        return (a, w, rows, a_s, w_s), {}
    rows = torch.zeros(256, dtype=torch.int32)
    return (a, w, rows, a_s, w_s), dict(a_rows=rows)


# one gate per activation, every field of epmoe.gate.Gate set somewhere
_GATES = (
    "silu:alpha=1.702,limit=7.0,up_offset=1.0",
    "gelu_tanh:limit=10.0,clamp_after=1",
    "gelu",
    "relu",
    "relu2:glu=0",
    "silu:gate_softcap=4.0,up_softcap=25.0",
)


def _gate_launches(y2, y3, mm, mi, offs):
    """The three activation kernels for every gate of _GATES with a bias on both row layouts
    (2-D: each row's expert from m_indices; 3-D masked: e's), the first gate also without one,
    and the int8 kernel's two passes (I > int8_single_pass_max) with a bias, GLU or not."""
    bias2 = torch.empty((8, y2.shape[-1]), dtype=torch.float32)  # (any float dtype)
    bias3 = torch.empty((y3.shape[0], y3.shape[-1]), dtype=torch.bfloat16)
    out = []
    for spec in _GATES:
        layouts = [(y2, None, mi, offs, bias2), (y3, mm, None, None, bias3)]
        if spec == _GATES[0]:
            layouts.append((y2, None, None, None, None))
        for yy, m, i, o, b in layouts:
            out.append(A._silu_and_mul_triton(yy, m, i, o, spec, b))
            for scheme, layout in (("fp8", "deepgemm"), ("int8", "row")):
                out.append(A._silu_and_mul_quant_triton(yy, scheme, m, 128, i, layout, o, spec, b))
    y_long = torch.empty((2, 3, 20000), dtype=torch.bfloat16)
    for spec in ("silu:limit=7.0", "relu2:glu=0"):
        b = torch.empty((2, 20000), dtype=torch.bfloat16)
        out.append(
            A._silu_and_mul_quant_triton(y_long, "int8", mm[:2], 128, None, "row", None, spec, b)
        )
    return out


def _gpt_oss_ht_launches():
    """The activation kernels at gpt-oss-20b's HT sizes (I 2880; fp8 pads it to 2944), its gate
    and bf16 biases: their registers (--resources) are what the biases cost on the GPU."""
    out = []
    for i, scheme in ((2880, None), (2944, "fp8"), (2880, "int8")):
        y = torch.empty((256, 2 * i), dtype=torch.bfloat16)
        kw = dict(m_indices=torch.empty((256,), dtype=torch.int32), gate=_GATES[0],
                  expert_offsets=torch.empty((33,), dtype=torch.int32),
                  bias=torch.empty((32, 2 * i), dtype=torch.bfloat16))  # fmt: skip
        if scheme is None:
            out.append(A._silu_and_mul_triton(y, **kw))
        else:
            out.append(A._silu_and_mul_quant_triton(y, scheme, **kw))
    return out


GEMV_GATES = (
    "silu:alpha=1.702,limit=7,up_offset=1", "silu:limit=7,clamp_after=1", "gelu_tanh", "gelu",
    "relu", "relu2:glu=0", "silu:gate_softcap=4,up_softcap=25",
)  # fmt: skip


def _gemv_pair(scheme: str, check: bool, T: int, spec: str = "silu", padded: bool = False,
               sizes=(128, 2048, 768, 8)):  # fmt: skip
    """Qwen3's expert sizes (``sizes``: E, H, I, K); ``padded``: biases, x of 2000 channels on
    weights of 2048 and an output of the first 2000 columns."""
    E, H, I, K = sizes
    W = gate.parse(spec).width(I)
    dt = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[scheme]
    s1 = s2 = None
    if scheme == "fp8":
        s1, s2 = torch.empty((E, W // 128, H // 128)), torch.empty((E, H // 128, I // 128))
    elif scheme == "int8":
        s1, s2 = torch.empty((E, W)), torch.empty((E, H))
    hx = 2000 if padded else H
    b1, b2 = (torch.empty((E, W), dtype=torch.bfloat16), torch.empty((E, H))) if padded else (
        None, None)  # fmt: skip
    x = torch.empty((T, hx), dtype=torch.bfloat16)
    ids = torch.zeros((T, K), dtype=torch.int64)
    w1 = torch.empty((E, W, H), dtype=dt)
    h = GV._gemv_gate_up_triton(x, ids, w1, s1, check, spec, b1)
    w2 = torch.empty((E, H, I), dtype=dt)
    hidden = hx if padded else None
    return h, GV._gemv_down_triton(h, ids, torch.rand((T, K)), w2, s2, check, b2, hidden)


def resources(compiled) -> str:
    """REG / STACK / SHARED / LOCAL of a compiled kernel, from cuobjdump -res-usage."""
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.knobs.nvidia.ptxas.path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip().startswith("REG:")]
    res = " ".join(lines[0].split()[:4]) if lines else "(no resource usage)"
    return f"{res} DYNAMIC_SHARED:{compiled.metadata.shared}"


def sass_summary(compiled, top: int = 8) -> str:
    """SASS instruction count and the ``top`` most frequent opcodes (predicates dropped)."""
    import collections
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.knobs.nvidia.ptxas.path), "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-c", f.name], capture_output=True, text=True).stdout
    ops = collections.Counter()
    for line in out.splitlines():
        if "*/" not in line or not line.strip().startswith("/*"):
            continue
        words = [w for w in line.split("*/", 1)[1].split() if not w.startswith("@")]
        if words:
            ops[words[0].rstrip(";")] += 1
    common = " ".join(f"{op}:{n}" for op, n in ops.most_common(top))
    return f"{sum(ops.values())} instructions ({common})"


def wgmma_serialized(compiled) -> str:
    """ptxas's notes that it serializes the build's wgmmas (C751x), '' if none (or no wgmma)."""
    import re
    import subprocess
    import tempfile

    ptx = compiled.asm["ptx"]
    if "wgmma.mma_async" not in ptx:
        return ""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [triton.knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", src, "-o",
               os.path.join(d, "k.cubin")]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True)
    return " | ".join(sorted(set(re.findall(r"\(C751\d\)[^']*", out.stderr))))


def strip_ptx(ptx: str) -> str:
    """ptx without source locations (``.loc``, ``.file``, debug sections, and the file path and
    line number a device assert reports): the code alone."""
    import re

    ptx = ptx.split("\t.section\t.debug", 1)[0]
    ptx = re.sub(r"(assertFile_\d+)\[\d+\] = \{[^}]*\};", r"\1 = <file>;", ptx)
    ptx = re.sub(r"(st\.param\.b32 \t\[param2\]), \d+;", r"\1, <line>;", ptx)  # (the line)
    keep = [ln for ln in ptx.splitlines() if not ln.lstrip().startswith((".loc", ".file"))]
    return "\n".join(keep).rstrip() + "\n"


def dump_ptx(folder: str, kname: str, key, compiled) -> None:
    import hashlib

    os.makedirs(folder, exist_ok=True)
    tag = hashlib.sha1(repr(key).encode()).hexdigest()[:12]
    with open(os.path.join(folder, f"{kname}-{tag}.ptx"), "w") as f:
        f.write(strip_ptx(compiled.asm["ptx"]))


def main() -> int:
    argv = sys.argv[1:]
    show = "--resources" in argv
    sass = "--sass" in argv
    wgmma = "--wgmma" in argv
    serialized = 0
    ptx_dir = argv[argv.index("--dump-ptx") + 1] if "--dump-ptx" in argv else None
    only = argv[argv.index("--only") + 1] if "--only" in argv else ""
    every = "--every-config" in argv
    shard, shards = (
        map(int, argv[argv.index("--shard") + 1].split("/")) if "--shard" in argv else (0, 1)
    )
    failed = built = index = 0
    for name, launch in cases(every).items():
        if only not in name:
            continue
        # the small permute cases compile the row-block scale kernel too
        with P.override(scales_by_row_min_entries=0):
            calls = record(launch)
        # kernels with a PDL switch also compile with it on (the recorded CPU launches have it
        # off); a GEMM config sweep's builds take it on where the bits of their index have odd
        # parity (unless --every-config): on and off in turn within each variant of _sweep
        twins = [
            (i, (fn, args, dict(kwargs, PDL=True, launch_pdl=True)))
            for i, (fn, args, kwargs) in enumerate(calls)
            if kwargs.get("PDL") is False or ("PDL" not in kwargs and _pdl_switch(fn))
        ]
        for i, twin in twins:
            if every or not _gemm_kernel(twin[0]):
                calls.append(twin)
            elif bin(i).count("1") % 2:
                calls[i] = twin
        # permute's copy kernel also with its L2 prefetches (direct sm90 launches may turn them on)
        calls += [
            (fn, args, dict(kwargs, PF_SCALES=True, PF_WAVES=2))
            for fn, args, kwargs in calls
            if kwargs.get("PF_WAVES") == 0
        ]
        seen = set()
        for fn, args, kwargs in calls:
            kname = getattr(fn, "__name__", None) or fn.fn.__name__  # (a Heuristics wraps it)
            key = (kname, tuple(sorted((k, str(v)) for k, v in kwargs.items())),
                   tuple(_arg_type(a) for a in args))  # fmt: skip
            if key in seen:
                continue
            seen.add(key)
            index += 1
            if (index - 1) % shards != shard:
                continue
            built += 1
            try:
                compiled = compile_launch(fn, args, kwargs)
                # (checked at launch: a kernel over it compiles, then fails OutOfResources)
                shared = compiled.metadata.shared
                if shared > G._MAX_SHARED:  # (an sm90 block's shared memory)
                    raise RuntimeError(f"shared memory {shared} B > {G._MAX_SHARED} B")
                if ptx_dir:
                    dump_ptx(ptx_dir, kname, key, compiled)
                extra = f"  [{resources(compiled)}]" if show else ""
                extra += f"  [{sass_summary(compiled)}]" if sass else ""
                note = wgmma_serialized(compiled) if wgmma else ""
                serialized += bool(note)
                extra += f"  [wgmma serialized: {note}]" if note else ""
                status = "SER   " if note else "ok    "
                print(f"{status}{name}: {kname} {dict(sorted(kwargs.items()))}{extra}", flush=True)
            except Exception as e:  # noqa: BLE001 - report every kernel that fails
                failed += 1
                # (a CompilationError's reason: the innermost of its chain, the excerpt last)
                while e.__cause__ is not None:
                    e = e.__cause__
                msg = str(e).strip().splitlines()
                print(f"FAIL  {name}: {kname}: {type(e).__name__}: {' | '.join(msg[-12:])}")
    if wgmma:
        print(f"compile_kernels: {serialized} build(s) whose wgmmas ptxas serializes")
    print(f"compile_kernels: {built} build(s), {failed} failure(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
