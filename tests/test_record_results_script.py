"""scripts/record_results.py (a benchmark JSON -> lines of benchmarks/results/<gpu>/
measurements.jsonl) on every format the benchmarks write, and the committed tables it appends to."""

import importlib.util
import json
import pathlib

import pytest
import torch

from epmoe.cli import bench

REPO = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("record_results", REPO / "scripts/record_results.py")
rr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rr)


def _one_gpu() -> dict:
    """bench_one_gpu.py --out, trimmed: the header and one measured, one skipped case."""
    return {
        "schema": 1,
        "command": "python benchmarks/bench_one_gpu.py --out one_gpu.json --only T=32",
        "date": "2026-12-03 11:52:36",
        "device": "NVIDIA H200",
        "versions": {"torch": "2.11.0+cu130", "git": "ab03a73"},
        "copy_gbps": 4261.8,
        "cases": [
            {
                "id": "qwen3-30b-a3b/fp8/auto/T32",
                "T": 32,
                "status": "ok",
                "path": "ll",
                "experts_hit": 113,
                "graph_ms": 0.1725,
                "host_us": 188.1,
                "launches": 5,
                "compile_s": 5.2,
                "kernels": {"_ll_scatter_kernel": 1},
                "step_s": {"launches": 0.4},
                "ratios": {"graph_over_raw": 1.07},
            },
            {"id": "qwen3-30b-a3b/fp8/auto/T4096", "status": "skipped", "errors": {}},
        ],
    }


def _metrics(lines):
    return {(x["case"], x["metric"]): (x["value"], x["unit"]) for x in lines}


def test_one_gpu_lines():
    lines = rr.rows(_one_gpu(), "h200", "one_gpu.json")
    assert lines[0] == {
        "gpu": "h200",
        "commit": "ab03a73",
        "date": "2026-12-03 11:52:36",
        "benchmark": "bench_one_gpu",
        "case": "copy",
        "metric": "copy_gbps",
        "value": 4261.8,
        "unit": "GB/s",
        "source": "one_gpu.json",
    }
    case = "qwen3-30b-a3b/fp8/auto/T32"
    # figures only: no seconds of a step, kernel counts, ratios or sizes; no skipped case
    assert _metrics(lines) == {
        ("copy", "copy_gbps"): (4261.8, "GB/s"),
        (case, "graph_ms"): (0.1725, "ms"),
        (case, "host_us"): (188.1, "us"),
        (case, "launches"): (5, "count"),
    }
    assert all(x["path"] == "ll" for x in lines[1:])
    assert list(lines[1]) == [f for f in rr.FIELDS]  # the column order of every line


