"""Launch-parameter sweep of the local-stage Triton kernels at workload W (one GPU).

Times each stage (CUDA-graph replay, L2 flushed by a read, median of 100; benchmarks/_timing) for
a set of values of the stage's launch config fields (``CONFIG`` of each epmoe.ops stage module,
changed for a point with the module's ``override(**fields)``), and prints / appends one JSON
line per point: {"stage", "params", "us", "gbps"} (with --device also "device_us", the kernels'
span). Used to choose the defaults in epmoe/ops; not a test.

  PYTHONPATH=.:benchmarks python3 scripts/stage_sweep.py --out sweep.jsonl [--only permute,...]

With --profile, each stage's default point also gets a kernel breakdown: the device time of every
kernel of one call (torch.profiler over graph replays, L2 flushed between them), {"stage",
"kernels": {name: us}, "timeline": {kernel: [start, end]}}, to tell the kernels' own time from
the gaps between dependent launches.
"""

import argparse
import contextlib
import functools
import importlib
import itertools
import json
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
import _bytes  # noqa: E402
import _configs  # noqa: E402
import _timing  # noqa: E402

from epmoe import _eager, reference  # noqa: E402

Q = importlib.import_module("epmoe.ops.quantize")
A = importlib.import_module("epmoe.ops.activation")
P = importlib.import_module("epmoe.ops.permute")
PK = importlib.import_module("epmoe.ops._permute_kernels")
U = importlib.import_module("epmoe.ops.unpermute")
CFG = _configs.CONFIGS["W"]


def grid(**axes):
    keys = list(axes)
    return [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*axes.values())]


@functools.cache
def data():
    gen = torch.Generator().manual_seed(0)
    M, H, I, E, T = CFG.prefill_tokens, CFG.hidden, CFG.intermediate, CFG.local_experts, 256
    ids = _configs.received_routing(CFG, M, gen).cuda()
    x = torch.randn((M, H), generator=gen).to(torch.bfloat16).cuda()
    p = _eager.run(
        P._permute_triton, torch.empty((M, 16), dtype=torch.uint8, device="cuda"), ids, E, 128
    )
    m_idx, inv, offs = p[2], p[3], p[4]
    y = torch.randn((m_idx.numel(), 2 * I), generator=gen).to(torch.bfloat16).cuda()
    x3 = torch.randn((E, T, H), generator=gen).to(torch.bfloat16).cuda()
    y3 = torch.randn((E, T, 2 * I), generator=gen).to(torch.bfloat16).cuda()
    mm = _configs.decode_masked_m(CFG, gen).cuda()
    yo = torch.randn((m_idx.numel(), H), generator=gen).to(torch.bfloat16).cuda()
    w = torch.rand(ids.shape, generator=gen).cuda()
    return dict(ids=ids, x=x, m_idx=m_idx, inv=inv, offs=offs, y=y, x3=x3, y3=y3, mm=mm, yo=yo, w=w)


@triton.jit
def _scatter_rows_kernel(x_ptr, inv_ptr, out_ptr, H, SRC_ROWS, K: tl.constexpr,
                         K_PAD: tl.constexpr, BLOCK_H: tl.constexpr, LOAD_POLICY: tl.constexpr,
                         STORE_CACHE: tl.constexpr):  # fmt: skip
    """Column chunk program_id(1) of row program_id(0) of x (row t % SRC_ROWS) to its rows in
    inv_perm (-1: none)."""
    t = tl.program_id(0)
    kk = tl.arange(0, K_PAD)
    rows = tl.load(inv_ptr + t * K + kk, mask=kk < K, other=-1)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_live = tl.where(tl.max(rows, axis=0) >= 0, H, 0)
    v = tl.load(x_ptr + (t % SRC_ROWS).to(tl.int64) * H + cols, mask=cols < h_live,
                eviction_policy=LOAD_POLICY)  # fmt: skip
    PK._store_rows(out_ptr, rows, v, cols, H, K, K_PAD, STORE_CACHE)


