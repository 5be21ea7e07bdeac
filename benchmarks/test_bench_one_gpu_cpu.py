"""CPU smoke tests of benchmarks/bench_one_gpu.py: the script's cases run on the tiny shape on CPU
through the same code paths as on the GPU (timings that need CUDA are recorded as skipped), so the
benchmark cannot rot between device sessions.

Run: ``python -m pytest -q benchmarks/test_bench_one_gpu_cpu.py``.
"""

import importlib.util
import json
from types import SimpleNamespace

import _configs
import bench_one_gpu as bench
import one_gpu_report
import pytest
import torch

import epmoe
import epmoe.quant
from epmoe import reference

TINY = _configs.CONFIGS[bench.CPU_SMOKE["shape"]]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
# the one-rank LL chain imports epmoe.ops.ll_scatter
HAS_LOCAL_LL = importlib.util.find_spec("epmoe.ops.ll_scatter") is not None


def _usable(case: dict) -> bool:
    """Whether the case can run in this checkout (LL on one rank needs ll_scatter)."""
    return HAS_LOCAL_LL or case["path"] != "ll"


def test_cpu_smoke_run(tmp_path, capsys):
    out = tmp_path / "smoke.json"
    argv = ["--cpu-smoke", "--out", str(out), "--only", "T=1,200"]
    if not HAS_TRANSFORMERS:
        argv.append("--no-transformers")
    report = bench.main(argv)
    on_disk = json.loads(out.read_text())
    assert on_disk["schema"] == 1 and on_disk["complete"] and on_disk["device"] == "cpu"
    assert on_disk["copy_gbps"] > 0 and len(on_disk["cases"]) == len(report["cases"])
    for when in ("start", "end"):
        assert set(on_disk["host_ref_us"][when]) == {"x_plus_x", "empty"}
        assert all(v > 0 for v in on_disk["host_ref_us"][when].values())
    # 3 schemes x (ll, ht, auto) x T {1, 200}
    assert {(c["scheme"], c["mode"], c["T"]) for c in on_disk["cases"]} == {
        (q, m, t) for q in bench.SCHEMES for m in bench.MODES for t in (1, 200)
    }
    for c in on_disk["cases"]:
        auto = c["mode"] == "auto"
        cfg = _configs.CONFIGS[c["shape"]]
        gemv = epmoe.layer.gemv_max_tokens(epmoe.quant.get(c["scheme"]), cfg.num_experts, cfg.top_k)
        auto_gemv = auto and c["T"] <= gemv  # (1 rank)
        auto_ll = auto and c["T"] <= epmoe.layer.AUTO_LL_MAX_TOKENS
        want = "gemv" if auto_gemv else "ll" if c["mode"] == "ll" or auto_ll else "ht"
        assert c["path"] == want, c["id"]
        if not _usable(c):
            assert "warmup" in c["errors"], c["id"]
            continue
        assert c["status"] == "ok" and not c["errors"], (c["id"], c["errors"])
        assert c["eager_ms"] > 0 and c["eager_loop_ms"] > 0 and c["host_us"] > 0
        assert c["eager_queued_ms"] > 0
        assert c["skips"]["graph"] == c["skips"]["launches"] == "needs CUDA"
        assert c["weight_bytes"] == c["experts_hit"] * bench.expert_weight_bytes(TINY, c["scheme"])
        assert c["floor_ms"] == pytest.approx(c["weight_bytes"] / (on_disk["copy_gbps"] * 1e6))
        assert c["ratios"]["eager_over_floor"] == pytest.approx(c["eager_ms"] / c["floor_ms"])
        # the raw GEMMs' operands are the layer's: combined the raw way, the same output
        tol = 1e-2 if c["scheme"] != "int8" else 0.12  # int8's anchor is the fp8 GEMM
        assert c["raw_rel_l2_vs_layer"] < tol, c["id"]
        assert ("anchor for int8" in c["raw_impl"]) == (c["scheme"] == "int8")
        lay = c["raw_layout"]
        if c["path"] == "ht":  # every choice a row; padding to each expert's alignment blocks
            assert lay["live_rows"] == c["T"] * TINY.top_k, c["id"]
            assert lay["live_rows"] <= lay["block_rows"] <= lay["M_sum"], c["id"]
            assert lay["block_rows"] % lay["alignment"] == 0, c["id"]
        if HAS_TRANSFORMERS:
            assert c["skips"]["grouped_mm/grouped_mm_graph_ms"] == "needs CUDA"
            assert c["rel_l2_vs_grouped_mm"] < (1e-2 if c["scheme"] == "bf16" else 0.1), c["id"]
            assert c.get("matches_grouped_mm", True) and c["grouped_mm_eager_ms"] > 0
    printed = capsys.readouterr().out
    assert "g/raw" in printed and "tiny-1rank" in printed