def test_hf_layer_deepep_and_pytest_benchmark_lines():
    hf = {
        "schema": 1,
        "date": "2026-12-03 00:17:28",
        "versions": {"git": "1979318"},
        "model": {"num_hidden_layers": 4},
        "runs": [],
        "cases": {
            "decode_b1": {
                "noop_ms": 0.45,
                "grouped_mm": {"step_ms": 0.71, "experts_ms": 0.26, "experts_us_per_layer": 64.0},
                "epmoe_fp8": {"step_ms": 0.55, "experts_ms": 0.09, "experts_us_per_layer": 23.5},
                "ratios": {"epmoe_fp8": 0.37},
            }
        },
    }
    got = _metrics(rr.rows(hf, "h200", "hf.json"))
    assert got == {
        ("qwen3-30b-a3b-L4/decode_b1/noop", "step_ms"): (0.45, "ms"),
        ("qwen3-30b-a3b-L4/decode_b1/grouped_mm", "step_ms"): (0.71, "ms"),
        ("qwen3-30b-a3b-L4/decode_b1/grouped_mm", "experts_us_per_layer"): (64.0, "us"),
        ("qwen3-30b-a3b-L4/decode_b1/epmoe_fp8", "step_ms"): (0.55, "ms"),
        ("qwen3-30b-a3b-L4/decode_b1/epmoe_fp8", "experts_us_per_layer"): (23.5, "us"),
    }
    layer = {
        "command": "python benchmarks/bench_layer.py --out layer.json",
        "gpu": "NVIDIA H200",
        "date": "2026-12-01",
        "config": "W",
        "quant": "fp8",
        "ll_tokens_per_rank": 128,
        "ht_tokens_per_rank": 4096,
        "slower_rank": {
            "ll_graph_ms": 1.81,
            "ll_graph_over_stages": 0.999,
            "ht_recv_rows": 8192,
            "host_us": {"permute": 306.2},
        },
        "per_rank": [],
    }
    lines = rr.rows(layer, "h200x2", "layer.json", commit="cf61e54")
    assert {x["commit"] for x in lines} == {"cf61e54"} and lines[0]["date"] == "2026-12-01"
    assert _metrics(lines) == {
        ("W/fp8/LL128-HT4096", "ll_graph_ms"): (1.81, "ms"),
        ("W/fp8/LL128-HT4096", "ll_graph_over_stages"): (0.999, "ratio"),
        ("W/fp8/LL128-HT4096", "host_us.permute"): (306.2, "us"),
    }
    deepep = {
        "workload": {"name": "W"},
        "device": "NVIDIA H200",
        "summary": {"ll_graph_fp8": {"ours_us": 71.8, "raw_us": 69.6, "ours_GBps": 310.0}},
        "ranks": [],
    }
    lines = rr.rows(deepep, "h200x2", "deepep.json", date="2026-12-01")
    assert lines[0]["commit"] == "unknown" and lines[0]["date"] == "2026-12-01"
    assert _metrics(lines) == {
        ("W/ll_graph_fp8", "ours_us"): (71.8, "us"),
        ("W/ll_graph_fp8", "raw_us"): (69.6, "us"),
        ("W/ll_graph_fp8", "ours_GBps"): (310.0, "GB/s"),
    }
    pb = {
        "datetime": "2026-12-03T00:21:42.9+00:00",
        "commit_info": {"id": "cb2dce83b8528d2c", "dirty": True},
        "machine_info": {},
        "benchmarks": [
            {
                "name": "test_permute_prefill[W-fp8]",
                "stats": {"median": 1e-4},
                "extra_info": {
                    "ms": 0.0894,
                    "gbps": 3387.3,
                    "frac_of_ceiling": 0.80,
                    "bytes": 3,
                    "target_frac": 0.8,
                    "ceiling_by_method": {"eager": 4240.4},
                },
            },
            {
                "name": "test_grouped_gemm_contiguous",
                "stats": {"median": 2e-3},
                "extra_info": {"tflops": 0.02},
            },
        ],
    }
    lines = rr.rows(pb, "h200", "bench.json")
    assert lines[0]["commit"] == "cb2dce8-dirty" and lines[0]["date"] == "2026-12-03 00:21:42"
    # the benchmark's own timing where it reports one; pytest-benchmark's median otherwise
    assert _metrics(lines) == {
        ("test_permute_prefill[W-fp8]", "ms"): (0.0894, "ms"),
        ("test_permute_prefill[W-fp8]", "gbps"): (3387.3, "GB/s"),
        ("test_permute_prefill[W-fp8]", "frac_of_ceiling"): (0.80, "ratio"),
        ("test_grouped_gemm_contiguous", "median_ms"): (2.0, "ms"),
        ("test_grouped_gemm_contiguous", "tflops"): (0.02, "TFLOP/s"),
    }


def test_epmoe_bench_json_lines():
    """``python -m epmoe bench``'s own JSON (made by its measurement loop, tiny shape on CPU)."""
    torch.manual_seed(0)
    doc = {"shape": {"name": "tiny"}, "date": "2026-12-04 10:00:00", "versions": {}}
    cpu = torch.device("cpu")
    doc.update(bench.run(bench.SHAPES["tiny"], [4], ["bf16"], ["ll"], cpu, 1, 0, log=print))
    got = _metrics(rr.rows(doc, "cpu", "bench.json"))
    assert set(got) == {
        ("tiny/T4/reference", "ms"),
        ("tiny/T4/grouped_mm", "ms"),
        ("tiny/T4/epmoe/bf16/ll", "ms"),
    }
    assert all(v > 0 and u == "ms" for v, u in got.values())


