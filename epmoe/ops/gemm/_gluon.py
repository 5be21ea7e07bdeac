"""The int8 contiguous grouped GEMM for sm90 in Gluon: Triton keeps an int32 wgmma synchronous.

Triton 3.6 makes a wgmma asynchronous only with a float32 accumulator, so each int8 K step of
:mod:`epmoe.ops.gemm._triton` waits for its own MMA before the next is issued. This kernel is the
same tiles with the MMA of step k in flight while step k + 1's is issued (``warpgroup_mma_wait(1)``)
and TMA filling the stages ahead: a persistent loop over the live `[BLOCK_M, BLOCK_N]` output tiles
of expert-contiguous rows (a block's expert is its first row's; -1 blocks never load), the next
tile's first K steps loaded during the current one's epilogue; a int8 `[M, K]` and w int8
`[E * N, K]` through TMA descriptors, int32 sums scaled per token x per channel (float32), out
bf16 `[M, N]` through a TMA store or from registers. The bytes equal the Triton kernel's (the same
integer sums, the same float ops). GPU only: under the interpreter a Gluon config runs the Triton
kernel (:func:`epmoe.ops.gemm._triton._runnable`).
"""

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from epmoe import _launch

_launch.DESCRIPTORS.add(TensorDescriptor)
# TMA copies by their Triton 3.6 names (the device's), renamed async_load / async_store later
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def _block_mn(tile, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(row block, column block) of ``tile``, GROUP_M row blocks sweeping the N tiles together
    (the Triton kernel's order)."""
    num_pid_n = gl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    group_m = gl.minimum(gl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (tile % in_group) % group_m, (tile % in_group) // group_m


@gluon.jit
def _load_step(a_desc, w_desc, a_bufs, w_bufs, ready, count, row_a, row_w, kb,
               BLOCK_K: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """TMA of K step ``kb``'s a and w tiles into stage ``count`` % STAGES."""
    s = count % STAGES
    bar = ready.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
    _tma_load(a_desc, [row_a, kb * BLOCK_K], bar, a_bufs.index(s))
    _tma_load(w_desc, [row_w, kb * BLOCK_K], bar, w_bufs.index(s))


@gluon.jit
def _live_tile(tile, num_tiles, step, m_indices_ptr, M, N, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
    """(tile, its expert): the first of ``tile``, ``tile`` + step, ... whose row block is an
    expert's (num_tiles when none is left)."""
    expert = _expert_of(tile, num_tiles, m_indices_ptr, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    while (tile < num_tiles) & (expert < 0):
        tile += step
        expert = _expert_of(tile, num_tiles, m_indices_ptr, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    return gl.minimum(tile, num_tiles), expert


@gluon.jit
def _expert_of(tile, num_tiles, m_indices_ptr, M, N, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
    """The expert of ``tile``'s row block (its first row's; -1 past the tiles)."""
    pid_m, _ = _block_mn(gl.minimum(tile, num_tiles - 1), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    expert = gl.load(m_indices_ptr + pid_m * BLOCK_M)
    return gl.where(tile < num_tiles, expert, -1)


@gluon.jit
def _first_steps(a_desc, w_desc, a_bufs, w_bufs, ready, loads, tile, expert, num_tiles, k_tiles,
                 M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                 GROUP_M: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Loads the first STAGES - 1 K steps of ``tile`` (none past the tiles); the new count."""
    if tile < num_tiles:
        pid_m, pid_n = _block_mn(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        for kb in gl.static_range(STAGES - 1):
            if kb < k_tiles:
                _load_step(a_desc, w_desc, a_bufs, w_bufs, ready, loads, pid_m * BLOCK_M,
                           expert * N + pid_n * BLOCK_N, kb, BLOCK_K, STAGES)  # fmt: skip
                loads += 1
    return loads


@gluon.jit
def _contiguous_int8_kernel(
    # the Triton contiguous kernel's arguments (a, w: Gluon TMA descriptors; out one with
    # STORE_TMA, else a pointer; a_rows and the a / w strides unused: the descriptors hold them)
    a_desc, w_desc, a_scale_ptr, w_scale_ptr, m_indices_ptr, a_rows_ptr, out,
    M, N, K, E,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_asm, stride_ask,
    stride_wse, stride_wsn, stride_wsk, stride_om, stride_on,
    QUANT: gl.constexpr, SCALE_K: gl.constexpr, GATHER: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, TMA: gl.constexpr,
    GLUON: gl.constexpr, STAGES: gl.constexpr, STORE_TMA: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1],
        instr_shape=[16, _instr_n(BLOCK_M, BLOCK_N, num_warps), 32],
    )  # fmt: skip
    a_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    if STORE_TMA:
        o_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], out.layout)

    k_tiles = gl.cdiv(K, BLOCK_K)
    num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    step = gl.num_programs(0)
    loads = 0  # K steps this program has loaded / consumed: stage = count % STAGES
    used = 0
    tile, expert = _live_tile(gl.program_id(0), num_tiles, step, m_indices_ptr, M, N, BLOCK_M,
                              BLOCK_N, GROUP_M)  # fmt: skip
    loads = _first_steps(a_desc, w_desc, a_bufs, w_bufs, ready, loads, tile, expert, num_tiles,
                         k_tiles, M, N, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES)  # fmt: skip
    while tile < num_tiles:
        pid_m, pid_n = _block_mn(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        row_a = pid_m * BLOCK_M
        row_w = expert * N + pid_n * BLOCK_N
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.int32, acc_layout)
        for kb in range(k_tiles):
            s = used % STAGES
            mbarrier.wait(ready.index(s), (used // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc,
                                is_async=True)  # fmt: skip
            # step kb - 1's MMA is done: its stage takes step kb + STAGES - 1
            acc, _, _ = warpgroup_mma_wait(1, deps=(acc, a_bufs.index(s), w_bufs.index(s)))
            used += 1
            if kb + STAGES - 1 < k_tiles:
                _load_step(a_desc, w_desc, a_bufs, w_bufs, ready, loads, row_a, row_w,
                           kb + STAGES - 1, BLOCK_K, STAGES)  # fmt: skip
                loads += 1
        # the next tile's first steps load during this one's last MMA and epilogue (every stage
        # but the last step's is free)
        expert_now = expert
        tile, expert = _live_tile(tile + step, num_tiles, step, m_indices_ptr, M, N, BLOCK_M,
                                  BLOCK_N, GROUP_M)  # fmt: skip
        loads = _first_steps(a_desc, w_desc, a_bufs, w_bufs, ready, loads, tile, expert,
                             num_tiles, k_tiles, M, N, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                             STAGES)  # fmt: skip
        acc = warpgroup_mma_wait(0, deps=(acc,))
        # (rows past M and columns past N wrap onto valid scales and are never stored)
        offs_m = row_a + gl.arange(0, BLOCK_M, gl.SliceLayout(1, acc_layout))
        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, acc_layout))
        a_s = gl.load(a_scale_ptr + (offs_m % M) * stride_asm)
        w_s = gl.load(w_scale_ptr + expert_now.to(gl.int64) * stride_wse +
                      (offs_n % N) * stride_wsn)  # fmt: skip
        y = (acc.to(gl.float32) * a_s[:, None] * w_s[None, :]).to(gl.bfloat16)
        if STORE_TMA:
            tma.store_wait(0)  # the previous tile's store has left o_smem
            o_smem.store(y)
            fence_async_shared()
            _tma_store(out, [row_a, pid_n * BLOCK_N], o_smem)
        else:
            o_ptrs = out + offs_m.to(gl.int64)[:, None] * stride_om + \
                offs_n[None, :] * stride_on  # fmt: skip
            gl.store(o_ptrs, y, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
    if STORE_TMA:
        tma.store_wait(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


@gluon.constexpr_function
def _instr_n(block_m, block_n, num_warps):
    """The widest int8 wgmma N (a multiple of 16 up to 224) dividing each warp's share of N."""
    per_warp_n = max(block_n // max(1, num_warps // max(1, block_m // 16)), 8)
    n = 224
    while n > per_warp_n or block_n % n:
        n -= 16
    return n


@functools.cache  # (per call otherwise: the descriptors are made at every launch)
def _layout(shape, dtype):
    return gl.NVMMASharedLayout.get_default_for(list(shape), dtype)


def descriptors(a, w, out, block_m: int, block_n: int, block_k: int, store_tma: bool):
    """The kernel's a int8 `[M, K]`, w int8 `[E, N, K]` (as `[E * N, K]`) and out bf16 `[M, N]`:
    TMA descriptors of its tiles (out: the tensor itself without ``store_tma``)."""
    k = a.shape[1]
    a_d = TensorDescriptor(a, [a.shape[0], k], [a.stride(0), 1], [block_m, block_k],
                           _layout((block_m, block_k), gl.int8))  # fmt: skip
    w_d = TensorDescriptor(w, [w.shape[0] * w.shape[1], k], [w.stride(1), 1], [block_n, block_k],
                           _layout((block_n, block_k), gl.int8))  # fmt: skip
    if not store_tma:
        return a_d, w_d, out
    o_d = TensorDescriptor(out, list(out.shape), [out.stride(0), 1], [block_m, block_n],
                           _layout((block_m, block_n), gl.bfloat16))  # fmt: skip
    return a_d, w_d, o_d
