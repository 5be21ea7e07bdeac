"""The CUDA host code of every Triton-backed op traces on FAKE CUDA tensors, on every launch path.

torch.compile runs an op's CUDA branch with fake tensors twice: dynamo propagates FakeTensors
through the op (its fake is the triton_op body), and AOTAutograd traces the body again under
FunctionalTensorMode, where wrap_triton records each launch, and reading an address
(``data_ptr``) or a value (``.item()``, ``bool(t)``), or a Python ``if`` / ``min`` on an unbacked
size, fails. The compile tests
that run on CPU trace the CPU branch (the reference) instead, and the GPU tests reach few of the
size-dependent paths, so here each op's CUDA branch is traced, no GPU needed, on fake CUDA inputs
at and around every size threshold of its launch code (permute's one-kernel / chain / row-block
scale paths, the int8 single- and two-pass rows, the column-chunk tiles, the looping-programs
caps), for every scheme, scale layout and masked / m_indices / expert_offsets variant, with static,
dynamic (symbolic) and unbacked (exact-size HT dispatch) row counts. Each trace must take the
expected path (the kernels in the graph, with their path constexprs) and give the outputs of the
op's CPU contract (shapes, dtypes, strides).

The traces run in one subprocess without TRITON_INTERPRET (under the interpreter triton.jit gives
interpreter functions that wrap_triton does not take): ``python -m tests.compile.test_fake_paths``
prints one JSON object, case id -> result (EPMOE_FAKE_PATHS_ONLY=<substring> runs some of them).
"""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# one xdist worker (--dist loadgroup): the module fixture's subprocess runs once, not per worker
pytestmark = pytest.mark.xdist_group("fake_paths")

_q = importlib.import_module("epmoe.ops.quantize")
_p = importlib.import_module("epmoe.ops.permute")
_a = importlib.import_module("epmoe.ops.activation")
_u = importlib.import_module("epmoe.ops.unpermute")
_ks = importlib.import_module("epmoe.kernels.scatter")
_kg = importlib.import_module("epmoe.kernels.gather")
_gv = importlib.import_module("epmoe.ops.gemv")

KINDS = ("static", "dyn", "unbacked")  # row counts: int, backed symbol, unbacked symbol

# ------------------------------------------------------------------------------------ the cases
# A case: (id, op, args, expected kernels, kind). args: ("t", shape, dtype) tensors, whose shape
# entries are ints or ("M", n), the row count (n, a backed symbol or an unbacked one, by kind), and
# scalars. Expected kernels: [(name, {constexpr: value})] in launch order; [] for the custom ops
# (opaque: no kernel is traced).
CASES = []
ALL, STATIC = KINDS, ("static",)


def case(cid, op, args, kernels, kinds=ALL):
    for kind in kinds:
        want = kernels(kind) if callable(kernels) else kernels
        CASES.append((f"{cid}-{kind}", op, args, want, kind))


def _t(shape, dtype):
    return ("t", tuple(shape), dtype)


def _rows(n):
    return ("M", n)


_DT = {"bf16": "bfloat16", "fp8": "float8_e4m3fn", "int8": "int8"}

# quantize: fp8 group tiles; int8 rows batched below INT8_ROW_TILE, one pass up to
# INT8_SINGLE_PASS_MAX columns, two passes above; 2-D, 3-D, masked 3-D (row slots capped at
# MASKED_PROGRAMS / E); both scale layouts
_QI = _q.CONFIG.int8_single_pass_max
for scheme, H in (("fp8", 7168), ("int8", 256), ("int8", _QI), ("int8", _QI + 128)):
    kname = f"_quant_{scheme}_kernel"
    single = {} if scheme == "fp8" else {"SINGLE_PASS": H <= _QI}
    for layout in _q.SCALE_LAYOUTS:
        x = _t((_rows(300), H), "bfloat16")
        case(f"quantize-{scheme}-H{H}-{layout}", "quantize", [x, scheme, 128, None, layout],
             [(kname, {**single, "HAS_MASK": False})])  # fmt: skip
        for T in (16, 300):  # slots: all T row blocks, then capped at MASKED_PROGRAMS // 8
            x3, mm = _t((8, _rows(T), H), "bfloat16"), _t((8,), "int32")
            case(f"quantize-{scheme}-H{H}-{layout}-masked-T{T}", "quantize",
                 [x3, scheme, 128, mm, layout], [(kname, {**single, "HAS_MASK": True})],
                 kinds=ALL if T == 300 else STATIC)  # fmt: skip
    case(f"quantize-{scheme}-H{H}-3d", "quantize",
         [_t((8, _rows(16), H), "bfloat16"), scheme, 128, None, "deepgemm"],
         [(kname, {**single, "HAS_MASK": False})], kinds=STATIC)  # fmt: skip

