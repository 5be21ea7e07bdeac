"""The deepep backend.

CPU (gloo ranks, deep_ep not needed): lean import, fake static shapes and handle layouts (also under
make_fx symbolic tracing), validation errors, the shared-buffer registry, ``ll_combine(out=)``.

Two GPUs (NCCL, deep_ep; ``multi_gpu``): EPMoE(backend="deepep") vs the torch backend and the
references for every mode and scheme; dispatch routing vs the torch backend; worst-case HT and LL
dispatch+combine captured in CUDA graphs and replayed with fresh inputs; 20 identical repeats;
HT <-> LL switching on one shared buffer. Each GPU test spawns its own 2 processes (deep_ep allows
one NVSHMEM buffer per process) and releases the deep_ep buffers before returning.

What "same routing" means (rows arrive in a different order per backend): HT - the multiset of
received rows, each row compared bit for bit as (payload bytes, scale bytes, local ids, weights of
the local entries; deep_ep zeroes the weights of -1 entries, the torch backend keeps them), plus
identical received counts, expert_counts and is_token_in_rank. LL - identical masked_m and, per
local expert, the multiset of its first masked_m rows (bf16: bit for bit; fp8: the source token
decoded from an anchor column, then the dequantized rows within LAYER_VS_QUANT_AWARE, since deep_ep
casts to fp8 with its own kernel).
"""

import functools
import hashlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv, statically_known_true

import epmoe
from benchmarks._baselines import raw_ht_combine, raw_ht_dispatch, raw_ll_combine, raw_ll_dispatch
from epmoe import comm as epcomm
from epmoe import ops, reference
from epmoe._multiproc import run_ranks
from tests._moe import check_layer_output, global_weights, tokens
from tests._opcheck import opcheck
from tests._routing import random_ids, random_weights
from tests._tol import LAYER_VS_QUANT_AWARE, assert_close, rel_l2

# LL needs one of deep_ep's compiled hidden sizes; E = 8 global experts keeps the test small.
CFG = dict(num_experts=8, hidden_size=2048, intermediate_size=256, top_k=3)
MAX_TOKENS = 64
QUANTS = ("bf16", "fp8", "int8")
GPU_TIMEOUT = 900.0


# ----------------------------------------------------------------------------------- helpers
def _bytes(t: torch.Tensor) -> torch.Tensor:
    """`[R, ...]` any dtype -> uint8 `[R, bytes per row]` on the CPU."""
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8).reshape(t.shape[0], -1)