@triton.jit
def _write_rows_kernel(inv_ptr, out_ptr, H, K: tl.constexpr, K_PAD: tl.constexpr,
                       BLOCK_H: tl.constexpr, STORE_CACHE: tl.constexpr):  # fmt: skip
    """_scatter_rows_kernel's stores alone (zeros, nothing read but inv_perm)."""
    t = tl.program_id(0)
    kk = tl.arange(0, K_PAD)
    rows = tl.load(inv_ptr + t * K + kk, mask=kk < K, other=-1)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    v = tl.zeros([BLOCK_H], dtype=out_ptr.dtype.element_ty)
    PK._store_rows(out_ptr, rows, v, cols, H, K, K_PAD, STORE_CACHE)


def scatter_rows(x, inv, out, write_only=False, src_rows=0):
    """x `[M, H]` (contiguous) rows to out's rows inv `[M, K]` (int32, -1: none), with permute's
    copy launch config; src_rows > 0: token t reads row t % src_rows (a source the L2 holds)."""
    M, H = x.shape
    K = inv.shape[1]
    cfg = P.CONFIG
    block_h = min(triton.next_power_of_2(H), max(16, cfg.copy_bytes // x.element_size()))
    grid = (M, triton.cdiv(H, block_h))
    meta = dict(
        K=K,
        K_PAD=triton.next_power_of_2(K),
        BLOCK_H=block_h,
        num_warps=cfg.copy_warps,
        STORE_CACHE=cfg.store_cache,
    )
    if write_only:
        _write_rows_kernel[grid](inv, out, H, **meta)
    else:
        _scatter_rows_kernel[grid](x, inv, out, H, src_rows or M, LOAD_POLICY=cfg.load_policy,
                                   **meta)  # fmt: skip
    return out


def source_rows(inv, m_sum):
    """int32 [m_sum]: the token each row of inv_perm comes from, -1 for none."""
    src = torch.full((m_sum,), -1, dtype=torch.int32, device=inv.device)
    live = inv >= 0
    tok = torch.arange(inv.shape[0], device=inv.device, dtype=torch.int32)[:, None]
    src[inv[live].long()] = tok.expand_as(inv)[live]
    return src


def rest_kernel(x8, s8, ids, inv, src, out, outs, chunks=True, scales=True):
    """permute's second kernel on fp8 rows (DeepGEMM-layout scales) alone, its inputs given:
    column chunk 1 of every token's row to its rows in inv_perm (chunks) and the row-block scale
    copy from the rows' source tokens src (scales), launched as permute launches it; PDL off
    (nothing runs before it)."""
    cfg = P.CONFIG
    block_h = min(triton.next_power_of_2(x8.shape[1]), max(16, cfg.copy_bytes // x8.element_size()))
    n_rest = triton.cdiv(x8.shape[1], block_h) - 1 if chunks else 0
    ids_used = ids if chunks else ids[:0]  # (no chunk programs: no tokens)
    P._launch_rest(x8, s8, ids_used, inv, src, out, outs, CFG.local_experts, block_h,
                   max(n_rest, 0), scales, dict(PDL=False), cfg)  # fmt: skip
    return out


def contiguous_rows(inv):
    """inv_perm's live entries renumbered in (t, k) order: the same copies to consecutive rows."""
    live = inv >= 0
    rows = torch.cumsum(live.flatten().to(torch.int32), 0).view(inv.shape) - 1
    return torch.where(live, rows, -1).to(torch.int32)


def count(t):
    return int(t.sum().item())


def cases():
    d = data()
    M, H, I, E = CFG.prefill_tokens, CFG.hidden, CFG.intermediate, CFG.local_experts
    live = count(d["m_idx"] >= 0)
    dec = count(d["mm"].clamp(max=256))
    srcs = count((d["ids"] >= 0).any(dim=1))
    copies = count(d["ids"] >= 0)
    fp8 = reference.quantize(d["x"], "fp8")
    i8 = reference.quantize(d["x"], "int8")
    qb = functools.partial(_bytes.quant_bytes, in_size=2, group=128)  # quantize of bf16
    sb = functools.partial(_bytes.quant_bytes, width=I, in_size=4, group=128)  # gate and up
    out = []
    for scheme in ("fp8", "int8"):
        out.append(
            (
                f"quantize_prefill_{scheme}",
                Q,
                qb(M, H, scheme=scheme),
                lambda s=scheme: Q._quantize_triton(
                    d["x"], s, 128, None, "deepgemm" if s == "fp8" else "row"
                ),
            )
        )
        out.append(
            (
                f"quantize_decode_{scheme}",
                Q,
                qb(dec, H, scheme=scheme),
                lambda s=scheme: Q._quantize_triton(
                    d["x3"], s, 128, d["mm"], "deepgemm" if s == "fp8" else "row"
                ),
            )
        )
        out.append(
            (
                f"silu_quant_prefill_{scheme}",
                A,
                sb(live, scheme=scheme) + 4 * d["m_idx"].numel(),
                lambda s=scheme: A._silu_and_mul_quant_triton(
                    d["y"],
                    s,
                    None,
                    128,
                    d["m_idx"],
                    "deepgemm" if s == "fp8" else "row",
                    d["offs"],
                ),
            )
        )
        out.append(
            (
                f"silu_quant_decode_{scheme}",
                A,
                sb(dec, scheme=scheme),
                lambda s=scheme: A._silu_and_mul_quant_triton(
                    d["y3"], s, d["mm"], 128, None, "deepgemm" if s == "fp8" else "row"
                ),
            )
        )
    for name, (xx, ss, layout) in {
        "bf16": (d["x"], None, "row"),
        "fp8": (*fp8, "deepgemm"),
        "int8": (*i8, "row"),
    }.items():
        S = 0 if ss is None else ss.shape[1]
        row = H * xx.element_size() + 4 * S
        m_sum = d["m_idx"].numel()
        ids = d["ids"]
        nbytes = _bytes.permute_bytes(srcs, copies, ids.numel(), ids.element_size(), row, m_sum, E)
        out.append(
            (
                f"permute_prefill_{name}",
                P,
                nbytes,
                lambda xx=xx, ss=ss, lay=layout: P._permute_triton(xx, d["ids"], E, 128, ss, lay),
            )
        )
    # silu diagnosis: the same work without m_indices (all M_sum rows live), on the live rows
    # packed, unfused silu_and_mul, and quantize of its output
    yl = d["y"][:live]
    hl = torch.empty((live, I), dtype=torch.bfloat16, device="cuda")
    out += [
        ("diag_silu_quant_all_rows", A, sb(d["m_idx"].numel(), scheme="fp8"),
         lambda: A._silu_and_mul_quant_triton(d["y"], "fp8", None, 128, None, "deepgemm")),
        ("diag_silu_quant_packed", A, sb(live, scheme="fp8"),
         lambda: A._silu_and_mul_quant_triton(yl, "fp8", None, 128, None, "deepgemm")),
        ("diag_silu_only_m_idx", A, live * 6 * I + 4 * d["m_idx"].numel(),
         lambda: A._silu_and_mul_triton(d["y"], None, d["m_idx"])),
        ("diag_quantize_h", Q, qb(live, I, scheme="fp8"),
         lambda: Q._quantize_triton(hl, "fp8", 128, None, "deepgemm")),
    ]  # fmt: skip
    dec_ids = d["ids"][:256]
    dsrc, dcop = count((dec_ids >= 0).any(dim=1)), count(dec_ids >= 0)
    row8 = H + 4 * (H // 128)
    m_dec = reference.permuted_rows(256, CFG.top_k, E, 128)
    out.append((
        "permute_decode_fp8", P,
        _bytes.permute_bytes(dsrc, dcop, dec_ids.numel(), dec_ids.element_size(), row8, m_dec, E),
        lambda: P._permute_triton(fp8[0][:256], dec_ids, E, 128, fp8[1][:256], "deepgemm"),
    ))  # fmt: skip
    # permute's payload scatter alone, its rows given (inv_perm): the floor of the copy kernel
    # for this mix of traffic (each source row read once, written to ~4 rows)
    x8 = fp8[0]
    out.append((
        "diag_permute_scatter_fp8", P, srcs * H + copies * H + 4 * d["inv"].numel(),
        lambda: scatter_rows(x8, d["inv"], torch.empty((d["m_idx"].numel(), H), dtype=x8.dtype,
                                                       device="cuda")),
    ))  # fmt: skip
    # the same destinations written with nothing read (HBM write bandwidth at this pattern), and
    # the same copies to consecutive rows (the scatter's cost over a streaming 1:4 broadcast)
    out8 = torch.empty((d["m_idx"].numel(), H), dtype=x8.dtype, device="cuda")
    inv_c = contiguous_rows(d["inv"])
    out += [
        ("diag_permute_write_only_fp8", P, copies * H + 4 * d["inv"].numel(),
         lambda: scatter_rows(x8, d["inv"], out8, write_only=True)),
        ("diag_permute_broadcast_fp8", P, srcs * H + copies * H + 4 * d["inv"].numel(),
         lambda: scatter_rows(x8, inv_c, out8)),
        ("diag_fill_fp8", P, copies * H, lambda: out8[: copies].fill_(0)),
        # (session 9) the same scatter from 512 source rows (3.7 MB, L2-resident after the first
        # reads): what the HBM reads cost the 1:4 mix
        ("diag_permute_scatter_l2src_fp8", P, srcs * H + copies * H + 4 * d["inv"].numel(),
         lambda: scatter_rows(x8, d["inv"], out8, src_rows=512)),
    ]  # fmt: skip
    # permute fp8's second kernel alone (session 8): chunk 1 copies with the scale rows (as in
    # permute), the chunk copies alone, the scale rows alone
    s8 = fp8[1]
    outs8 = Q.alloc_scales((d["m_idx"].numel(),), s8.shape[1], "deepgemm", "cuda")
    src8 = source_rows(d["inv"], d["m_idx"].numel())
    c1 = H - min(H, P.CONFIG.copy_bytes)  # (fp8: one byte a column)
    sc_bytes = count(d["m_idx"] >= 0) * (4 * s8.shape[1] * 2 + 4)
    ch_bytes = srcs * c1 + copies * c1 + 4 * d["inv"].numel()
    out += [
        ("diag_rest_fp8", P, ch_bytes + sc_bytes,
         lambda: rest_kernel(x8, s8, d["ids"], d["inv"], src8, out8, outs8)),
        ("diag_rest_chunks_fp8", P, ch_bytes,
         lambda: rest_kernel(x8, s8, d["ids"], d["inv"], src8, out8, outs8, scales=False)),
        ("diag_rest_scales_fp8", P, sc_bytes,
         lambda: rest_kernel(x8, s8, d["ids"], d["inv"], src8, out8, outs8, chunks=False)),
    ]  # fmt: skip
    tiny = torch.empty((M, 16), dtype=torch.uint8, device="cuda")
    out.append(("permute_index_only", P, 1, lambda: P._permute_triton(tiny, d["ids"], E, 128)))
    out.append(
        (
            "unpermute_prefill",
            U,
            _bytes.unpermute_bytes(copies, M, H, d["ids"].numel()),
            lambda: U._unpermute_triton(d["yo"], d["inv"], d["w"]),
        )
    )
    dec_inv = d["inv"][:256]
    out.append(
        (
            "unpermute_decode",
            U,
            _bytes.unpermute_bytes(count(dec_inv >= 0), 256, H, dec_inv.numel()),
            lambda: U._unpermute_triton(d["yo"], dec_inv, d["w"][:256]),
        )
    )
    return out


# points per stage: config fields of the stage's module (SHARED: of epmoe.ops.quantize); the
# decided designs (fixed in the code) and their measurements: docs/kernels.md
SWEEPS = {
    "quantize_prefill_fp8": [{}],
    "quantize_prefill_int8": grid(int8_warps=[4, 8]),
    "quantize_decode_fp8": [{}],
    "quantize_decode_int8": grid(max_warps=[4, 8, 16]),
    "silu_quant_prefill_fp8": [{}],
    # (I = 2048: 32 / 16 / 8 elements a thread are 2 / 4 / 8 warps)
    "silu_quant_prefill_int8": grid(int8_thread_elems=[32, 16, 8]),
    "silu_quant_decode_fp8": [{}],
    "silu_quant_decode_int8": grid(max_warps=[4, 8, 16]),
    "permute_prefill_bf16": [{}],
    "permute_prefill_fp8": [{}, dict(pf_rest_per_sm=16), dict(pf_rest_per_sm=8)] * 3,
    "permute_prefill_int8": [{}],
    "permute_index_only": [{}],
    "diag_permute_scatter_fp8": grid(copy_bytes=[2048, 4096, 8192], copy_warps=[4, 8])
    + grid(copy_bytes=[4096], copy_warps=[4], store_cache=["", ".wt"]),
    "diag_permute_write_only_fp8": grid(copy_bytes=[4096, 8192], copy_warps=[4, 8]),
    "diag_permute_broadcast_fp8": [{}],
    "diag_fill_fp8": [{}],
    "diag_rest_fp8": [{}] + grid(scale_tile=[2048, 8192]),
    "diag_rest_chunks_fp8": [{}],
    "diag_rest_scales_fp8": [{}],
    "permute_decode_fp8": grid(small_entries=[2048, 0]),
    "unpermute_prefill": [{}],
    "unpermute_decode": [{}],
    "diag_silu_quant_all_rows": [{}],
    "diag_silu_quant_packed": [{}],
    "diag_silu_only_m_idx": [{}],
    "diag_quantize_h": [{}],
}
# fields of epmoe.ops.quantize's config that steer every stage's kernels
SHARED = {"max_warps", "min_slots", "masked_programs"}


def configured(mod, params: dict) -> contextlib.ExitStack:
    """The stage module's config (and quantize's, for SHARED fields) overridden by params."""
    stack = contextlib.ExitStack()
    shared = {k: v for k, v in params.items() if k in SHARED}
    own = {k: v for k, v in params.items() if k not in SHARED}
    if shared:
        stack.enter_context(Q.override(**shared))
    if own:
        stack.enter_context(mod.override(**own))
    return stack


def kernel_profile(fn, iters: int = 20) -> dict:
    """One profiler run of ``fn``'s graph replays (L2 flushed before each): ``kernels``, the
    average device µs per call of each kernel it launches, and ``timeline``, each kernel's median
    start and end (µs after the call's first kernel starts) by launch order: when each kernel of
    a dependent chain begins and ends, e.g. how long the index chain holds the copy back."""
    run = _timing._capture(lambda: _eager.run(fn)) or (lambda: _eager.run(fn))
    calls = _timing.profiled_calls(run, iters)
    total: dict = {}
    for call in calls:
        for name, start, end in call:
            total[name] = total.get(name, 0.0) + end - start
    total["(all kernels)"] = sum(total.values())
    kernels = {k: round(v / iters, 2) for k, v in sorted(total.items(), key=lambda kv: -kv[1])}
    timeline = {}
    for i in range(min(len(c) for c in calls)):
        starts = [c[i][1] - c[0][1] for c in calls]
        ends = [c[i][2] - c[0][1] for c in calls]
        name = calls[0][i][0].split("(")[0][:40]
        timeline[f"{i}:{name}"] = [
            round(statistics.median(starts), 2),
            round(statistics.median(ends), 2),
        ]
    return dict(kernels=kernels, timeline=timeline)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep.jsonl")
    ap.add_argument("--only", default="")
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--profile", action="store_true", help="kernel breakdown per stage")
    ap.add_argument("--device", action="store_true", help="device span of every point too")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    t_end = time.time() + args.budget_s
    with open(args.out, "a") as f:
        copy = _timing.copy_timings()
        print(json.dumps({"copy_2GiB": copy}), file=f, flush=True)
        print("copy", copy, flush=True)
        for name, mod, nbytes, fn in cases():
            if only and not any(name.startswith(o) for o in only):
                continue
            if args.profile:
                try:
                    rec = dict(stage=name, **kernel_profile(fn))
                except Exception as e:  # noqa: BLE001
                    rec = dict(stage=name, profile_error=repr(e)[:300])
                print(json.dumps(rec), file=f, flush=True)
                print(rec, flush=True)
            for params in SWEEPS.get(name, [{}]):
                if time.time() > t_end:
                    print("budget reached", flush=True)
                    return
                try:
                    with configured(mod, params):
                        # launched as the public functions do (wrap_triton off, no HOP per launch)
                        t = _timing.time_cuda(lambda fn=fn: _eager.run(fn))
                        rec = dict(stage=name, params=params, us=t.ms * 1e3, gbps=t.gbps(nbytes))
                        if args.device:  # the kernels' span too (no graph launch in it)
                            dt = _timing.device_time(lambda fn=fn: _eager.run(fn), iters=30)
                            rec["device_us"] = None if dt is None else round(dt.ms * 1e3, 2)
                except Exception as e:  # noqa: BLE001 - a bad point is reported, not fatal
                    rec = dict(stage=name, params=params, error=repr(e)[:300])
                print(json.dumps(rec), file=f, flush=True)
                print(rec, flush=True)


if __name__ == "__main__":
    main()