# permute: one kernel up to SMALL_ENTRIES (t, k) entries (K padded to a power of 2), the
# count / scan / copy chain above, and with DeepGEMM-layout scales from SCALES_BY_ROW_MIN_ENTRIES
# entries a fourth kernel (the scales per row block, and the column chunks past the first). An
# unbacked row count (exact-size dispatch) always takes the chain, per-token scales.
_SMALL, _BYROW = _p.CONFIG.small_entries, _p.CONFIG.scales_by_row_min_entries
_CHAIN = ["_count_tokens_kernel", "_scan_kernel", "_place_copy_kernel"]


def _permute_kernels(M, K, S, layout):
    def kernels(kind):
        by_row = S > 0 and layout == "deepgemm" and M * K >= _BYROW and kind != "unbacked"
        if not by_row and M * 8 <= _SMALL and kind != "unbacked":
            names = ["_small_permute_kernel"]
        else:
            names = _CHAIN + (["_rest_scales_kernel"] if by_row else [])
        return [(n, {}) for n in names]

    return kernels


_EDGES = {8: (_SMALL // 8, _SMALL // 8 + 1, _BYROW // 8), 6: ()}
for K, Ms in ((8, (1, _SMALL // 8, _SMALL // 8 + 1, _BYROW // 8 - 1, _BYROW // 8, 40000)),
              (6, (_SMALL // 8, _SMALL // 8 + 1, _BYROW // 6, _BYROW // 6 + 1))):  # fmt: skip
    for M in Ms:
        for scheme, H, S in (("bf16", 512, 0), ("fp8", 7168, 56), ("int8", 4096, 1),
                             ("fp8", 256, 2)):  # fmt: skip
            for layout in ("row", "deepgemm") if S else ("row",):
                if H == 256 and layout == "row":
                    continue
                args = [_t((_rows(M), H), _DT[scheme]), _t((_rows(M), K), "int64"), 16, 128,
                        _t((_rows(M), S), "float32") if S else None, layout]  # fmt: skip
                edge = M in _EDGES[K] and H != 256
                case(f"permute-{scheme}-H{H}-{layout}-K{K}-M{M}", "permute", args,
                     _permute_kernels(M, K, S, layout), kinds=ALL if edge else STATIC)  # fmt: skip

# silu_and_mul(_quant): column chunks past SILU_TILE / FP8_TILE outputs; int8 rows batched below
# INT8_ROW_TILE, one pass up to INT8_SINGLE_PASS_MAX, two passes above; m_indices / expert_offsets
# programs looping over the rows, capped at ROW_PROGRAMS / OFFSETS_PROGRAMS; masked 3-D
_AI = _a.CONFIG.int8_single_pass_max
_CAP = max(_a.CONFIG.row_programs, _a.CONFIG.offsets_programs)
_VARIANTS = ("plain", "m_indices", "offsets", "both")


def _silu_kernel(scheme, inter, flags):
    if scheme is None:
        return [("_silu_mul_kernel", flags)]
    if scheme == "fp8":
        return [("_silu_mul_fp8_kernel", flags)]
    return [("_silu_mul_int8_kernel", {**flags, "SINGLE_PASS": inter <= _AI})]


for scheme, inter in ((None, 256), (None, _a.CONFIG.silu_tile + 128), ("fp8", 256),
                      ("fp8", _a.CONFIG.fp8_tile + 128), ("int8", 256), ("int8", _AI),
                      ("int8", _AI + 128)):  # fmt: skip
    layouts = ("row",) if scheme is None else _q.SCALE_LAYOUTS
    name = "silu_and_mul" if scheme is None else "silu_and_mul_quant"
    tag = f"silu-{scheme or 'bf16'}-I{inter}"
    for M in (300, 2 * _CAP + 2):  # below / above the looping programs' cap
        for rows in _VARIANTS:
            y = _t((_rows(M), 2 * inter), "bfloat16")
            mi = _t((_rows(M),), "int32") if rows in ("m_indices", "both") else None
            eo = _t((17,), "int32") if rows in ("offsets", "both") else None
            want = _silu_kernel(scheme, inter, {"HAS_ROWS": mi is not None,
                                                "HAS_MASK": eo is not None})  # fmt: skip
            for layout in layouts:
                if layout == "deepgemm" and rows != "both":
                    continue
                args = ([y, None, mi, eo] if scheme is None
                        else [y, scheme, None, 128, mi, layout, eo])  # fmt: skip
                kinds = ALL if M == 300 and rows in ("plain", "both") else STATIC
                case(f"{tag}-{rows}-{layout}-M{M}", name, args, want, kinds=kinds)
    for T in (16, 300):  # masked (LL): [E, T, 2I] with masked_m
        y3, mm = _t((8, _rows(T), 2 * inter), "bfloat16"), _t((8,), "int32")
        want = _silu_kernel(scheme, inter, {"HAS_ROWS": False, "HAS_MASK": True})
        for layout in layouts:
            args = ([y3, mm, None, None] if scheme is None
                    else [y3, scheme, mm, 128, None, layout, None])  # fmt: skip
            kinds = ALL if T == 300 and layout == "row" else STATIC
            case(f"{tag}-masked-{layout}-T{T}", name, args, want, kinds=kinds)

# unpermute: one program per (token, column chunk of BLOCK_BYTES)
for H in (512, _u.CONFIG.block_bytes, 7168):
    for dt in ("bfloat16", "float32"):
        for M in (1, 300):
            case(f"unpermute-{dt}-H{H}-M{M}", "unpermute",
                 [_t((4 * 128 + 9 * M, H), dt), _t((_rows(M), 8), "int32"),
                  _t((_rows(M), 8), "float32")],
                 [("_topk_gather_kernel", {"SLOTS": False, "CHECK": True})],
                 kinds=ALL if M == 300 and dt == "bfloat16" else STATIC)  # fmt: skip
# the layer's chain: no row check (inv_perm from its own permute)
case("unpermute-unchecked", "unpermute",
     [_t((4 * 128 + 9 * 300, 512), "bfloat16"), _t((_rows(300), 8), "int32"),
      _t((_rows(300), 8), "float32"), False],
     [("_topk_gather_kernel", {"SLOTS": False, "CHECK": False})])  # fmt: skip

# ll_scatter / ll_gather (the one-rank LL chain): scatter rows in column chunks past TILE (bf16),
# 32 groups (fp8), INT8_SINGLE_MAX (int8, else one program a row), both scale layouts; gather
# chunks of GATHER_BYTES, weighted or not
for quant, H in (("bf16", 512), ("bf16", _ks.TILE + 128), ("fp8", 4096), ("fp8", 7168),
                 ("int8", _ks.INT8_SINGLE_MAX), ("int8", _ks.INT8_SINGLE_MAX + 128)):  # fmt: skip
    chunks = _ks.scatter_tiling(H, quant)[2]
    code = _gv.quant.get(quant).kernel_code
    want = [("_ll_scatter_kernel", {"QUANT": code, "SINGLE": chunks == 1})]
    for layout in ("row",) if quant == "bf16" else ("row", "deepgemm"):
        for T in (1, 300):
            args = [_t((_rows(T), H), "bfloat16"), _t((_rows(T), 8), "int64"), 16, 512, quant, 16,
                    64, layout]  # fmt: skip
            kinds = ALL if T == 300 and layout == "row" else STATIC
            case(f"ll_scatter-{quant}-H{H}-{layout}-T{T}", "ll_scatter", args, want, kinds=kinds)
for H in (512, _kg.GATHER_BYTES // 2 + 128):
    for weighted in (True, False):
        w = _t((_rows(300), 8), "float32") if weighted else None
        case(f"ll_gather-H{H}-w{weighted}", "ll_gather",
             [_t((16, 512, H), "bfloat16"), _t((_rows(300), 8), "int32"), w],
             [("_topk_gather_kernel", dict(SLOTS=True, HAS_W=weighted, CHECK=True))])  # fmt: skip
case("ll_gather-unchecked", "ll_gather",
     [_t((16, 512, 512), "bfloat16"), _t((_rows(300), 8), "int32"), _t((_rows(300), 8), "float32"),
      False],
     [("_topk_gather_kernel", {"SLOTS": True, "HAS_W": True, "CHECK": False})])  # fmt: skip

# grouped GEMMs: custom ops, opaque to the compiler (their fakes run; the CUDA kernels, deep_gemm
# or the int8 Triton GEMMs, never see a fake tensor): both layouts, every scheme, trusted or not
for scheme in ("bf16", "fp8", "int8"):
    dt, N, Kd = _DT[scheme], 256, 512
    a_s = {"bf16": None, "fp8": Kd // 128, "int8": 1}[scheme]
    w_s = {"bf16": None, "fp8": (16, N // 128, Kd // 128), "int8": (16, N)}[scheme]
    for trusted in (False, True):
        ws = _t(w_s, "float32") if w_s else None
        case(f"gemm-contiguous-{scheme}-trusted{trusted}", "grouped_gemm_contiguous",
             [_t((_rows(4480), Kd), dt), _t((16, N, Kd), dt), _t((_rows(4480),), "int32"),
              _t((_rows(4480), a_s), "float32") if a_s else None, ws, _t((17,), "int32"),
              trusted], [])  # fmt: skip
        case(f"gemm-masked-{scheme}-trusted{trusted}", "grouped_gemm_masked",
             [_t((16, _rows(64), Kd), dt), _t((16, N, Kd), dt), _t((16,), "int32"),
              _t((16, _rows(64), a_s), "float32") if a_s else None, ws, 8, trusted],
             [], kinds=("static", "dyn"))  # fmt: skip

# per-choice GEMVs (one rank, mode "auto", a few tokens): one launch each, no size thresholds in
# the launch code; the ids checked by an extra program writing a flag, or not at all (the layer's
# chained gemv_down); a gate without a gate half, biases, x narrower than the padded weights and
# an output of its first columns
_GEMV_QUANT = {_DT[name]: s.kernel_code for name, s in _gv.quant.SCHEMES.items()}
for scheme in ("bf16", "fp8", "int8"):
    dt, E, H, I, K = _DT[scheme], 128, 2048, 768, 8
    s1 = {"bf16": None, "fp8": (E, 2 * I // 128, H // 128), "int8": (E, 2 * I)}[scheme]
    s2 = {"bf16": None, "fp8": (E, H // 128, I // 128), "int8": (E, H)}[scheme]
    for check in (True, False):
        want = {"QUANT": _GEMV_QUANT[dt], "CHECK": check, "ASSERT": False}
        case(f"gemv_gate_up-{scheme}-check{check}", "gemv_gate_up",
             [_t((_rows(4), H), "bfloat16"), _t((_rows(4), K), "int64"), _t((E, 2 * I, H), dt),
              _t(s1, "float32") if s1 else None, check],
             [("_gemv_gate_up_kernel", want)])  # fmt: skip
        case(f"gemv_down-{scheme}-check{check}", "gemv_down",
             [_t((_rows(4), K, I), "bfloat16"), _t((_rows(4), K), "int64"),
              _t((_rows(4), K), "float32"), _t((E, H, I), dt), _t(s2, "float32") if s2 else None,
              check],
             [("_gemv_down_kernel", want)])  # fmt: skip
    s1 = {"bf16": None, "fp8": (E, I // 128, H // 128), "int8": (E, I)}[scheme]
    want = {"QUANT": _GEMV_QUANT[dt], "CHECK": False, "HAS_BIAS": True}
    case(f"gemv_gate_up-{scheme}-relu2-bias-padded", "gemv_gate_up",
         [_t((_rows(4), H - 48), "bfloat16"), _t((_rows(4), K), "int64"), _t((E, I, H), dt),
          _t(s1, "float32") if s1 else None, False, "relu2:glu=0", _t((E, I), "bfloat16")],
         [("_gemv_gate_up_kernel", {**want, "ACT": 4, "GLU": False})])  # fmt: skip
    case(f"gemv_down-{scheme}-bias-hidden", "gemv_down",
         [_t((_rows(4), K, I), "bfloat16"), _t((_rows(4), K), "int64"),
          _t((_rows(4), K), "float32"), _t((E, H, I), dt), _t(s2, "float32") if s2 else None,
          False, _t((E, H), "float32"), H - 48],
         [("_gemv_down_kernel", want)])  # fmt: skip


# ----------------------------------------------------------------------- the subprocess: traces
def _run_all() -> dict:  # pragma: no cover - runs in the subprocess
    import warnings

    import torch
    import torch._higher_order_ops.triton_kernel_wrap as tkw
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensorMode, dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    import epmoe.ops  # noqa: F401

    # Without a GPU there is no CUDA device index to ask for (the fake tensors say cuda:0)
    if not hasattr(torch._C, "_cuda_getDevice"):
        torch._C._cuda_getDevice = lambda: 0

    # The TTIR mutation analysis of each launch is not under test (and, with a GPU, would compile
    # every kernel to TTIR): it fails at once, quietly, and every argument counts as written
    def no_ttir(*args, **kwargs):
        raise RuntimeError("no TTIR analysis in this test")

    tkw.generate_ttir = no_ttir
    tkw.log.disabled = True
    if not torch.cuda.is_available():
        # Python indexing of a CUDA tensor takes a CUDA device guard, which a CPU-only torch
        # lacks (also for fake tensors): the simple index forms as the dispatcher ops they are
        getitem = torch.Tensor.__getitem__

        def cuda_getitem(self, idx):
            if self.device.type == "cuda":
                if isinstance(idx, int):
                    return torch.ops.aten.select.int(self, 0, idx)
                if isinstance(idx, slice) and idx.step in (None, 1):
                    return torch.ops.aten.slice.Tensor(self, 0, idx.start, idx.stop)
            return getitem(self, idx)

        torch.Tensor.__getitem__ = cuda_getitem
    warnings.filterwarnings("error", message=".*data pointer of FakeTensor.*")

    lib = torch.library.Library("epmoe_fake_paths", "FRAGMENT")
    lib.define("take_rows(Tensor[] ts) -> Tensor[]")

    def take_rows_fake(ts):
        """The tensors cut to one new unbacked row count, as an exact-size dispatch returns."""
        n = torch.library.get_ctx().new_dynamic_size()
        return [t.new_empty((n, *t.shape[1:])) for t in ts]

    torch.library.register_fake("epmoe_fake_paths::take_rows", take_rows_fake, lib=lib)

    def describe(v):
        if not isinstance(v, torch.Tensor):
            return None
        return dict(shape=[str(s) for s in v.shape], stride=[str(s) for s in v.stride()],
                    dtype=str(v.dtype).replace("torch.", ""), device=v.device.type)  # fmt: skip

    def flat(out):
        return list(out) if isinstance(out, (list, tuple)) else [out]

    def call(op, args):
        return getattr(torch.ops.epmoe, op)(*args)

    def build(args, dev, kind, se, plain):
        rows = {}

        def size(d):
            if not isinstance(d, tuple):
                return d
            n = d[1]
            if kind == "unbacked" and plain:
                if n not in rows:
                    with se.ignore_fresh_unbacked_symbols():
                        rows[n] = se.create_unbacked_symint()
                    torch._check(rows[n] >= 0)
                return rows[n]
            if kind == "dyn":
                if n not in rows:
                    s = se.create_symbol(n, ConstantSource(f"m{len(rows)}"),
                                         dynamic_dim=DimDynamic.DYNAMIC)  # fmt: skip
                    rows[n] = se.create_symintnode(s, hint=n)
                return rows[n]
            return n

        out, cut = [], []
        for a in args:
            if isinstance(a, tuple) and a and a[0] == "t":
                _, shape, dt = a
                t = torch.empty([size(d) for d in shape], dtype=getattr(torch, dt), device=dev)
                out.append(t)
                # unbacked: the tensors whose first dim is the row count get it from take_rows
                row0 = bool(shape) and isinstance(shape[0], tuple)
                cut.append(kind == "unbacked" and row0)
            else:
                out.append(a)
                cut.append(False)
        return out, cut

    def kernels(gm):
        found = []
        for n in gm.graph.nodes:
            if "triton_kernel_wrapper" not in str(n.target):
                continue
            k = tkw.kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
            k = getattr(k, "fn", k)
            consts = {
                a: v for a, v in n.kwargs["kwargs"].items() if isinstance(v, (bool, int, str))
            }
            found.append([k.__name__, consts])
        return found

    def fake_call(op, args, kind, dev):
        """The op on plain FakeTensors, as dynamo propagates them (the triton_op body runs as
        its fake): the outputs' descriptions."""
        se = ShapeEnv()
        with FakeTensorMode(shape_env=se):
            return [describe(v) for v in flat(call(op, build(args, dev, kind, se, True)[0]))]

    def aot_trace(op, args, kind):
        """The op traced as AOTAutograd traces it (make_fx under FunctionalTensorMode: the
        triton_op body decomposes into its launches): (the outputs, the kernels launched)."""
        se = ShapeEnv()
        with FakeTensorMode(shape_env=se):
            built, cut = build(args, "cuda", kind, se, False)
            pos = [i for i, a in enumerate(built) if isinstance(a, torch.Tensor)]

            def f(*ts):
                ts = list(ts)
                which = [i for i in range(len(ts)) if cut[pos[i]]]
                if which:  # unbacked: the row-count tensors cut to a fresh size
                    new = torch.ops.epmoe_fake_paths.take_rows([ts[i] for i in which])
                    for i, t in zip(which, new, strict=True):
                        ts[i] = t
                it = iter(ts)
                return flat(call(op, [next(it) if i in pos else a for i, a in enumerate(built)]))

            gm = make_fx(dispatch_functionalize(f, FunctionalTensorMode()))(
                *[built[i] for i in pos]
            )
            (outs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
            vals = [o.meta["val"] if o is not None else None for o in outs]
            return [describe(v) for v in vals], kernels(gm), scalar_empties(gm)

    def scalar_empties(gm):
        """The 0-d empty tensors the body allocates (Inductor lowers each to a kernel)."""
        found = []
        for n in gm.graph.nodes:
            val = n.meta.get("val")
            if "empty" in str(n.target) and isinstance(val, torch.Tensor) and val.dim() == 0:
                found.append(str(n.target))
        return found

    results = {}
    only = os.environ.get("EPMOE_FAKE_PATHS_ONLY", "")  # (a substring of the case ids to run)
    for cid, op, args, _, kind in CASES:
        if only not in cid:
            continue
        try:
            res = dict(ok=True, plain=fake_call(op, args, kind, "cuda"))
            res["aot"], res["kernels"], res["scalar_empties"] = aot_trace(op, args, kind)
            if kind == "static":  # the contract: the CPU branch (the reference) on fake tensors
                res["cpu"] = fake_call(op, args, kind, "cpu")
        except Exception as e:  # noqa: BLE001 - reported per case
            import traceback

            res = dict(ok=False, error=f"{type(e).__name__}: {e}"[:3000],
                       tb=traceback.format_exc()[-3000:])  # fmt: skip
        results[cid] = res
    if not only or only in TUNED_GEMV:
        results[TUNED_GEMV] = _tuned_gemv_trace(aot_kernels=kernels)
    return results


# a GPU whose tuned table holds GEMV entries, traced with every size symbolic (opcheck's dynamic
# pass): the entries' configs, the weights' sizes specialized for the lookup
TUNED_GEMV = "gemv-tuned-table-symbolic-sizes"
TUNED_GEMV_UP, TUNED_GEMV_DOWN = (32, 1024, 8), (16, 512, 8)


def _tuned_gemv_trace(aot_kernels) -> dict:  # pragma: no cover - runs in the subprocess
    import tempfile
    from pathlib import Path

    import torch
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensorMode, dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from epmoe.ops.gemm import _tuned

    def entry(layout, config, **layer):
        return dict(layout=layout, scheme="bf16", N=64 if layout == "gemv_up" else 256,
                    K=256 if layout == "gemv_up" else 64, E=4, block=2, m=4, **layer,
                    config=dict(zip(("block_n", "block_k", "num_warps"), config, strict=True)),
                    backend="triton", us={})  # fmt: skip

    saved = (_tuned.DIR, _tuned._device_name, torch.cuda.is_available)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            doc = dict(entries=[entry("gemv_up", TUNED_GEMV_UP, gate="silu", bias=False),
                                entry("gemv_down", TUNED_GEMV_DOWN)])  # fmt: skip
            (Path(tmp) / _tuned.file_name("NVIDIA H200")).write_text(json.dumps(doc))
            _tuned.DIR, _tuned._device_name = Path(tmp), lambda index: "NVIDIA H200"
            torch.cuda.is_available = lambda: True
            _tuned.table.cache_clear()
            se = ShapeEnv()

            def sym(value, name):
                s = se.create_symbol(value, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
                return se.create_symintnode(s, hint=value)

            with FakeTensorMode(shape_env=se):
                T, E, W, H, I = sym(3, "t"), sym(4, "e"), sym(128, "w"), sym(256, "h"), sym(64, "i")
                K = sym(2, "k")  # (top-k: the entries' key, as opcheck's dynamic pass makes it)
                x = torch.empty((T, H), dtype=torch.bfloat16, device="cuda")
                ids = torch.empty((T, K), dtype=torch.int32, device="cuda")
                tw = torch.empty((T, K), dtype=torch.float32, device="cuda")
                w1 = torch.empty((E, W, H), dtype=torch.bfloat16, device="cuda")
                w2 = torch.empty((E, H, I), dtype=torch.bfloat16, device="cuda")

                def f(x, ids, tw, w1, w2):
                    h = torch.ops.epmoe.gemv_gate_up(x, ids, w1)
                    return torch.ops.epmoe.gemv_down(h, ids, tw, w2)

                gm = make_fx(dispatch_functionalize(f, FunctionalTensorMode()))(x, ids, tw, w1, w2)
        return dict(ok=True, kernels=aot_kernels(gm))
    except Exception:  # noqa: BLE001 - reported
        import traceback

        return dict(ok=False, tb=traceback.format_exc()[-3000:])
    finally:
        _tuned.DIR, _tuned._device_name, torch.cuda.is_available = saved
        _tuned.table.cache_clear()


# ------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def traced():
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.compile.test_fake_paths"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if "No module named" in proc.stderr and "triton.backends" in proc.stderr:
        pytest.skip("this Triton build has no CUDA backend")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _same_contract(got, want, kind):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is None:
            continue
        assert g["dtype"] == w["dtype"] and g["device"] == "cuda"
        assert len(g["shape"]) == len(w["shape"])
        if kind == "static":
            assert g["shape"] == w["shape"], (g, w)
            assert g["stride"] == w["stride"], (g, w)


@pytest.mark.parametrize("cid,op,args,expect,kind", CASES, ids=[c[0] for c in CASES])
def test_cuda_host_code_traces_on_fake_tensors(traced, cid, op, args, expect, kind):
    res = traced[cid]
    assert res["ok"], res.get("tb", res.get("error"))
    aot = res["aot"]
    _same_contract(aot, res["plain"], "dyn")  # dynamo's fake propagation and AOT's trace agree
    if kind == "static":
        _same_contract(aot, res["cpu"], "static")
    names = [k[0] for k in res["kernels"]]
    assert names == [k[0] for k in expect], names
    for (_, consts), (name, want) in zip(res["kernels"], expect, strict=True):
        for key, val in want.items():
            assert consts.get(key) == val, (name, key, consts.get(key), val)
    # a flag or code buffer is `[1]`, not 0-d: Inductor would fill a 0-d empty in a kernel of its
    # own, one more launch per compiled call
    assert res["scalar_empties"] == [], res["scalar_empties"]


def test_a_tuned_table_sets_the_gemv_launch_with_symbolic_sizes(traced):
    """The GEMVs traced with every size symbolic on a GPU whose table holds their entries (the
    pass where opcheck's dynamic check hashed SymInts) launch the entries' configs; the symbolic
    token count takes the several-token entry."""
    res = traced[TUNED_GEMV]
    assert res["ok"], res.get("tb")
    got = {name: (c["BLOCK_N"], c["BLOCK_K"]) for name, c in res["kernels"]}
    assert got == {"_gemv_gate_up_kernel": TUNED_GEMV_UP[:2],
                   "_gemv_down_kernel": TUNED_GEMV_DOWN[:2]}  # fmt: skip


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(_run_all()))
