"""The ``epmoe`` command line on CPU: env, demo (2 gloo ranks; a corrupted stage), bench --tiny."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from epmoe import _deps
from epmoe.__main__ import main
from epmoe.cli import bench, demo, env

REPO = Path(__file__).resolve().parents[1]


def _epmoe(*args, timeout):
    """Run the real command (``python -m epmoe ...``) and return the finished process."""
    # a user's shell: none of the test runner's own variables (pytest-xdist's worker id would turn
    # pytest-benchmark off in the bench command's pytest)
    envv = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    envv["PYTHONUNBUFFERED"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "epmoe", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=envv,
    )


def _clear_env_caches():
    for f in (env.package, env.gpus, env.peer_access, env.deepep_status):
        f.cache_clear()


# ---------------------------------------------------------------------------------------------- env
def test_env_prints_versions_and_backends(capsys):
    torch.manual_seed(0)
    _clear_env_caches()
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"torch         {torch.__version__}" in out
    import importlib.metadata

    assert f"triton        {importlib.metadata.version('triton')}" in out
    for name, load in (("deep_ep", _deps.deep_ep), ("deep_gemm", _deps.deep_gemm)):
        try:
            load()
        except ImportError as e:  # missing here: the exact install hint of epmoe._deps is shown
            assert f"{name:<14}missing: {e}" in out
        else:
            assert f"{name:<14}{env.package(name).version}" in out
    for line in (
        "comm backends",
        "  local         yes",
        "torch (gloo)  yes",
        "torch (nccl)",
        "deepep",
        "quant schemes",
        "bf16  cpu   yes",
        "fp8   cpu   yes",
        "int8  cpu   yes",
    ):
        assert line in out, line
    if not torch.cuda.is_available():
        assert "GPUs\n  none: " in out
        assert "deepep        no " in out
        assert "`epmoe demo` here: 2 gloo rank(s) on cpu, backend torch" in out


def _fake_machine(monkeypatch, cc, peer=True, deep_ok=True):
    """Pretend to be a 2-GPU host (nothing touches CUDA): exercises the GPU lines on CPU."""
    _clear_env_caches()
    gpus = tuple(env.Gpu(i, "NVIDIA H200", cc, 139.8, 18) for i in range(2))
    monkeypatch.setattr(env, "cuda_status", lambda: env.Status(True, "CUDA 13.0"))
    monkeypatch.setattr(env, "gpus", lambda: gpus)
    monkeypatch.setattr(env, "peer_access", lambda: {(0, 1): peer, (1, 0): peer})
    real_package, real_find = env.package, env.importlib.util.find_spec

    def package(name):
        if name in ("deep_ep", "deep_gemm"):
            if deep_ok:
                return env.Package(name, "1.0", "tokenspeed-" + name.replace("_", ""), True, "")
            return env.Package(name, None, None, False, f"{name} is not installed: pip install x")
        return real_package(name)

    def find_spec(name, *a):
        if name == "epmoe.comm.deepep":
            return object()  # the backend module (written separately) counts as present
        if name in ("deep_ep", "deep_gemm") and not deep_ok:
            return None
        return real_find(name, *a)

    monkeypatch.setattr(env, "package", package)
    monkeypatch.setattr(env.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(env, "deepep_status", env.deepep_status.__wrapped__)


def test_env_gpu_lines_hopper(monkeypatch):
    _fake_machine(monkeypatch, (9, 0))
    out = env.render()
    assert "cuda:0  NVIDIA H200  compute capability 9.0" in out
    assert "peer access (torch.cuda.can_device_access_peer): 2/2 pairs" in out
    assert "18 NVLink links up" in out
    assert env.deepep_status().ok
    assert env.quant_status("fp8", "cuda") == env.Status(True, "deep_gemm fp8 grouped GEMM (sm90)")
    assert env.quant_status("int8", "cuda").ok


def test_env_gpu_lines_say_why_not(monkeypatch):
    _fake_machine(monkeypatch, (8, 0), peer=False, deep_ok=False)
    fp8 = env.quant_status("fp8", "cuda")
    assert not fp8.ok and "compute capability >= 9.0 (sm90), found 8.0" in fp8.why
    assert "deep_gemm not installed" in fp8.why
    ep = env.deepep_status()
    assert not ep.ok and "no peer access between GPUs 0->1, 1->0" in ep.why
    assert "deep_ep not installed" in ep.why
    assert "no peer access: 0->1, 1->0" in env.render()


# --------------------------------------------------------------------------------------------- demo
def test_demo_two_gloo_ranks_passes():
    t0 = time.perf_counter()
    p = _epmoe("demo", "--device", "cpu", "--world", "2", timeout=150)
    wall = time.perf_counter() - t0
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "2 rank(s) on cpu, backend torch (gloo)" in out
    for mode in ("HT", "LL"):
        for q in ("bf16", "fp8", "int8"):
            assert f"[{mode} | {q}]" in out
    for stage in demo.STAGES:
        assert f"\n{stage:<12}" in out, stage
    assert "FAIL" not in out
    n_rows = sum(
        1
        for line in out.splitlines()
        if line.split()[:1] and line.split()[0] in demo.STAGES and line.endswith("  ok")
    )
    verdict = re.search(rf"all {n_rows} checks passed on 2 ranks \(([\d.]+) s\)\n", out)
    assert verdict and float(verdict.group(1)) <= wall + 0.1, out[-300:]


def test_demo_reports_the_whole_run_time(monkeypatch, capsys):
    """The verdict's time covers the ranks' whole run (spawn, start-up, checks), not one rank's."""

    def ranks(fn, args, nprocs, join, start_method):
        time.sleep(0.5)  # the ranks' start-up and checks
        args[2].put((True, "epmoe demo: all 3 checks passed on 2 ranks"))

    monkeypatch.setattr(torch.multiprocessing, "start_processes", ranks)
    assert demo.run_demo(world=2, device="cpu", quants=("bf16",))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    secs = re.fullmatch(r"epmoe demo: all 3 checks passed on 2 ranks \(([\d.]+) s\)", last)
    assert secs and float(secs.group(1)) >= 0.5, last


