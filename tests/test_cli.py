"""The ``epmoe`` command line on CPU: env, demo (2 gloo ranks; a corrupted stage), bench --tiny."""

import json
import os
import re
import shutil
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
def test_bench_tiny_runs_from_the_package_alone(tmp_path):
    """``python -m epmoe bench --tiny`` needs the installed package only: epmoe/ copied alone onto
    PYTHONPATH, run from an empty directory (no checkout, no benchmarks/), default --out-dir."""
    pytest.importorskip("matplotlib")
    import matplotlib.image

    site, cwd = tmp_path / "site", tmp_path / "cwd"
    shutil.copytree(REPO / "epmoe", site / "epmoe", ignore=shutil.ignore_patterns("__pycache__"))
    cwd.mkdir()
    envv = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    envv.update(PYTHONPATH=str(site), PYTHONUNBUFFERED="1")
    code = "import sys, epmoe; from epmoe.__main__ import main; print(epmoe.__file__); main()"
    p = subprocess.run(
        [sys.executable, "-c", code, "bench", "--tiny"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=envv,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.splitlines()[0] == str(site / "epmoe" / "__init__.py")  # not the checkout
    p = subprocess.run(
        [sys.executable, "-m", "epmoe", "bench", "--tiny", "--quant", "bf16", "--mode", "ll"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=envv,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "epmoe bench: T=64 epmoe/bf16/ll: " in p.stdout  # progress streamed
    out = cwd / bench.DEFAULT_OUT_DIR
    doc = json.loads((out / "bench.json").read_text())
    assert doc["shape"]["name"] == "tiny" and doc["command"].startswith("epmoe bench --tiny")
    assert [(r["impl"], r.get("scheme"), r.get("mode")) for r in doc["results"]] == [
        ("reference", None, None),
        ("grouped_mm", None, None),
        ("epmoe", "bf16", "ll"),
    ]
    assert all(r["ms"] > 0 for r in doc["results"])
    assert doc["results"][2]["rel_err"] < 0.02 and doc["results"][2]["path"] == "ll"
    md = (out / "bench.md").read_text()
    assert "| 64 | epmoe bf16 ll | ll |" in md and "| 64 | reference |" in md
    img = matplotlib.image.imread(str(out / "bench.png"))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_bench_run_covers_every_scheme_and_mode():
    """The measurement loop in process: every scheme and mode against both baselines, outputs
    checked against the dense reference; LL skipped above its token bound."""
    torch.manual_seed(0)
    lines = []
    cpu, tiny = torch.device("cpu"), bench.SHAPES["tiny"]
    doc = bench.run(tiny, [2], bench.SCHEMES, bench.MODES, cpu, 1, 0, log=lines.append)
    recs = {(r["impl"], r.get("scheme"), r.get("mode")): r for r in doc["results"]}
    assert len(recs) == 2 + 9 and len(lines) == 11
    for q, tol in (("bf16", 0.02), ("int8", 0.05), ("fp8", 0.1)):
        for m in bench.MODES:
            r = recs[("epmoe", q, m)]
            assert "error" not in r and r["ms"] > 0 and r["rel_err"] < tol, r
            assert r["path"] == {"ht": "ht", "ll": "ll", "auto": "gemv"}[m]
    assert recs[("grouped_mm", None, None)]["rel_err"] < 0.02
    doc = bench.run(tiny, [bench.LL_MAX_TOKENS + 1], ["bf16"], ["ll"], cpu, 1, 0, log=lines.append)
    assert doc["results"][-1]["skipped"] == f"LL above {bench.LL_MAX_TOKENS} tokens"


def test_grouped_mm_baseline_matches_the_reference():
    """The grouped_mm baseline is the dense layer: skipped choices (-1), empty experts."""
    from epmoe import reference

    torch.manual_seed(0)
    T, E, H, inter, K = 13, 6, 64, 32, 3
    x = torch.randn(T, H).bfloat16()
    ids = torch.rand(T, E).topk(K, dim=1).indices
    ids[ids == 5] = -1  # expert 5 empty, its choices skipped
    ids[0] = -1
    w = torch.rand(T, K)
    w1 = (torch.randn(E, 2 * inter, H) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, inter) / inter**0.5).bfloat16()
    ref = reference.dense_moe(x, ids, w, w1, w2)
    out = bench.grouped_mm_moe(x, ids, w, w1, w2)
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    assert torch.all(out[0] == 0)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 0.01


def _doc(results):
    return {
        "schema": 1,
        "command": "epmoe bench",
        "date": "2026-01-01 00:00:00",
        "device": "NVIDIA H200",
        "versions": {"epmoe": "0.1.0", "torch": "2.11.0"},
        "shape": {"name": "qwen3-30b-a3b", "E": 128, "H": 2048, "I": 768, "K": 8},
        "iters": 20,
        "results": results,
        "notes": ["a note"],
    }


def test_bench_report_from_json(tmp_path):
    """--from-json renders the table and the plot of an earlier run (nothing timed)."""
    pytest.importorskip("matplotlib")
    doc = _doc(
        [
            {"impl": "reference", "T": 32, "ms": 40.0},
            {"impl": "grouped_mm", "T": 32, "ms": 0.5, "graph_ms": 0.46, "rel_err": 0.004},
            {
                "impl": "epmoe",
                "scheme": "fp8",
                "mode": "auto",
                "T": 32,
                "path": "ll",
                "ms": 0.25,
                "graph_ms": 0.2,
                "rel_err": 0.06,
            },
            {"impl": "epmoe", "scheme": "int8", "mode": "ll", "T": 32, "error": "RuntimeError: x"},
            {"impl": "epmoe", "scheme": "bf16", "mode": "ll", "T": 4096, "skipped": "LL above"},
        ]
    )
    src = tmp_path / "in.json"
    src.write_text(json.dumps(doc))
    assert main(["bench", "--from-json", str(src), "--out-dir", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "bench.md").read_text()
    assert "- device: NVIDIA H200" in md and "- versions: epmoe 0.1.0, torch 2.11.0" in md
    assert "| 32 | reference |  | 40.000 |  |  |  |  |" in md
    assert "| 32 | grouped_mm |  | 0.500 | 0.460 | 80.00x |  | 0.0040 |" in md
    # against grouped_mm: graph / graph when both have one
    assert "| 32 | epmoe fp8 auto | ll | 0.250 | 0.200 | 160.00x | 2.30x | 0.0600 |" in md
    assert "| 32 | epmoe int8 ll | | RuntimeError: x |" in md
    assert "| 4096 | epmoe bf16 ll | | LL above |" in md
    assert "note: a note" in md
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
    assert err == ["epmoe bench: needs matplotlib: pip install matplotlib"]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in.json"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--quant", "fp4"], "--quant expected a comma list of bf16, fp8, int8, got 'fp4'"),
        (["--mode", "ht,x"], "--mode expected a comma list of ht, ll, auto, got 'ht,x'"),
        (["--tokens", "0"], "--tokens expected positive token counts, got '0'"),
        (["--", "-k", "permute"], "unrecognized arguments: -k permute"),
    ],
)
def test_bench_rejects_bad_arguments(tmp_path, capsys, argv, message):
    assert main(["bench", "--tiny", "--out-dir", str(tmp_path / "r"), *argv]) == 2
    assert capsys.readouterr().err.strip() == f"epmoe bench: {message}"
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["bench", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert "usage: epmoe" in capsys.readouterr().out
