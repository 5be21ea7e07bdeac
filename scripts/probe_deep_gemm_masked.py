"""Probe deep_gemm's masked grouped GEMM, called directly (no padding), for T (rows per expert slot)
on and off its row block: are the live rows right, and are the NEXT expert's live rows clobbered?

deep_gemm addresses a/out of the masked layout as 2-D `[E * T, *]` tensors and TMA-stores whole
BLOCK_M-row blocks from row e * T + i * BLOCK_M, so a BLOCK_M that does not divide T should make
the last block of expert e overwrite the first rows of expert e + 1. BLOCK_M comes from its
heuristics (sm90 masked: 64 or 128, chosen from expected_m). Each config runs a few times (the
overwrite races with the next expert's own store) into an output pre-filled with NaN.

For each bad config the line says which row blocks B in (64, 128, 256) explain the bad rows
(``fits_B``: every bad live row is one a block of B rows of the previous expert overwrites).
``op_ok`` is epmoe's grouped_gemm (which pads T to ``masked_row_block``) on the same inputs.

Run on the GPU machine from the repo root:
  python3 scripts/probe_deep_gemm_masked.py [--configs] [--out probe.txt]
``--configs`` sets DG_PRINT_CONFIGS=1 (deep_gemm prints each chosen block M / N once; long).
"""

import argparse
import os
import sys

SCHEMES = ("bf16", "fp8")
TS = (38, 64, 96, 128, 192, 256)
BLOCKS = (64, 128, 256)
E, N, K = 4, 256, 512
REPEATS = 5
TOL = 1e-2  # per-row relative L2 error vs the dequantized float32 reference


def _operands(torch, reference, gemm, scheme, T, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(E, T, K, generator=gen).cuda()
    w = (torch.randn(E, N, K, generator=gen) / K**0.5).cuda()
    if scheme == "bf16":
        return a.bfloat16(), None, w.bfloat16(), None
    aq, a_s = reference.quantize(a, "fp8")
    wq, ws = reference.quantize_weights(w, "fp8")
    s_mn = gemm.empty_fp8_act_scales((E, T), K // 128, "cuda")
    s_mn.copy_(a_s)  # deep_gemm's own layout: no transpose inside the call
    return aq, s_mn, wq.contiguous(), ws.contiguous()


def _bad_rows(torch, y, want):
    """bool `[E, T]`: rows off by more than TOL (relative L2 per row) or not finite."""
    y, want = y.float(), want.float()
    err = (y - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)
    return ~torch.isfinite(y).all(dim=-1) | (err > TOL)


def _predicted(torch, counts, T, block):
    """bool `[E, T]`: rows of expert e + 1 that the last ``block``-row block of expert e covers."""
    hit = torch.zeros(E, T, dtype=torch.bool)
    for e in range(E - 1):
        end = -(-counts[e] // block) * block  # rows of expert e's blocks, from its row 0
        spill = min(max(end - T, 0), T)
        hit[e + 1, :spill] = True
    return hit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", action="store_true", help="set DG_PRINT_CONFIGS=1")
    parser.add_argument("--out", help="also write the result lines to this file")
    args = parser.parse_args()
    if args.configs:
        os.environ["DG_PRINT_CONFIGS"] = "1"

    import torch

    from epmoe import reference
    from epmoe.ops import gemm
    from epmoe.ops.gemm._select import _dg_functions, _dg_role

    dev = torch.device("cuda")
    lines = []

    def emit(line):
        print(line, flush=True)
        lines.append(line)

    emit(f"device {torch.cuda.get_device_name(dev)} cap {torch.cuda.get_device_capability(dev)}")
    emit(
        f"E={E} N={N} K={K} repeats={REPEATS}; masked_row_block: "
        + ", ".join(f"{s}={gemm.masked_row_block(s, dev)}" for s in SCHEMES)
    )
    failing = {s: set() for s in SCHEMES}
    passing = {s: set() for s in SCHEMES}
    for scheme in SCHEMES:
        fn = _dg_functions()[f"{scheme}_masked"]
        if fn is None or not _dg_role(f"{scheme}_masked", dev):
            emit(f"{scheme}: deep_gemm masked not available here, skipped")
            continue
        for T in TS:
            patterns = {"full": [T] * E, "mixed": [3, T, T // 2 + 1, T]}
            for em in (1, 8, 64, T):
                em_passed = max(1, min(em, T))  # what epmoe passes (clamped to T)
                for name, counts in patterns.items():
                    a, a_s, w, ws = _operands(torch, reference, gemm, scheme, T, seed=T + em)
                    mm = torch.tensor(counts, dtype=torch.int32, device=dev)
                    want = reference.grouped_gemm_masked(a, w, mm, a_s, ws)
                    live = (torch.arange(T, device=dev)[None, :] < mm[:, None]).cpu()
                    bad = torch.zeros(E, T, dtype=torch.bool)
                    for _ in range(REPEATS):
                        out = torch.full((E, T, N), float("nan"), dtype=torch.bfloat16, device=dev)
                        if scheme == "fp8":
                            fn((a, a_s), (w, ws), out, mm, em_passed)
                        else:
                            fn(a, w, out, mm, em_passed)
                        torch.cuda.synchronize()
                        bad |= _bad_rows(torch, out, want).cpu()
                    bad &= live
                    y = gemm.grouped_gemm(
                        a, w, masked_m=mm, a_scales=a_s, w_scales=ws, expected_m=em_passed
                    )
                    op_ok = not bool((_bad_rows(torch, y, want).cpu() & live).any())
                    per_expert = bad.sum(dim=1).tolist()
                    heads = [bool(bad[e].any()) and bool(bad[e, 0]) for e in range(1, E)]
                    fits = [
                        b
                        for b in BLOCKS
                        if bool((bad & ~_predicted(torch, counts, T, b)).sum() == 0)
                    ]
                    raw_ok = not bool(bad.any())
                    (passing if raw_ok else failing)[scheme].add(T)
                    emit(
                        f"{scheme:4} T={T:3} em={em:3}(passed {em_passed:3}) {name:5} "
                        f"raw_ok={raw_ok!s:5} bad_live_rows={per_expert} "
                        f"next_expert_head_clobbered={any(heads)!s:5} "
                        f"fits_B={fits if not raw_ok else '-'} op_ok={op_ok}"
                    )
    for scheme in SCHEMES:
        emit(
            f"{scheme}: T with raw failures {sorted(failing[scheme])}; "
            f"T always ok {sorted(passing[scheme] - failing[scheme])}"
        )
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