def test_demo_corrupted_stage_fails():
    """A perturbed permute output must be caught by permute's own checks (and only downstream)."""
    p = _epmoe(
        "demo",
        "--device",
        "cpu",
        "--world",
        "2",
        "--mode",
        "ht",
        "--quant",
        "bf16",
        "--start-method",
        "fork",
        "--selftest-corrupt",
        "permute",
        timeout=120,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    rows = {}
    for line in p.stdout.splitlines():
        parts = line.split()
        if parts and parts[0] in demo.STAGES:
            rows.setdefault(parts[0], []).append("FAIL" not in line)
    assert rows["permute"] == [False, False]
    assert all(rows["dispatch"]) and all(rows["gemm1"]) and not all(rows["layer"])
    assert "epmoe demo: FAILED" in p.stdout


def test_demo_rejects_bad_arguments(capsys):
    # 8 experts do not split over 3 ranks
    assert main(["demo", "--device", "cpu", "--world", "3"]) == 1
    assert "--experts expected a multiple of the world size 3, got 8" in capsys.readouterr().err
    assert not demo.run_demo(world=1, device="cpu", modes=("xx",))
    assert "--mode expected ht or ll, got 'xx'" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------- bench
def test_bench_tiny_writes_json_markdown_png(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    p = _epmoe("bench", "--tiny", "--out-dir", str(tmp_path), timeout=150)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "test_bench_cpu.py::test_permute PASSED" in p.stdout  # progress streamed
    data = json.loads((tmp_path / "bench.json").read_text())
    names = {b["name"] for b in data["benchmarks"]}
    assert {
        "test_permute",
        "test_grouped_gemm_contiguous",
        "test_epmoe_layer_local[ht]",
        "test_epmoe_layer_local[ll]",
    } <= names
    assert all(b["stats"]["median"] > 0 for b in data["benchmarks"])
    md = (tmp_path / "bench.md").read_text()
    assert "| group | benchmark | median |" in md
    for name in names:
        assert f"`{name[5:]}`" in md
    assert "GB/s" in md and "TFLOP/s" in md
    png = tmp_path / "bench.png"
    assert png.stat().st_size > 0
    img = matplotlib.image.imread(str(png))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_bench_report_uses_ceilings(tmp_path):
    """Report rendering alone, on a hand-made pytest-benchmark JSON (no timing involved)."""
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)

    def entry(name, median, **extra):
        return {
            "name": name,
            "group": "stage",
            "extra_info": extra,
            "stats": {"median": median, "iqr": median / 10, "rounds": 7},
        }

    data = {
        "datetime": "2026-01-01T00:00:00",
        "machine_info": {"node": "n"},
        "commit_info": {},
        "benchmarks": [
            entry("test_permute[W]", 2e-5, gbps=2400.0, ceiling_gbps=4800.0),
            entry("test_gemm[W]", 1e-3, tflops=600.0, ceiling_tflops=800.0),
            entry("test_layer[W]", 3e-3),
            entry("test_decode[W]", 1e-4, tflops=5.0, weight_gbps=3000.0, copy_gbps=4000.0),
        ],
    }
    src = tmp_path / "in.json"
    src.write_text(json.dumps(data))
    assert main(["bench", "--from-json", str(src), "--out-dir", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "bench.md").read_text()
    assert "| stage | `permute[W]` | 20 us | 2 us | 7 | 2,400 GB/s | 4,800 GB/s | 50% |" in md
    assert "| 600 TFLOP/s | 800 TFLOP/s | 75% |" in md
    assert "| stage | `layer[W]` | 3 ms | 300 us | 7 |  |  |  |" in md
    assert "| `decode[W]` | 100 us | 10 us | 7 | 3,000 GB/s | 4,000 GB/s | 75% |" in md
    import matplotlib.image

    assert matplotlib.image.imread(str(tmp_path / "r" / "bench.png")).shape[0] > 100


@pytest.mark.parametrize("from_json", [False, True])
def test_bench_without_matplotlib_says_so_and_writes_nothing(
    tmp_path, capsys, monkeypatch, from_json
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    src = tmp_path / "in.json"
    src.write_text("{}")
    out = tmp_path / "r"
    argv = ["bench", "--out-dir", str(out)] + (
        ["--from-json", str(src)] if from_json else ["--tiny"]
    )
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        'epmoe bench: needs matplotlib: pip install -e ".[bench]" (or pip install matplotlib)'
    ]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in.json"]


def test_bench_without_suite_fails(tmp_path, capsys):
    assert bench.run_bench(bench_dir=str(tmp_path / "none"), out_dir=str(tmp_path)) == 2
    assert "no benchmarks/ directory" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["bench", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert "usage: epmoe" in capsys.readouterr().out
