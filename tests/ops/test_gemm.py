"""grouped_gemm on CPU: contiguous and masked, every scheme, vs a per-row loop; opcheck; errors."""

import json

import pytest
import torch

from epmoe import ops, reference
from epmoe.ops.gemm import _tuned
from tests._opcheck import opcheck
from tests._tol import GEMM_VS_QUANT_AWARE, rel_l2

_TABLES = sorted(_tuned.DIR.glob("*.json"))  # (the committed tuned tables)


def _operands(scheme, lead, E, N, Kd):
    a = torch.randn(*lead, Kd)
    w = torch.randn(E, N, Kd) / Kd**0.5
    if scheme == "bf16":
        return a.bfloat16(), None, w.bfloat16(), None, a.bfloat16().float(), w.bfloat16().float()
    aq, as_ = reference.quantize(a, scheme)
    wq, ws = reference.quantize_weights(w, scheme)
    return aq, as_, wq, ws, reference.dequantize(aq, as_), reference.dequantize_weights(wq, ws)


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_contiguous(scheme, seed):
    E, N, Kd, M = 3, 128, 256, 20
    a, as_, w, ws, ad, wd = _operands(scheme, (M,), E, N, Kd)
    m_idx = torch.randint(-1, E, (M,), dtype=torch.int32)
    m_idx[:4] = 1  # expert 0 or 2 may be empty: that must work too
    y = ops.grouped_gemm(a, w, m_indices=m_idx, a_scales=as_, w_scales=ws)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    for r in range(M):
        e = int(m_idx[r])
        if e >= 0:
            want = ad[r] @ wd[e].t()
            assert rel_l2(y[r], want) < GEMM_VS_QUANT_AWARE


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_masked(scheme, seed):
    E, T, N, Kd = 3, 6, 128, 128
    a, as_, w, ws, ad, wd = _operands(scheme, (E, T), E, N, Kd)
    masked_m = torch.tensor([0, 3, 6], dtype=torch.int32)
    y = ops.grouped_gemm(a, w, masked_m=masked_m, a_scales=as_, w_scales=ws, expected_m=3)
    assert y.shape == (E, T, N)
    for e in range(E):
        n = int(masked_m[e])
        if n:
            assert rel_l2(y[e, :n], ad[e, :n] @ wd[e].t()) < GEMM_VS_QUANT_AWARE


def test_gemm_opcheck(seed):
    a, as_, w, ws, _, _ = _operands("fp8", (8,), 2, 128, 128)
    m_idx = torch.tensor([0, 0, 1, -1, 1, 1, -1, 0], dtype=torch.int32)
    opcheck(torch.ops.epmoe.grouped_gemm_contiguous.default, (a, w, m_idx, as_, ws))
    a3, as3, w3, ws3, _, _ = _operands("int8", (2, 4), 2, 64, 32)
    mm = torch.tensor([1, 4], dtype=torch.int32)
    opcheck(torch.ops.epmoe.grouped_gemm_masked.default, (a3, w3, mm, as3, ws3, 2))


def test_gemm_bad_input(seed):
    a, as_, w, ws, _, _ = _operands("fp8", (4,), 2, 128, 128)
    m_idx = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="grouped_gemm: m_indices/masked_m expected exactly one"):
        ops.grouped_gemm(a, w, a_scales=as_, w_scales=ws)
    with pytest.raises(ValueError, match="grouped_gemm: a_scales/w_scales expected tensors"):
        ops.grouped_gemm(a, w, m_indices=m_idx)
    with pytest.raises(ValueError, match="grouped_gemm: w expected dtype"):
        ops.grouped_gemm(a, w.float(), m_indices=m_idx, a_scales=as_, w_scales=ws)
    with pytest.raises(ValueError, match="grouped_gemm: m_indices expected ids"):
        ops.grouped_gemm(
            a, w, m_indices=torch.full((4,), 2, dtype=torch.int32), a_scales=as_, w_scales=ws
        )
    with pytest.raises(ValueError, match="grouped_gemm: a_scales expected shape"):
        ops.grouped_gemm(a, w, m_indices=m_idx, a_scales=as_[:, :0], w_scales=ws)


def test_gemm_inputs_that_need_grad_are_refused(seed):
    """The GEMMs have no backward: an input that would need one is a ValueError at the call
    (through the op too), never a gradient that silently stops there; under no_grad it runs."""
    a, w = torch.randn(4, 32).bfloat16(), torch.randn(2, 16, 32).bfloat16().requires_grad_()
    m_idx = torch.tensor([0, 0, 1, -1], dtype=torch.int32)
    a3, mm = torch.randn(2, 3, 32).bfloat16(), torch.tensor([1, 3], dtype=torch.int32)
    for call in (
        lambda: ops.grouped_gemm(a, w, m_indices=m_idx),
        lambda: torch.ops.epmoe.grouped_gemm_contiguous(a, w, m_idx),
        lambda: ops.grouped_gemm(a3, w, masked_m=mm),
        lambda: torch.ops.epmoe.grouped_gemm_masked(a3, w, mm),
    ):
        with pytest.raises(ValueError, match="grouped_gemm: w expected a tensor that does not"):
            call()
        with torch.no_grad():
            assert not call().requires_grad


