"""How close a decode GEMM can come to the floor: the time a kernel takes only to read an expert
layer's weights, against those bytes at the run's copy bandwidth (the floor of
``bench_one_gpu.py``).

    python benchmarks/bench_weight_stream.py --out stream.json [--shapes qwen3-30b-a3b,...]
        [--schemes fp8,bf16]

Per shape, scheme and GEMM (gemm1: w1 `[E, W, H]` with W the gate's rows, 2I for a gated one;
gemm2: w2 `[E, H, I]`; every expert, the model's sizes as the layer's floor counts them; int8
codes are fp8's bytes), timed as the layer is (CUDA graph replay, L2 flushed before each call):

- ``floor_us``: the bytes at ``copy_gbps`` (bytes read + written per second: the layer's floor);
- ``tiles_us``: a Triton kernel that reads the weights as the masked GEMMs do (a program per
  (column block, expert) over K steps of 128 bytes, pipelined through a 16-row ``tl.dot``, no
  activations, nothing but a checksum written), the best of two tiles;
- ``linear_us``: the same kernel over the same bytes in address order (tiles of whole 128-byte
  rows back to back);
- ``frac_of_floor``: floor_us / tiles_us.

The JSON: {"benchmark": "weight_stream", "device", "date", "versions", "copy_gbps", "cases":
[{"id": "<shape>/<scheme>/<gemm>", "weight_bytes", "floor_us", "tiles_us", "linear_us",
"frac_of_floor"}]}; ``scripts/record_results.py`` appends it.
"""

import argparse
import datetime
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _configs  # noqa: E402
import _report  # noqa: E402
import _timing  # noqa: E402

import epmoe  # noqa: E402

# (rows a tile, bytes of K a step, pipeline stages): the masked GEMMs' weight tiles
TILES = ((128, 128, 4), (64, 256, 4))


@triton.jit
def _stream_kernel(w_ptr, ones_ptr, out_ptr, ROWS, K, BN: tl.constexpr, BK: tl.constexpr,
                   STAGES: tl.constexpr):  # fmt: skip
    """Program (n, e): rows n * BN .. of expert e's `[ROWS, K]` weights, K in BK steps, into a
    tl.dot with 16 rows of ones `[16, BK]` (so Triton pipelines the loads); writes 16 sums."""
    pid_n = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    base = w_ptr + e * ROWS * K + rows.to(tl.int64)[:, None] * K + tl.arange(0, BK)[None, :]
    ones = tl.load(ones_ptr + tl.arange(0, 16)[:, None] * BK + tl.arange(0, BK)[None, :])
    acc = tl.zeros([16, BN], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        acc = tl.dot(ones, tl.trans(tl.load(base + k0)), acc)
    tile = e * tl.num_programs(0) + pid_n
    tl.store(out_ptr + tile * 16 + tl.arange(0, 16), tl.sum(acc, axis=1))


def stream_us(w: torch.Tensor, linear: bool) -> float:
    """Best µs over TILES of reading w `[E, R, K]` (linear: as `[E, R * K / BK, BK]`)."""
    best = float("inf")
    for bn, bk_bytes, stages in TILES:
        bk = bk_bytes // w.element_size()
        if w.shape[1] % bn or w.shape[2] % bk:  # (the kernel reads whole tiles only)
            raise ValueError(f"stream_us: w expected [E, R, K] of R % {bn} == K % {bk} == 0, "
                             f"got {list(w.shape)}")  # fmt: skip
        v = w.view(w.shape[0], -1, bk) if linear else w
        E, R, K = v.shape
        out = torch.empty(E * (R // bn) * 16, device=w.device)
        ones = torch.ones((16, bk), device=w.device).to(w.dtype)

        def run(v=v, ones=ones, out=out, bn=bn, bk=bk, stages=stages, R=R, K=K, E=E):
            _stream_kernel[(R // bn, E)](v, ones, out, R, K, BN=bn, BK=bk, STAGES=stages,
                                         num_warps=4)  # fmt: skip

        best = min(best, _timing.time_cuda(run).ms * 1e3)
    return best


def case(cfg, scheme: str, gemm: str, gbps: float) -> dict:
    E, H, I = cfg.local_experts, cfg.hidden, cfg.intermediate  # noqa: E741
    shape = (E, epmoe.gate.get(cfg.gate).width(I), H) if gemm == "gemm1" else (E, H, I)
    dtype = torch.bfloat16 if scheme == "bf16" else torch.float8_e4m3fn
    w = torch.randn(shape, device="cuda").to(dtype)
    nbytes = w.numel() * w.element_size()
    floor = nbytes / (gbps * 1e3)
    tiles = stream_us(w, False)
    return {
        "id": f"{cfg.name}/{scheme}/{gemm}",
        "weight_bytes": nbytes,
        "floor_us": floor,
        "tiles_us": tiles,
        "linear_us": stream_us(w, True),
        "frac_of_floor": floor / tiles,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b")
    p.add_argument("--schemes", default="fp8,bf16")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_weight_stream: needs a CUDA GPU", file=sys.stderr)
        return 2
    gbps = _timing.copy_gbps()
    cases = []
    for name in args.shapes.split(","):
        cfg = _configs.CONFIGS[name]
        for scheme in args.schemes.split(","):
            for gemm in ("gemm1", "gemm2"):
                cases.append(case(cfg, scheme, gemm, gbps))
                print(json.dumps(cases[-1]), flush=True)
    doc = {
        "benchmark": "weight_stream",
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "versions": _report.versions(),
        "copy_gbps": gbps,
        "cases": cases,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
