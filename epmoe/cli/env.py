"""``epmoe env``: one screen that says what will run on this machine, and why not when not.

Reports the versions of torch / triton / deep_ep / deep_gemm (or the install hint of
:mod:`epmoe._deps`), Python, the GPUs with their compute capability, peer access between them (what
DeepEP's intranode kernels need; NVLink link counts when ``pynvml`` is installed), and which
communication backends and quantization schemes are usable. Never fails on a CPU-only machine: every
probe catches its own errors and reports them as a reason.
"""

import functools
import importlib
import importlib.metadata
import importlib.util
import platform
import sys
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from epmoe import quant
from epmoe.cli import _plan

# Hopper is the oldest architecture DeepGEMM's grouped GEMMs (bf16 and fp8) support.
DEEP_GEMM_MIN_CC = (9, 0)
# Top-level module -> pip distributions that may provide it (prebuilt wheels first).
_DISTS = {
    "torch": ("torch",),
    "triton": ("triton", "pytorch-triton"),
    "deep_ep": ("tokenspeed-deepep", "deep_ep", "deep-ep"),
    "deep_gemm": ("tokenspeed-deepgemm", "deep_gemm", "deep-gemm"),
}


class Status(NamedTuple):
    ok: bool
    why: str


class Package(NamedTuple):
    name: str
    version: Optional[str]  # installed distribution version, None when not installed
    dist: Optional[str]  # the distribution that provides it
    importable: bool
    why: str  # install hint or import error when not importable


class Gpu(NamedTuple):
    index: int
    name: str
    cc: Tuple[int, int]
    mem_gib: float
    nvlinks: Optional[int]  # active NVLink links, None when unknown


def _dist_version(module: str) -> Tuple[Optional[str], Optional[str]]:
    candidates = list(_DISTS.get(module, ()))
    try:
        candidates += importlib.metadata.packages_distributions().get(module, [])
    except Exception:  # noqa: BLE001 - broken metadata must not break `env`
        pass
    for dist in candidates:
        try:
            return importlib.metadata.version(dist), dist
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


@functools.cache
def package(name: str) -> Package:
    """Probe one package without letting a broken install raise.

    deep_ep / deep_gemm are imported (through :mod:`epmoe._deps`, so the hint is the library's own)
    only when their spec is found; torch and triton are only looked up.
    """
    version, dist = _dist_version(name)
    if name in ("deep_ep", "deep_gemm"):
        from epmoe import _deps

        try:
            getattr(_deps, name)()
        except ImportError as e:
            if importlib.util.find_spec(name) is None:
                return Package(name, version, dist, False, str(e))
            cause = e.__cause__ or e
            return Package(name, version, dist, False, f"installed but import failed: {cause}")
        except Exception as e:  # noqa: BLE001 - e.g. OSError for a missing libcuda / nvshmem
            return Package(name, version, dist, False, f"installed but import failed: {e!r}")
        return Package(name, version, dist, True, "")
    if name == "torch":
        return Package(name, torch.__version__, dist, True, "")
    if importlib.util.find_spec(name) is None:
        return Package(name, version, dist, False, f"{name} is not installed: pip install {name}")
    return Package(name, version, dist, True, "")


def _nvlinks(index: int) -> Optional[int]:
    if importlib.util.find_spec("pynvml") is None:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            up = 0
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    state = pynvml.nvmlDeviceGetNvLinkState(h, link)
                    up += int(state == pynvml.NVML_FEATURE_ENABLED)
                except pynvml.NVMLError:
                    break
            return up
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVML is optional information
        return None


def cuda_status() -> Status:
    """Whether torch can use a CUDA device here, and why not."""
    if torch.version.cuda is None:
        return Status(False, f"torch {torch.__version__} is a CPU-only build")
    try:
        if not torch.cuda.is_available():
            return Status(
                False, "no CUDA device visible (no driver, or CUDA_VISIBLE_DEVICES hides them)"
            )
    except Exception as e:  # noqa: BLE001
        return Status(False, f"CUDA init failed: {e!r}")
    return Status(True, f"CUDA {torch.version.cuda}")


@functools.cache
def gpus() -> Tuple[Gpu, ...]:
    if not cuda_status().ok:
        return ()
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(Gpu(i, p.name, (p.major, p.minor), p.total_memory / 2**30, _nvlinks(i)))
    return tuple(out)


@functools.cache
def peer_access() -> Dict[Tuple[int, int], bool]:
    """(i, j) -> torch.cuda.can_device_access_peer(i, j) for every ordered pair of GPUs."""
    n = len(gpus())
    out = {}
    for i in range(n):
        for j in range(n):
            if i != j:
                try:
                    out[(i, j)] = bool(torch.cuda.can_device_access_peer(i, j))
                except Exception:  # noqa: BLE001
                    out[(i, j)] = False
    return out


def comm_backends() -> List[Tuple[str, Status]]:
    """(backend, status) for local, torch/gloo, torch/nccl and deepep."""
    dist = torch.distributed
    out = [("local", Status(True, "one rank, no communication"))]
    if not dist.is_available():
        no = Status(False, "torch was built without torch.distributed")
        return out + [("torch (gloo)", no), ("torch (nccl)", no), ("deepep", no)]
    if dist.is_gloo_available():
        out.append(("torch (gloo)", Status(True, "CPU processes, all_to_all_single")))
    else:
        out.append(("torch (gloo)", Status(False, "torch was built without gloo")))
    cuda = cuda_status()
    if not dist.is_nccl_available():
        out.append(("torch (nccl)", Status(False, "torch was built without NCCL")))
    elif not cuda.ok:
        out.append(("torch (nccl)", Status(False, cuda.why)))
    else:
        out.append(("torch (nccl)", Status(True, f"{len(gpus())} GPU(s), all_to_all_single")))
    out.append(("deepep", deepep_status()))
    return out