# ---------------------------------------------------------------- GEMM1 and the gate, fused
GATE_SPECS = ("silu", "silu:alpha=1.702,limit=7.0,up_offset=1.0", "relu2:glu=0")


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("spec", GATE_SPECS)
def test_gemm_gate_is_the_unfused_pair(scheme, spec, seed):
    """grouped_gemm_gate == GEMM1 then the activation stage, bit for bit (the CPU kernels are the
    references of both), with a bias and -1 rows; both scale layouts."""
    from epmoe import gate as G

    g = G.get(spec)
    E, I, Kd = 3, 128, 256
    a, as_, w, ws, _, _ = _operands(scheme, (20,), E, g.width(I), Kd)
    m_idx = torch.randint(-1, E, (20,), dtype=torch.int32)
    bias = torch.randn(E, g.width(I))
    y = ops.grouped_gemm(a, w, m_indices=m_idx, a_scales=as_, w_scales=ws)
    live = m_idx >= 0
    for layout in ("row", "deepgemm"):
        h, s = ops.grouped_gemm_gate(a, w, m_idx, as_, ws, spec, bias, scale_layout=layout)
        if scheme == "bf16":
            want = ops.silu_and_mul(y, m_indices=m_idx, gate=spec, bias=bias)
            assert s.shape == (20, 0) and torch.equal(h[live], want[live])
            continue
        q, qs = ops.silu_and_mul_quant(y, scheme, m_indices=m_idx, scale_layout=layout, gate=spec,
                                       bias=bias)  # fmt: skip
        assert torch.equal(h[live].view(torch.uint8), q[live].view(torch.uint8))
        assert torch.equal(s[live], qs[live]) and s.stride() == qs.stride()