def test_budget_spent_skips_every_case_with_a_note(tmp_path):
    out = tmp_path / "b.json"
    report = bench.main(["--cpu-smoke", "--out", str(out), "--budget-s", "0", "--only", "ht"])
    on_disk = json.loads(out.read_text())
    assert not on_disk["complete"] and len(on_disk["skipped"]) == len(report["cases"]) == 9
    assert all(c["status"] == "skipped" and c["skips"]["case"] == "budget" for c in report["cases"])
    assert any("skipped (budget)" in n for n in on_disk["notes"])


def test_a_failing_step_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    def broken(self, fn):
        raise RuntimeError("boom")

    monkeypatch.setattr(bench.CpuTimer, "loop", broken)
    out = tmp_path / "e.json"
    argv = [
        "--cpu-smoke",
        "--out",
        str(out),
        "--only",
        "ht",
        "T=1",
        "bf16,fp8",
        "--no-transformers",
    ]
    bench.main(argv)
    cases = json.loads(out.read_text())["cases"]
    assert [c["id"] for c in cases] == ["tiny-1rank/bf16/ht/T1", "tiny-1rank/fp8/ht/T1"]
    for c in cases:
        assert c["status"] == "error" and c["errors"]["eager"].startswith("RuntimeError: boom")
        assert "raw_rel_l2_vs_layer" in c and "floor_ms" in c  # later steps still ran


def test_missing_transformers_is_a_skip(tmp_path, monkeypatch):
    def missing(*args):
        raise ImportError("No module named 'transformers'")

    monkeypatch.setattr(bench, "hf_grouped_mm_experts", missing)
    out = tmp_path / "t.json"
    report = bench.main(["--cpu-smoke", "--out", str(out), "--only", "ht", "T=1", "bf16"])
    (c,) = report["cases"]
    assert c["status"] == "ok" and not c["errors"]
    assert "not importable" in c["skips"]["grouped_mm"] and "rel_l2_vs_grouped_mm" not in c


def _layer(scheme, mode, T):
    layer = bench.make_layer(TINY, scheme, mode, T, 200, "cpu")
    g = torch.Generator().manual_seed(3)
    E, H, I = TINY.local_experts, TINY.hidden, TINY.intermediate
    w1 = (torch.randn((E, 2 * I, H), generator=g) * bench.W_STD).bfloat16()
    w2 = (torch.randn((E, H, I), generator=g) * bench.W_STD).bfloat16()
    layer.load_weights(w1, w2)
    return layer, w1, w2


@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_raw_ll_operands_give_the_layer_output(scheme):
    """The masked-layout raw GEMMs (built without the layer's LL path) reproduce the HT layer."""
    T = 40
    layer, w1, w2 = _layer(scheme, "ht", T)
    r = bench.make_routing(TINY, T, 0, "cpu")
    with torch.no_grad():
        want = layer(r.x, r.ids, r.weights)
    weights = tuple(getattr(layer, n) for n in bench.WEIGHTS)
    timer = bench.CpuTimer(1, 0)
    for path, args in (("ll", (T, T, None)), ("ht", (None, 0, layer.alignment))):
        res = bench.raw_gemms(TINY, scheme, weights, r, path, *args, timer)
        assert res["_skip"] == "needs CUDA" and "raw_ms" not in res
        assert bench.rel_l2(res["_out"], want) < 1e-2, path
    assert bench.rel_l2(want, reference.dense_moe(r.x, r.ids, r.weights, w1, w2)) < 0.1


