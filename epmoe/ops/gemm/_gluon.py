"""The int8, fp8 and bf16 grouped GEMMs for sm90 in Gluon: Triton keeps an int32 wgmma synchronous.

Triton 3.6 makes a wgmma asynchronous only with a float32 accumulator, so each int8 K step of
:mod:`epmoe.ops.gemm._triton` waits for its own MMA before the next is issued. These kernels are
the same tiles with the MMA of step k in flight while step k + 1's is issued
(``warpgroup_mma_wait(1)``) and TMA filling the stages ahead: a persistent loop over the live
`[BLOCK_M, BLOCK_N]` output tiles, the next tile's first K steps loaded during the current one's
epilogue; int32 sums scaled per token x per channel (float32), out bf16. bf16 operands (float32
sums, out bf16 unscaled) take the same loops for what Triton does not give them: warp
specialization and the cooperative 128x256 tile. fp8 (1x128 / 128x128 block scales; the loop
and WS without COOP, tiles of at most 128 columns) takes what Triton's fp8 loop lacks: TMA stages
fed through mbarriers ahead of the MMAs across tiles, persistent over the live tiles; each K step
(one 128-wide scale group) sums into its own float32 accumulator, scaled into the tile's once
done (its scales loaded while the MMA runs). Two layouts, one loop:

- contiguous: a `[M, K]` of expert-contiguous rows (a block's expert is its first row's; -1
  blocks never load), out `[M, N]` through a TMA store or from registers;
- masked: a `[E, T, K]` (as `[E * T, K]`), the live tiles only (each expert's count in row
  blocks, from a running sum over the counts every program makes), out `[E, T, N]` from
  registers (rows past the count never written) or, T a multiple of BLOCK_M, through a TMA store
  of whole row blocks (as `[E * T, N]`: rows past the count in a live block written too).

Either loop runs as one warpgroup or two (num_warps 8) on each tile, or warp-specialized (WS): one
TMA warp and two MMA warpgroups that take the tiles in turn, each one's epilogue under the other's
MMAs, or (COOP) share each tile's halves (the tuner picks per shape).

w `[E * N, K]` (a's dtype) through a TMA descriptor. int8's and fp8's bytes equal the Triton
kernels' (the same integer sums or per-step MMAs, the same float ops). GPU only: under the
interpreter a Gluon config runs the Triton kernel (:func:`epmoe.ops.gemm._triton._runnable`).
"""

import functools

import torch
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
def _load_step(a_desc, w_desc, a_bufs, w_bufs, ready, s, row_a, row_w, kb,
               BLOCK_K: gl.constexpr):  # fmt: skip
    """TMA of K step ``kb``'s a and w tiles into stage ``s``."""
    bar = ready.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
    _tma_load(a_desc, [row_a, kb * BLOCK_K], bar, a_bufs.index(s))
    _tma_load(w_desc, [row_w, kb * BLOCK_K], bar, w_bufs.index(s))


@gluon.jit
def _load_gate_step(a_desc, w_desc, a_bufs, w_bufs, ready, s, row_a, row_w, up, kb,
                    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
    """:func:`_load_step` of GEMM1 + gate: a's tile, and the gate rows from ``row_w`` and the up
    rows from ``row_w + up`` into the two halves of stage ``s``'s w tile."""
    bar = ready.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes)
    _tma_load(a_desc, [row_a, kb * BLOCK_K], bar, a_bufs.index(s))
    _tma_load(w_desc, [row_w, kb * BLOCK_K], bar, w_bufs.index(s).slice(0, BLOCK_N))
    _tma_load(w_desc, [row_w + up, kb * BLOCK_K], bar, w_bufs.index(s).slice(BLOCK_N, BLOCK_N))