def test_gemm_gate_opcheck_and_bad_input(seed):
    a, as_, w, ws, _, _ = _operands("fp8", (8,), 2, 256, 128)
    m_idx = torch.tensor([0, 0, 1, -1, 1, 1, -1, 0], dtype=torch.int32)
    b = torch.randn(2, 256)
    opcheck(torch.ops.epmoe.grouped_gemm_gate.default, (a, w, m_idx, as_, ws, "silu", b))
    ab, _, wb, _, _, _ = _operands("bf16", (8,), 2, 64, 32)
    opcheck(torch.ops.epmoe.grouped_gemm_gate.default, (ab, wb, m_idx), dict(gate="relu2:glu=0"))
    ai, asi, wi, wsi, _, _ = _operands("int8", (8,), 2, 256, 128)
    opcheck(torch.ops.epmoe.grouped_gemm_gate.default, (ai, wi, m_idx, asi, wsi, "silu", b))
    cases = [
        ((ai, wi, m_idx, asi), {}, "grouped_gemm_gate: a_scales/w_scales expected tensors"),
        ((a, w, m_idx, as_, ws), dict(gate="swish"), "grouped_gemm_gate: gate expected a gate"),
        ((a, w[:, :128], m_idx, as_, ws[:, :1]), {}, "grouped_gemm_gate: I expected a multiple"),
        ((a, w, m_idx, as_, ws), dict(bias=b[:, :5]), "grouped_gemm_gate: bias expected shape"),
        ((ab, wb[:, :63], m_idx), {}, "grouped_gemm_gate: w.shape\\[1\\] expected a multiple"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            ops.grouped_gemm_gate(*args, **kw)


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("spec", GATE_SPECS)
def test_gemm_masked_gate_is_the_unfused_pair(scheme, spec, seed):
    """grouped_gemm_masked_gate == masked GEMM1 then the activation stage, bit for bit on the live
    rows (the CPU references of both), with a bias; both scale layouts."""
    from epmoe import gate as G

    g = G.get(spec)
    E, T, I, Kd = 3, 12, 128, 256
    a, as_, w, ws, _, _ = _operands(scheme, (E, T), E, g.width(I), Kd)
    masked_m = torch.tensor([0, 5, 12], dtype=torch.int32)
    bias = torch.randn(E, g.width(I))
    y = ops.grouped_gemm(a, w, masked_m=masked_m, a_scales=as_, w_scales=ws)
    live = torch.arange(T)[None, :] < masked_m[:, None]
    for layout in ("row", "deepgemm"):
        h, s = ops.grouped_gemm_masked_gate(a, w, masked_m, as_, ws, spec, bias, layout)
        if scheme == "bf16":
            want = ops.silu_and_mul(y, masked_m=masked_m, gate=spec, bias=bias)
            assert s.shape == (E, T, 0) and torch.equal(h[live], want[live])
            continue
        q, qs = ops.silu_and_mul_quant(y, scheme, masked_m=masked_m, scale_layout=layout,
                                       gate=spec, bias=bias)  # fmt: skip
        assert torch.equal(h[live].view(torch.uint8), q[live].view(torch.uint8))
        assert torch.equal(s[live], qs[live]) and s.stride() == qs.stride()


def test_gemm_masked_gate_opcheck_and_bad_input(seed):
    a, as_, w, ws, _, _ = _operands("fp8", (2, 8), 2, 256, 128)
    masked_m = torch.tensor([3, 8], dtype=torch.int32)
    b = torch.randn(2, 256)
    op = torch.ops.epmoe.grouped_gemm_masked_gate.default
    opcheck(op, (a, w, masked_m, as_, ws, "silu", b))
    ab, _, wb, _, _, _ = _operands("bf16", (2, 8), 2, 64, 32)
    opcheck(op, (ab, wb, masked_m), dict(gate="relu2:glu=0"))
    ai, asi, wi, wsi, _, _ = _operands("int8", (2, 8), 2, 256, 128)
    opcheck(op, (ai, wi, masked_m, asi, wsi, "silu", b), dict(scale_layout="deepgemm"))
    name = "grouped_gemm_masked_gate"
    cases = [
        ((ai, wi, masked_m, asi), {}, f"{name}: a_scales/w_scales expected tensors"),
        ((a, w, masked_m, as_, ws), dict(gate="swish"), f"{name}: gate expected a gate"),
        ((a, w[:, :128], masked_m, as_, ws[:, :1]), {}, f"{name}: I expected a multiple"),
        ((a, w, masked_m, as_, ws), dict(bias=b[:, :5]), f"{name}: bias expected shape"),
        ((ab, wb[:, :63], masked_m), {}, f"{name}: w.shape\\[1\\] expected a multiple"),
        ((a, w, masked_m[:1], as_, ws), {}, f"{name}: masked_m expected shape"),
        ((a[:1], w, masked_m, as_[:1], ws), {}, f"{name}: a expected shape"),
        ((a, w, torch.tensor([3, 9], dtype=torch.int32), as_, ws), {},
         f"{name}: masked_m expected counts in \\[0, 8\\]"),
    ]  # fmt: skip
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            ops.grouped_gemm_masked_gate(*args, **kw)


@pytest.mark.parametrize("which", ["masked", "contiguous"])
def test_tuned_launch_goes_direct_after_tuning(which, monkeypatch):
    """After the autotuner's first call per launch plan, the Triton GEMMs launch the tuned
    config's JITFunction directly, with the heuristics' EVEN_K filled in (through the heuristics
    layer, Triton's own run binds every argument again on each call); a plan the tuned table has
    takes its config without autotuning."""
    import triton

    from epmoe import _launch
    from epmoe.ops.gemm import _triton

    tuned = _triton._tuner(which, 2, 128 if which == "contiguous" else 0)
    cfg = tuned.configs[0]
    table_cfg = dict(tuned.configs[-1].all_kwargs())
    through_tuner, direct, tables = [], [], {}

    def tuner_run(*args, grid, warmup, **meta):
        through_tuner.append(grid)
        tuned.best_config = cfg

    def prepared_launch(self, tensors, wrap):
        assert not wrap  # (called from the op's CUDA kernel: wrap_triton's flag is on there)
        direct.append((self.fn, self.grid, (*tensors, *self.tail), self.meta))

    monkeypatch.setattr(_launch, "_INTERPRET", False)
    monkeypatch.setattr(_launch.Prepared, "_launch", prepared_launch)
    monkeypatch.setattr(tuned, "run", tuner_run)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(_triton._tuned, "lookup", lambda *key: tables.get(key[-2]))
    names = tuned.fn.arg_names
    K = 384  # not a multiple of 256: EVEN_K is False for BLOCK_K = 256
    n = 7 if which == "masked" else 6  # (leading tensor arguments)
    sizes = tuple(K if x == "K" else 1 for x in names[n : names.index("QUANT")])
    meta = dict(QUANT=2, SCALE_K=128)
    meta.update({"BLOCK_M": 16, "M_SPLIT": 1} if which == "masked" else {})

    def plan(rows):
        table = (which, "int8", 1, K, 1, 16 if which == "masked" else 128, rows, "cuda")
        return _triton._Plan(which, 2, 128 if which == "contiguous" else 0, table,
                             lambda m: (m["BLOCK_N"], 1, 1), sizes, dict(meta))  # fmt: skip

    tensors = tuple(range(n))
    tables[99] = table_cfg  # (99 rows: the table has them; 1 row: it does not)
    p1, p99 = plan(1), plan(99)
    for _ in range(3):
        _triton._launch_plan(p1, tensors)
    for _ in range(2):
        _triton._launch_plan(p99, tensors)
    assert len(through_tuner) == 1 and len(direct) == 4
    fn, g, a, m = direct[1]
    assert not isinstance(fn, triton.runtime.autotuner.Heuristics) and fn is tuned.fn.fn
    assert g == (cfg.kwargs["BLOCK_N"], 1, 1) and a == tensors + sizes  # (grid padded to 3-D)
    assert m["EVEN_K"] == (K % cfg.kwargs["BLOCK_K"] == 0)
    assert m["num_warps"] == cfg.num_warps and m["num_stages"] == cfg.num_stages
    assert all(m[k] == v for k, v in {**cfg.kwargs, **meta}.items())
    assert all(direct[-1][3][k] == v for k, v in table_cfg.items())  # (the table's config)


# ------------------------------------------------------------------ backend choice, tuned table
def _stand_in_sm90(monkeypatch, deep_gemm: bool = True):
    """The backend choice sees an sm90 GPU, with deep_gemm (its entry points never called) or
    without it (asking for them raises ImportError)."""
    from epmoe.ops.gemm import _select

    def missing():
        raise ImportError("deep_gemm is not installed")

    fns = {role: (lambda *a: None) for role in _select._DG_NAMES}
    fns["alignment"] = lambda: 128
    monkeypatch.setattr(_select, "_cap", lambda device: (9, 0))
    monkeypatch.setattr(_select._deps, "available", lambda dep: deep_gemm or dep != "deep_gemm")
    monkeypatch.setattr(_select, "_dg_functions", (lambda: fns) if deep_gemm else missing)


@pytest.fixture
def sm90(monkeypatch, h200_table):
    """CPU stand-in for an H200 with deep_gemm (its entry points never called) and a tuned table
    directory of its own (``h200_table``)."""
    from epmoe.ops.gemm import _select

    _stand_in_sm90(monkeypatch)
    return _select._backend, h200_table


def _entry(layout, scheme, block, m, backend, N=256, K=512, E=4):
    config = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    return dict(layout=layout, scheme=scheme, N=N, K=K, E=E, block=block, m=m, config=config,
                backend=backend, us={backend: 1.0})  # fmt: skip


def test_backend_without_a_table_keeps_the_measured_defaults(sm90):
    backend, _ = sm90
    dev = torch.device("cuda", 0)
    assert backend("fp8", "contiguous", dev, 256, 512, 4, 128, 64) == "deep_gemm"
    assert backend("bf16", "contiguous", dev, 256, 512, 4, 128, 64) == "deep_gemm"
    assert backend("int8", "contiguous", dev, 256, 512, 4, 128, 64) == "triton"
    assert backend("fp8", "masked", dev, 256, 512, 4, 128, 8) == "deep_gemm"
    assert backend("int8", "masked", dev, 256, 512, 4, 128, 8) == "triton"
    # alignments deep_gemm cannot take: our kernels (bf16: torch._grouped_mm takes any)
    assert backend("fp8", "contiguous", dev, 256, 512, 4, 16, 64) == "triton"
    assert backend("bf16", "contiguous", dev, 256, 512, 4, 32, 64) == "grouped_mm"
    assert backend("fp8", "contiguous", dev, 256, 512, 4, 0, 64) == "deep_gemm"  # (0: default)


def test_backend_without_deep_gemm_takes_ours(sm90, monkeypatch):
    """A GPU without deep_gemm: every layout falls to our kernels (the contiguous layout's
    alignment is deep_gemm's question only where it is installed: no ImportError)."""
    from epmoe.ops.gemm import _select

    _stand_in_sm90(monkeypatch, deep_gemm=False)
    backend, _ = sm90
    dev = torch.device("cuda", 0)
    for block in (0, 16, 128):
        assert backend("fp8", "contiguous", dev, 256, 512, 4, block, 64) == "triton"
        assert backend("bf16", "contiguous", dev, 256, 512, 4, block, 64) == "grouped_mm"
    assert backend("fp8", "masked", dev, 256, 512, 4, 128, 8) == "triton"
    assert backend("bf16", "masked", dev, 256, 512, 4, 128, 8) == "triton"  # (bmm: every slot row)
    assert _select.contiguous_row_block("fp8", dev) == 128  # (our Triton prefill tiles)
    assert _select.masked_row_block("fp8", dev) == 1  # (no slot padding for deep_gemm's blocks)


@pytest.mark.parametrize("capturing", [False, True])
def test_deep_gemm_runtime_is_made_once_on_its_own_thread(capturing, monkeypatch):
    """deep_gemm's runtime keeps the workspace its first use allocates: made once, on a thread of
    its own with the GEMM's device current (a CUDA-graph pool takes every allocation of the
    warming thread) unless capturing; never for CPU tensors; its error reaches the caller."""
    import contextlib
    import threading
    import types

    from epmoe.ops.gemm import _deepgemm

    events, current = [], [None]

    @contextlib.contextmanager
    def on(device):
        current[0] = device
        yield
        current[0] = None

    def query():
        events.append((threading.get_ident(), current[0]))
        return 132

    dg = types.SimpleNamespace(get_num_sms=query)
    monkeypatch.setattr(_deepgemm, "_RUNTIME_MADE", False)
    monkeypatch.setattr(_deepgemm._deps, "deep_gemm", lambda: dg)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(torch.cuda, "device", on)
    _deepgemm._make_runtime(torch.device("cpu"))
    assert events == []
    dev = torch.device("cuda", 1)
    for _ in range(2):
        _deepgemm._make_runtime(dev)
    me = threading.get_ident()
    if capturing:
        assert events == [(me, None)]
    else:
        ((thread, device),) = events
        assert thread != me and device == dev

    def broken():
        raise RuntimeError("no device")

    monkeypatch.setattr(_deepgemm, "_RUNTIME_MADE", False)
    monkeypatch.setattr(dg, "get_num_sms", broken)
    with pytest.raises(RuntimeError, match="no device"):
        _deepgemm._make_runtime(dev)
    assert not _deepgemm._RUNTIME_MADE


def test_deep_gemm_calls_make_its_runtime_first(monkeypatch):
    from epmoe.ops.gemm import _deepgemm

    events = []
    monkeypatch.setattr(_deepgemm, "_make_runtime", lambda dev: events.append(("runtime", dev)))

    def gemm(*args):
        events.append("gemm")

    a, w = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(2, 16, 8, dtype=torch.bfloat16)
    _deepgemm._deep_gemm_contiguous(gemm, a, w, torch.zeros(4, dtype=torch.int32), None, None)
    _deepgemm._deep_gemm_masked(gemm, a.view(2, 2, 8), w, torch.ones(2, dtype=torch.int32),
                                None, None, 0, 1)  # fmt: skip
    assert events == [("runtime", a.device), "gemm"] * 2


@pytest.mark.parametrize("T, em, hint", [(512, 128, 157), (512, 0, 512), (16, 8, 16), (512, 1, 4)])
def test_deep_gemm_masked_is_hinted_the_fullest_experts_rows(monkeypatch, T, em, hint):
    """deep_gemm sizes its row block by expected_m: it gets the fullest expert's rows (the mean
    plus 2.5 sqrt(mean), at most T), not the mean the layer passes."""
    from epmoe.ops.gemm import _deepgemm

    monkeypatch.setattr(_deepgemm, "_make_runtime", lambda dev: None)
    hints = []
    a, w = torch.zeros(2, T, 8, dtype=torch.bfloat16), torch.zeros(2, 16, 8, dtype=torch.bfloat16)
    mm = torch.ones(2, dtype=torch.int32)
    _deepgemm._deep_gemm_masked(lambda *args: hints.append(args[-1]), a, w, mm, None, None, em, 1)
    assert hints == [hint]


def test_backend_follows_the_tuned_table(sm90):
    backend, tmp = sm90
    dev = torch.device("cuda", 0)
    entries = [
        _entry("contiguous", "fp8", 128, 256, "triton"),
        _entry("contiguous", "fp8", 128, 4096, "deep_gemm"),
        _entry("contiguous", "bf16", 16, 512, "triton"),
        _entry("contiguous", "int8", 128, 512, "deep_gemm"),  # (cannot run int8: ignored)
        _entry("masked", "fp8", 16, 8, "triton"),  # (block: the kernel's BLOCK_M at T, em)
    ]
    (tmp / "nvidia_h200.json").write_text(json.dumps(dict(device="NVIDIA H200", entries=entries)))
    assert backend("fp8", "contiguous", dev, 256, 512, 4, 128, 200) == "triton"
    assert backend("fp8", "contiguous", dev, 256, 512, 4, 128, 256) == "triton"
    assert backend("fp8", "contiguous", dev, 256, 512, 4, 128, 300) == "deep_gemm"
    assert backend("fp8", "contiguous", dev, 256, 512, 4, 128, 99999) == "deep_gemm"  # (largest)
    assert backend("bf16", "contiguous", dev, 256, 512, 4, 16, 64) == "triton"
    assert backend("int8", "contiguous", dev, 256, 512, 4, 128, 64) == "triton"
    assert backend("fp8", "contiguous", dev, 256, 512, 8, 128, 64) == "deep_gemm"  # (other E)
    assert backend("fp8", "masked", dev, 256, 512, 4, 128, 8) == "triton"  # (T 128: BLOCK_M 16)
    assert backend("fp8", "masked", dev, 256, 512, 4, 512, 64) == "deep_gemm"  # (BLOCK_M 64)
    assert _tuned.has("contiguous", "fp8", 256, 512, 4, dev)
    assert not _tuned.has("gate", "fp8", 256, 512, 4, dev)
    assert not _tuned.has("contiguous", "fp8", 256, 512, 4, torch.device("cpu"))
    cfg = _tuned.lookup("contiguous", "fp8", 256, 512, 4, 128, 100, dev)
    assert cfg == entries[0]["config"]
    assert _tuned.lookup("contiguous", "fp8", 256, 512, 4, 128, 100, torch.device("cpu")) is None


def test_backend_of_an_entry_is_its_fastest_that_runs_here(sm90, monkeypatch):
    """An entry whose winner is not installed here (tuned where deep_gemm was) gives the next
    fastest backend it timed, not the untuned default (bf16 masked: torch.bmm)."""
    from epmoe.ops.gemm import _select

    backend, tmp = sm90
    dev = torch.device("cuda", 0)
    timed = dict(deep_gemm=1.0, triton=1.25)
    entries = [
        dict(_entry("masked", "bf16", 16, 8, "deep_gemm"), us=timed),
        dict(_entry("contiguous", "fp8", 128, 256, "deep_gemm"), us=timed),
        dict(_entry("masked", "fp8", 16, 8, "deep_gemm"), us=dict(timed, triton=1.0)),
    ]
    (tmp / "nvidia_h200.json").write_text(json.dumps(dict(device="NVIDIA H200", entries=entries)))
    assert backend("bf16", "masked", dev, 256, 512, 4, 128, 8) == "deep_gemm"
    assert backend("fp8", "contiguous", dev, 256, 512, 4, 128, 256) == "deep_gemm"
    assert backend("fp8", "masked", dev, 256, 512, 4, 128, 8) == "deep_gemm"  # (a tie: by name)
    monkeypatch.setattr(_select._deps, "available", lambda name: name != "deep_gemm")
    _tuned.reread()
    assert backend("bf16", "masked", dev, 256, 512, 4, 128, 8) == "triton"
    assert backend("fp8", "contiguous", dev, 256, 512, 4, 128, 256) == "triton"
    assert backend("fp8", "masked", dev, 256, 512, 4, 128, 8) == "triton"


def test_gate_and_path_entries_are_per_gate_and_bias(sm90):
    """The fused GEMM1 + gate and the path of a layer are measured per gate spec and biases: a
    gpt-oss layer (clamped SwiGLU, biases) never reads the plain SiLU layer's entries of the same
    sizes; entries without the fields are the plain SiLU, no biases."""
    _, tmp = sm90
    dev = torch.device("cuda", 0)
    clamped = "silu:alpha=1.702,limit=7.0,up_offset=1.0"
    old = _entry("gate", "fp8", 128, 512, "triton")  # (written before the fields existed)
    new = dict(_entry("gate", "fp8", 128, 512, "unfused"), gate=clamped, bias=True)
    path = dict(scheme="fp8", E=4, H=512, I=256, K=2, t=32, path="ll", alignment=0, us={})
    paths = [path, dict(path, path="ht", alignment=16, gate=clamped, bias=True)]
    doc = dict(device="NVIDIA H200", entries=[old, new], paths=paths)
    (tmp / "nvidia_h200.json").write_text(json.dumps(doc))
    _tuned._paths.cache_clear()
    try:
        assert _tuned.backend("gate", "fp8", 256, 512, 4, 128, 512, dev) == "triton"
        assert _tuned.backend("gate", "fp8", 256, 512, 4, 128, 512, dev, clamped, True) == "unfused"
        assert _tuned.backend("gate", "fp8", 256, 512, 4, 128, 512, dev, clamped) is None
        assert _tuned.has("gate", "fp8", 256, 512, 4, dev, "silu", False)
        assert not _tuned.has("gate", "fp8", 256, 512, 4, dev, "gelu_tanh", False)
        assert [p["path"] for p in _tuned.paths("fp8", 4, 512, 256, 2, dev)] == ["ll"]
        assert [p["path"] for p in _tuned.paths("fp8", 4, 512, 256, 2, dev, clamped, True)] == [
            "ht"
        ]
        assert _tuned.paths("fp8", 4, 512, 256, 2, dev, "silu", True) == []
    finally:
        _tuned._paths.cache_clear()


def test_reread_drops_every_answer_drawn_from_the_table(sm90):
    """A rewritten table reaches the fused-gate choices once _tuned.reread() has run (the tuner
    re-reads through it between its runs): the masked GEMM1 + gate choice follows the new entry."""
    from epmoe.ops.gemm import _select
    from epmoe.ops.gemm._triton import masked_gate_tiling

    _, tmp = sm90
    dev = torch.device("cuda", 0)
    block = masked_gate_tiling(128, 8, 1)[0]  # (1: fp8's kernel code)

    def write(backend):
        entry = dict(_entry("masked_gate", "fp8", block, 8, backend, N=128), gate="silu",
                     bias=False)  # fmt: skip
        (tmp / "nvidia_h200.json").write_text(json.dumps(dict(entries=[entry])))

    write("triton")
    _tuned.reread()
    assert _select.fuses_masked_gate("fp8", dev, 128, 512, 4, 128, 8)
    write("unfused")
    assert _select.fuses_masked_gate("fp8", dev, 128, 512, 4, 128, 8)  # (cached)
    _tuned.reread()
    assert not _select.fuses_masked_gate("fp8", dev, 128, 512, 4, 128, 8)


def test_reread_replans_the_launches():
    """A plan's launch holds the config it took from the table at its first launch: after
    _tuned.reread() the next call plans afresh (the tuner times its paths after rewriting the
    table), so no launch keeps a config of the table read before."""
    from epmoe.ops.gemm import _triton, _tuned

    dev = torch.device("cpu")
    a = torch.zeros((4, 32, 256), dtype=torch.bfloat16)
    w = torch.zeros((4, 128, 256), dtype=torch.bfloat16)
    out = torch.zeros((4, 32, 128), dtype=torch.bfloat16)
    args = (a.dtype, 32, 128, 256, 4, a.stride(), w.stride(), None, None, out.stride(), 8, False,
            0, 0, dev)  # fmt: skip
    plan = _triton._masked_plan(*args)
    plan.prepared[(0, False)] = "launch of the old table"
    assert _triton._masked_plan(*args) is plan
    _tuned.reread()
    fresh = _triton._masked_plan(*args)
    assert fresh is not plan and not fresh.prepared
    readers = set(_tuned._READERS)
    for memo in ("_contiguous_plan", "_masked_plan", "_gate_plan", "_masked_gate_plan"):
        assert getattr(_triton, memo) in readers, memo


def test_gathers_follows_the_gather_entries(sm90):
    """GEMM1 gathers its rows only where a "gather" entry of this gate and biases measured it
    faster than permute's copy, and only where GEMM1 runs on our Triton kernels (the fused kernel
    or the contiguous backend): deep_gemm reads rows in order."""
    from epmoe.ops.gemm import _select

    _, tmp = sm90
    dev = torch.device("cuda", 0)
    gather = dict(_entry("gather", "fp8", 128, 512, "gather"), config={})
    copy = dict(_entry("gather", "fp8", 128, 4096, "copy"), config={})
    on_dg = dict(_entry("gather", "bf16", 128, 512, "gather"), config={})
    theirs = _entry("contiguous", "fp8", 128, 512, "deep_gemm")
    ours = _entry("contiguous", "fp8", 128, 4096, "triton")
    doc = dict(device="NVIDIA H200", entries=[gather, copy, on_dg, theirs, ours])
    (tmp / "nvidia_h200.json").write_text(json.dumps(doc))
    _tuned.reread()
    try:
        # (fp8 at m 512: deep_gemm runs GEMM1, measured faster: nothing to gather into)
        assert not _select.gathers("fp8", dev, 256, 512, 4, 128, 512)
        assert _tuned.has("gather", "fp8", 256, 512, 4, dev, "silu", False)
        assert not _tuned.has("gather", "fp8", 256, 512, 4, dev, "silu", True)
        assert not _select.gathers("fp8", dev, 256, 512, 4, 128, 4096)  # (copy measured faster)
        assert not _select.gathers("bf16", dev, 256, 512, 4, 128, 512)  # (deep_gemm's GEMM1)
        assert not _select.gathers("fp8", torch.device("cpu"), 256, 512, 4, 128, 512)
        doc["entries"][3] = _entry("contiguous", "fp8", 128, 512, "triton")
        (tmp / "nvidia_h200.json").write_text(json.dumps(doc))
        _tuned.reread()
        assert _select.gathers("fp8", dev, 256, 512, 4, 128, 512)
        assert not _select.gathers("fp8", dev, 256, 512, 4, 128, 512, "silu", True)  # (biases)
        # GEMM1 fused with the gate (our kernel) gathers too, whatever the contiguous backend
        doc["entries"][3] = theirs
        doc["entries"].append(_entry("gate", "fp8", 128, 512, "triton", N=128))
        (tmp / "nvidia_h200.json").write_text(json.dumps(doc))
        _tuned.reread()
        assert _select._backend("fp8", "contiguous", dev, 256, 512, 4, 128, 512) == "deep_gemm"
        assert _select.gathers("fp8", dev, 256, 512, 4, 128, 512)
        # a Gluon config reads its rows through TMA only: no gather, whatever the entry says
        gluon = dict(doc["entries"][-1]["config"], TMA=True, GLUON=True)
        doc["entries"][-1] = dict(doc["entries"][-1], config=gluon)
        (tmp / "nvidia_h200.json").write_text(json.dumps(doc))
        _tuned.reread()
        assert _select.fuses_gate("fp8", dev, 128, 512, 4, 128, 512)
        assert not _select.gathers("fp8", dev, 256, 512, 4, 128, 512)
    finally:
        _tuned.reread()


def test_tuned_file_names():
    assert _tuned.file_name("NVIDIA H200") == "nvidia_h200.json"
    assert _tuned.file_name("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3.json"


@pytest.mark.parametrize("name", sorted(p.name for p in _TABLES))
def test_committed_tables_hold_what_the_kernels_run(name):
    """Each committed table: named after its device, entries and paths unique, and every entry's
    config one its kernel runs at the entry's row block under today's limits (``fits`` rules), so
    a change to those limits cannot leave a table whose configs fail at launch."""
    from epmoe import quant
    from epmoe.ops import gemv
    from epmoe.ops.gemm import _triton

    doc = json.loads((_tuned.DIR / name).read_text())
    assert _tuned.file_name(doc["device"]) == name
    keys = [_tuned.problem(e) + (e["m"],) for e in doc["entries"]]
    assert len(set(keys)) == len(keys) and doc["entries"]
    paths = [_tuned.layer_key(p) + (p["t"],) for p in doc["paths"]]
    assert len(set(paths)) == len(paths)
    assert all(p["path"] in ("gemv", "ll", "ht") and (p["alignment"] > 0) == (p["path"] == "ht")
               for p in doc["paths"])  # fmt: skip
    for e in doc["entries"]:
        layout, c, block = e["layout"], e["config"], e["block"]
        code = quant.get(e["scheme"]).kernel_code
        assert layout in _tuned.LAYOUTS, e
        if layout in ("contiguous", "masked", "gate", "masked_gate"):
            assert _triton.fits_layout(layout, c, code, block), e
        elif layout in ("gemv_up", "gemv_down"):
            kernel, launch = layout[5:], (c["block_n"], c["block_k"], c["num_warps"])
            assert gemv.fits(kernel, e["scheme"], launch, e["K"], block), e
        else:
            assert e["backend"] in ("copy", "gather") and c == {}, e


@pytest.mark.parametrize("name", sorted(p.name for p in _TABLES))
@pytest.mark.parametrize("deep_gemm", [True, False])
def test_committed_tables_give_every_ll_call_a_grouped_gemm(name, deep_gemm, monkeypatch):
    """On each committed table's GPU (an sm90 stand-in), with deep_gemm installed or not, both
    masked GEMMs of every LL call (T <= 512) on one rank's experts of qwen3 / Mixtral / W run ours,
    or deep_gemm where it is installed, never torch.bmm (every slot row: qwen3 bf16 at T = 256 2x
    slower on an H100 without deep_gemm) nor the reference."""
    from epmoe.ops.gemm import _select

    device_name = json.loads((_tuned.DIR / name).read_text())["device"]
    monkeypatch.setattr(_tuned, "_device_name", lambda index: device_name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _stand_in_sm90(monkeypatch, deep_gemm)
    _tuned.reread()
    dev, want = torch.device("cuda", 0), {"deep_gemm", "triton"} if deep_gemm else {"triton"}
    try:
        for E, H, I, K in ((128, 2048, 768, 8), (8, 4096, 14336, 2), (128, 7168, 2048, 8)):  # noqa: E741
            for scheme in ("bf16", "fp8", "int8"):
                slot = _select.masked_row_block(scheme, dev)
                for t in range(1, 513):
                    c, em = reference.round_up(t, slot), -(-t * K // E)
                    got = {_select._backend(scheme, "masked", dev, n, k, E, c, em)
                           for n, k in ((2 * I, H), (H, I))}  # fmt: skip
                    assert got <= want, (E, scheme, t, got)
    finally:
        _tuned.reread()


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_contiguous_a_rows_reads_the_named_rows(scheme, seed):
    """a_rows (permute's src_rows): the same bytes as the permuted copy, on both GEMM1 ops;
    opcheck; a bad row or shape is a ValueError."""
    M, K, E, N, Kd = 9, 2, 3, 256, 128
    x, xs, w, ws, _, _ = _operands(scheme, (M,), E, N, Kd)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(M)])
    p = ops.permute(x, ids, num_experts=E, alignment=4, x_scales=xs)
    idx = ops.permute(x[:, :0], ids, num_experts=E, alignment=4)
    live = p.m_indices >= 0
    want = ops.grouped_gemm(p.x, w, p.m_indices, a_scales=p.x_scales, w_scales=ws)
    got = ops.grouped_gemm(x, w, idx.m_indices, a_scales=xs, w_scales=ws, a_rows=idx.src_rows)
    assert got.shape == want.shape and torch.equal(got[live], want[live])
    args = (x, w, idx.m_indices, xs, ws, None, False, 0, idx.src_rows)
    opcheck(torch.ops.epmoe.grouped_gemm_contiguous.default, args)
    h0, s0 = ops.grouped_gemm_gate(p.x, w, p.m_indices, p.x_scales, ws)
    h1, s1 = ops.grouped_gemm_gate(x, w, idx.m_indices, xs, ws, a_rows=idx.src_rows)
    assert torch.equal(h0[live].float(), h1[live].float()) and torch.equal(s0[live], s1[live])
    opcheck(torch.ops.epmoe.grouped_gemm_gate.default, (x, w, idx.m_indices, xs, ws),
            dict(a_rows=idx.src_rows))  # fmt: skip
    bad = idx.src_rows.clone()
    bad[0] = M
    cases = [
        (bad, "grouped_gemm: a_rows expected ids in \\[0, 9\\) or -1"),
        (idx.src_rows.long(), "grouped_gemm: a_rows expected dtype"),
        (idx.src_rows[:-1], "grouped_gemm: m_indices expected shape"),
    ]
    for rows, match in cases:
        with pytest.raises(ValueError, match=match):
            ops.grouped_gemm(x, w, m_indices=idx.m_indices, a_scales=xs, w_scales=ws,
                             a_rows=rows)  # fmt: skip
