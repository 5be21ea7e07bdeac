"""``epmoe demo``: the end-to-end expert-parallel MoE job on an embedded model, checked per stage.

The command spawns the local ranks itself: by default 2 gloo processes on CPU (backend ``torch``);
with two or more GPUs and an importable deep_ep, one process per GPU with NCCL and backend
``deepep``. Every rank builds the same global weights (one seed), its own tokens and routing
(seed + rank), then for each mode (``ht``, ``ll``) and each usable quant scheme runs the
:class:`epmoe.EPMoE` layer once with :meth:`~epmoe.EPMoE.record_stages` (HT: quantize -> dispatch
-> permute -> gemm1 -> act -> gemm2 -> unpermute -> combine; LL: ll_dispatch -> [quantize] ->
gemm1 -> act -> gemm2 -> ll_combine; one rank with the local backend runs the layer's local
stages) and checks every recorded stage output against a check that does not reuse the op
(:mod:`epmoe.cli._demo_checks`), and the layer's output against its run without a record,
``reference.quantized_moe`` and ``reference.dense_moe``. The demo runs no chain of its own: it
checks the configuration the layer runs. Rank 0 gathers every rank's results and prints one table
per (mode, scheme) with the worst error over ranks. ``run_demo`` returns False (the command exits
1) on any failed check or crashed rank.

``--selftest-corrupt STAGE`` perturbs that stage's output inside the layer's run (before its check
and before the next stage consumes it), to show that the checks catch a wrong stage.
"""

import argparse
import dataclasses
import math
import os
import sys
import time
from datetime import timedelta
from typing import List, Optional, Sequence, Tuple

import torch

from epmoe import _multiproc, quant
from epmoe.cli import _demo_checks as checks
from epmoe.cli import env
from epmoe.cli._plan import EXPERTS, Plan, default_plan, gpu_count
from epmoe.layer import HT_STAGES, LL_STAGES, LOCAL_LL_STAGES

# Model shape of the demo. H and I are multiples of 128 so that fp8 (1x128 / 128x128 groups) runs.
HIDDEN, INTERMEDIATE, TOP_K, TOKENS = 256, 128, 2, 32  # and EXPERTS (8, from _plan)
# DeepEP's low-latency kernels are compiled for a fixed set of hidden sizes; 2048 is the smallest.
DEEPEP_HIDDEN, DEEPEP_INTERMEDIATE = 2048, 512
MODES = ("ht", "ll")
QUANTS = tuple(quant.SCHEMES)
STAGES = tuple(dict.fromkeys(HT_STAGES + LL_STAGES + ("layer",)))
# --selftest-corrupt also takes the stages only one rank with the local backend runs
CORRUPT_STAGES = STAGES + tuple(s for s in LOCAL_LL_STAGES if s not in STAGES)


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    plan: Plan
    modes: Sequence[str]
    quants: Sequence[str]
    experts: int
    hidden: int
    intermediate: int
    top_k: int
    tokens: int
    seed: int
    worst_case: bool
    corrupt: Optional[str]