def test_masked_layout_places_every_choice():
    ids = torch.tensor([[0, 2], [2, 1], [0, 1]])
    x = torch.arange(3 * 4, dtype=torch.float32).reshape(3, 4).bfloat16()
    a, counts, slot = bench.masked_layout(x, ids, 4, 5)
    assert counts.tolist() == [2, 2, 2, 0] and counts.dtype == torch.int32
    assert slot.tolist() == [0, 0, 1, 0, 1, 1]  # (t, k) order inside each expert
    for i, (e, s) in enumerate(zip(ids.reshape(-1).tolist(), slot.tolist(), strict=True)):
        assert torch.equal(a[e, s], x[i // 2])
    live = torch.arange(5)[None, :] < counts[:, None]
    assert not a[~live].any()


def test_routing_is_seeded_distinct_and_normalised():
    r1, r2 = bench.make_routing(TINY, 33, 0, "cpu"), bench.make_routing(TINY, 33, 0, "cpu")
    assert torch.equal(r1.ids, r2.ids) and torch.equal(r1.x, r2.x)
    assert r1.ids.dtype == torch.int64 and r1.weights.dtype == torch.float32
    assert all(len(set(row)) == TINY.top_k for row in r1.ids.tolist())
    assert torch.allclose(r1.weights.sum(1), torch.ones(33))
    assert r1.experts_hit == torch.unique(r1.ids).numel()


def test_expert_weight_bytes():
    cfg = _configs.CONFIGS["dsv3-1gpu"]
    n = 3 * 7168 * 2048
    assert bench.expert_weight_bytes(cfg, "bf16") == 2 * n
    assert bench.expert_weight_bytes(cfg, "fp8") == n + 4 * (32 * 56 + 56 * 16)
    assert bench.expert_weight_bytes(cfg, "int8") == n + 4 * (4096 + 7168)
    # all 256 bf16 experts: the 22.5 GB the docstring plans memory around
    assert cfg.local_experts * bench.expert_weight_bytes(cfg, "bf16") / 2**30 == pytest.approx(21.0)


def test_plan_and_only_filters():
    only = bench.parse_only(["shape=W", "fp8,int8", "ll", "T=1,512,4096"])
    assert only == {"shape": ["W"], "scheme": ["fp8", "int8"], "mode": ["ll"], "T": [1, 512, 4096]}
    cases = bench.plan_cases(only["shape"], only["scheme"], only["mode"], only["T"])
    assert [c.id for c in cases] == [
        "W/fp8/ll/T1",
        "W/fp8/ll/T512",
        "W/int8/ll/T1",
        "W/int8/ll/T512",
    ]
    full = bench.plan_cases(bench.SHAPES, bench.SCHEMES, bench.MODES, bench.QUICK_TOKENS)
    assert len(full) == 3 * 3 * (3 + 4 + 4)  # ll only up to LL_MAX_TOKENS
    with pytest.raises(SystemExit):
        bench.parse_only(["scheme=fp4"])
    with pytest.raises(SystemExit):
        bench.parse_only(["nonsense"])


def test_compile_targets_default_to_auto_at_two_sizes():
    def rec(shape, scheme, mode, T):
        return {"id": f"{shape}/{scheme}/{mode}/T{T}", "shape": shape, "scheme": scheme,
                "mode": mode, "T": T, "status": "ok", "errors": {}}  # fmt: skip

    recs = [
        rec(s, q, m, t)
        for s in ("qwen3-30b-a3b", "W")
        for q in bench.SCHEMES
        for m in bench.MODES
        for t in (1, 32, 4096)
        if not (m == "ll" and t > bench.LL_MAX_TOKENS)
    ]
    args = SimpleNamespace(compile_all=False, compile_shapes=None, compile_tokens=None)
    picked = sorted(r["id"] for r in bench.compile_targets(recs, args))
    assert picked == sorted(
        f"qwen3-30b-a3b/{q}/auto/T{t}" for q in bench.SCHEMES for t in bench.COMPILE_TOKENS
    )
    no_auto = [r for r in recs if r["mode"] != "auto"]
    picked = sorted(r["id"] for r in bench.compile_targets(no_auto, args))
    assert "qwen3-30b-a3b/fp8/ll/T32" in picked and "qwen3-30b-a3b/fp8/ht/T4096" in picked
    assert len(picked) == 6
    args.compile_all = True
    assert len(bench.compile_targets(recs, args)) == len(recs)


def test_weights_are_shared_between_mode_layers():
    sr = bench.ShapeRun(TINY, "cpu", 0, 200, bench.CpuTimer(1, 0))
    ht = sr.layer("fp8", "ht", 8)
    auto = sr.layer("fp8", "auto", 8)
    assert all(getattr(auto, n) is getattr(ht, n) for n in bench.WEIGHTS)
    assert isinstance(auto, epmoe.EPMoE) and auto.mode == "auto"
    aligned = sr.layer("fp8", "ht32", 8)  # (HT at permute alignment 32, the same weights)
    assert aligned.mode == "ht" and aligned.alignment == 32 and ht.alignment == 128
    assert aligned.w1 is ht.w1 and bench.parse_only(["ht16,ht64"]) == {"mode": ["ht16", "ht64"]}
    sr.layer("int8", "ht", 8)  # a new scheme frees the previous one's layers
    assert ("auto", None) not in sr.layers
    sr.close()


def test_stack_step_runs_the_layer_n_times_and_reports_per_layer():
    """The "stack" step: LayerStack is n chained layer calls; its eager figures are per layer and
    the compiled ones need CUDA (skipped on CPU, nothing else recorded for them)."""
    sr = bench.ShapeRun(TINY, "cpu", 0, 200, bench.CpuTimer(2, 0))
    case = bench.Case(TINY.name, "fp8", "ht", 8)
    rec = bench.run_case(sr, case, {"stack"}, stack=3)
    assert rec["status"] == "ok", rec["errors"]
    assert rec["stack_layers"] == 3 and rec["stack_eager_ms"] > 0 and rec["stack_host_us"] > 0
    assert "stack_graph_ms" not in rec  # (needs CUDA)
    assert all(rec["skips"][f"stack_{v}"] == "needs CUDA" for v in bench.COMPILE_VARIANTS)
    layer, r = sr.layer("fp8", "ht", 8), sr.routing(8)
    with torch.no_grad():
        want = r.x
        for _ in range(3):
            want = layer(want, r.ids, r.weights)
        assert torch.equal(bench.LayerStack(layer, 3)(r.x, r.ids, r.weights), want)
    assert not torch.equal(want, layer(r.x, r.ids, r.weights))
    sr.close()


class _GraphOnCpu(bench.CpuTimer):
    """A CPU timer whose "graph" runs the call once and returns the calls so far (ms), keeping
    each call's token ids: the routings step's bookkeeping without a GPU."""

    def __init__(self):
        super().__init__(2, 0)
        self.ids = []

    def graph(self, fn) -> float:
        fn()
        return float(len(self.ids))


def test_routings_step_times_the_case_routing_then_others_and_takes_medians():
    timer = _GraphOnCpu()
    sr = bench.ShapeRun(TINY, "cpu", 0, 200, timer, routings=3)
    sr.copy_gbps = 1.0
    layer = sr.layer("bf16", "ht", 8)

    def spy(x, ids, w):
        timer.ids.append(ids.clone())
        return layer(x, ids, w)

    rec = bench.run_case(sr, bench.Case(TINY.name, "bf16", "ht", 8), {"routings"})
    assert "graph_ms_routings" not in rec  # (only after a graph_ms of the case's own routing)
    got = bench._routings_step(sr, spy, 8, "bf16")
    assert got["graph_ms_routings"] == [1.0, 2.0, 3.0] and got["graph_median_ms"] == 2.0
    assert torch.equal(timer.ids[0], sr.routing(8).ids)  # the case's own routing first
    assert len({tuple(i.flatten().tolist()) for i in timer.ids}) == 3  # then two other draws
    again = [r.ids for r in sr.routings(8, 3)]
    assert all(torch.equal(a, b) for a, b in zip(again, timer.ids, strict=True))  # seeded
    per = bench.expert_weight_bytes(TINY, "bf16") / 1e6
    hits = [torch.unique(i).numel() for i in timer.ids]
    assert got["floor_ms_routings"] == pytest.approx([h * per for h in hits])
    assert got["floor_median_ms"] == pytest.approx(sorted(hits)[1] * per)
    rec.update(got)
    assert bench.ratios(rec)["graph_median_over_floor_median"] == pytest.approx(
        2.0 / got["floor_median_ms"]
    )
    (row,) = one_gpu_report.routing_rows({"cases": [rec]}, "ht")
    assert row.startswith(f"| {TINY.name} | bf16 | 8 | ht | 1.000 / 2.000 / 3.000 | 2.000 | ")
    assert not list(one_gpu_report.routing_rows({"cases": [rec]}, "ll"))
    sr.close()


def test_latest_rows_of_measurements_take_each_case_from_its_latest_run():
    def line(case, date, commit, metric, value, bench="bench_one_gpu"):
        return dict(benchmark=bench, case=case, date=date, commit=commit, metric=metric,
                    value=value, path="ll")  # fmt: skip

    q = "qwen3-30b-a3b/fp8/auto/T32"
    lines = [
        line(q, "2026-12-06 08:14:00", "aaa1111", "graph_ms", 0.30),
        line(q, "2026-12-06 08:14:00", "aaa1111", "floor_ms", 0.15),
        line(q, "2026-12-06 08:14:00", "aaa1111", "raw_ms", 0.25),
        line(q, "2026-12-07 16:05:32", "bbb2222", "graph_ms", 0.21),
        line(q, "2026-12-07 16:05:32", "bbb2222", "graph_median_ms", 0.20),
        line(q, "2026-12-07 16:05:32", "bbb2222", "floor_median_ms", 0.16),
        line(q, "2026-12-07 16:05:32", "bbb2222", "eager_ms", 0.206),
        line(q, "2026-12-07 16:05:32", "bbb2222", "host_us", 194.2),
        line(q, "2026-12-07 16:05:32", "bbb2222", "launches", 5),
        line("W/int8/auto/T4096", "2026-12-05 16:59:19", "ccc3333", "graph_ms", 3.918),
        line("W/int8/auto/T4096", "2026-12-05 16:59:19", "ccc3333", "floor_ms", 1.870),
        line("qwen3-30b-a3b/fp8/ll/T32", "2026-12-08 00:00:00", "ddd4444", "graph_ms", 9.0),
        line(q, "2026-12-08 00:00:00", "eee5555", "median_ms", 9.0, bench="pytest_benchmark"),
    ]
    w, qr = one_gpu_report.latest_rows(lines, "auto")
    assert qr == (
        "| qwen3-30b-a3b | fp8 | 32 | ll | 0.200 | 0.160 (1.25x) | 0.250 (0.80x), 2026-12-06 08:14 "
        "| - | 0.206 | 194 | 5 | 2026-12-07 16:05, `bbb2222` |"
    )
    assert w.startswith("| W | int8 | 4096 | ll | 3.918 | 1.870 (2.10x) | - | - | - |")
    assert w.endswith("| 2026-12-05 16:59, `ccc3333` |")
    assert len(list(one_gpu_report.latest_rows(lines, "ll"))) == 1


# ------------------------------------------------------------------ gates, biases, other experts
GPT_OSS = _configs.CONFIGS["tiny-gpt-oss"]
GEMMA4 = _configs.CONFIGS["tiny-gemma4"]
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")


def test_model_configs():
    """The gpt-oss / Gemma4 shapes: their sizes, gates and biases, and the plain twin's."""
    oss, plain = _configs.CONFIGS["gpt-oss-20b"], _configs.CONFIGS["gpt-oss-20b-silu"]
    assert (oss.hidden, oss.intermediate, oss.local_experts, oss.top_k) == (2880, 2880, 32, 4)
    assert oss.bias and oss.hf_experts == "gpt_oss" and oss.plain == plain.name
    g = epmoe.gate.get(oss.gate)
    assert (g.act, g.alpha, g.limit, g.up_offset, g.clamp_after) == ("silu", 1.702, 7.0, 1.0, False)
    same = ("hidden", "intermediate", "num_experts", "ranks", "top_k")
    assert all(getattr(plain, f) == getattr(oss, f) for f in same)
    assert plain.gate == "silu" and not plain.bias and plain.plain is None
    gem = _configs.CONFIGS["gemma4-26b-a4b"]
    assert (gem.hidden, gem.intermediate, gem.local_experts, gem.top_k) == (2816, 704, 128, 8)
    assert gem.gate == "gelu_tanh" and not gem.bias and gem.hf_experts == "gemma4"
    assert set(bench.MODEL_SHAPES) <= set(_configs.CONFIGS)
    assert not set(bench.MODEL_SHAPES) & set(bench.SHAPES)  # not in the default run
    assert {c.hf_experts for c in _configs.CONFIGS.values()} <= set(bench.HF_EXPERTS)


def _weights(cfg):
    sr = bench.ShapeRun(cfg, "cpu", 0, 200, bench.CpuTimer(1, 0))
    return sr, sr.routing(40)


@needs_transformers
@pytest.mark.parametrize("cfg", [TINY, GPT_OSS, GEMMA4], ids=lambda c: c.name)
def test_hf_experts_compute_the_configs_mlp(cfg):
    """The grouped_mm baseline holds epmoe's weights in its class's layout: grouped_mm and the
    class's own (eager) forward give the float32 reference of w1 / w2 / b1 / b2 and the gate."""
    sr, r = _weights(cfg)
    assert (sr.b1 is None) == (not cfg.bias)
    want = reference.dense_moe(r.x, r.ids, r.weights, sr.w1, sr.w2, cfg.gate, sr.b1, sr.b2)
    experts = sr.experts()
    with torch.no_grad():
        got = experts(r.x, r.ids, r.weights.bfloat16())
        experts.config._experts_implementation = "eager"
        eager = experts(r.x, r.ids, r.weights.bfloat16())
    assert bench.rel_l2(got, want) < bench.GROUPED_MM_TOL
    assert bench.rel_l2(eager, want) < bench.GROUPED_MM_TOL
    if cfg.hf_experts != "gpt_oss":  # the same layout: epmoe's tensors themselves
        assert experts.gate_up_proj.data_ptr() == sr.w1.data_ptr()
        assert experts.down_proj.data_ptr() == sr.w2.data_ptr()
    sr.close()


@needs_transformers
def test_gpt_oss_layout_and_a_wrong_mapping_fails_the_check():
    """gpt-oss: gate_up_proj `[E, H, 2I]` with gate / up columns interleaved (biases too),
    down_proj `[E, I, H]`; each mapping mistake moves the output far past GROUPED_MM_TOL."""
    sr, r = _weights(GPT_OSS)
    E, H, I = GPT_OSS.local_experts, GPT_OSS.hidden, GPT_OSS.intermediate
    ex = sr.experts()
    assert ex.gate_up_proj.shape == (E, H, 2 * I) and ex.gate_up_proj.is_contiguous()
    assert torch.equal(ex.gate_up_proj[:, :, 0::2], sr.w1[:, :I].transpose(1, 2))
    assert torch.equal(ex.gate_up_proj[:, :, 1::2], sr.w1[:, I:].transpose(1, 2))
    assert torch.equal(ex.gate_up_proj_bias[:, 0::2], sr.b1[:, :I])
    assert torch.equal(ex.gate_up_proj_bias[:, 1::2], sr.b1[:, I:])
    assert torch.equal(ex.down_proj, sr.w2.transpose(1, 2)) and ex.down_proj.is_contiguous()
    assert torch.equal(ex.down_proj_bias, sr.b2)
    assert (ex.alpha, ex.limit) == (1.702, 7.0)
    want = reference.dense_moe(r.x, r.ids, r.weights, sr.w1, sr.w2, GPT_OSS.gate, sr.b1, sr.b2)
    wrong = {
        "not interleaved": ("gate_up_proj", sr.w1.transpose(1, 2).contiguous()),
        "bias not interleaved": ("gate_up_proj_bias", sr.b1),
        "no b2": ("down_proj_bias", torch.zeros_like(sr.b2)),
        "no b1": ("gate_up_proj_bias", torch.zeros_like(sr.b1)),
    }
    with torch.no_grad():
        for why, (name, t) in wrong.items():
            keep = getattr(ex, name)
            setattr(ex, name, torch.nn.Parameter(t, requires_grad=False))
            err = bench.rel_l2(ex(r.x, r.ids, r.weights.bfloat16()), want)
            setattr(ex, name, keep)
            assert err > 5 * bench.GROUPED_MM_TOL, why
    sr.close()


@needs_transformers
def test_hf_experts_refuse_a_config_they_do_not_compute():
    import dataclasses

    w1, w2 = torch.zeros(8, 2 * 88, 192), torch.zeros(8, 192, 88)
    with pytest.raises(ValueError, match="computes the gate gelu_tanh, not silu"):
        bench.hf_grouped_mm_experts(dataclasses.replace(GEMMA4, gate="silu"), w1, w2)
    with pytest.raises(ValueError, match="no expert biases"):
        bench.hf_grouped_mm_experts(dataclasses.replace(GEMMA4, bias=True), w1, w2)
    with pytest.raises(ValueError, match="hf_experts"):
        bench.hf_grouped_mm_experts(dataclasses.replace(GEMMA4, hf_experts="mixtral"), w1, w2)


def _padded_prepared(cfg, scheme, w1, w2, b1, b2):
    """(w1, w1_scale, w2, w2_scale, b1, b2) as a ``scheme`` layer keeps them (zero-padded to the
    scheme's sizes, quantized), built without the layer."""
    F = torch.nn.functional
    of = epmoe.quant.get(scheme).size_multiple
    H, I = cfg.hidden, cfg.intermediate
    Hp, Ip = reference.round_up(H, of), reference.round_up(I, of)
    w1p = torch.cat([F.pad(h, (0, Hp - H, 0, Ip - I)) for h in w1.split(I, dim=1)], dim=1)
    w2p = F.pad(w2, (0, Ip - I, 0, Hp - H))
    b1p = torch.cat([F.pad(h, (0, Ip - I)) for h in b1.float().split(I, dim=1)], dim=1)
    b2p = F.pad(b2.float(), (0, Hp - H))
    if scheme == "bf16":
        return w1p, None, w2p, None, b1p, b2p
    q1, s1 = reference.quantize_weights(w1p, scheme)
    q2, s2 = reference.quantize_weights(w2p, scheme)
    return q1, s1, q2, s2, b1p, b2p


@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_raw_gemms_run_the_gate_biases_and_padding(scheme):
    """The raw GEMMs' operands at gpt-oss's gate and biases and at sizes fp8 pads (H 200, I 72):
    combined the raw way they give the layer's reference output (no layer needed)."""
    sr, r = _weights(GPT_OSS)
    weights = _padded_prepared(GPT_OSS, scheme, sr.w1, sr.w2, sr.b1, sr.b2)
    if scheme == "fp8":
        assert weights[0].shape[1:] == (2 * 128, 256)  # H 200 -> 256, I 72 -> 128 a half
    args = (r.x, r.ids, r.weights, sr.w1, sr.w2)
    if scheme == "bf16":
        want = reference.dense_moe(*args, GPT_OSS.gate, sr.b1, sr.b2)
    else:
        want = reference.quantized_moe(*args, scheme, GPT_OSS.gate, sr.b1, sr.b2)
    timer = bench.CpuTimer(1, 0)
    for path, a in (("ll", (64, 40, None)), ("ht", (None, 0, 128))):
        res = bench.raw_gemms(GPT_OSS, scheme, weights, r, path, *a, timer)
        assert res["_out"].shape == r.x.shape
        assert bench.rel_l2(res["_out"], want) < 1e-2, path
    plain = bench.raw_gemms(GPT_OSS, scheme, weights[:4], r, "ht", None, 0, 128, timer)
    assert bench.rel_l2(plain["_out"], want) > 0.05  # the biases count
    sr.close()


def test_expert_weight_bytes_of_gated_and_biased_experts():
    cfg = _configs.CONFIGS["gpt-oss-20b"]
    n, bias = 3 * 2880 * 2880, 2 * (2 * 2880 + 2880)  # bf16 biases
    assert bench.expert_weight_bytes(cfg, "bf16") == 2 * n + bias
    assert bench.expert_weight_bytes(cfg, "fp8") == n + 4 * 3 * 23 * 23 + bias  # 23 blocks of 2880
    assert bench.expert_weight_bytes(cfg, "int8") == n + 4 * (2 * 2880 + 2880) + bias
    plain = _configs.CONFIGS["gpt-oss-20b-silu"]
    assert bench.expert_weight_bytes(plain, "bf16") == 2 * n


def _rec(shape, scheme, mode, T, graph_ms, eager_ms=None, gmm=None):
    r = {"shape": shape, "scheme": scheme, "mode": mode, "T": T, "status": "ok", "errors": {}}
    r.update(graph_ms=graph_ms, eager_ms=eager_ms, ratios={})
    if gmm is not None:
        r["ratios"]["graph_over_grouped_mm_graph"] = graph_ms / gmm
    return r


def test_summary_gate_bias_cost_and_targets():
    oss, plain = "gpt-oss-20b", "gpt-oss-20b-silu"
    report = {
        "cases": [
            _rec(oss, "fp8", "auto", 32, 0.102, 0.2, gmm=0.3),  # 0.34 of grouped_mm: met
            _rec(plain, "fp8", "auto", 32, 0.1, 0.19),
            _rec(oss, "bf16", "auto", 32, 0.11, gmm=0.12),  # 0.92 > 1 / 1.3: not met
            _rec(plain, "bf16", "auto", 32, 0.1),  # 1.1 > 1.03: not met
            _rec(oss, "bf16", "auto", 4096, 1.0, gmm=1.25),  # above 128: <= 1, met
            _rec(oss, "int8", "auto", 4096, 1.0, gmm=0.5),  # no int8 target above 128
            _rec(oss, "fp8", "ll", 32, 0.1, gmm=0.3),  # not the auto layer
            _rec(oss, "fp8", "ht", 32, 0.2),  # no twin at ht
            _rec("qwen3-30b-a3b", "fp8", "auto", 32, 0.1, gmm=0.3),
            {"shape": plain, "scheme": "fp8", "mode": "ht", "T": 32, "status": "skipped"},
        ]
    }
    report["cases"][0]["kernel_us"] = {"gemm": 60.0, "act": 12.0, "unpermute": 30.0}
    report["cases"][1]["kernel_us"] = {"gemm": 60.5, "act": 10.0, "silu_only": 1.0}
    bench.summarize(report)
    cost = {(e["scheme"], e["mode"], e["T"]): e for e in report["gate_bias_cost"]}
    assert set(cost) == {("fp8", "auto", 32), ("bf16", "auto", 32)}
    delta = {"gemm": -0.5, "act": 2.0, "unpermute": 30.0, "silu_only": -1.0}
    assert cost[("fp8", "auto", 32)]["kernel_delta_us"] == delta
    assert cost[("bf16", "auto", 32)]["kernel_delta_us"] == {}
    e = cost[("fp8", "auto", 32)]
    assert e["shape"] == oss and e["plain"] == plain and e["max_ratio"] == bench.GATE_BIAS_MAX
    assert e["ratio"] == e["graph_ratio"] == pytest.approx(1.02) and e["met"] is True
    assert e["eager_ratio"] == pytest.approx(0.2 / 0.19)
    assert cost[("bf16", "auto", 32)]["met"] is False
    assert cost[("bf16", "auto", 32)]["eager_ratio"] is None
    oss_targets = [t for t in report["targets"] if t["shape"] == oss]
    got = {(t["scheme"], t["T"]): (t["max_ratio"], t["met"]) for t in oss_targets}
    assert got == {
        ("fp8", 32): (0.5, True),
        ("bf16", 32): (pytest.approx(1 / 1.3), False),
        ("bf16", 4096): (1.0, True),
    }
    assert all(t["mode"] == "auto" and t["against"] == "grouped_mm" for t in oss_targets)
    # qwen3's fp8 T = 32 record has no floor: its floor target is there, unmeasured
    (q3,) = [t for t in report["targets"] if t["shape"] != oss]
    assert (q3["against"], q3["ratio"], q3["met"]) == ("floor", None, None)
    lines = bench.summary_lines(report)
    assert any(line.startswith("gate_bias_cost gpt-oss-20b / gpt-oss-20b-silu") for line in lines)


def test_the_log_line_shows_the_routings_median_where_timed():
    """A case's log line: its own routing's graph_ms and, with --routings, the median the targets
    divide (a reader copying figures from the log gets both, named)."""
    budget, case = bench.Budget(60.0), "qwen3-30b-a3b/fp8/auto/T512"
    one = dict(_rec("qwen3-30b-a3b", "fp8", "auto", 512, 0.2714, eager_ms=0.27), id=case)
    line = bench._progress(one, budget)
    assert f"{case} ok eager_ms=0.270 graph_ms=0.271 raw_ms=-" in line
    line = bench._progress(dict(one, graph_median_ms=0.2652), budget)
    assert "graph_ms=0.271 graph_median_ms=0.265 raw_ms=-" in line


def test_summary_issue_33_targets():
    """Floor, fp8, fixed-ms and vLLM targets: the median over routings where timed on several,
    vLLM's figures on an H200 only and at their T only."""
    q3, mx = "qwen3-30b-a3b", "mixtral-8x7b"

    def rec(shape, scheme, T, g, floor=None, median=None, floor_median=None):
        r = _rec(shape, scheme, "auto", T, g)
        r.update(floor_ms=floor, graph_median_ms=median, floor_median_ms=floor_median)
        return r

    cases = [
        rec(q3, "bf16", 32, 0.26, floor=0.248),  # 1.048 <= 1.10
        rec(q3, "fp8", 512, 0.204, floor=0.141),  # 1.447 > 1.25
        rec(q3, "fp8", 8, 0.070, floor=0.057, median=0.081, floor_median=0.057),  # median: 1.42
        rec(q3, "int8", 512, 0.197),  # 0.197 / 0.204 <= 1
        rec(q3, "int8", 16384, 1.655),  # no fp8 case at 16384: unmeasured
        rec(q3, "bf16", 4096, 0.666),  # <= 0.68 ms
        rec(mx, "bf16", 512, 0.942),  # vLLM 0.876: behind
        rec(mx, "fp8", 16, 0.3),  # no vLLM figure at T = 16
    ]
    want = {
        (q3, "bf16", 32, "floor"): (0.26 / 0.248, True),
        (q3, "fp8", 512, "floor"): (0.204 / 0.141, False),
        (q3, "fp8", 8, "floor"): (0.081 / 0.057, False),
        (q3, "int8", 512, "fp8"): (0.197 / 0.204, True),
        (q3, "int8", 16384, "fp8"): (None, None),
        (q3, "bf16", 4096, 0.68): (0.666 / 0.68, True),
    }
    for device, vllm in (("NVIDIA H100 80GB HBM3", {}), ("NVIDIA H200", {
        (q3, "bf16", 32, "vllm"): (0.26 / 0.283, True),
        (q3, "bf16", 4096, "vllm"): (0.666 / 0.752, True),
        (q3, "fp8", 8, "vllm"): (0.081 / 0.090, True),
        (q3, "fp8", 512, "vllm"): (0.204 / 0.242, True),
        (mx, "bf16", 512, "vllm"): (0.942 / 0.876, False),
    })):  # fmt: skip
        report = {"device": device, "cases": [dict(c) for c in cases]}
        bench.summarize(report)
        got = {
            (t["shape"], t["scheme"], t["T"], t["against"]): (t["ratio"], t["met"])
            for t in report["targets"]
        }
        expect = {**want, **vllm}
        assert got == {k: (pytest.approx(r) if r else r, m) for k, (r, m) in expect.items()}
    lines = bench.summary_lines(report)
    assert "target mixtral-8x7b bf16 auto T512 graph / vllm <= 1.000: 1.075 False" in lines


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
def test_cpu_smoke_gpt_oss_and_gemma4_shapes(tmp_path, monkeypatch):
    """The tiny gpt-oss / Gemma4 shapes through the script: every path and scheme, the layer
    built with the config's gate and biases matches transformers' own experts (GptOssExperts,
    Gemma4TextExperts) on the same weights, the raw GEMMs' operands are the layer's, and the
    gate / bias cost against a plain twin is recorded."""
    import dataclasses

    twin = dataclasses.replace(
        GPT_OSS, name="tiny-gpt-oss-silu", gate="silu", bias=False, hf_experts="qwen3_moe"
    )
    monkeypatch.setitem(_configs.CONFIGS, twin.name, twin)
    monkeypatch.setitem(
        _configs.CONFIGS, GPT_OSS.name, dataclasses.replace(GPT_OSS, plain=twin.name)
    )
    out = tmp_path / "m.json"
    shapes = f"shape={GPT_OSS.name},{twin.name},{GEMMA4.name}"
    report = bench.main(["--cpu-smoke", "--out", str(out), "--only", shapes, "ht,auto", "T=1,40"])
    on_disk = json.loads(out.read_text())
    assert on_disk["complete"] and len(on_disk["cases"]) == 3 * 3 * 2 * 2
    for c in on_disk["cases"]:
        cfg = _configs.CONFIGS[c["shape"]]
        assert (c["gate"], c["bias"]) == (cfg.gate, cfg.bias)
        if not _usable(c):
            continue
        assert c["status"] == "ok" and not c["errors"], (c["id"], c["errors"])
        tol = 1e-2 if c["scheme"] != "int8" else 0.12
        assert c["raw_rel_l2_vs_layer"] < tol, c["id"]
        assert c["rel_l2_vs_grouped_mm"] < (1e-2 if c["scheme"] == "bf16" else 0.1), c["id"]
        assert c.get("matches_grouped_mm", True), c["id"]
    cost = on_disk["gate_bias_cost"]
    assert {(e["scheme"], e["mode"], e["T"]) for e in cost} == {
        (q, m, t) for q in bench.SCHEMES for m in ("ht", "auto") for t in (1, 40)
    }
    assert all(e["eager_ratio"] > 0 and e["ratio"] is None and e["met"] is None for e in cost)
    assert on_disk["targets"] == [] and report["gate_bias_cost"] == cost