def _pkg_reason(name: str) -> Optional[str]:
    p = package(name)
    if p.importable:
        return None
    if importlib.util.find_spec(name) is None:
        return f"{name} not installed (see packages)"
    return f"{name} {p.why}"


@functools.cache
def deepep_status() -> Status:
    """DeepEP needs CUDA, >= 2 GPUs with peer access, deep_ep and epmoe's deepep backend."""
    why = []
    cuda = cuda_status()
    if not cuda.ok:
        why.append(cuda.why)
    elif len(gpus()) < 2:
        why.append(f"needs >= 2 GPUs on this host, found {len(gpus())}")
    else:
        missing = [f"{i}->{j}" for (i, j), ok in peer_access().items() if not ok]
        if missing:
            why.append("no peer access between GPUs " + ", ".join(missing))
    pkg = _pkg_reason("deep_ep")
    if pkg:
        why.append(pkg)
    if importlib.util.find_spec("epmoe.comm.deepep") is None:
        why.append("this epmoe build has no epmoe.comm.deepep backend")
    if why:
        return Status(False, "; ".join(why))
    return Status(
        True, f"deep_ep {package('deep_ep').version or '?'}, {len(gpus())} GPUs with peer access"
    )


def quant_status(scheme, device: str) -> Status:
    """Whether ``scheme`` ("bf16", "fp8", "int8" or a QuantScheme) runs on ``device`` ("cpu" or
    "cuda") here.

    CPU runs every scheme through the reference kernels. On CUDA, bf16 and fp8 use DeepGEMM's
    grouped GEMMs (compute capability >= 9.0), int8 uses Triton kernels.
    """
    scheme = quant.get(scheme, "quant_status", "scheme")
    if device == "cpu":
        return Status(True, "reference kernels")
    why = []
    cuda = cuda_status()
    if not cuda.ok:
        why.append(cuda.why)
    if scheme is quant.INT8:
        pkg = _pkg_reason("triton")
        if pkg:
            why.append(pkg)
        return Status(False, "; ".join(why)) if why else Status(True, "Triton kernels")
    if cuda.ok:
        cc = min(g.cc for g in gpus())
        if cc < DEEP_GEMM_MIN_CC:
            need = ".".join(map(str, DEEP_GEMM_MIN_CC))
            why.append(
                f"deep_gemm needs compute capability >= {need} (sm90), found {cc[0]}.{cc[1]}"
            )
    pkg = _pkg_reason("deep_gemm")
    if pkg:
        why.append(pkg)
    if why:
        return Status(False, "; ".join(why))
    cc = min(g.cc for g in gpus())
    return Status(True, f"deep_gemm {scheme} grouped GEMM (sm{cc[0]}{cc[1]})")


def _line(label: str, st: Status, width: int = 14) -> str:
    return f"  {label:<{width}}{'yes' if st.ok else 'no '}  {st.why}"


def render() -> str:
    """The whole ``epmoe env`` screen as text."""
    import epmoe

    lines = [
        f"epmoe {epmoe.__version__}  ({epmoe.__file__.rsplit('/', 2)[0]})",
        f"python {platform.python_version()}  ({sys.executable})  {platform.system()} "
        f"{platform.machine()}",
        "",
        "packages",
    ]
    for name in ("torch", "triton", "deep_ep", "deep_gemm"):
        p = package(name)
        if name == "torch":
            extra = f"  (CUDA {torch.version.cuda})" if torch.version.cuda else "  (CPU build)"
            lines.append(f"  {name:<14}{p.version}{extra}")
        elif p.importable:
            lines.append(
                f"  {name:<14}{p.version or 'version unknown'}"
                + (f"  ({p.dist})" if p.dist and p.dist != name else "")
            )
        else:
            ver = f"{p.version} " if p.version else ""
            lines.append(f"  {name:<14}{ver}missing: {p.why}")
    lines += ["", "GPUs"]
    cuda = cuda_status()
    if not cuda.ok:
        lines.append(f"  none: {cuda.why}")
    else:
        for g in gpus():
            link = "" if g.nvlinks is None else f", {g.nvlinks} NVLink links up"
            lines.append(
                f"  cuda:{g.index}  {g.name}  compute capability {g.cc[0]}.{g.cc[1]}  "
                f"{g.mem_gib:.0f} GiB{link}"
            )
        peers = peer_access()
        if peers:
            ok = sum(peers.values())
            nv = (
                ""
                if any(g.nvlinks is not None for g in gpus())
                else " (NVLink state unknown: pip install nvidia-ml-py to show links)"
            )
            lines.append(
                f"  peer access (torch.cuda.can_device_access_peer): {ok}/{len(peers)} pairs{nv}"
            )
            bad = [f"{i}->{j}" for (i, j), v in peers.items() if not v]
            if bad:
                lines.append("  no peer access: " + ", ".join(bad))
    lines += ["", "comm backends"]
    lines += [_line(name, st) for name, st in comm_backends()]
    lines += ["", "quant schemes"]
    for scheme in quant.SCHEMES.values():
        for i, dev in enumerate(("cpu", "cuda")):
            st = quant_status(scheme, dev)
            name = scheme.name if i == 0 else ""
            lines.append(f"  {name:<6}{dev:<6}{'yes' if st.ok else 'no '}  {st.why}")
    plan = _plan.default_plan()
    lines += [
        "",
        f"`epmoe demo` here: {plan.world} {plan.dist_backend} rank(s) on {plan.device}, "
        f"backend {plan.backend}",
    ]
    return "\n".join(lines)


def main(args=None) -> int:
    print(render())
    return 0