# -------------------------------------------------------------------------------------------- ranks
def _inputs(cfg: DemoConfig, rank: int, device: torch.device):
    E, H, inter, K, T = cfg.experts, cfg.hidden, cfg.intermediate, cfg.top_k, cfg.tokens
    g = torch.Generator().manual_seed(cfg.seed)
    w1 = torch.randn(E, 2 * inter, H, generator=g) / math.sqrt(H)
    w2 = torch.randn(E, H, inter, generator=g) / math.sqrt(inter)
    g = torch.Generator().manual_seed(cfg.seed + 1 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices  # K distinct experts per token
    w = torch.softmax(torch.randn(T, K, generator=g), dim=1)
    if T > 0:
        ids[0, K - 1] = -1  # one dropped choice: the -1 path runs on every rank
    return w1, w2, x.to(device), ids.to(device), w.to(device)


def _gather(t: torch.Tensor, world: int) -> torch.Tensor:
    """All ranks' `[T, ...]` tensors concatenated: `[world * T, ...]` (float32 for gloo's sake)."""
    import torch.distributed as dist

    src = t.float() if t.is_floating_point() else t
    parts = [torch.empty_like(src) for _ in range(world)]
    dist.all_gather(parts, src.contiguous())
    return torch.cat(parts)


def _check_layer(cfg: DemoConfig, layer, inp: checks.Inputs, rank: int) -> List[checks.Row]:
    """One (mode, scheme): the layer's recorded run, each stage checked, then the layer's output."""
    chk = checks.Checks(layer.mode, layer.quant, cfg.corrupt)
    with torch.no_grad():
        with layer.record_stages(replace=checks.corrupt_hook(cfg.corrupt)) as rec:
            out = chk.out("layer", layer(inp.x, inp.ids, inp.w))
        # the record first: the probes and the second run may reuse a backend's receive buffers
        (checks.run_ht if layer.mode == "ht" else checks.run_ll)(chk, layer, rec, inp, rank)
        plain = layer(inp.x, inp.ids, inp.w)
    checks.check_layer(chk, out, plain, inp)
    return chk.rows


def _run_rank(rank: int, cfg: DemoConfig) -> List[checks.Row]:
    import torch.distributed as dist

    import epmoe
    from epmoe import reference
    from epmoe.comm import _registry

    device = torch.device("cuda", rank) if cfg.plan.device == "cuda" else torch.device("cpu")
    w1, w2, x, ids, w = _inputs(cfg, rank, device)
    world = cfg.plan.world
    X, IDS, W = _gather(x, world), _gather(ids, world), _gather(w, world)
    w1d, w2d = w1.to(device), w2.to(device)
    dense = reference.dense_moe(x, ids, w, w1d, w2d)
    rows: List[checks.Row] = []
    for mode in cfg.modes:
        for q in cfg.quants:
            qref = reference.quantized_moe(x, ids, w, w1d, w2d, q)
            inp = checks.Inputs(x, ids, w, X, IDS, W, qref, dense)
            layer = epmoe.EPMoE(
                cfg.experts,
                cfg.hidden,
                cfg.intermediate,
                cfg.top_k,
                quant=q,
                mode=mode,
                group=dist.group.WORLD,
                backend=cfg.plan.backend,
                max_tokens_per_rank=cfg.tokens if mode == "ll" else None,
                worst_case=cfg.worst_case,
                device=device,
            )
            try:
                layer.load_weights(w1, w2)
                rows += _check_layer(cfg, layer, inp, rank)
            finally:
                layer.comm.close()
                _registry.unregister(layer.comm_key)
    return rows


def _fmt_err(e: float, tol: float) -> str:
    if not math.isfinite(e):
        return "inf"
    if tol == 0:
        return str(int(e))
    return f"{e:.2e}"


def _report(per_rank: List[List[checks.Row]], cfg: DemoConfig) -> Tuple[bool, str]:
    """Print the per-stage tables (worst error over ranks) and the failures; returns (True when all
    passed, the verdict line without its time: run_demo prints it with the run's wall time)."""
    n = len(per_rank[0])
    if any(len(r) != n for r in per_rank):
        return False, "epmoe demo: ranks ran different checks"
    width = max([len(r.check) for r in per_rank[0]] + [5])
    header = (
        f"{'stage':<12}{'shape (rank 0)':<18}{'dtype':<15}{'check':<{width + 2}}"
        f"{'max err':>9}  {'tol':>8}  ok"
    )
    failed = []
    last = None
    for i in range(n):
        rows = [r[i] for r in per_rank]
        r0 = rows[0]
        worst = max(rows, key=lambda r: r.error if math.isfinite(r.error) else math.inf)
        ok = all(r.ok for r in rows)
        if (r0.mode, r0.quant) != last:
            last = (r0.mode, r0.quant)
            print(f"\n[{r0.mode.upper()} | {r0.quant}]", flush=True)
            print(header)
            print("-" * len(header))
        bad_ranks = [k for k, r in enumerate(rows) if not r.ok]
        mark = "ok" if ok else "FAIL (rank " + ",".join(map(str, bad_ranks)) + ")"
        tol = _fmt_err(r0.tol, r0.tol) if r0.tol else "0"
        print(
            f"{r0.stage:<12}{r0.shape:<18}{r0.dtype:<15}{r0.check:<{width + 2}}"
            f"{_fmt_err(worst.error, r0.tol):>9}  {tol:>8}  {mark}"
        )
        if not ok:
            failed.append(f"{r0.mode}/{r0.quant} {r0.stage}: {r0.check}")
    print()
    for f in failed:
        print(f"  - {f}")
    sys.stdout.flush()
    if failed:
        return False, f"epmoe demo: FAILED {len(failed)} of {n} checks on {cfg.plan.world} ranks"
    return True, f"epmoe demo: all {n} checks passed on {cfg.plan.world} ranks"


def _worker(rank: int, cfg: DemoConfig, port: int, results) -> None:
    import torch.distributed as dist

    if cfg.plan.device == "cpu":
        # the ranks share the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.plan.world))
    else:
        torch.cuda.set_device(rank)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        cfg.plan.dist_backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=cfg.plan.world,
        timeout=timedelta(seconds=300),
    )
    try:
        rows = _run_rank(rank, cfg)
        gathered = [None] * cfg.plan.world if rank == 0 else None
        dist.gather_object(rows, gathered, dst=0)
        if rank == 0:
            results.put(_report(gathered, cfg))
        dist.barrier()
    finally:
        if cfg.plan.backend == "deepep":
            from epmoe.comm.deepep import release_buffers

            release_buffers()  # collective, before the group goes away
        dist.destroy_process_group()


