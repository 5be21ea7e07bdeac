"""``epmoe bench``: run the pytest-benchmark suite and write a JSON, markdown and PNG report.

Runs ``pytest benchmarks/`` (the stage and end-to-end benchmarks; ``--tiny`` runs only the tiny
CPU shape of ``benchmarks/test_bench_cpu.py``) with pytest's output streamed as progress, then
writes into ``--out-dir`` (default ``benchmarks/results/<date>``):

- ``bench.json``: pytest-benchmark's JSON (``--benchmark-json``),
- ``bench.md``: one table row per benchmark (median, IQR, rounds, achieved GB/s or TFLOP/s and the
  ceiling measured in the same run with its percentage, when the benchmark reports them),
- ``bench.png``: achieved bandwidth / TFLOP/s per benchmark against its ceiling, plus median times.

Benchmarks report metrics through ``benchmark.extra_info``: ``gbps`` / ``tflops`` (achieved) and
``ceiling_gbps`` / ``ceiling_tflops`` (HBM copy, raw DeepGEMM, raw DeepEP, ... measured in the run).
``--from-json FILE`` re-renders the markdown and PNG of an earlier run without running anything.
Arguments after ``--`` go to pytest unchanged.
"""

import argparse
import datetime
import importlib
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

TINY_FILE = "test_bench_cpu.py"
# The tiny CPU run is a smoke of the suite and its report, not a measurement: keep it short.
TINY_PYTEST_ARGS = (
    "--benchmark-max-time=0.05",
    "--benchmark-min-rounds=3",
    "--benchmark-warmup=off",
)
# (achieved keys, ceiling keys, unit) read from extra_info, first key present wins. The ceiling_*
# keys are the convention; the others are what the GPU benchmarks name their same-run baselines.
METRICS = (
    (("gbps", "weight_gbps", "achieved_gbps"), ("ceiling_gbps", "copy_gbps", "hbm_gbps"), "GB/s"),
    (("tflops",), ("ceiling_tflops", "raw_tflops"), "TFLOP/s"),
)


# What the report needs beyond the core install (module, pip name), checked before writing a file
REPORT_PACKAGES = (("matplotlib", "matplotlib"), ("pytest_benchmark", "pytest-benchmark"))


def missing_packages(modules: Sequence[Tuple[str, str]] = REPORT_PACKAGES) -> List[str]:
    """pip names of the report's packages that do not import here."""
    missing = []
    for module, pip_name in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(pip_name)
    return missing


def _check_packages(modules: Sequence[Tuple[str, str]] = REPORT_PACKAGES) -> bool:
    """Print one line naming the pip command when a package is missing; True when all import."""
    missing = missing_packages(modules)
    if missing:
        print(
            f'epmoe bench: needs {", ".join(missing)}: pip install -e ".[bench]" '
            f"(or pip install {' '.join(missing)})",
            file=sys.stderr,
        )
    return not missing


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def find_bench_dir(explicit: Optional[str] = None) -> Optional[Path]:
    """``--bench-dir``, else ``./benchmarks``, else the source checkout's ``benchmarks/``."""
    for cand in (
        [Path(explicit)] if explicit else [Path.cwd() / "benchmarks", repo_root() / "benchmarks"]
    ):
        if cand.is_dir():
            return cand.resolve()
    return None


# ------------------------------------------------------------------------------------------ report
def _fmt_time(sec: float) -> str:
    for unit, f in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if sec >= f:
            return f"{sec / f:.3g} {unit}"
    return f"{sec / 1e-9:.3g} ns"


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _metric(b: dict) -> Optional[Tuple[str, float, Optional[float]]]:
    """(unit, achieved, ceiling or None) of a benchmark, or None when it reports no rate.

    A rate with a ceiling is preferred over one without (a decode GEMM reports both TFLOP/s and the
    weight bandwidth it achieves against the copy ceiling: the bandwidth is the one that matters).
    """
    info = b.get("extra_info") or {}

    def first(keys):
        return next((float(info[k]) for k in keys if isinstance(info.get(k), (int, float))), None)

    found = []
    for achieved, ceiling, unit in METRICS:
        a = first(achieved)
        if a is not None:
            found.append((unit, a, first(ceiling)))
    with_ceiling = [m for m in found if m[2]]
    return (with_ceiling or found or [None])[0]


