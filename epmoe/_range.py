"""Device-side range check: one small kernel instead of four torch ops (ge, lt, and, all).

Value checks run on every call (ids in range, masked_m counts <= capacity). As torch ops they cost
four launches before the ``_assert_async`` (each a host-side op call) and four graph nodes per
replay. :func:`range_ok` computes the same 0-d bool with one Triton
program for the small inputs these checks see on the decode path; large inputs (prefill ids) keep
the torch expression, whose kernels use the whole GPU.
"""

import torch
import triton
import triton.language as tl

from epmoe import _eager, _launch

BLOCK = 1024
MAX_ELEMENTS = 8 * BLOCK  # one program loops over at most 8 blocks


@triton.jit(do_not_specialize=["n", "lo", "hi"])
def _range_kernel(x_ptr, ok_ptr, n, lo, hi, BLOCK: tl.constexpr):
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + i, mask=i < n, other=lo)
        bad += ((v < lo) | (v >= hi)).to(tl.int32)
    lane = tl.arange(0, BLOCK)
    tl.store(ok_ptr + lane, (lane * 0 + tl.sum(bad, axis=0)) == 0, mask=lane < 1)


def range_ok(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """0-d bool tensor on x's device: every element of x (any shape, integer) lies in [lo, hi).

    The kernel runs only on plain CUDA tensors with nothing tracing (``_eager.plain``) and is
    launched directly: these checks run inside op implementations, where ``wrap_triton`` would
    route the launch through its higher-order op (far more host time than the launch). Anything
    else (CPU, fake or traced tensors, large inputs) takes the torch expression, which every
    tracer records.
    """
    # plain() first: under tracing numel() may be an unbacked size that must not be guarded on
    if not _eager.plain(x) or x.numel() > MAX_ELEMENTS:
        return ((x >= lo) & (x < hi)).all()
    ok = torch.empty((), dtype=torch.bool, device=x.device)
    flat = x.reshape(-1)
    with _eager.on_device(x):
        launch = _launch.direct(_range_kernel)[(1,)]
        launch(flat, ok, flat.numel(), lo, hi, BLOCK=BLOCK, num_warps=4)
    return ok
