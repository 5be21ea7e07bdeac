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