def run_demo(
    world: Optional[int] = None,
    device: Optional[str] = None,
    backend: Optional[str] = None,
    quants: Optional[Sequence[str]] = None,
    modes: Sequence[str] = MODES,
    tokens: int = TOKENS,
    experts: int = EXPERTS,
    hidden: Optional[int] = None,
    intermediate: Optional[int] = None,
    top_k: int = TOP_K,
    seed: int = 0,
    worst_case: bool = False,
    corrupt: Optional[str] = None,
    start_method: str = "spawn",
) -> bool:
    """Spawn the ranks, run every (mode, scheme), print the tables; True when every check passed.

    ``quants=None`` runs every scheme usable on the device (and says why others are skipped);
    ``hidden``/``intermediate`` default to 256/128 (2048/512 with DeepEP, whose LL kernels need a
    supported hidden size). ``corrupt`` names a stage whose output is perturbed (selftest).
    ``start_method="fork"`` (CPU only) starts the ranks without re-importing torch in each: about
    twice as fast on a small machine, but only safe from a process that has not run torch work.
    """
    started = time.perf_counter()  # the verdict reports the whole run: spawn, ranks, exit
    plan = default_plan(device, world, backend, experts)
    err = _validate(plan, experts, top_k, tokens, modes, corrupt)
    if not err and start_method not in ("spawn", "fork"):
        err = f"--start-method expected spawn or fork, got {start_method!r}"
    if not err and start_method == "fork" and plan.device != "cpu":
        err = "--start-method fork expected --device cpu (CUDA cannot be forked), got cuda"
    if err:
        print(f"epmoe demo: {err}", file=sys.stderr)
        return False
    deepep = plan.backend == "deepep"
    hidden = hidden or (DEEPEP_HIDDEN if deepep else HIDDEN)
    intermediate = intermediate or (DEEPEP_INTERMEDIATE if deepep else INTERMEDIATE)
    quants = _pick_quants(quants, plan.device, hidden, intermediate)
    if quants is None:
        return False
    if not quants:
        print("epmoe demo: no usable quant scheme", file=sys.stderr)
        return False
    cfg = DemoConfig(
        plan,
        tuple(modes),
        tuple(quants),
        experts,
        hidden,
        intermediate,
        top_k,
        tokens,
        seed,
        worst_case,
        corrupt,
    )
    print(
        f"epmoe demo: {plan.world} rank(s) on {plan.device}, backend {plan.backend} "
        f"({plan.dist_backend}); E={experts} H={hidden} I={intermediate} top-{top_k}, "
        f"T={tokens} tokens/rank, modes {'/'.join(modes)}, quant {'/'.join(quants)}, "
        f"seed {seed}" + (f", corrupting stage {corrupt!r} (selftest)" if corrupt else ""),
        flush=True,
    )
    result = _spawn(cfg, start_method)
    if result is None:
        return False
    ok, verdict = result
    print(f"{verdict} ({time.perf_counter() - started:.1f} s)", flush=True)
    return ok


def _spawn(cfg: DemoConfig, start_method: str) -> Optional[Tuple[bool, str]]:
    """Run the ranks; rank 0's (passed, verdict), or None when a rank crashed."""
    import torch.multiprocessing as mp

    ctx = mp.get_context(start_method)
    results = ctx.SimpleQueue()
    try:
        mp.start_processes(
            _worker,
            args=(cfg, _multiproc.free_port(), results),
            nprocs=cfg.plan.world,
            join=True,
            start_method=start_method,
        )
    except Exception as e:  # noqa: BLE001 - a crashed rank is a failed demo, reported as such
        print(f"epmoe demo: a rank failed: {e}", file=sys.stderr)
        return None
    if results.empty():
        return None
    return results.get()