@gluon.jit
def _silu_mul(g, u):
    """silu(g) * u of float32 g and u as the Triton gate kernels compute it on the GPU
    (epmoe.gate's FAST path: g times rcp(1 + ex2(-g log2(e))), then times u)."""
    e = gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r",
                                  [g * -1.4426950408889634], dtype=gl.float32, is_pure=True,
                                  pack=1)  # fmt: skip
    r = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + e],
                                  dtype=gl.float32, is_pure=True, pack=1)  # fmt: skip
    return g * r * u


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _block_ends(masked_m_ptr, E, T, E_PAD: gl.constexpr, BLOCK_M: gl.constexpr,
                num_warps: gl.constexpr):  # fmt: skip
    """int32 `[E_PAD]`: the running sum of the experts' live row blocks (counts clamped to
    [0, T]; E_PAD >= E, the padding's blocks 0)."""
    ex = gl.arange(0, E_PAD, gl.BlockedLayout([1], [32], [num_warps], [0]))
    count = gl.minimum(gl.maximum(gl.load(masked_m_ptr + ex, mask=ex < E, other=0), 0), T)
    return gl.associative_scan((count + BLOCK_M - 1) // BLOCK_M, 0, _add)


@gluon.jit
def _tile_of(tile, num_tiles, rows_ptr, ends, M, N, T, MASKED: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
    """(expert, a's first row, the row within the expert's frame, column block) of ``tile``; the
    expert is -1 for a dead tile or one past the tiles. Contiguous: the first row's m_indices
    (``rows_ptr``). Masked: the live tiles only, expert by expert (``ends``: their row blocks'
    running sum), column block by column block, row blocks fastest (the programs that share a
    weight tile run together: it is read from HBM once)."""
    t = gl.minimum(tile, num_tiles - 1)
    if MASKED:
        n_blocks = gl.cdiv(N, BLOCK_N)
        before = ends * n_blocks <= t  # (the experts whose tiles all come before t)
        e = gl.sum(before.to(gl.int32), axis=0)
        first = gl.max(gl.where(before, ends, 0), axis=0)
        blocks = gl.maximum(gl.min(gl.where(before, 2**30, ends), axis=0) - first, 1)
        pid_n = (t - first * n_blocks) // blocks
        t0 = (t - first * n_blocks) % blocks * BLOCK_M
        expert = e
        row_a = e * T + t0
    else:
        pid_m, pid_n = _block_mn(t, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        expert = gl.load(rows_ptr + pid_m * BLOCK_M)
        row_a = pid_m * BLOCK_M
        t0 = row_a
    return gl.where(tile < num_tiles, expert, -1), row_a, t0, pid_n


@gluon.jit
def _live_tile(tile, num_tiles, step, rows_ptr, ends, M, N, T, MASKED: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
    """:func:`_tile_of` of the first live tile of ``tile``, ``tile`` + step, ... (the tile:
    num_tiles when none is left)."""
    expert, row_a, t0, pid_n = _tile_of(tile, num_tiles, rows_ptr, ends, M, N, T, MASKED, BLOCK_M,
                                        BLOCK_N, GROUP_M)  # fmt: skip
    while (tile < num_tiles) & (expert < 0):
        tile += step
        expert, row_a, t0, pid_n = _tile_of(tile, num_tiles, rows_ptr, ends, M, N, T, MASKED,
                                            BLOCK_M, BLOCK_N, GROUP_M)  # fmt: skip
    return gl.minimum(tile, num_tiles), expert, row_a, t0, pid_n


@gluon.jit
def _walk(rows_ptr, M, N, K, E, T, MASKED: gl.constexpr, E_PAD: gl.constexpr,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
          GROUP_M: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """What a loop over the program's live tiles starts from: (K steps a tile, ends and tiles
    as :func:`_tiles` gives them, the stride between the program's tiles, and :func:`_live_tile`
    of its first)."""
    k_tiles = gl.cdiv(K, BLOCK_K)
    ends, num_tiles = _tiles(rows_ptr, M, N, E, T, MASKED, E_PAD, BLOCK_M, BLOCK_N, num_warps)
    step = gl.num_programs(0)
    first = _live_tile(gl.program_id(0), num_tiles, step, rows_ptr, ends, M, N, T, MASKED, BLOCK_M,
                       BLOCK_N, GROUP_M)  # fmt: skip
    return k_tiles, ends, num_tiles, step, first


@gluon.jit
def _first_steps(a_desc, w_desc, a_bufs, w_bufs, ready, loads, live, row_a, row_w, k_tiles,
                 BLOCK_K: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Loads the first STAGES - 1 K steps of a tile (none unless ``live``); the new count."""
    if live:
        for kb in gl.static_range(STAGES - 1):
            if kb < k_tiles:
                _load_step(a_desc, w_desc, a_bufs, w_bufs, ready, loads % STAGES, row_a, row_w,
                           kb, BLOCK_K)  # fmt: skip
                loads += 1
    return loads


@gluon.jit
def _scaled_out(acc, a_scale_ptr, w_scale_ptr, expert, t0, pid_n, rows, N, stride_ase,
                stride_asm, stride_wse, stride_wsn, acc_layout: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """bf16 of a tile's int32 sums times its per-token x per-channel scales (bf16 and fp8
    operands: of its float32 sums, fp8's scaled per K step), with its rows (in the expert's frame
    of ``rows`` rows) and columns; rows past ``rows`` and columns past N wrap onto valid scales
    and are never stored."""
    offs_m = t0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, acc_layout))
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, acc_layout))
    if not _is_int(acc.dtype):
        return acc.to(gl.bfloat16), offs_m, offs_n
    e64 = expert.to(gl.int64)
    a_s = gl.load(a_scale_ptr + e64 * stride_ase + (offs_m % rows) * stride_asm)
    w_s = gl.load(w_scale_ptr + e64 * stride_wse + (offs_n % N) * stride_wsn)
    return (acc.to(gl.float32) * a_s[:, None] * w_s[None, :]).to(gl.bfloat16), offs_m, offs_n


@gluon.jit
def _tiles(rows_ptr, M, N, E, T, MASKED: gl.constexpr, E_PAD: gl.constexpr,
           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """(ends, tiles): masked, the running sum of live row blocks (:func:`_block_ends`) and the
    live tiles; contiguous, every tile (ends unused)."""
    num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    ends = num_tiles
    if MASKED:
        ends = _block_ends(rows_ptr, E, T, E_PAD, BLOCK_M, num_warps)
        num_tiles = gl.max(ends, axis=0) * gl.cdiv(N, BLOCK_N)
    return ends, num_tiles


@gluon.jit
def _epilogue(acc, out, o_smem, a_scale_ptr, w_scale_ptr, rows_ptr, tile_at, M, N, T, strides,
              acc_layout: gl.constexpr, MASKED: gl.constexpr, STORE_TMA: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """A finished tile's int32 sums, scaled, into out: through o_smem and a TMA store, or from
    registers (masked: the rows below the expert's count). ``tile_at``: (expert, a's first row,
    row in the expert's frame, column block); ``strides``: a scales' expert and row, w scales'
    expert and column, out's expert, row and column."""
    expert, row_a, t0, pid_n = tile_at
    stride_ase, stride_asm, stride_wse, stride_wsn, stride_oe, stride_om, stride_on, _, _ = strides
    rows = gl.minimum(gl.load(rows_ptr + expert), T) if MASKED else M  # (live rows)
    y, offs_m, offs_n = _scaled_out(acc, a_scale_ptr, w_scale_ptr, expert, t0, pid_n, rows, N,
                                    stride_ase, stride_asm, stride_wse, stride_wsn, acc_layout,
                                    BLOCK_M, BLOCK_N)  # fmt: skip
    if STORE_TMA:
        tma.store_wait(0)  # the previous tile's store has left o_smem
        o_smem.store(y)
        fence_async_shared()
        _tma_store(out, [row_a, pid_n * BLOCK_N], o_smem)
    else:
        o_ptrs = out + expert.to(gl.int64) * stride_oe + \
            offs_m.to(gl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on  # fmt: skip
        gl.store(o_ptrs, y, mask=(offs_m[:, None] < rows) & (offs_n[None, :] < N))


@gluon.jit
def _gate_epilogue(acc_g, acc_u, out, o_smem, row, pid_n, BLOCK_N: gl.constexpr):
    """GEMM1 + gate's epilogue of a tile's gate and up sums: h = silu(g) * u of their bf16
    roundings (the unfused chain's GEMM1 output) through o_smem and a TMA store at ``row``."""
    h = _silu_mul(acc_g.to(gl.bfloat16).to(gl.float32), acc_u.to(gl.bfloat16).to(gl.float32))
    tma.store_wait(0)  # the previous tile's store has left o_smem
    o_smem.store(h.to(gl.bfloat16))
    fence_async_shared()
    _tma_store(out, [row, pid_n * BLOCK_N], o_smem)


@gluon.jit
def _tile_scales(a_scale_ptr, w_scale_ptr, rows_ptr, tile_at, M, T, strides,
                 acc_layout: gl.constexpr, MASKED: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr):  # fmt: skip
    """fp8: (a's scale pointers of the tile's rows, w's of its 128-row block: BLOCK_N divides
    128, the K strides of both), each K step's group added by :func:`_step_scales`; rows past
    the live ones wrap onto valid scales (their sums are never stored)."""
    expert, row_a, t0, pid_n = tile_at
    stride_ase, stride_asm, stride_wse, stride_wsn, _, _, _, stride_ask, stride_wsk = strides
    rows = gl.minimum(gl.load(rows_ptr + expert), T) if MASKED else M  # (live rows)
    offs_m = t0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, acc_layout))
    e64 = expert.to(gl.int64)
    a_s = a_scale_ptr + e64 * stride_ase + (offs_m % rows) * stride_asm
    w_s = w_scale_ptr + e64 * stride_wse + (pid_n * BLOCK_N // 128) * stride_wsn
    return a_s, w_s, stride_ask, stride_wsk


@gluon.jit
def _step_scales(scales, kb, BLOCK_K: gl.constexpr):
    """fp8: float32 `[BLOCK_M]` scales of K step ``kb``'s sums (its 128-wide group): a's per row
    times w's block scale (the Triton kernel's float ops)."""
    a_s, w_s, stride_ask, stride_wsk = scales
    g = kb * BLOCK_K // 128
    return gl.load(a_s + g * stride_ask) * gl.load(w_s + g * stride_wsk)


@gluon.jit
def _mma_step(acc, part, a_s, w_s, scales, kb, BLOCK_K: gl.constexpr):
    """K step ``kb``'s MMA of stages a_s x w_s into acc; (acc, part). int8 / bf16: issued, step
    kb - 1's done at return. fp8: into ``part`` (its own accumulator), done and scaled into acc
    at return, its scales loaded while it runs (scaling step kb - 1's under step kb's MMA made
    ptxas serialize every wgmma: it cannot tell the two sums' registers apart across
    ``warpgroup_mma_wait(1)``)."""
    if a_s.dtype == gl.float8e4nv:
        part = warpgroup_mma(a_s, w_s, part, use_acc=False, is_async=True)
        sc = _step_scales(scales, kb, BLOCK_K)
        part, _, _ = warpgroup_mma_wait(0, deps=(part, a_s, w_s))
        acc = acc + part * sc[:, None]
    else:
        acc = warpgroup_mma(a_s, w_s, acc, is_async=True)
        acc, _, _ = warpgroup_mma_wait(1, deps=(acc, a_s, w_s))
    return acc, part


@gluon.jit
def _k_steps(a_desc, w_desc, a_bufs, w_bufs, ready, used, loads, row_a, row_w, k_tiles, scales,
             acc_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             BLOCK_K: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """A tile's K steps from the ring (:func:`_mma_step`), each stage refilled with the step
    STAGES - 1 ahead once its MMA is done; (acc, used, loads), int8 / bf16's last MMA still in
    flight."""
    acc = gl.zeros((BLOCK_M, BLOCK_N), _acc_dtype(a_desc.dtype), acc_layout)
    part = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)  # (fp8: a step's sum)
    for kb in range(k_tiles):
        s = used % STAGES
        mbarrier.wait(ready.index(s), (used // STAGES) & 1)
        # (then step kb - 1's MMA is done: its stage takes step kb + STAGES - 1)
        acc, part = _mma_step(acc, part, a_bufs.index(s), w_bufs.index(s).permute((1, 0)),
                              scales, kb, BLOCK_K)  # fmt: skip
        used += 1
        if kb + STAGES - 1 < k_tiles:
            _load_step(a_desc, w_desc, a_bufs, w_bufs, ready, loads % STAGES, row_a, row_w,
                       kb + STAGES - 1, BLOCK_K)  # fmt: skip
            loads += 1
    return acc, used, loads


@gluon.jit
def _persistent(
    a_desc, w_desc, a_scale_ptr, w_scale_ptr, rows_ptr, out, M, N, K, E, T, strides,
    MASKED: gl.constexpr, E_PAD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    STORE_TMA: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """The loop both kernels run over their live tiles without WS (module doc); M: a's rows, E
    (<= E_PAD) and T: the masked layout's experts and slot rows; ``strides`` as
    :func:`_epilogue` takes them."""
    acc_layout: gl.constexpr = _acc_layout(BLOCK_M, BLOCK_N, num_warps, a_desc.dtype)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    o_smem = out  # (without STORE_TMA: unused)
    if STORE_TMA:
        o_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], out.layout)

    k_tiles, ends, num_tiles, step, first = _walk(rows_ptr, M, N, K, E, T, MASKED, E_PAD, BLOCK_M,
                                                  BLOCK_N, BLOCK_K, GROUP_M, num_warps)  # fmt: skip
    tile, expert, row_a, t0, pid_n = first
    loads = 0  # K steps this program has loaded / consumed: stage = count % STAGES
    used = 0
    loads = _first_steps(a_desc, w_desc, a_bufs, w_bufs, ready, loads, tile < num_tiles, row_a,
                         expert * N + pid_n * BLOCK_N, k_tiles, BLOCK_K, STAGES)  # fmt: skip
    while tile < num_tiles:
        scales = _tile_scales(a_scale_ptr, w_scale_ptr, rows_ptr, (expert, row_a, t0, pid_n), M,
                              T, strides, acc_layout, MASKED, BLOCK_M, BLOCK_N)  # fmt: skip
        acc, used, loads = _k_steps(
            a_desc, w_desc, a_bufs, w_bufs, ready, used, loads, row_a,
            expert * N + pid_n * BLOCK_N, k_tiles, scales, acc_layout, BLOCK_M, BLOCK_N, BLOCK_K,
            STAGES)  # fmt: skip
        # the next tile's first steps load during this one's last MMA and epilogue (every stage
        # but the last step's is free)
        this = (expert, row_a, t0, pid_n)
        tile, expert, row_a, t0, pid_n = _live_tile(tile + step, num_tiles, step, rows_ptr, ends,
                                                    M, N, T, MASKED, BLOCK_M, BLOCK_N,
                                                    GROUP_M)  # fmt: skip
        loads = _first_steps(a_desc, w_desc, a_bufs, w_bufs, ready, loads, tile < num_tiles,
                             row_a, expert * N + pid_n * BLOCK_N, k_tiles, BLOCK_K,
                             STAGES)  # fmt: skip
        acc = warpgroup_mma_wait(0, deps=(acc,))
        _epilogue(acc, out, o_smem, a_scale_ptr, w_scale_ptr, rows_ptr, this, M, N, T, strides,
                  acc_layout, MASKED, STORE_TMA, BLOCK_M, BLOCK_N)  # fmt: skip
    if STORE_TMA:
        tma.store_wait(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


@gluon.jit
def _ws_slot(ring, j, kb, k_tiles, STAGES: gl.constexpr, RINGS: gl.constexpr):
    """WS: (count in its ring, stage) of K step ``kb`` of the program's ``j``-th live tile, which
    ring ``ring`` (= j % RINGS) holds; the TMA warp and the MMA warpgroups address stages by it."""
    c = j // RINGS * k_tiles + kb
    return c, ring * STAGES + c % STAGES


@gluon.jit
def _ws_load(a_desc, w_desc, a_bufs, w_bufs, ready, empty, rows_ptr, M, N, K, E, T,
             MASKED: gl.constexpr, E_PAD: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
             STAGES: gl.constexpr, RINGS: gl.constexpr, GATE: gl.constexpr):  # fmt: skip
    """WS's TMA warp: every K step of the program's live tiles, in order, into the ring of the
    warpgroup that takes the tile (RINGS 1: the one ring both share; a stage refilled once the
    MMAs that read it signal ``empty``). GATE: w holds 2N rows an expert, N gate rows then N up
    rows, and a stage takes both halves of the tile's columns."""
    k_tiles, ends, num_tiles, step, first = _walk(rows_ptr, M, N, K, E, T, MASKED, E_PAD, BLOCK_M,
                                                  BLOCK_N, BLOCK_K, GROUP_M, 1)  # fmt: skip
    tile, expert, row_a, t0, pid_n = first
    j = 0
    while tile < num_tiles:
        row_w = expert * (2 * N if GATE else N) + pid_n * BLOCK_N
        for kb in range(k_tiles):
            c, s = _ws_slot(j % RINGS, j, kb, k_tiles, STAGES, RINGS)
            # (a barrier starts with its phase before 0 complete: the first round waits on none)
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            if GATE:
                _load_gate_step(a_desc, w_desc, a_bufs, w_bufs, ready, s, row_a, row_w, N, kb,
                                BLOCK_N, BLOCK_K)  # fmt: skip
            else:
                _load_step(a_desc, w_desc, a_bufs, w_bufs, ready, s, row_a, row_w, kb, BLOCK_K)
        j += 1
        tile, expert, row_a, t0, pid_n = _live_tile(tile + step, num_tiles, step, rows_ptr, ends,
                                                    M, N, T, MASKED, BLOCK_M, BLOCK_N,
                                                    GROUP_M)  # fmt: skip


@gluon.jit
def _ws_mma(a_bufs, w_bufs, ready, empty, o_smem, a_scale_ptr, w_scale_ptr, rows_ptr, out, M, N,
            K, E, T, strides, PART: gl.constexpr, MASKED: gl.constexpr, E_PAD: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
            GROUP_M: gl.constexpr, STAGES: gl.constexpr, STORE_TMA: gl.constexpr):  # fmt: skip
    """WS's warpgroup PART (0 / 1): the MMAs and epilogue of every other live tile of the
    program, from its own ring of STAGES (a ring per warpgroup: each is filled and drained in
    order, so a barrier's parity never stands for a fill two rounds back), its epilogue under
    the other warpgroup's MMAs."""
    acc_layout: gl.constexpr = _acc_layout(BLOCK_M, BLOCK_N, 4, a_bufs.dtype)
    o_buf = o_smem.index(PART) if STORE_TMA else o_smem
    k_tiles, ends, num_tiles, step, first = _walk(rows_ptr, M, N, K, E, T, MASKED, E_PAD, BLOCK_M,
                                                  BLOCK_N, BLOCK_K, GROUP_M, 4)  # fmt: skip
    FP8: gl.constexpr = a_bufs.dtype == gl.float8e4nv
    tile, expert, row_a, t0, pid_n = first
    j = 0
    while tile < num_tiles:
        if j % 2 == PART:
            scales = _tile_scales(a_scale_ptr, w_scale_ptr, rows_ptr, (expert, row_a, t0, pid_n),
                                  M, T, strides, acc_layout, MASKED, BLOCK_M, BLOCK_N)  # fmt: skip
            acc = gl.zeros((BLOCK_M, BLOCK_N), _acc_dtype(a_bufs.dtype), acc_layout)
            part = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)  # (fp8: a step's sum)
            for kb in range(k_tiles):
                c, s = _ws_slot(PART, j, kb, k_tiles, STAGES, 2)
                mbarrier.wait(ready.index(s), (c // STAGES) & 1)
                acc, part = _mma_step(acc, part, a_bufs.index(s),
                                      w_bufs.index(s).permute((1, 0)), scales, kb,
                                      BLOCK_K)  # fmt: skip
                # the stage whose MMA is done is free: fp8 this step's, else step kb - 1's
                if FP8:
                    mbarrier.arrive(empty.index(PART * STAGES + c % STAGES))
                else:
                    mbarrier.arrive(empty.index(PART * STAGES + (c + STAGES - 1) % STAGES),
                                    pred=kb > 0)  # fmt: skip
            if not FP8:
                acc = warpgroup_mma_wait(0, deps=(acc,))
                last = (j // 2 * k_tiles + k_tiles - 1) % STAGES
                mbarrier.arrive(empty.index(PART * STAGES + last))
            _epilogue(acc, out, o_buf, a_scale_ptr, w_scale_ptr, rows_ptr,
                      (expert, row_a, t0, pid_n), M, N, T, strides, acc_layout, MASKED,
                      STORE_TMA, BLOCK_M, BLOCK_N)  # fmt: skip
        j += 1
        tile, expert, row_a, t0, pid_n = _live_tile(tile + step, num_tiles, step, rows_ptr, ends,
                                                    M, N, T, MASKED, BLOCK_M, BLOCK_N,
                                                    GROUP_M)  # fmt: skip
    if STORE_TMA:
        tma.store_wait(0)


@gluon.jit
def _ws_coop(a_bufs, w_bufs, ready, empty, o_smem, a_scale_ptr, w_scale_ptr, rows_ptr, out, M, N,
             K, E, T, strides, PART: gl.constexpr, MASKED: gl.constexpr, E_PAD: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
             GROUP_M: gl.constexpr, STAGES: gl.constexpr, STORE_TMA: gl.constexpr,
             GATE: gl.constexpr):  # fmt: skip
    """COOP's warpgroup PART (0 / 1): rows PART * BLOCK_M / 2 on of every live tile of the
    program, from the ring both read (each stage freed by both warpgroups' arrivals), then those
    rows' epilogue. GATE: GEMM1 + gate (bf16 operands, the plain SiLU), a gate and an up
    accumulator from the two halves of each stage's w tile, then :func:`_gate_epilogue`."""
    HALF: gl.constexpr = BLOCK_M // 2
    acc_layout: gl.constexpr = _acc_layout(HALF, BLOCK_N, 4, a_bufs.dtype)
    o_buf = o_smem.index(PART) if STORE_TMA else o_smem
    k_tiles, ends, num_tiles, step, first = _walk(rows_ptr, M, N, K, E, T, MASKED, E_PAD, BLOCK_M,
                                                  BLOCK_N, BLOCK_K, GROUP_M, 4)  # fmt: skip
    tile, expert, row_a, t0, pid_n = first
    c = 0  # K steps consumed: stage = c % STAGES
    while tile < num_tiles:
        acc = gl.zeros((HALF, BLOCK_N), _acc_dtype(a_bufs.dtype), acc_layout)
        acc_u = acc  # (GATE: the up rows' sums; else unused)
        for kb in range(k_tiles):
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            a_rows = a_bufs.index(s).slice(PART * HALF, HALF)
            if GATE:
                w = w_bufs.index(s)
                acc = warpgroup_mma(a_rows, w.slice(0, BLOCK_N).permute((1, 0)), acc,
                                    is_async=True)  # fmt: skip
                acc_u = warpgroup_mma(a_rows, w.slice(BLOCK_N, BLOCK_N).permute((1, 0)), acc_u,
                                      is_async=True)  # fmt: skip
                acc, acc_u, _, _ = warpgroup_mma_wait(2, deps=(acc, acc_u, a_rows, w))
            else:
                acc = warpgroup_mma(a_rows, w_bufs.index(s).permute((1, 0)), acc, is_async=True)
                acc, _, _ = warpgroup_mma_wait(1, deps=(acc, a_rows, w_bufs.index(s)))
            # step kb - 1's MMAs are done: this warpgroup is through with its stage
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=kb > 0)
            c += 1
        if GATE:
            acc, acc_u = warpgroup_mma_wait(0, deps=(acc, acc_u))
        else:
            acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))
        if GATE:
            _gate_epilogue(acc, acc_u, out, o_buf, row_a + PART * HALF, pid_n, BLOCK_N)
        else:
            _epilogue(acc, out, o_buf, a_scale_ptr, w_scale_ptr, rows_ptr,
                      (expert, row_a + PART * HALF, t0 + PART * HALF, pid_n), M, N, T, strides,
                      acc_layout, MASKED, STORE_TMA, HALF, BLOCK_N)  # fmt: skip
        tile, expert, row_a, t0, pid_n = _live_tile(tile + step, num_tiles, step, rows_ptr, ends,
                                                    M, N, T, MASKED, BLOCK_M, BLOCK_N,
                                                    GROUP_M)  # fmt: skip
    if STORE_TMA:
        tma.store_wait(0)


@gluon.jit
def _ws_part(a_bufs, w_bufs, ready, empty, o_smem, a_scale_ptr, w_scale_ptr, rows_ptr, out, M, N,
             K, E, T, strides, PART: gl.constexpr, MASKED: gl.constexpr, E_PAD: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
             GROUP_M: gl.constexpr, STAGES: gl.constexpr, STORE_TMA: gl.constexpr,
             COOP: gl.constexpr, GATE: gl.constexpr):  # fmt: skip
    """MMA warpgroup PART of :func:`_ws`: :func:`_ws_coop` if COOP (GATE: GEMM1 + gate's),
    else :func:`_ws_mma`."""
    if COOP:
        _ws_coop(a_bufs, w_bufs, ready, empty, o_smem, a_scale_ptr, w_scale_ptr, rows_ptr, out, M,
                 N, K, E, T, strides, PART, MASKED, E_PAD, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                 STAGES, STORE_TMA, GATE)  # fmt: skip
    else:
        _ws_mma(a_bufs, w_bufs, ready, empty, o_smem, a_scale_ptr, w_scale_ptr, rows_ptr, out, M,
                N, K, E, T, strides, PART, MASKED, E_PAD, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                STAGES, STORE_TMA)  # fmt: skip


@gluon.jit
def _ws(
    a_desc, w_desc, a_scale_ptr, w_scale_ptr, rows_ptr, out, M, N, K, E, T, strides,
    MASKED: gl.constexpr, E_PAD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    STORE_TMA: gl.constexpr, COOP: gl.constexpr, GATE: gl.constexpr,
):  # fmt: skip
    """:func:`_persistent`'s tiles warp-specialized (num_warps 4: the first MMA warpgroup):
    two MMA warpgroups take the program's live tiles in turn (232 registers each: a 128x128
    int32 accumulator and the epilogue's), one TMA warp fills a ring of STAGES for each. COOP:
    the two take the halves of every tile instead (64x256 each), from one ring. GATE (with COOP):
    GEMM1 + gate, a w stage of the tile's gate and up rows (:func:`_ws_coop`)."""
    RINGS: gl.constexpr = 1 if COOP else 2
    W_ROWS: gl.constexpr = 2 * BLOCK_N if GATE else BLOCK_N
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [RINGS * STAGES, BLOCK_M, BLOCK_K],
                                       a_desc.layout)  # fmt: skip
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [RINGS * STAGES, W_ROWS, BLOCK_K],
                                       w_desc.layout)  # fmt: skip
    ready = gl.allocate_shared_memory(gl.int64, [RINGS * STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RINGS * STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RINGS * STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2 if COOP else 1)  # (COOP: both warpgroups read it)
    o_smem = out  # (without STORE_TMA: unused)
    if STORE_TMA:  # (one staging tile per MMA warpgroup: COOP's out descriptor is half a tile)
        OUT_M: gl.constexpr = BLOCK_M // 2 if COOP else BLOCK_M
        o_smem = gl.allocate_shared_memory(gl.bfloat16, [2, OUT_M, BLOCK_N], out.layout)
    # (each partition walks the live tiles itself: a worker partition takes no tensors, and the
    # masked layout's running sum is one)
    gl.warp_specialize([
        (_ws_part, (a_bufs, w_bufs, ready, empty, o_smem, a_scale_ptr, w_scale_ptr, rows_ptr, out,
                    M, N, K, E, T, strides, 0, MASKED, E_PAD, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                    STAGES, STORE_TMA, COOP, GATE)),
        (_ws_part, (a_bufs, w_bufs, ready, empty, o_smem, a_scale_ptr, w_scale_ptr, rows_ptr, out,
                    M, N, K, E, T, strides, 1, MASKED, E_PAD, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                    STAGES, STORE_TMA, COOP, GATE)),
        (_ws_load, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, rows_ptr, M, N, K, E, T, MASKED,
                    E_PAD, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, RINGS, GATE)),
    ], [4, 1], [232, 40])  # fmt: skip


@gluon.jit
def _contiguous_gluon_kernel(
    # the Triton contiguous kernel's arguments (a, w: Gluon TMA descriptors; out one with
    # STORE_TMA, else a pointer; a_rows and the a / w strides unused: the descriptors hold them)
    a_desc, w_desc, a_scale_ptr, w_scale_ptr, m_indices_ptr, a_rows_ptr, out,
    M, N, K, E,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_asm, stride_ask,
    stride_wse, stride_wsn, stride_wsk, stride_om, stride_on,
    QUANT: gl.constexpr, SCALE_K: gl.constexpr, GATHER: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, TMA: gl.constexpr,
    GLUON: gl.constexpr, STAGES: gl.constexpr, STORE_TMA: gl.constexpr, num_warps: gl.constexpr,
    WS: gl.constexpr = False, COOP: gl.constexpr = False,
):  # fmt: skip
    strides = (0, stride_asm, stride_wse, stride_wsn, 0, stride_om, stride_on, stride_ask,
               stride_wsk)  # fmt: skip
    if WS:
        _ws(a_desc, w_desc, a_scale_ptr, w_scale_ptr, m_indices_ptr, out, M, N, K, E, 1, strides,
            False, 1, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, STORE_TMA, COOP,
            False)  # fmt: skip
    else:
        _persistent(a_desc, w_desc, a_scale_ptr, w_scale_ptr, m_indices_ptr, out, M, N, K, E, 1,
                    strides, False, 1, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, STORE_TMA,
                    num_warps)  # fmt: skip


@gluon.jit
def _masked_gluon_kernel(
    # the Triton masked kernel's arguments (a `[E * T, K]`, w: Gluon TMA descriptors; out one of
    # `[E * T, N]` with STORE_TMA, else a pointer; the a / w strides unused: the descriptors hold
    # them)
    a_desc, w_desc, a_scale_ptr, w_scale_ptr, masked_m_ptr, out_ptr, ok_ptr,
    T, N, K, E,
    stride_ae, stride_at, stride_ak, stride_we, stride_wn, stride_wk,
    stride_ase, stride_ast, stride_ask, stride_wse, stride_wsn, stride_wsk,
    stride_oe, stride_ot, stride_on,
    QUANT: gl.constexpr, SCALE_K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr, M_SPLIT: gl.constexpr, CHECK: gl.constexpr, E_PAD: gl.constexpr,
    TMA: gl.constexpr, GLUON: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
    WS: gl.constexpr = False, COOP: gl.constexpr = False, STORE_TMA: gl.constexpr = False,
):  # fmt: skip
    if CHECK:  # the op's value check, without launches of its own: ok = all counts in [0, T]
        if gl.program_id(0) == 0:
            ex = gl.arange(0, E_PAD, gl.BlockedLayout([1], [32], [num_warps], [0]))
            c = gl.load(masked_m_ptr + ex, mask=ex < E, other=0)
            n_bad = gl.sum(((c < 0) | (c > T)).to(gl.int32), axis=0)
            gl.store(ok_ptr + ex, (ex * 0 + n_bad) == 0, mask=ex < 1)
    # (counts clamped to T: a bad count never reads past its expert's slot)
    strides = (stride_ase, stride_ast, stride_wse, stride_wsn, stride_oe, stride_ot, stride_on,
               stride_ask, stride_wsk)  # fmt: skip
    if WS:
        _ws(a_desc, w_desc, a_scale_ptr, w_scale_ptr, masked_m_ptr, out_ptr, E * T, N, K, E, T,
            strides, True, E_PAD, BLOCK_M, BLOCK_N, BLOCK_K, 1, STAGES, STORE_TMA, COOP,
            False)  # fmt: skip
    else:
        _persistent(a_desc, w_desc, a_scale_ptr, w_scale_ptr, masked_m_ptr, out_ptr, E * T, N, K,
                    E, T, strides, True, E_PAD, BLOCK_M, BLOCK_N, BLOCK_K, 1, STAGES, STORE_TMA,
                    num_warps)  # fmt: skip


@gluon.jit
def _gate_gluon_kernel(
    # the Triton GEMM1 + gate kernel's arguments (a `[M, K]`, w `[E * 2I, K]`: Gluon TMA
    # descriptors; h a descriptor of `[M, I]`; the scale, bias and h-scale pointers, a_rows and
    # the strides unused: bf16, the plain SiLU, no bias, no gather)
    a_desc, w_desc, a_scale_ptr, w_scale_ptr, m_indices_ptr, a_rows_ptr, b_ptr, h_desc, hs_ptr,
    M, I, K, E,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_asm, stride_ask,
    stride_wse, stride_wsn, stride_wsk, stride_be, stride_bw, stride_hm, stride_hn,
    stride_hsm, stride_hsg,
    QUANT: gl.constexpr, SCALE_K: gl.constexpr, HAS_BIAS: gl.constexpr, FAST: gl.constexpr,
    GATHER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr, ACT: gl.constexpr, ALPHA: gl.constexpr, LIMIT: gl.constexpr,
    CLAMP_AFTER: gl.constexpr, UP_OFFSET: gl.constexpr, GLU: gl.constexpr,
    GATE_SOFTCAP: gl.constexpr, UP_SOFTCAP: gl.constexpr, TMA: gl.constexpr,
    GLUON: gl.constexpr, STAGES: gl.constexpr, STORE_TMA: gl.constexpr, num_warps: gl.constexpr,
    WS: gl.constexpr = False, COOP: gl.constexpr = False,
):  # fmt: skip
    gl.static_assert(QUANT == 0 and not HAS_BIAS and not GATHER and FAST and COOP and STORE_TMA)
    gl.static_assert(ACT == 0 and ALPHA == 1.0 and LIMIT == 0.0 and UP_OFFSET == 0.0 and GLU)
    gl.static_assert(GATE_SOFTCAP == 0.0 and UP_SOFTCAP == 0.0)
    _ws(a_desc, w_desc, a_scale_ptr, w_scale_ptr, m_indices_ptr, h_desc, M, I, K, E, 1,
        (0, 0, 0, 0, 0, 0, 0, 0, 0), False, 1, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, True,
        True, True)  # fmt: skip


@gluon.constexpr_function
def _is_int(dtype):
    return dtype == gl.int8 or dtype == gl.int32


@gluon.constexpr_function
def _acc_dtype(dtype):
    """The wgmma accumulator of operands of ``dtype``: int32 for int8, else float32."""
    return gl.int32 if _is_int(dtype) else gl.float32


@gluon.constexpr_function
def _acc_layout(block_m, block_n, num_warps, dtype):
    """The wgmma accumulator's layout of a `[block_m, block_n]` tile over num_warps, operands of
    ``dtype`` (int8 / fp8: K 32 an instruction; bf16: 16)."""
    n = _instr_n(block_m, block_n, num_warps, 224 if _is_int(dtype) else 256)
    k = 32 if dtype.primitive_bitwidth == 8 else 16
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, n, k])  # fmt: skip


@gluon.constexpr_function
def _instr_n(block_m, block_n, num_warps, widest):
    """The widest wgmma N (a multiple of 16 up to ``widest``: int8 224, bf16 256) dividing each
    warp's share of N."""
    per_warp_n = max(block_n // max(1, num_warps // max(1, block_m // 16)), 8)
    n = widest
    while n > per_warp_n or block_n % n:
        n -= 16
    return n


_GL_DTYPES = {torch.int8: gl.int8, torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}


@functools.cache  # (per call otherwise: the descriptors are made at every launch)
def _layout(shape, dtype):
    return gl.NVMMASharedLayout.get_default_for(list(shape), dtype)


def descriptors(a, w, out, block_m: int, block_n: int, block_k: int, store_tma: bool,
                out_rows: int = 0):  # fmt: skip
    """The kernels' a int8, fp8 or bf16 `[M, K]` (masked: `[E, T, K]`, as `[E * T, K]`), w `[E, N,
    K]` of a's dtype (as `[E * N, K]`) and out bf16 `[M, N]`: TMA descriptors of their tiles (out:
    the tensor itself without ``store_tma``; its tile ``out_rows`` rows, else block_m: COOP stores
    half tiles)."""
    k, dtype = a.shape[-1], _GL_DTYPES[a.dtype]
    a_d = TensorDescriptor(a, [a.numel() // k, k], [a.stride(-2), 1], [block_m, block_k],
                           _layout((block_m, block_k), dtype))  # fmt: skip
    w_d = TensorDescriptor(w, [w.shape[0] * w.shape[1], k], [w.stride(1), 1], [block_n, block_k],
                           _layout((block_n, block_k), dtype))  # fmt: skip
    if not store_tma:
        return a_d, w_d, out
    rows = out_rows or block_m
    o_d = TensorDescriptor(out, list(out.shape), [out.stride(0), 1], [rows, block_n],
                           _layout((rows, block_n), gl.bfloat16))  # fmt: skip
    return a_d, w_d, o_d
