"""CPU smoke test of benchmarks/bench_hf.py: the tiny Qwen3-MoE-shaped model through every
backend and both case kinds on CPU (dynamo only, no Inductor), so the benchmark cannot rot between
device sessions.

Run: ``python -m pytest -q benchmarks/test_bench_hf_cpu.py``.
"""

import json

import pytest
import torch

pytest.importorskip("transformers")

import bench_hf  # noqa: E402


def test_cpu_smoke_run(tmp_path):
    out = tmp_path / "smoke.json"
    report = bench_hf.main(["--cpu-smoke", "--out", str(out), "--batches", "1", "--prefill", "32"])
    on_disk = json.loads(out.read_text())
    assert on_disk["schema"] == 1 and on_disk["complete"] and on_disk["device"] == "cpu"
    backends = [bench_hf.NOOP, *bench_hf.IMPLS]
    assert [r["id"] for r in on_disk["runs"]] == [
        f"{b}/{c}" for b in backends for c in ("decode_b1", "prefill_t32")
    ]
    for r in on_disk["runs"]:
        assert r["status"] == "ok", (r["id"], r.get("error"))
        assert r["step_ms"] > 0 and r["fullgraph"] is True and r["method"] == "cpu"
        if r["backend"].startswith("epmoe"):
            want = "gemv" if r["case"] == "decode_b1" else "ll"  # one rank: 1 <= 8 < 32 <= 128
            assert r["epmoe_mode"] == "auto" and r["epmoe_path"] == want
    for case in ("decode_b1", "prefill_t32"):
        row = on_disk["cases"][case]
        assert row["noop_ms"] > 0
        for b in bench_hf.IMPLS:
            assert row[b]["experts_ms"] == pytest.approx(row[b]["step_ms"] - row["noop_ms"])
        assert set(row["ratios"]) == {b for b in bench_hf.IMPLS if b.startswith("epmoe")}
    targets = {(t["backend"], t["case"]): t for t in on_disk["targets"]}
    assert len(targets) == len(bench_hf.TARGETS)
    assert targets[("epmoe", "decode_b1")]["ratio"] is not None
    assert targets[("epmoe", "decode_b64")]["met"] is None  # not measured here
    assert report["cases"] == on_disk["cases"]


def test_kernel_table_per_step(monkeypatch):
    import contextlib

    import _timing

    acts = [("a", 0.0, 3.0), ("b", 3.0, 4.0), ("a", 5.0, 6.0)] * 2  # two steps
    monkeypatch.setattr(_timing, "device_activities", lambda prof: acts)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.profiler, "profile", lambda **kw: contextlib.nullcontext())
    calls = []
    assert bench_hf.kernel_table(lambda: calls.append(1), iters=2) == [
        ("a", 4.0, 2.0),
        ("b", 1.0, 1.0),
    ]
    assert len(calls) == 3  # one untimed step, then the profiled ones


def test_noop_keeps_the_router_in_the_compiled_step():
    """The no-op backend's zeros depend on the routing: Inductor cannot drop the top-k."""
    from torch._inductor.utils import run_and_get_code

    def step(x, gate):
        w, ids = torch.topk(torch.softmax(x @ gate, dim=-1), 2, dim=-1)
        return bench_hf.noop_experts_forward(None, x, ids, w)

    x, gate = torch.randn(4, 16), torch.randn(16, 8)
    out, code = run_and_get_code(torch.compile(step, fullgraph=True), x, gate)
    assert torch.equal(out, torch.zeros_like(x))
    assert "topk" in "\n".join(code)


def test_model_fields_are_the_named_configs():
    """Each model's MoE sizes (and gpt-oss's gate) are its named config's in _configs."""
    import _configs

    import epmoe.gate

    oss, gem = _configs.CONFIGS["gpt-oss-20b"], _configs.CONFIGS["gemma4-26b-a4b"]
    f = bench_hf.GPT_OSS_20B
    g = epmoe.gate.get(oss.gate)
    assert (f["hidden_size"], f["intermediate_size"]) == (oss.hidden, oss.intermediate)
    assert (f["num_local_experts"], f["num_experts_per_tok"]) == (oss.num_experts, oss.top_k)
    assert (f["swiglu_alpha"], f["swiglu_limit"]) == (g.alpha, g.limit)
    f = bench_hf.GEMMA4_26B_A4B
    assert (f["hidden_size"], f["moe_intermediate_size"]) == (gem.hidden, gem.intermediate)
    assert (f["num_experts"], f["top_k_experts"]) == (gem.num_experts, gem.top_k)
    assert f["hidden_activation"] == "gelu_pytorch_tanh" and len(f["layer_types"]) == 30
    cut = bench_hf.config_fields(f, 2)
    assert cut["num_hidden_layers"] == 2
    assert cut["layer_types"] == ["sliding_attention", "full_attention"]
    assert "layer_types" not in bench_hf.config_fields(bench_hf.GPT_OSS_20B, 2)
    assert bench_hf.MODELS["qwen3-30b-a3b"].targets == bench_hf.TARGETS


@pytest.mark.parametrize("model", ["gpt-oss-20b", "gemma4-26b-a4b"])
def test_cpu_smoke_models(tmp_path, model):
    """The tiny gpt-oss / Gemma4 models (sliding-window caches, biases, their gates) through the
    script: the epmoe backend runs the model's experts with the gate epmoe recognized."""
    import _configs

    cfg = _configs.CONFIGS[model]
    out = tmp_path / "m.json"
    argv = ["--cpu-smoke", "--model", model, "--out", str(out), "--impls", "grouped_mm,epmoe"]
    report = bench_hf.main(argv + ["--batches", "1", "--prefill", "32"])
    on_disk = json.loads(out.read_text())
    assert on_disk["complete"] and on_disk["model"]["name"] == model
    assert on_disk["model"]["num_hidden_layers"] == 2 and on_disk["targets"] == []
    for r in on_disk["runs"]:
        assert r["status"] == "ok", (r["id"], r.get("error"))
        assert r["step_ms"] > 0 and r["fullgraph"] is True
    for r in (r for r in on_disk["runs"] if r["backend"] == "epmoe"):
        assert "epmoe_fallback" not in r, r["epmoe_fallback"]
        assert (r["epmoe_gate"], r["epmoe_bias"]) == (cfg.gate, cfg.bias)
    assert set(report["cases"]["decode_b1"]["ratios"]) == {"epmoe"}


def test_a_fallback_gets_no_ratio():
    def run(backend, case, ms, **kw):
        return dict(backend=backend, case=case, step_ms=ms, status="ok", **kw)

    report = {
        "runs": [
            run("noop", "decode_b1", 1.0),
            run("grouped_mm", "decode_b1", 2.0),
            run("epmoe", "decode_b1", 1.5),
            run("epmoe_fp8", "decode_b1", 2.0, epmoe_fallback="GptOssExperts: why"),
        ]
    }
    bench_hf.summarize(report, 2)
    row = report["cases"]["decode_b1"]
    assert row["ratios"] == {"epmoe": 0.5}
    assert row["epmoe_fp8"]["fallback"] == "GptOssExperts: why"
    assert row["epmoe_fp8"]["experts_ms"] == pytest.approx(1.0)