def _label(b: dict) -> str:
    name = b.get("name", "?")
    return name[5:] if name.startswith("test_") else name


def _benchmarks(data: dict) -> List[dict]:
    return [b for b in data.get("benchmarks", []) if b.get("stats")]


def render_markdown(data: dict, command: str, gpu: Optional[str] = None) -> str:
    """The markdown report of a pytest-benchmark JSON document.

    ``gpu`` names the GPUs of the run; by default the ``gpu`` entries of the benchmarks' extra_info.
    """
    mi = data.get("machine_info") or {}
    ci = data.get("commit_info") or {}
    cpu = (mi.get("cpu") or {}).get("brand_raw") or mi.get("processor") or "?"
    gpu = gpu or ", ".join(
        sorted(
            {
                str((b.get("extra_info") or {}).get("gpu"))
                for b in _benchmarks(data)
                if (b.get("extra_info") or {}).get("gpu")
            }
        )
    )
    commit = (ci.get("id") or "?")[:10] + (" (dirty)" if ci.get("dirty") else "")
    lines = [
        "# epmoe benchmarks",
        "",
        f"- date: {data.get('datetime', '?')}",
        f"- command: `{command}`",
        f"- machine: {mi.get('node', '?')}, CPU {cpu}" + (f", GPU {gpu}" if gpu else ""),
        f"- python {mi.get('python_version', '?')}, commit {commit}",
        "",
        "| group | benchmark | median | IQR | rounds | achieved | ceiling | % of ceiling |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for b in _benchmarks(data):
        s = b["stats"]
        m = _metric(b)
        ach = ceil = pct = ""
        if m:
            unit, a, c = m
            ach = f"{_num(a)} {unit}"
            if c:
                ceil, pct = f"{_num(c)} {unit}", f"{100 * a / c:.0f}%"
        lines.append(
            f"| {b.get('group') or ''} | `{_label(b)}` | {_fmt_time(s['median'])} | "
            f"{_fmt_time(s['iqr'])} | {s['rounds']} | {ach} | {ceil} | {pct} |"
        )
    if not _benchmarks(data):
        lines.append("| | (no benchmark ran) | | | | | | |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    """PNG: achieved rate vs ceiling per benchmark (one panel per unit) and median times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = _benchmarks(data)
    panels = []
    for *_, unit in METRICS:
        rows = [(b, _metric(b)) for b in benches]
        rows = [(b, m) for b, m in rows if m and m[0] == unit]
        if rows:
            panels.append((unit, rows))
    panels.append(("time", [(b, None) for b in benches]))
    heights = [max(1.5, 0.35 * len(rows) + 1.0) for _, rows in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(10, sum(heights)),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for ax, (unit, rows) in zip(axes[:, 0], panels, strict=True):
        labels = [_label(b) for b, _ in rows]
        ys = range(len(rows))
        if unit == "time":
            med = [b["stats"]["median"] * 1e6 for b, _ in rows]
            iqr = [b["stats"]["iqr"] * 1e6 / 2 for b, _ in rows]
            ax.barh(ys, med, xerr=iqr, color="tab:blue", alpha=0.8)
            ax.set_xlabel("median time [us] (error bar: IQR)")
            if med and min(med) > 0 and max(med) / min(med) > 100:
                ax.set_xscale("log")
            ax.set_title("median time per benchmark")
        else:
            ach = [m[1] for _, m in rows]
            ceil = [m[2] if m[2] else math.nan for _, m in rows]
            ax.barh(
                ys, ceil, color="none", edgecolor="gray", hatch="//", label="ceiling (same run)"
            )
            ax.barh(ys, ach, color="tab:green", alpha=0.85, label="achieved")
            for y, a, c in zip(ys, ach, ceil, strict=True):
                if c == c and c > 0:
                    ax.text(a, y, f" {100 * a / c:.0f}%", va="center", fontsize=8)
            ax.set_xlabel(unit)
            ax.set_title(f"achieved {unit} vs ceiling")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_yticks(list(ys))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    if not benches:
        axes[-1, 0].text(
            0.5, 0.5, "no benchmark ran", ha="center", va="center", transform=axes[-1, 0].transAxes
        )
    fig.suptitle(f"epmoe benchmarks {data.get('datetime', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _local_gpus() -> Optional[str]:
    from epmoe.cli import env

    names = [g.name for g in env.gpus()]
    return f"{len(names)}x {names[0]}" if names else None


def write_report(
    json_path: Path, out_dir: Path, command: str, gpu: Optional[str] = None
) -> Tuple[Path, Path]:
    """Write ``bench.md`` and ``bench.png`` for ``json_path`` into ``out_dir``."""
    data = json.loads(Path(json_path).read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    md, png = out_dir / "bench.md", out_dir / "bench.png"
    md.write_text(render_markdown(data, command, gpu))
    plot(data, png)
    return md, png


# --------------------------------------------------------------------------------------------- run
def run_bench(
    filter: Optional[str] = None,
    out_dir: Optional[str] = None,
    tiny: bool = False,
    bench_dir: Optional[str] = None,
    pytest_args: Sequence[str] = (),
    command: str = "epmoe bench",
) -> int:
    """Run the suite (streaming pytest's output), then write the report; returns pytest's code."""
    if not _check_packages():
        return 2
    bdir = find_bench_dir(bench_dir)
    if bdir is None:
        print(
            "epmoe bench: no benchmarks/ directory (run from a source checkout or pass "
            "--bench-dir)",
            file=sys.stderr,
        )
        return 2
    target = bdir / TINY_FILE if tiny else bdir
    if not target.exists():
        print(f"epmoe bench: {target} does not exist", file=sys.stderr)
        return 2
    out = Path(out_dir) if out_dir else bdir / "results" / datetime.date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "bench.json"
    if json_path.exists():
        json_path.unlink()  # never report a stale run
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(target),
        "-v",
        "-p",
        "no:cacheprovider",
        "--benchmark-enable",
        f"--benchmark-json={json_path}",
        "--benchmark-columns=median,iqr,rounds",
        "--benchmark-sort=fullname",
    ]
    if tiny:
        cmd += list(TINY_PYTEST_ARGS)
    if filter:
        cmd += ["-k", filter]
    cmd += list(pytest_args)
    print("epmoe bench: " + shlex.join(cmd), flush=True)
    # pytest runs from the checkout root so that its configuration (markers, rootdir) applies.
    rc = subprocess.call(cmd, cwd=bdir.parent, env=os.environ.copy())
    if not json_path.exists():
        print(f"epmoe bench: pytest exited {rc} without writing {json_path}", file=sys.stderr)
        return rc or 1
    md, png = write_report(json_path, out, command, _local_gpus())
    print(f"epmoe bench: wrote {json_path}, {md}, {png}", flush=True)
    return rc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-k", "--filter", default=None, help="pytest -k expression")
    p.add_argument(
        "--out-dir", default=None, help="report directory (default: benchmarks/results/<date>)"
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help=f"only the tiny CPU shape (benchmarks/{TINY_FILE}), short timing",
    )
    p.add_argument("--bench-dir", default=None, help="benchmarks directory (default: ./benchmarks)")
    p.add_argument(
        "--from-json",
        default=None,
        metavar="FILE",
        help="only render bench.md / bench.png from an existing JSON",
    )


def main(args: argparse.Namespace, extra: Sequence[str] = ()) -> int:
    extra = list(extra)
    if extra and extra[0] == "--":
        extra = extra[1:]
    command = "epmoe " + shlex.join(getattr(args, "argv", None) or ["bench"])
    if args.from_json:
        if not _check_packages(REPORT_PACKAGES[:1]):
            return 2
        src = Path(args.from_json)
        md, png = write_report(src, Path(args.out_dir) if args.out_dir else src.parent, command)
        print(f"epmoe bench: wrote {md}, {png}")
        return 0
    return run_bench(args.filter, args.out_dir, args.tiny, args.bench_dir, extra, command)