def _digest(*ts: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in ts:
        h.update(_bytes(t.reshape(1, -1)).numpy().tobytes())
    return h.hexdigest()


def _ht_rows(d) -> list:
    """Sorted received rows (bytes of payload | scales | local ids | weights of local entries)."""
    ids = d.topk_ids.detach().cpu()
    w = torch.where(ids >= 0, d.topk_weights.detach().cpu(), 0.0)
    parts = [_bytes(d.x)] + ([_bytes(d.x_scales)] if d.x_scales is not None else [])
    rows = torch.cat(parts + [_bytes(ids), _bytes(w)], dim=1)[(ids >= 0).any(dim=1)]
    return sorted(r.tobytes() for r in rows.numpy())


def _dequant(q: torch.Tensor, s) -> torch.Tensor:
    """float32 rows of a bf16/fp8/int8 payload (fp8: 128-channel groups; int8: one scale)."""
    if s is None:
        return q.float()
    return q.float() * s.float().repeat_interleave(q.shape[-1] // s.shape[-1], dim=-1)


def _anchored_tokens(T, rank, gen):
    """bf16 `[T, H]`: column 0 = 1 + (global token id), the rest in (-0.5, 0.5). Column 0 is the
    amax of its fp8 group, so it survives the fp8 cast exactly (q = 448) and names the token."""
    x = torch.rand((T, CFG["hidden_size"]), generator=gen) - 0.5
    x[:, 0] = torch.arange(T) + 1 + rank * T
    return x.bfloat16()


def _weighted_sum(x, ids, w):
    """float32 `[T, H]`: x[t] * sum of the weights of t's valid choices (identity experts)."""
    return x.float() * torch.where(ids >= 0, w, 0.0).sum(dim=1, keepdim=True)


def _ranks_per_token(ids, world, E):
    El = E // world
    return torch.stack([((ids >= 0) & (ids // El == r)).any(1) for r in range(world)], 1).sum(1)


def _new_comm(backend, **kw):
    kw.setdefault("max_tokens_per_rank", MAX_TOKENS)
    return epcomm.create(backend, dist.group.WORLD, CFG["num_experts"], CFG["hidden_size"], **kw)


def _release():
    from epmoe.comm import deepep

    torch.cuda.synchronize()
    dist.barrier()
    deepep.release_buffers()


# ================================================================================== CPU tests
def test_import_is_lean():
    """Importing the backend module loads neither deep_ep nor CUDA."""
    code = (
        "import sys, torch, epmoe, epmoe.comm.deepep as d; "
        "assert 'deep_ep' not in sys.modules, 'deep_ep imported'; "
        "assert not torch.cuda.is_initialized(), 'CUDA initialized'; print('ok')"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def _fake_rank(rank, world):
    from epmoe.comm import deepep

    E, H, K, T = CFG["num_experts"], CFG["hidden_size"], CFG["top_k"], 16
    El, ch = E // world, 12
    c = _new_comm("deepep", max_tokens_per_rank=T, num_sms=2 * ch)
    assert isinstance(c, deepep.DeepEPComm) and c.name == "deepep"
    assert "deep_ep" not in sys.modules  # fakes and validation never load it
    i32, f32, bf16, fp8 = torch.int32, torch.float32, torch.bfloat16, torch.float8_e4m3fn
    with FakeTensorMode(shape_env=ShapeEnv()):
        ids, w = torch.empty((T, K), dtype=torch.int64), torch.empty((T, K))
        for dtype, S in ((bf16, 0), (fp8, H // 128), (torch.int8, 1)):
            x = torch.empty((T, H), dtype=dtype)
            s = torch.empty((T, S)) if S else None
            for worst in (True, False):
                d = ops.ht_dispatch(x, ids, w, c.key, x_scales=s, worst_case=worst)
                n = d.x.shape[0]
                if worst:
                    assert n == world * T
                else:
                    assert isinstance(n, torch.SymInt) and not isinstance(n, int)
                assert d.x.dtype == dtype and tuple(d.x.shape[1:]) == (H,)
                assert (d.x_scales is None) == (S == 0)
                if S:
                    assert d.x_scales.dtype == f32 and d.x_scales.shape[1] == S
                assert d.topk_ids.dtype == torch.int64 and d.topk_ids.shape[1] == K
                assert d.topk_weights.dtype == f32 and d.expert_counts.shape == (El,)
                assert d.expert_counts.dtype == i32
                want = [
                    ((T, world), torch.bool),
                    ((world, world), i32),
                    ((world, ch), i32),
                    ((world, ch), i32),
                    ((n,), i32),
                    ((T, world), i32),
                ]
                assert len(d.handle) == len(want)
                for h, (shape, dt) in zip(d.handle, want, strict=True):
                    assert h.dtype == dt and len(h.shape) == len(shape)
                    assert all(
                        statically_known_true(a == b) for a, b in zip(h.shape, shape, strict=True)
                    )
                out = ops.ht_combine(torch.empty((n, H), dtype=bf16), d.handle, c.key)
                assert tuple(out.shape) == (T, H) and out.dtype == bf16
        x = torch.empty((T, H), dtype=bf16)
        C = world * T
        for use_fp8 in (False, True):
            d = ops.ll_dispatch(x, ids, c.key, use_fp8=use_fp8)
            assert d.x.shape == (El, C, H) and d.x.dtype == (fp8 if use_fp8 else bf16)
            if use_fp8:  # deep_ep's column-major (TMA) scale layout, declared by the fake
                assert d.x_scales.shape == (El, C, H // 128)
                assert d.x_scales.stride() == (C * H // 128, 1, C)
            else:
                assert d.x_scales is None
            assert d.masked_m.shape == (El,) and d.masked_m.dtype == i32
            assert [(tuple(h.shape), h.dtype) for h in d.handle] == [
                ((El, C), i32),
                ((El, world), torch.int64),
            ]
            y = torch.empty((El, C, H), dtype=bf16)
            assert ops.ll_combine(y, ids, w, d.handle, c.key).shape == (T, H)
            out = torch.empty((T, H), dtype=bf16)
            assert ops.ll_combine(y, ids, w, d.handle, c.key, out=out) is out
        # with max_tokens_per_rank the worst-case bound is world * max_tokens_per_rank
        wide = _new_comm("deepep", max_tokens_per_rank=24, num_sms=2 * ch)
        d = ops.ht_dispatch(x, ids, w, wide.key, worst_case=True)
        assert d.x.shape == (world * 24, H) and d.handle[4].shape == (world * 24,)
        assert d.handle[0].shape == (T, world)

    # symbolic tracing goes through the fakes only (no kernel, no deep_ep)
    def ht_exact(x, ids, w):
        d = ops.ht_dispatch(x, ids, w, c.key, worst_case=False)
        return ops.ht_combine(d.x, d.handle, c.key)

    def ll_step(x, ids, w):
        d = ops.ll_dispatch(x, ids, c.key, use_fp8=False)
        return ops.ll_combine(d.x, ids, w, d.handle, c.key)

    args = (torch.randn(T, H).bfloat16(), random_ids(T, K, E), random_weights(T, K))
    for fn, name in ((ht_exact, "epmoe.ht_dispatch_exact"), (ll_step, "epmoe.ll_dispatch")):
        gm = make_fx(fn, tracing_mode="symbolic")(*args)
        assert name in gm.code and "_combine" in gm.code
    assert "deep_ep" not in sys.modules
    return True


def test_fakes_static_shapes():
    assert run_ranks(_fake_rank, 2, "gloo") == [True, True]


def _validation_rank(rank, world):
    from epmoe.comm import deepep

    E, H, K, T = CFG["num_experts"], CFG["hidden_size"], CFG["top_k"], 16
    mk = _new_comm
    for kw, match in (
        (dict(num_sms=21), "EPMoE: num_sms expected a multiple of 2"),
        (dict(num_sms=0), "EPMoE: num_sms expected a positive int"),
        (dict(num_nvl_bytes=1000), "EPMoE: num_nvl_bytes expected a multiple of 128"),
        (dict(max_tokens_per_rank=0), "EPMoE: max_tokens_per_rank expected a positive int"),
    ):
        with pytest.raises(ValueError, match=match):
            mk("deepep", **kw)
    with pytest.raises(ValueError, match="EPMoE: num_experts expected a multiple of"):
        epcomm.create("deepep", dist.group.WORLD, 7, H)

    c = mk("deepep", max_tokens_per_rank=T)
    small = mk("deepep", max_tokens_per_rank=T, num_nvl_bytes=1 << 20)
    odd = mk("deepep", max_tokens_per_rank=1)  # world * 1 is not a multiple of 4
    deep = mk("deepep", max_tokens_per_rank=600)  # 2 * 601 > NVSHMEM_QP_DEPTH (1024)
    no_ll = mk("deepep", max_tokens_per_rank=None)
    with FakeTensorMode(shape_env=ShapeEnv()):
        ids, w = torch.empty((T, K), dtype=torch.int64), torch.empty((T, K))
        x = torch.empty((T, H), dtype=torch.bfloat16)
        cases = [
            (
                lambda: ops.ht_dispatch(x, ids, w, c.key, x_scales=torch.empty((T, 1))),
                "dispatch: x_scales expected None with a torch.bfloat16 payload",
            ),
            (
                lambda: ops.ht_dispatch(x, ids, w, small.key),
                "dispatch: num_nvl_bytes expected at least",
            ),
            (
                lambda: ops.ll_dispatch(
                    torch.empty((T + 1, H), dtype=torch.bfloat16),
                    torch.empty((T + 1, K), dtype=torch.int64),
                    c.key,
                ),
                "ll_dispatch: x expected at most max_tokens_per_rank=16 tokens, got 17",
            ),
            (
                lambda: ops.ll_dispatch(x[:1], ids[:1], odd.key),
                "ll_dispatch: max_tokens_per_rank expected world_size \\* max_tokens_per_rank a "
                "multiple of 4",
            ),
            (
                lambda: ops.ll_dispatch(x, ids, deep.key),
                "ll_dispatch: max_tokens_per_rank expected at most 511",
            ),
            (
                lambda: ops.ll_dispatch(x, ids, no_ll.key),
                "ll_dispatch: max_tokens_per_rank expected a positive int for LL mode",
            ),
        ]
        for fn, match in cases:
            with pytest.raises(ValueError, match=match):
                fn()
        # LL: only deep_ep's compiled hidden sizes
        c2 = epcomm.create("deepep", dist.group.WORLD, E, 1024, max_tokens_per_rank=T)
        with pytest.raises(ValueError, match="ll_dispatch: hidden_size expected one of"):
            ops.ll_dispatch(torch.empty((T, 1024), dtype=torch.bfloat16), ids, c2.key)
        # intranode HT rows: int4 pairs (2064 int8 bytes is not a multiple of 32), <= 16352 bytes
        for h, dtype in ((2064, torch.int8), (8192, torch.bfloat16)):
            c3 = epcomm.create("deepep", dist.group.WORLD, E, h)
            with pytest.raises(
                ValueError,
                match="dispatch: x expected rows of a multiple of 32 "
                "bytes, at most 16352, for deep_ep, got",
            ):
                ops.ht_dispatch(
                    torch.empty((T, h), dtype=dtype),
                    ids,
                    w,
                    c3.key,
                    x_scales=torch.empty((T, 1)) if h == 2064 else None,
                )

    # registry: layers over the same ranks share one entry per kind; share_buffer -> "shared"
    ranks = tuple(range(world))
    ht, ll = deepep._BUFFERS[(ranks, "ht")], deepep._BUFFERS[(ranks, "ll")]
    assert id(c) in ht.needs and id(c) in ll.needs and id(small) in ht.needs
    assert ht.buffer is None and ll.buffer is None  # nothing allocated before first use
    sh = mk("deepep", share_buffer=True)
    assert id(sh) in deepep._BUFFERS[(ranks, "shared")].needs
    sh.close()
    assert id(sh) not in deepep._BUFFERS[(ranks, "shared")].needs
    with pytest.raises(ValueError, match="deepep: mode expected one of"):
        c.prepare(("xx",))
    return True


def test_validation_errors():
    assert run_ranks(_validation_rank, 2, "gloo") == [True, True]


def _world3_rank(rank, world):
    H, K, T = CFG["hidden_size"], CFG["top_k"], 4
    c = epcomm.create("deepep", dist.group.WORLD, 6, H, max_tokens_per_rank=T)
    with FakeTensorMode(shape_env=ShapeEnv()):
        x = torch.empty((T, H), dtype=torch.bfloat16)
        ids, w = torch.empty((T, K), dtype=torch.int64), torch.empty((T, K))
        with pytest.raises(ValueError, match=r"dispatch: world_size expected one of \(2, 4, 8\)"):
            ops.ht_dispatch(x, ids, w, c.key, worst_case=True)
        d = ops.ll_dispatch(x, ids, c.key)  # LL has no such restriction (3 * 4 % 4 == 0)
        assert d.x.shape == (2, 3 * T, H)
    return True


def test_world_three_rejected_for_ht_only():
    assert run_ranks(_world3_rank, 3, "gloo") == [True] * 3


def _world1_rank(rank, world):
    with pytest.raises(ValueError, match="EPMoE: backend expected 'local' for a group of one rank"):
        epcomm.create("deepep", dist.group.WORLD, 8, CFG["hidden_size"])
    return True


def test_world_one_rejected():
    assert run_ranks(_world1_rank, 1, "gloo") == [True]


def test_ll_combine_out_matches_functional(seed):
    """The ``out=`` variant (epmoe::ll_combine_out) writes what the functional op returns."""
    T, H, K, E = 6, 128, 2, 8
    c = epcomm.create("local", None, E, H, max_tokens_per_rank=8)
    x, ids, w = torch.randn(T, H).bfloat16(), random_ids(T, K, E), random_weights(T, K)
    d = ops.ll_dispatch(x, ids, c.key)
    y = (d.x.float() * 1.5).bfloat16()
    want = ops.ll_combine(y, ids, w, d.handle, c.key)
    out = torch.full((T, H), 7.0, dtype=torch.bfloat16)
    assert ops.ll_combine(y, ids, w, d.handle, c.key, out=out) is out
    assert torch.equal(out, want)
    opcheck(torch.ops.epmoe.ll_combine_out.default, (y, ids, w, list(d.handle), c.key, out))
    for bad, match in (
        (torch.empty((T, H), dtype=torch.float32), "ll_combine: out expected dtype torch.bfloat16"),
        (torch.empty((T + 1, H), dtype=torch.bfloat16), r"ll_combine: out expected shape \[6, 12"),
        (torch.empty((H, T), dtype=torch.bfloat16).t(), "ll_combine: out expected a contiguous"),
    ):
        with pytest.raises(ValueError, match=match):
            ops.ll_combine(y, ids, w, d.handle, c.key, out=bad)


# ================================================================================== GPU tests
def _layer_rank(rank, world, mode, worst):
    """EPMoE deepep vs torch backend vs references, every scheme; returns failure messages."""
    dev = torch.device("cuda", rank)
    w1, w2 = global_weights(**CFG)
    # the same T on every rank (worst-case HT needs it), different tokens per rank
    x, ids, w = tokens(MAX_TOKENS, seed=100 + rank, **CFG)
    fails = []
    for quant in QUANTS:
        outs = {}
        for backend in ("deepep", "torch"):
            layer = epmoe.EPMoE(
                **CFG,
                quant=quant,
                mode=mode,
                group=dist.group.WORLD,
                backend=backend,
                max_tokens_per_rank=MAX_TOKENS,
                worst_case=worst,
                device=dev,
            )
            assert layer.comm.name == backend
            layer.load_weights(w1, w2)
            outs[backend] = layer(x.to(dev), ids.to(dev), w.to(dev)).cpu()
        try:
            check_layer_output(outs["deepep"], x, ids, w, w1, w2, quant)
        except AssertionError as e:
            fails.append(f"rank {rank} {mode} worst={worst} {quant}: {e}")
        e = rel_l2(outs["deepep"], outs["torch"])
        if not e < LAYER_VS_QUANT_AWARE:
            fails.append(f"rank {rank} {mode} worst={worst} {quant}: vs torch rel L2 {e:.4g}")
    _release()
    return fails


@pytest.mark.multi_gpu
@pytest.mark.slow
@pytest.mark.parametrize("mode,worst", [("ht", False), ("ht", True), ("ll", False)])
def test_layer_matches_torch_backend_and_references(mode, worst):
    fails = run_ranks(_layer_rank, 2, "nccl", mode, worst, timeout=GPU_TIMEOUT)
    assert fails == [[], []], "\n".join(sum(fails, []))


def _ht_routing_rank(rank, world):
    E, H, K = CFG["num_experts"], CFG["hidden_size"], CFG["top_k"]
    fails = []
    # worst-case bound T (same T everywhere) or max_tokens_per_rank (ranks hold different T)
    for max_tokens, T in ((None, 48), (MAX_TOKENS, (48, 40)[rank])):
        dp = _new_comm("deepep", max_tokens_per_rank=max_tokens)
        tc = _new_comm("torch", max_tokens_per_rank=max_tokens)
        g = torch.Generator().manual_seed(10 + rank)
        x = torch.randn((T, H), generator=g).bfloat16()
        ids, w = random_ids(T, K, E, 0.2, g), random_weights(T, K, g)
        fails += _ht_routing_cases(rank, world, dp, tc, x, ids, w, f"max_tokens={max_tokens}")
    _release()
    return fails


def _ht_routing_cases(rank, world, dp, tc, x, ids, w, what):
    dev, E = torch.device("cuda", rank), CFG["num_experts"]
    fails = []
    for quant in QUANTS:
        xq, s = (x, None) if quant == "bf16" else reference.quantize(x, quant)
        args = [t.to(dev) for t in (xq, ids, w)]
        s_d = None if s is None else s.to(dev)
        for worst in (False, True):
            tag = f"rank {rank} {what} {quant} worst={worst}"
            got = ops.ht_dispatch(*args, dp.key, x_scales=s_d, worst_case=worst)
            ref = ops.ht_dispatch(*args, tc.key, x_scales=s_d, worst_case=worst)
            if got.x.shape[0] != ref.x.shape[0]:
                fails.append(f"{tag}: N {got.x.shape[0]} != torch {ref.x.shape[0]}")
            if _ht_rows(got) != _ht_rows(ref):
                fails.append(f"{tag}: received rows differ from the torch backend")
            if not torch.equal(got.expert_counts.cpu(), ref.expert_counts.cpu()):
                fails.append(f"{tag}: expert_counts {got.expert_counts} != {ref.expert_counts}")
            if not torch.equal(got.handle[0].cpu(), ref.handle[0].cpu()):
                fails.append(f"{tag}: is_token_in_rank differs")
            valid = (got.topk_ids >= 0).any(dim=1).cpu()
            nv = int(valid.sum())
            if not (valid[:nv].all() and not valid[nv:].any()):
                fails.append(f"{tag}: padding rows are not all at the end with ids -1")
            if int(got.expert_counts.sum()) != int((got.topk_ids >= 0).sum()):
                fails.append(f"{tag}: expert_counts do not sum to the local entries")
            # combine sums each token's rows home: send dequantized rows back
            back = [
                ops.ht_combine(_dequant(d.x, d.x_scales).bfloat16(), d.handle, k).cpu()
                for d, k in ((got, dp.key), (ref, tc.key))
            ]
            try:
                assert_close(back[0], back[1])
                want = _dequant(xq, s) * _ranks_per_token(ids, world, E).unsqueeze(1)
                assert_close(back[0], want.bfloat16())
            except AssertionError as e:
                fails.append(f"{tag}: combine: {e}")
    return fails


@pytest.mark.multi_gpu
@pytest.mark.slow
def test_ht_dispatch_routing_matches_torch_backend():
    fails = run_ranks(_ht_routing_rank, 2, "nccl", timeout=GPU_TIMEOUT)
    assert fails == [[], []], "\n".join(sum(fails, []))


def _ll_expert_rows(d, e):
    """(token ids, float32 rows) of local expert e's live rows, sorted by token id."""
    m = int(d.masked_m[e])
    rows = _dequant(d.x[e, :m], None if d.x_scales is None else d.x_scales[e, :m]).cpu()
    tok = rows[:, 0].round().long() - 1
    order = tok.argsort()
    return tok[order], rows[order], d.x[e, :m].cpu()[order]


def _ll_routing_rank(rank, world):
    dev = torch.device("cuda", rank)
    E, K, T = CFG["num_experts"], CFG["top_k"], MAX_TOKENS
    dp, tc = _new_comm("deepep"), _new_comm("torch")
    g = torch.Generator().manual_seed(20 + rank)
    x = _anchored_tokens(T, rank, g)
    ids, w = random_ids(T, K, E, 0.2, g), random_weights(T, K, g)
    xd, idsd, wd = x.to(dev), ids.to(dev), w.to(dev)
    fails = []
    for use_fp8 in (False, True):
        tag = f"rank {rank} use_fp8={use_fp8}"
        got = ops.ll_dispatch(xd, idsd, dp.key, use_fp8=use_fp8)
        ref = ops.ll_dispatch(xd, idsd, tc.key, use_fp8=use_fp8)
        if not torch.equal(got.masked_m.cpu(), ref.masked_m.cpu()):
            fails.append(f"{tag}: masked_m {got.masked_m} != torch {ref.masked_m}")
        else:
            for e in range(E // world):
                tg, rg, bg = _ll_expert_rows(got, e)
                tr, rr, br = _ll_expert_rows(ref, e)
                if not torch.equal(tg, tr):
                    fails.append(f"{tag}: expert {e} receives other tokens")
                elif not use_fp8 and not torch.equal(_bytes(bg), _bytes(br)):
                    fails.append(f"{tag}: expert {e} rows differ")
                elif use_fp8 and tg.numel() and not rel_l2(rg, rr) < LAYER_VS_QUANT_AWARE:
                    fails.append(f"{tag}: expert {e} fp8 rows rel L2 {rel_l2(rg, rr):.4g}")
        # combine the received rows unchanged (identity experts); keeps dispatch/combine pairs
        y = _dequant(got.x, got.x_scales).bfloat16()
        out = ops.ll_combine(y, idsd, wd, got.handle, dp.key).cpu()
        src = _dequant(*reference.quantize(x, "fp8")) if use_fp8 else x.float()
        want = _weighted_sum(src, ids, w)
        e = rel_l2(out, want)
        if not e < (LAYER_VS_QUANT_AWARE if use_fp8 else 1e-2):
            fails.append(f"{tag}: combine rel L2 {e:.4g}")
        if not use_fp8:
            try:
                assert_close(out, want.bfloat16())
            except AssertionError as err:
                fails.append(f"{tag}: combine: {err}")
    _release()
    return fails


@pytest.mark.multi_gpu
@pytest.mark.slow
def test_ll_dispatch_routing_matches_torch_backend():
    fails = run_ranks(_ll_routing_rank, 2, "nccl", timeout=GPU_TIMEOUT)
    assert fails == [[], []], "\n".join(sum(fails, []))


def _ht_step(key, x, ids, w, scales):
    """Worst-case HT dispatch, dequantize (identity experts), combine."""
    d = ops.ht_dispatch(x, ids, w, key, x_scales=scales, worst_case=True)
    y = _dequant(d.x, d.x_scales).bfloat16()  # padding rows: garbage, never read
    return d, ops.ht_combine(y, d.handle, key)


def _ll_step(key, x, ids, w, use_fp8, out):
    """LL dispatch, dequantize (identity experts), weighted combine (into ``out`` if given)."""
    d = ops.ll_dispatch(x, ids, key, use_fp8=use_fp8)
    y = _dequant(d.x, d.x_scales).bfloat16()  # rows past masked_m: never read
    return d, ops.ll_combine(y, ids, w, d.handle, key, out=out)


def _ht_graph_rank(rank, world):
    """Worst-case HT dispatch+combine in a CUDA graph == eager, for fresh inputs and repeats."""
    dev = torch.device("cuda", rank)
    E, H, K, T = CFG["num_experts"], CFG["hidden_size"], CFG["top_k"], 32
    c = _new_comm("deepep", max_tokens_per_rank=None)
    fails = []

    def inputs(quant, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn((T, H), generator=g).bfloat16()
        xq, s = (x, None) if quant == "bf16" else reference.quantize(x, quant)
        return xq, s, random_ids(T, K, E, 0.2, g), random_weights(T, K, g)

    for quant in QUANTS:
        xq, s, ids, w = inputs(quant, 1000 * rank)
        sx, sids, sw = xq.to(dev), ids.to(dev), w.to(dev)
        ss = None if s is None else s.to(dev)
        step = functools.partial(_ht_step, c.key, sx, sids, sw, ss)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gd, gout = step()
        for i in range(20):
            xq, s, ids, w = inputs(quant, 1000 * rank + 1 + i)
            sx.copy_(xq.to(dev))
            sids.copy_(ids.to(dev))
            sw.copy_(w.to(dev))
            if ss is not None:
                ss.copy_(s.to(dev))
            graph.replay()
            torch.cuda.synchronize()
            replay = (_ht_rows(gd), gd.expert_counts.cpu(), gout.cpu())
            ed, eout = step()
            tag = f"rank {rank} {quant} replay {i}"
            if replay[0] != _ht_rows(ed) or not torch.equal(replay[1], ed.expert_counts.cpu()):
                fails.append(f"{tag}: dispatch differs from eager")
            if not torch.equal(replay[2], eout.cpu()):
                fails.append(f"{tag}: combine differs from eager")
            want = (_dequant(xq, s) * _ranks_per_token(ids, world, E).unsqueeze(1)).bfloat16()
            try:
                assert_close(replay[2], want)
            except AssertionError as e:
                fails.append(f"{tag}: combine vs reference: {e}")
        digests = set()
        for _ in range(20):  # same inputs: bit-identical every time
            graph.replay()
            rows = hashlib.sha256(b"".join(_ht_rows(gd))).hexdigest()  # order-free
            digests.add((_digest(gout, gd.expert_counts), rows))
        if len(digests) != 1:
            fails.append(f"rank {rank} {quant}: 20 replays gave {len(digests)} different results")
        del graph
    _release()
    return fails


@pytest.mark.multi_gpu
@pytest.mark.slow
def test_ht_worst_case_cuda_graph_replay_matches_eager():
    fails = run_ranks(_ht_graph_rank, 2, "nccl", timeout=GPU_TIMEOUT)
    assert fails == [[], []], "\n".join(sum(fails, []))


def _ll_graph_rank(rank, world):
    """LL dispatch + combine(out=) in a CUDA graph == eager and the reference, fresh inputs."""
    dev = torch.device("cuda", rank)
    E, H, K, T = CFG["num_experts"], CFG["hidden_size"], CFG["top_k"], MAX_TOKENS
    c = _new_comm("deepep")
    fails = []

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return _anchored_tokens(T, rank, g), random_ids(T, K, E, 0.2, g), random_weights(T, K, g)

    for use_fp8 in (False, True):
        x, ids, w = inputs(2000 * rank)
        sx, sids, sw = x.to(dev), ids.to(dev), w.to(dev)
        sout = torch.empty((T, H), dtype=torch.bfloat16, device=dev)
        step = functools.partial(_ll_step, c.key, sx, sids, sw, use_fp8)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # dispatch+combine pairs keep deep_ep's two LL buffers in step
                step(sout)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gd, _ = step(sout)
        for i in range(20):
            x, ids, w = inputs(2000 * rank + 1 + i)
            sx.copy_(x.to(dev))
            sids.copy_(ids.to(dev))
            sw.copy_(w.to(dev))
            graph.replay()
            torch.cuda.synchronize()
            got_out, got_m = sout.cpu(), gd.masked_m.cpu()
            got_tok = [_ll_expert_rows(gd, e)[0] for e in range(E // world)]
            ed, eout = step(None)  # an eager pair between replays keeps the pattern
            tag = f"rank {rank} use_fp8={use_fp8} replay {i}"
            if not torch.equal(got_m, ed.masked_m.cpu()) or any(
                not torch.equal(t, _ll_expert_rows(ed, e)[0]) for e, t in enumerate(got_tok)
            ):
                fails.append(f"{tag}: dispatch differs from eager")
            if not torch.equal(got_out, eout.cpu()):
                fails.append(f"{tag}: combine differs from eager")
            src = _dequant(*reference.quantize(x, "fp8")) if use_fp8 else x.float()
            err = rel_l2(got_out, _weighted_sum(src, ids, w))
            if not err < (LAYER_VS_QUANT_AWARE if use_fp8 else 1e-2):
                fails.append(f"{tag}: combine vs reference rel L2 {err:.4g}")
        digests = set()
        for _ in range(20):
            graph.replay()
            toks = [_ll_expert_rows(gd, e)[0] for e in range(E // world)]  # order-free
            digests.add(_digest(sout, gd.masked_m, *toks))
        if len(digests) != 1:
            fails.append(f"rank {rank} use_fp8={use_fp8}: 20 replays gave {len(digests)} results")
        del graph
    _release()
    return fails


@pytest.mark.multi_gpu
@pytest.mark.slow
def test_ll_cuda_graph_replay_matches_eager():
    fails = run_ranks(_ll_graph_rank, 2, "nccl", timeout=GPU_TIMEOUT)
    assert fails == [[], []], "\n".join(sum(fails, []))


def _raw_rank(rank, world):
    """Our ops give what raw deep_ep calls on the same buffer give (HT and LL, every payload)."""
    from types import SimpleNamespace

    dev = torch.device("cuda", rank)
    E, K, T = CFG["num_experts"], CFG["top_k"], MAX_TOKENS
    c = _new_comm("deepep")
    ht_buf, (dcfg, ccfg) = c.buffer("ht"), c.ht_configs()
    g = torch.Generator().manual_seed(40 + rank)
    x = _anchored_tokens(T, rank, g)
    ids, w = random_ids(T, K, E, 0.2, g), random_weights(T, K, g)
    idsd, wd = ids.to(dev), w.to(dev)
    fails = []
    for quant in QUANTS:
        xq, s = (x, None) if quant == "bf16" else reference.quantize(x, quant)
        xd, sd = xq.to(dev), None if s is None else s.to(dev)
        for worst in (False, True):
            tag = f"rank {rank} HT {quant} worst={worst}"
            ours = ops.ht_dispatch(xd, idsd, wd, c.key, x_scales=sd, worst_case=worst)
            nw = world * T if worst else 0
            recv, rids, rw, _, handle = raw_ht_dispatch(ht_buf, dcfg, xd, sd, idsd, wd, E, nw)
            rx, rs = (recv, None) if sd is None else recv
            raw = SimpleNamespace(x=rx, x_scales=rs, topk_ids=rids.long(), topk_weights=rw)
            if _ht_rows(ours) != _ht_rows(raw) or ours.x.shape != rx.shape:
                fails.append(f"{tag}: dispatch differs from raw deep_ep")
            y_ours = _dequant(ours.x, ours.x_scales).bfloat16()
            y_raw = _dequant(rx, rs).bfloat16()
            got = ops.ht_combine(y_ours, ours.handle, c.key)
            if not torch.equal(got, raw_ht_combine(ht_buf, ccfg, y_raw, handle)):
                fails.append(f"{tag}: combine differs from raw deep_ep")
    ll_buf = c.buffer("ll")
    xd = x.to(dev)
    for use_fp8 in (False, True):
        tag = f"rank {rank} LL use_fp8={use_fp8}"
        ours = ops.ll_dispatch(xd, idsd, c.key, use_fp8=use_fp8)
        got = ops.ll_combine(
            _dequant(ours.x, ours.x_scales).bfloat16(), idsd, wd, ours.handle, c.key
        )
        recv, count, handle = raw_ll_dispatch(ll_buf, xd, idsd, T, E, use_fp8)
        rx, rs = recv if use_fp8 else (recv, None)
        want = raw_ll_combine(ll_buf, _dequant(rx, rs).bfloat16(), idsd, wd, handle)
        raw = SimpleNamespace(x=rx, x_scales=rs, masked_m=count)
        if not torch.equal(ours.masked_m, count) or any(
            not torch.equal(_ll_expert_rows(ours, e)[0], _ll_expert_rows(raw, e)[0])
            for e in range(E // world)
        ):
            fails.append(f"{tag}: dispatch differs from raw deep_ep")
        if use_fp8 and ours.x_scales.stride() != rs.stride():
            fails.append(f"{tag}: scale strides {ours.x_scales.stride()} != raw {rs.stride()}")
        if not torch.equal(got, want):
            fails.append(f"{tag}: combine differs from raw deep_ep")
    _release()
    return fails


@pytest.mark.multi_gpu
@pytest.mark.slow
def test_ops_match_raw_deep_ep_calls():
    fails = run_ranks(_raw_rank, 2, "nccl", timeout=GPU_TIMEOUT)
    assert fails == [[], []], "\n".join(sum(fails, []))


# opcheck without test_aot_dispatch_dynamic: it compares values of two runs, and padding rows (HT
# worst case) and LL rows past masked_m are unspecified memory, the LL slot order is not fixed.
_OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _opcheck_rank(rank, world):
    """Fakes match the real deep_ep outputs (shapes, dtypes, strides); no undeclared mutation."""
    dev = torch.device("cuda", rank)
    E, K, T = CFG["num_experts"], CFG["top_k"], MAX_TOKENS
    c = _new_comm("deepep")
    g = torch.Generator().manual_seed(50 + rank)
    x = _anchored_tokens(T, rank, g)
    ids, w = random_ids(T, K, E, 0.2, g).to(dev), random_weights(T, K, g).to(dev)
    xq, s = (t.to(dev) for t in reference.quantize(x, "fp8"))
    x = x.to(dev)
    fails = []

    def check(op, args):
        try:
            opcheck(op, args, utils=_OPCHECK_UTILS)
        except Exception as e:  # noqa: BLE001 - report every op, keep the ranks in step
            fails.append(f"rank {rank} {op}: {e}")

    ep = torch.ops.epmoe
    for worst in (True, False):
        dispatch = ep.ht_dispatch.default if worst else ep.ht_dispatch_exact.default
        check(dispatch, (xq, ids, w, c.key, s))
        check(dispatch, (x, ids, w, c.key, None))
    d = ops.ht_dispatch(x, ids, w, c.key, worst_case=True)
    check(ep.ht_combine.default, (d.x, list(d.handle), c.key))
    for use_fp8 in (False, True):
        check(ep.ll_dispatch.default, (x, ids, c.key, use_fp8))
        d = ops.ll_dispatch(x, ids, c.key)
        args = (d.x, ids, w, list(d.handle), c.key)
        check(ep.ll_combine.default, args)
        check(ep.ll_combine_out.default, args + (torch.empty_like(x),))
    _release()
    return fails


@pytest.mark.multi_gpu
@pytest.mark.slow
def test_opcheck_deepep_ops():
    fails = run_ranks(_opcheck_rank, 2, "nccl", timeout=GPU_TIMEOUT)
    assert fails == [[], []], "\n".join(sum(fails, []))


def _switch_rank(rank, world):
    """HT and two LL layouts on one shared buffer: every switch cleans the LL region first."""
    from epmoe.comm import deepep

    dev = torch.device("cuda", rank)
    E, H, K = CFG["num_experts"], CFG["hidden_size"], CFG["top_k"]
    a = _new_comm("deepep", share_buffer=True, max_tokens_per_rank=64)
    b = _new_comm("deepep", share_buffer=True, max_tokens_per_rank=32)
    a.prepare(("ll",))  # sized for both layouts; creating it does not count as an LL call
    entry = deepep._BUFFERS[(tuple(range(world)), "shared")]
    assert entry.low_latency and set(entry.needs) >= {id(a), id(b)}
    buf = entry.buffer
    cleans = []
    real_clean = buf.clean_low_latency_buffer

    def counting_clean(*args):  # a spy: records the call and runs deep_ep's own clean
        cleans.append(args)
        return real_clean(*args)

    buf.clean_low_latency_buffer = counting_clean
    g = torch.Generator().manual_seed(30 + rank)
    fails = []

    def ht():
        x = torch.randn((48, H), generator=g).bfloat16()
        ids, w = random_ids(48, K, E, 0.2, g), random_weights(48, K, g)
        d = ops.ht_dispatch(x.to(dev), ids.to(dev), w.to(dev), a.key)
        out = ops.ht_combine(d.x, d.handle, a.key).cpu()
        assert_close(out, (x.float() * _ranks_per_token(ids, world, E).unsqueeze(1)).bfloat16())

    def ll(c, T):
        x = torch.randn((T, H), generator=g).bfloat16()
        ids, w = random_ids(T, K, E, 0.2, g), random_weights(T, K, g)
        d = ops.ll_dispatch(x.to(dev), ids.to(dev), c.key)
        out = ops.ll_combine(d.x, ids.to(dev), w.to(dev), d.handle, c.key).cpu()
        assert_close(out, _weighted_sum(x, ids, w).bfloat16())

    steps = [
        ("ll a", lambda: ll(a, 64), 0),
        ("ht", ht, 0),
        ("ll a", lambda: ll(a, 64), 1),
        ("ll a", lambda: ll(a, 64), 1),
        ("ll b", lambda: ll(b, 32), 2),
        ("ht", ht, 2),
        ("ll b", lambda: ll(b, 32), 3),
        ("ll a", lambda: ll(a, 64), 4),
    ]
    for name, fn, want_cleans in steps:
        try:
            fn()
        except AssertionError as e:
            fails.append(f"rank {rank} {name}: {e}")
        if len(cleans) != want_cleans:
            fails.append(f"rank {rank} after {name}: {len(cleans)} cleans, expected {want_cleans}")
    if cleans and cleans[-1] != (64, H, E):
        fails.append(f"rank {rank}: last clean {cleans[-1]} is not layout a")
    buf.clean_low_latency_buffer = real_clean
    assert entry.buffer is buf  # one buffer served both modes and both layouts throughout
    _release()
    return fails


@pytest.mark.multi_gpu
@pytest.mark.slow
def test_shared_buffer_switches_between_ht_and_ll_layouts():
    fails = run_ranks(_switch_rank, 2, "nccl", timeout=GPU_TIMEOUT)
    assert fails == [[], []], "\n".join(sum(fails, []))