def _pick_quants(quants, device: str, hidden: int, intermediate: int) -> Optional[List[str]]:
    """The schemes to run: every usable one when ``quants`` is None (saying why others are
    skipped); None (after printing why) when a requested one cannot run."""
    if quants is None:
        picked = []
        for q in QUANTS:
            st = env.quant_status(q, device)
            if st.ok:
                picked.append(q)
            else:
                print(f"epmoe demo: skipping {q} on {device}: {st.why}")
        quants = picked
    else:
        for q in quants:
            if q not in QUANTS:
                print(
                    f"epmoe demo: --quant expected one of {', '.join(QUANTS)}, got {q!r}",
                    file=sys.stderr,
                )
                return None
            st = env.quant_status(q, device)
            if not st.ok:
                print(f"epmoe demo: {q} cannot run on {device} here: {st.why}", file=sys.stderr)
                return None
    for q in quants:
        m = quant.get(q).size_multiple
        if hidden % m or intermediate % m:
            print(
                f"epmoe demo: {q} needs hidden and intermediate multiples of {m}, got {hidden}, "
                f"{intermediate}",
                file=sys.stderr,
            )
            return None
    return list(quants)


def _validate(plan: Plan, experts, top_k, tokens, modes, corrupt) -> Optional[str]:
    if plan.device not in ("cpu", "cuda"):
        return f"--device expected cpu or cuda, got {plan.device!r}"
    if plan.device == "cuda" and gpu_count() < plan.world:
        return f"--world {plan.world} on cuda needs {plan.world} GPUs, found {gpu_count()}"
    if plan.world < 1:
        return f"--world expected a positive int, got {plan.world}"
    if experts % plan.world:
        return f"--experts expected a multiple of the world size {plan.world}, got {experts}"
    if plan.backend == "local" and plan.world != 1:
        return f"--backend local expected --world 1, got {plan.world}"
    if plan.backend not in ("local", "torch", "deepep"):
        return f"--backend expected local, torch or deepep, got {plan.backend!r}"
    if not 1 <= top_k <= experts:
        return f"--topk expected 1..{experts}, got {top_k}"
    if tokens < 1:
        return f"--tokens expected a positive int, got {tokens}"
    for m in modes:
        if m not in MODES:
            return f"--mode expected ht or ll, got {m!r}"
    if corrupt is not None and corrupt not in CORRUPT_STAGES:
        return f"--selftest-corrupt expected one of {', '.join(CORRUPT_STAGES)}, got {corrupt!r}"
    return None


def _csv(s: str) -> List[str]:
    return [p.strip() for p in s.split(",") if p.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--world",
        type=int,
        default=None,
        help="ranks to spawn (default: 2 on CPU; one per GPU with DeepEP)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="default: cuda with >= 2 GPUs and deep_ep importable, else cpu",
    )
    p.add_argument(
        "--backend",
        choices=("local", "torch", "deepep"),
        default=None,
        help="EPMoE comm backend (default: deepep on GPUs, torch on CPU)",
    )
    p.add_argument(
        "--quant",
        type=_csv,
        default=None,
        help="comma list of bf16,fp8,int8 (default: every scheme usable here)",
    )
    p.add_argument("--mode", type=_csv, default=list(MODES), help="comma list of ht,ll")
    p.add_argument("--tokens", type=int, default=TOKENS, help="tokens per rank")
    p.add_argument("--experts", type=int, default=EXPERTS, help="global experts")
    p.add_argument("--hidden", type=int, default=None, help="H (default 256; 2048 with DeepEP)")
    p.add_argument(
        "--intermediate", type=int, default=None, help="I (default 128; 512 with DeepEP)"
    )
    p.add_argument("--topk", type=int, default=TOP_K, help="experts per token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--worst-case",
        action="store_true",
        help="HT dispatch with the static worst-case receive size",
    )
    p.add_argument(
        "--selftest-corrupt",
        metavar="STAGE",
        default=None,
        choices=CORRUPT_STAGES,
        help="perturb this stage's output to show the checks catch it (exits 1)",
    )
    p.add_argument(
        "--start-method",
        choices=("spawn", "fork"),
        default="spawn",
        help="how ranks start; fork (CPU only) skips re-importing torch per rank",
    )


def main(args: argparse.Namespace) -> int:
    ok = run_demo(
        world=args.world,
        device=args.device,
        backend=args.backend,
        quants=args.quant,
        modes=args.mode,
        tokens=args.tokens,
        experts=args.experts,
        hidden=args.hidden,
        intermediate=args.intermediate,
        top_k=args.topk,
        seed=args.seed,
        worst_case=args.worst_case,
        corrupt=args.selftest_corrupt,
        start_method=args.start_method,
    )
    return 0 if ok else 1


__all__ = ["Plan", "default_plan", "run_demo", "add_arguments", "main", "STAGES"]
