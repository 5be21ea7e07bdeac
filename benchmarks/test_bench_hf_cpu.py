"""CPU smoke test of benchmarks/bench_hf.py: the tiny Qwen3-MoE-shaped model through every
backend and both case kinds on CPU (dynamo only, no Inductor), so the benchmark cannot rot between
device sessions.

Run: ``python -m pytest -q benchmarks/test_bench_hf_cpu.py``.
"""

import json

import pytest

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
            assert r["epmoe_mode"] == "auto" and r["epmoe_path"] == "ll"  # 1 and 32 <= 128
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
    import _timing

    calls = [[("a", 0.0, 3.0), ("b", 3.0, 4.0), ("a", 5.0, 6.0)]] * 2
    monkeypatch.setattr(_timing, "profiled_calls", lambda step, iters: calls)
    assert bench_hf.kernel_table(lambda: None, iters=2) == [("a", 4.0, 2), ("b", 1.0, 1)]