def test_tune_gemm_table_lines():
    """scripts/tune_gemm.py's table: each backend's µs of each problem, each variant's of each
    path size, the winner as ``path``; the header's commit and date."""
    doc = {
        "device": "NVIDIA H200", "triton": "3.6.0", "date": "2026-12-05 10:00:00 UTC",
        "commit": "abc1234",
        "entries": [dict(layout="contiguous", scheme="fp8", N=1536, K=2048, E=128, block=16,
                         m=2176, config={"BLOCK_M": 16}, backend="triton",
                         us={"triton": 40.5, "deep_gemm": 44.0})],
        "paths": [dict(scheme="fp8", E=128, H=2048, I=768, K=8, t=32, path="ht", alignment=16,
                       us={"ll": 90.0, "ht@128": 120.0, "ht@16": 84.0})],
    }  # fmt: skip
    lines = rr.rows(doc, "h200", "tuned.json")
    assert {(x["case"], x["metric"], x["value"], x["path"]) for x in lines} == {
        ("contiguous/fp8/N1536-K2048-E128/block16/M2176", "triton_us", 40.5, "triton"),
        ("contiguous/fp8/N1536-K2048-E128/block16/M2176", "deep_gemm_us", 44.0, "triton"),
        ("path/fp8/E128-H2048-I768-K8/T32", "ll_us", 90.0, "ht@16"),
        ("path/fp8/E128-H2048-I768-K8/T32", "ht@128_us", 120.0, "ht@16"),
        ("path/fp8/E128-H2048-I768-K8/T32", "ht@16_us", 84.0, "ht@16"),
    }
    assert {(x["benchmark"], x["commit"], x["date"], x["unit"]) for x in lines} == {
        ("tune_gemm", "abc1234", "2026-12-05 10:00:00", "us")
    }


def test_weight_stream_lines():
    """benchmarks/bench_weight_stream.py's JSON: its copy ceiling and each case's µs and ratio
    under the weight_stream benchmark (not bench_one_gpu's, whose layout it shares)."""
    doc = {
        "benchmark": "weight_stream", "device": "NVIDIA H100 80GB HBM3",
        "date": "2026-12-06 11:50:00", "versions": {"git": "abc1234"}, "copy_gbps": 2950.0,
        "cases": [dict(id="qwen3-30b-a3b/fp8/gemm2", weight_bytes=201326592, floor_us=68.2,
                       tiles_us=78.1, linear_us=77.9, frac_of_floor=0.873)],
    }  # fmt: skip
    lines = rr.rows(doc, "h100", "stream.json")
    assert {(x["case"], x["metric"], x["value"], x["unit"]) for x in lines} == {
        ("copy", "copy_gbps", 2950.0, "GB/s"),
        ("qwen3-30b-a3b/fp8/gemm2", "floor_us", 68.2, "us"),
        ("qwen3-30b-a3b/fp8/gemm2", "tiles_us", 78.1, "us"),
        ("qwen3-30b-a3b/fp8/gemm2", "linear_us", 77.9, "us"),
        ("qwen3-30b-a3b/fp8/gemm2", "frac_of_floor", 0.873, "ratio"),
    }
    assert {(x["benchmark"], x["commit"]) for x in lines} == {("weight_stream", "abc1234")}


def test_main_appends_and_never_rewrites(tmp_path, capsys):
    src = tmp_path / "run.json"
    src.write_text(json.dumps(_one_gpu()))
    out = tmp_path / "results" / "h200" / "measurements.jsonl"
    argv = ["--gpu", "h200", "--results-dir", str(tmp_path / "results"), str(src)]
    assert rr.main(argv + ["--dry-run"]) == 0 and not out.exists()
    assert rr.main(argv) == 0
    first = out.read_text()
    assert rr.main(argv + ["--commit", "abc1234", "--date", "2026-12-05"]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert out.read_text().startswith(first) and len(lines) == 8
    assert {(x["commit"], x["date"]) for x in lines[4:]} == {("abc1234", "2026-12-05")}
    assert "appended 4 lines to" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert rr.main(["--gpu", "h200", "--results-dir", str(tmp_path / "results"), str(bad)]) == 2
    assert "record_results: expected the JSON of bench_one_gpu.py" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rr.main(["--gpu", "../x", str(src)])


@pytest.mark.parametrize("gpu", ["h200", "h200x2"])
def test_committed_measurements_are_well_formed(gpu):
    """Every committed line has the columns, a unit and a number; each results folder holds its
    page and its table only (no logs, no run-named files)."""
    folder = REPO / "benchmarks" / "results" / gpu
    assert sorted(p.name for p in folder.iterdir()) == ["RESULTS.md", "measurements.jsonl"]
    lines = [json.loads(x) for x in (folder / "measurements.jsonl").read_text().splitlines()]
    assert lines
    for x in lines:
        assert x["gpu"] == gpu and set(x) <= set(rr.FIELDS), x
        assert {"commit", "date", "benchmark", "case", "metric", "value", "unit"} <= set(x), x
        assert isinstance(x["value"], (int, float)) and x["unit"], x
