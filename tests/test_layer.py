"""EPMoE on one rank (local backend) vs the references, all modes and schemes; bad input."""

import json
import warnings

import pytest
import torch

import epmoe
from tests._moe import SMALL, check_layer_output, global_weights, small_layer, tokens
from tests._tol import LAYER_VS_DENSE, LAYER_VS_QUANT_AWARE, rel_l2


def make_layer(quant, mode, worst_case=False, **kw):
    return small_layer(quant, mode, worst_case, alignment=16, max_tokens_per_rank=32, **kw)


@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("mode,worst_case", [("ht", False), ("ht", True), ("ll", False)])
@pytest.mark.parametrize("T", [0, 1, 29])
def test_layer_one_rank(quant, mode, worst_case, T):
    layer = make_layer(quant, mode, worst_case)
    x, ids, w = tokens(T, seed=T, **SMALL)
    out = layer(x, ids, w)
    check_layer_output(out, x, ids, w, *global_weights(**SMALL), quant)


def test_all_tokens_to_one_expert():
    layer = make_layer("bf16", "ht")
    x, ids, w = tokens(12, seed=3, **SMALL)
    ids = torch.full_like(ids, 5)
    ids[:, 1:] = -1
    check_layer_output(layer(x, ids, w), x, ids, w, *global_weights(**SMALL), "bf16")


def test_all_padding_tokens_give_zero():
    layer = make_layer("int8", "ll")
    x, ids, w = tokens(4, seed=3, **SMALL)
    out = layer(x, torch.full_like(ids, -1), w)
    assert (out == 0).all()


def _bad(**kw):
    args = dict(SMALL, quant="bf16", mode="ht", backend="local", device="cpu")
    args.update(kw)
    return lambda: epmoe.EPMoE(**args)


@pytest.mark.parametrize(
    "make,match",
    [
        (_bad(alignment=0), "EPMoE: alignment expected a positive int, got 0"),
        (_bad(alignment=-128), "EPMoE: alignment expected a positive int"),
        (_bad(alignment=16.0), "EPMoE: alignment expected a positive int"),
        (_bad(quant="fp4"), "EPMoE: quant expected one of"),
        (_bad(mode="xx"), "EPMoE: mode expected one of"),
        (_bad(gate="swish"), "EPMoE: gate expected a gate spec"),
        (_bad(gate="gelu:alpha=2"), "EPMoE: gate expected a gate spec"),
        (_bad(mode="ll"), "EPMoE: max_tokens_per_rank expected a positive int"),
        (_bad(backend="nccl"), "EPMoE: backend expected one of"),
    ],
)
def test_layer_bad_config(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_alignment_must_match_gemm_row_block(monkeypatch):
    from epmoe import layer as layer_mod

    monkeypatch.setattr(layer_mod, "smallest_row_block", lambda scheme, device: 16)
    with pytest.raises(ValueError, match="EPMoE: alignment expected a multiple of 16"):
        _bad(alignment=24)()


def test_layer_bad_input():
    layer = make_layer("bf16", "ht")
    ll = make_layer("bf16", "ll")
    x, ids, w = tokens(6, seed=1, **SMALL)
    cases = [
        (lambda: layer(x.float(), ids, w), "EPMoE: x expected dtype torch.bfloat16"),
        (lambda: layer(x[:, :100], ids, w), "EPMoE: x expected shape"),
        (lambda: layer(x, ids.int(), w), "EPMoE: topk_ids expected dtype torch.int64"),
        (lambda: layer(x, ids[:, :2], w), "EPMoE: topk_ids expected shape"),
        (lambda: layer(x, ids, w.double()), "EPMoE: topk_weights expected dtype"),
        (
            lambda: layer(x, torch.full_like(ids, 8), w),
            "permute: topk_ids expected ids in \\[0, 8\\)",
        ),
        (
            lambda: ll(x, torch.full_like(ids, 99), w),
            "ll_scatter: topk_ids expected ids in \\[0, 8\\)",
        ),
        (
            lambda: ll(*tokens(33, seed=1, **SMALL)),
            "ll_dispatch: x expected at most max_tokens_per_rank=32 tokens, got 33",
        ),
        (
            lambda: layer.load_weights(torch.zeros(8, 128, 256), torch.zeros(8, 256, 128)),
            "load_weights: w1 expected shape",
        ),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def test_device_mismatch_is_value_error():
    layer = make_layer("bf16", "ht")
    x, ids, w = tokens(4, seed=1, **SMALL)
    with pytest.raises(ValueError, match="EPMoE: x expected device cpu"):
        layer(x.to("meta"), ids, w)
    with pytest.raises(ValueError, match="EPMoE: topk_ids expected device cpu"):
        layer(x, ids.to("meta"), w)


@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8"])
def test_auto_mode_picks_ll_up_to_its_threshold(quant, monkeypatch):
    layer = small_layer(quant, "auto", alignment=16, ll_max_tokens=8)
    assert layer.uses_ll(8) and not layer.uses_ll(9) and layer.uses_ll(0)
    w1, w2 = global_weights(**SMALL)
    for T in (0, 1, 8, 9, 20):
        x, ids, w = tokens(T, seed=T, **SMALL)
        out = layer(x, ids, w)
        check_layer_output(out, x, ids, w, w1, w2, quant)
        # each path gives the bytes of the layer fixed to that mode
        fixed = small_layer(
            quant, "ll" if T <= 8 else "ht", alignment=16, max_tokens_per_rank=8 if T <= 8 else None
        )
        assert torch.equal(out, fixed(x, ids, w)), T


def test_auto_gemv_cutoff_follows_expected_rereads():
    """The GEMVs (one weight read per choice) stop where choices start to share experts: T * K
    over the expected touched experts E * (1 - (1 - K/E)**T) past GEMV_MAX_REREADS."""
    L, q = epmoe.layer, epmoe.quant
    assert L.expected_rereads(1, 8, 2) == 1.0
    assert L.expected_rereads(8, 8, 2) == pytest.approx(16 / (8 * (1 - 0.75**8)))
    assert L.expected_rereads(8, 128, 8) <= L.GEMV_MAX_REREADS < L.expected_rereads(3, 8, 2)
    cut = {(E, K): [L.gemv_max_tokens(q.get(s), E, K) for s in ("bf16", "fp8", "int8")]
           for E, K in ((128, 8), (8, 2), (32, 4), (8, 8))}  # fmt: skip
    assert cut == {(128, 8): [8, 8, 4], (8, 2): [2, 2, 2], (32, 4): [4, 4, 4], (8, 8): [1, 1, 1]}
    mixtral = epmoe.EPMoE(8, 64, 64, 2, mode="auto", backend="local", device="cpu")
    assert [mixtral.path(T) for T in (1, 2, 3)] == ["gemv", "gemv", "ll"]
    assert mixtral.gemv_max_tokens == 2
    ll = small_layer("bf16", "ll", max_tokens_per_rank=8)
    assert ll.gemv_max_tokens == 0 and ll.path(0) == ll.path(1) == "ll"  # (no GEMVs at T = 0)
    assert small_layer("bf16", "ht").path(0) == "ht"
    assert L.expected_rereads(1, 4, 8) == 2.0  # (more choices than experts: no GEMVs at all)
    assert epmoe.EPMoE(4, 64, 64, 8, mode="auto", backend="local", device="cpu").path(1) == "ll"


def test_auto_follows_this_gpus_measured_paths(monkeypatch):
    """One rank, mode "auto": above the GEMV cutoff each call size takes the path and alignment
    this GPU's tuned table measured fastest (the smallest measured size >= the call's); sizes past
    the table keep the rules; a given alignment keeps the layer's (its HT entries are not used)."""
    from epmoe import layer as layer_mod
    from epmoe import reference

    measured = [
        dict(scheme="fp8", E=8, H=256, I=128, K=3, t=4, path="ll", alignment=0),
        dict(scheme="fp8", E=8, H=256, I=128, K=3, t=16, path="ht", alignment=32),
        dict(scheme="fp8", E=8, H=256, I=128, K=3, t=64, path="ht", alignment=16),
    ]
    asked = []

    def paths(scheme, E, H, I, K, device, gate, bias):  # noqa: E741
        asked.append((str(scheme), E, H, I, K, gate, bias))
        return measured

    monkeypatch.setattr(layer_mod._tuned, "paths", paths)
    layer = small_layer("fp8", "auto", ll_max_tokens=32)
    assert asked == [("fp8", 8, 256, 128, 3, "silu", False)]  # (the layer's gate and biases)
    cut = layer.gemv_max_tokens
    plans = {T: layer.plan(T) for T in (cut + 1, 5, 16, 17, 32, 33, 100)}
    assert plans == {cut + 1: ("ll", 128), 5: ("ht", 32), 16: ("ht", 32), 17: ("ht", 16),
                     32: ("ht", 16), 33: ("ht", 16), 100: ("ht", 128)}  # fmt: skip
    w1, w2 = global_weights(**SMALL)
    for T in (5, 17, 100):
        x, ids, w = tokens(T, seed=T, **SMALL)
        with layer.record_stages() as rec:
            out = layer(x, ids, w)
        rows = reference.permuted_rows(T, 3, 8, plans[T][1])
        assert rec["permute"].m_indices.shape == (rows,) and layer.path(T) == "ht"
        check_layer_output(out, x, ids, w, w1, w2, "fp8")
    given = small_layer("fp8", "auto", ll_max_tokens=32, alignment=64)
    assert [given.plan(T) for T in (5, 17, 33)] == [("ll", 64), ("ll", 64), ("ht", 64)]
    given.gemv_max_tokens = 0  # (settable: the cached plans follow)
    assert given.plan(1) == ("ll", 64)


def test_auto_gemvs_give_way_where_measured_slower(monkeypatch):
    """Up to the GEMV cutoff a call keeps the GEMVs unless a measured path that timed them found
    the masked GEMMs faster at a size <= the call's (then LL, or the next measured path); entries
    that did not time the GEMVs leave them; a set cutoff is followed as it is."""
    from epmoe import layer as layer_mod

    sizes = dict(scheme="bf16", E=64, H=64, I=64, K=2, alignment=0)
    measured = [
        dict(sizes, t=2, path="gemv", us={"gemv": 10.0, "ll": 12.0}),
        dict(sizes, t=5, path="ll", us={"gemv": 14.0, "ll": 12.0}),
        dict(sizes, t=8, path="ll", us={"gemv": 19.0, "ll": 13.0}),
        dict(sizes, t=16, path="ht", alignment=32, us={"ll": 20.0, "ht@32": 15.0}),
    ]
    monkeypatch.setattr(layer_mod._tuned, "paths", lambda *args: measured)
    layer = epmoe.EPMoE(64, 64, 64, 2, mode="auto", backend="local", device="cpu")
    assert layer.gemv_max_tokens == 8
    assert [layer.path(T) for T in range(1, 10)] == ["gemv"] * 4 + ["ll"] * 4 + ["ht"]
    layer.gemv_max_tokens = 8  # (set: followed, measured paths or not)
    assert [layer.path(T) for T in (5, 8, 9)] == ["gemv", "gemv", "ht"]
    measured[1:3] = [dict(m, us={"ll": 12.0}) for m in measured[1:3]]  # (GEMVs not timed)
    layer = epmoe.EPMoE(64, 64, 64, 2, mode="auto", backend="local", device="cpu")
    assert [layer.path(T) for T in (5, 8, 9)] == ["gemv", "gemv", "ht"]


@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8"])
def test_ht_fused_gate_where_measured(quant, monkeypatch):
    """Where this GPU's table measured GEMM1 and the gate faster as one kernel, HT runs
    grouped_gemm_gate: the same bytes as GEMM1 then the activation (its CPU kernel is their
    references), with the gate, the biases and the padded sizes the layer passes."""
    from epmoe import layer as layer_mod

    asked = []

    def fuses(scheme, device, inter, k, e, row_block, m, gate, bias):
        asked.append((str(scheme), inter, k, e, row_block, m, gate, bias))
        return True

    gate = "silu:alpha=1.702,limit=7.0,up_offset=1.0"
    shape = dict(num_experts=8, hidden_size=200, intermediate_size=72, top_k=2)
    kw = dict(quant=quant, mode="ht", alignment=16, gate=gate, bias=True, backend="local",
              device="cpu")  # fmt: skip
    g = torch.Generator().manual_seed(5)
    w1, w2 = torch.randn(8, 144, 200, generator=g) / 14, torch.randn(8, 200, 72, generator=g) / 9
    b1, b2 = torch.randn(8, 144, generator=g), torch.randn(8, 200, generator=g)
    x, ids, w = tokens(24, seed=3, **shape)
    plain = epmoe.EPMoE(**shape, **kw)
    plain.load_weights(w1, w2, b1=b1, b2=b2)
    want = plain(x, ids, w)
    monkeypatch.setattr(layer_mod, "fuses_gate", fuses)
    has = []  # (a table with "gate" entries of this layer's gate and biases)
    monkeypatch.setattr(layer_mod._tuned, "has", lambda *args: has.append(args[-2:]) or True)
    fused = epmoe.EPMoE(**shape, **kw)
    fused.load_weights(w1, w2, b1=b1, b2=b2)
    with fused.record_stages() as rec:
        out = fused(x, ids, w)
    assert torch.equal(out, want) and "gemm1" not in rec and "act" in rec
    Hp, Ip = fused.hidden_padded, fused.inter_padded
    assert asked == [(quant, Ip, Hp, 8, 16, rec["permute"].m_indices.shape[0], gate, True)]
    assert has == [(gate, True)] * 3  # (the "gate", "masked_gate" and "gather" entries)


@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("gate", ["silu:alpha=1.702,limit=7.0,up_offset=1.0", "silu"])
def test_ll_fused_gate_where_measured(quant, gate, monkeypatch):
    """Where this GPU's table measured masked GEMM1 and the gate faster as one kernel, LL runs
    grouped_gemm_masked_gate: the same bytes as masked GEMM1 then the activation (its CPU kernel
    is their references), with the gate, the biases, the padded sizes and the slots the layer
    passes."""
    from epmoe import layer as layer_mod

    asked = []

    def fuses(scheme, device, inter, k, e, t, expected_m, gate, bias):
        asked.append((str(scheme), inter, k, e, t, expected_m, gate, bias))
        return True

    bias = gate != "silu"  # (the plain SiLU without biases: what `epmoe demo` checks)
    shape = dict(num_experts=8, hidden_size=200, intermediate_size=72, top_k=2)
    kw = dict(quant=quant, mode="ll", max_tokens_per_rank=32, gate=gate, bias=bias,
              backend="local", device="cpu")  # fmt: skip
    g = torch.Generator().manual_seed(6)
    w1, w2 = torch.randn(8, 144, 200, generator=g) / 14, torch.randn(8, 200, 72, generator=g) / 9
    b1, b2 = (torch.randn(8, 144, generator=g), torch.randn(8, 200, generator=g)) if bias else \
        (None, None)  # fmt: skip
    x, ids, w = tokens(24, seed=4, **shape)
    plain = epmoe.EPMoE(**shape, **kw)
    plain.load_weights(w1, w2, b1=b1, b2=b2)
    with plain.record_stages() as want_rec:
        want = plain(x, ids, w)
    monkeypatch.setattr(layer_mod, "fuses_masked_gate", fuses)
    has = []  # (a table with "masked_gate" entries of this layer's gate and biases)
    monkeypatch.setattr(layer_mod._tuned, "has", lambda *args: has.append(args[0]) or True)
    fused = epmoe.EPMoE(**shape, **kw)
    fused.load_weights(w1, w2, b1=b1, b2=b2)
    with fused.record_stages() as rec:
        out = fused(x, ids, w)
    assert "gemm1" in want_rec and "gemm1" not in rec and "act" in rec
    assert torch.equal(out, want)
    Hp, Ip = fused.hidden_padded, fused.inter_padded
    a, sc, masked_m, _ = rec["ll_scatter"]
    assert asked == [(quant, Ip, Hp, 8, a.shape[1], fused.expected_m(24), gate, bias)]
    assert "masked_gate" in has
    if bias:
        return
    # `epmoe demo`'s stage checks take a fused record (act against GEMM1's reference)
    from epmoe.cli import _demo_checks as D

    chk = D.Checks("ll", quant, None)
    live = torch.arange(a.shape[1])[None, :] < masked_m[:, None]
    D.check_experts_ll(chk, fused, rec, a, sc if quant != "bf16" else None, masked_m, live)
    assert len(chk.rows) >= 2 and all(r.ok for r in chk.rows), chk.rows


@pytest.mark.parametrize(
    "quant,fused", [("bf16", False), ("fp8", True), ("int8", False), ("int8", True)]
)
def test_ht_gathers_where_measured(quant, fused, monkeypatch):
    """Where this GPU's table measured GEMM1 reading x's rows through permute's src_rows faster
    than permute's copy, permute copies no row and GEMM1 (fused with the gate or not) gathers:
    the layer's output bytes are the same, the permute record holds the index outputs only."""
    from epmoe import layer as layer_mod

    asked = []

    def gathers(scheme, device, width, k, e, row_block, m, gate, bias):
        asked.append((str(scheme), width, k, e, row_block, m, gate, bias))
        return True

    shape = dict(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2)
    kw = dict(quant=quant, mode="ht", alignment=16, backend="local", device="cpu")
    g = torch.Generator().manual_seed(6)
    w1, w2 = torch.randn(8, 256, 256, generator=g) / 16, torch.randn(8, 256, 128, generator=g) / 11
    x, ids, w = tokens(24, seed=4, **shape)
    plain = epmoe.EPMoE(**shape, **kw)
    plain.load_weights(w1, w2)
    want = plain(x, ids, w)
    monkeypatch.setattr(layer_mod, "gathers", gathers)
    monkeypatch.setattr(layer_mod, "fuses_gate", lambda *args: fused)
    monkeypatch.setattr(layer_mod._tuned, "has", lambda *args: True)
    gathering = epmoe.EPMoE(**shape, **kw)
    gathering.load_weights(w1, w2)
    with gathering.record_stages() as rec:
        out = gathering(x, ids, w)
    assert torch.equal(out, want)
    p = rec["permute"]
    assert p.x.shape == (p.m_indices.shape[0], 0) and p.x_scales is None
    assert ("gemm1" in rec) is not fused
    assert asked == [(quant, 256, 256, 8, 16, p.m_indices.shape[0], "silu", False)]
    # `epmoe demo`'s stage checks take a gathering record (x's rows through src_rows)
    from epmoe.cli import _demo_checks as D

    chk = D.Checks("ht", quant, None)
    xq, xs = rec["quantize"] if quant != "bf16" else (x, None)
    D.check_experts_ht(chk, gathering, rec, xq, xs, ids, w)
    assert len(chk.rows) >= 5 and all(r.ok for r in chk.rows), chk.rows


def _untuned_layer(quant="fp8", mode="auto", **kw):
    """A SMALL layer built on CPU (no weights: only its construction's warning is tested)."""
    extra = dict(max_tokens_per_rank=32) if mode == "ll" else {}
    return epmoe.EPMoE(**SMALL, quant=quant, mode=mode, backend="local", device="cpu", **extra,
                       **kw)  # fmt: skip


def test_a_gpu_without_this_layers_tuned_entries_says_so_once(h200_table, monkeypatch):
    """Built for a GPU whose tuned table lacks problems the layer looks up, a layer warns once per
    GPU model, layer and missing set: the layouts without entries (an "auto" layer's path entries
    too) and the tuner's command for this layer. A table holding them is silent; so is CPU."""
    from epmoe.ops.gemm import _tuned

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _untuned_layer()  # (CPU: no table to lack)
    monkeypatch.setattr(_tuned, "_gpu", lambda device: "NVIDIA H200")
    with pytest.warns(epmoe.UntunedWarning) as record:
        layer = _untuned_layer(ll_max_tokens=32)
        _untuned_layer(ll_max_tokens=32)  # (the same layer: said already)
    (msg,) = [str(r.message) for r in record]
    assert "NVIDIA H200's tuned table (epmoe/ops/gemm/tuned/nvidia_h200.json) has no contiguous, " \
        "gate, masked, masked_gate, gemv_up, gemv_down, path entries for fp8 experts of H 256, " \
        "I 128, 8 on this GPU, top-3" in msg  # fmt: skip
    assert msg.endswith("python scripts/tune_gemm.py --layer 256 128 8 3 --schemes fp8 --paths")
    problems = layer.tuning_problems()
    assert [p[0] for p in problems] == ["contiguous", "contiguous", "gate", "masked", "masked",
                                        "masked_gate", "gemv_up", "gemv_down"]  # fmt: skip
    entries = [dict(layout=lay, scheme=q, N=n, K=k, E=e, block=16, m=1, gate=g, bias=b,
                    config={}, backend="triton") for lay, q, n, k, e, g, b in problems]  # fmt: skip
    path = dict(scheme="fp8", E=8, H=256, I=128, K=3, t=64, path="ll", alignment=0)
    table = h200_table / _tuned.file_name("NVIDIA H200")
    for held, said in [(entries, "path"), (entries[1:], "contiguous, path")]:
        table.write_text(json.dumps(dict(entries=held)))
        _tuned.reread()  # (a rewritten table: said again)
        with pytest.warns(epmoe.UntunedWarning, match=f"has no {said} entries for fp8 experts"):
            _untuned_layer(ll_max_tokens=32)
    table.write_text(json.dumps(dict(entries=entries, paths=[path])))
    _tuned.reread()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _untuned_layer(ll_max_tokens=32)
        ll, ht = _untuned_layer(mode="ll"), _untuned_layer(mode="ht")
    assert [p[0] for p in ll.tuning_problems()] == ["masked", "masked", "masked_gate"]
    assert [p[0] for p in ht.tuning_problems()] == ["contiguous", "contiguous", "gate"]
    table.write_text(json.dumps(dict(entries=entries[3:])))
    _tuned.reread()
    with pytest.warns(epmoe.UntunedWarning, match="no contiguous, gate entries for fp8"):
        _untuned_layer(mode="ht")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _untuned_layer(mode="ll")  # (what it looks up is there)
    with pytest.warns(epmoe.UntunedWarning, match="no contiguous, gate, path entries for fp8"):
        _untuned_layer()  # (the same sizes, more missing: said)
    said = (r"no contiguous, gate entries for bf16 experts of H 256, I 128, 8 on this GPU, top-3, "
            r"gate gelu_tanh, biases: .* --layer 256 128 8 3 --gate 'gelu_tanh' --bias "
            r"--schemes bf16$")  # fmt: skip
    with pytest.warns(epmoe.UntunedWarning, match=said):
        _untuned_layer(quant="bf16", mode="ht", gate="gelu_tanh", bias=True)


def test_auto_mode_bad_config():
    with pytest.raises(ValueError, match="EPMoE: ll_max_tokens expected a positive int, got 0"):
        _bad(mode="auto", ll_max_tokens=0)()
    with pytest.raises(ValueError, match="EPMoE: ll_max_tokens expected None unless mode='auto'"):
        _bad(mode="ht", ll_max_tokens=8)()


@pytest.mark.parametrize("mode", ["ht", "ll"])
def test_any_strides_of_ids_and_weights(mode):
    layer = make_layer("int8", mode)
    x, ids, w = tokens(10, seed=4, **SMALL)
    ids_t, w_t = ids.t().contiguous().t(), w.t().contiguous().t()  # column-major
    assert not ids_t.is_contiguous()
    assert torch.equal(layer(x, ids_t, w_t), layer(x, ids, w))


def test_expert_at_exactly_ll_capacity():
    """Every slot of one expert used, the last one included."""
    layer = make_layer("bf16", "ll")  # capacity 32
    x, ids, w = tokens(32, seed=5, **SMALL)
    ids[:, 0] = 2
    ids[:, 1:] = -1
    check_layer_output(layer(x, ids, w), x, ids, w, *global_weights(**SMALL), "bf16")


@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8"])
def test_load_weights_copies_and_quantizes_like_the_reference(quant, monkeypatch):
    from epmoe import layer as layer_mod
    from epmoe import reference

    monkeypatch.setattr(layer_mod, "LOAD_ROWS", 128)  # several chunks per expert
    w1, w2 = global_weights(**SMALL)
    w1 = w1.bfloat16().requires_grad_()
    layer = epmoe.EPMoE(**SMALL, quant=quant, backend="local", device="cpu", alignment=16)
    layer.load_weights(w1, w2)
    q, s = reference.quantize_weights(w1.detach(), quant)
    assert torch.equal(layer.w1.view(torch.uint8), q.view(torch.uint8))
    assert (s is None and layer.w1_scale is None) or torch.equal(layer.w1_scale, s)
    assert not layer.w1.requires_grad and layer.w1.data_ptr() != w1.data_ptr()
    before = layer.w1.clone()
    with torch.no_grad():
        w1.mul_(2)  # the layer does not follow the caller's later edits
    assert torch.equal(layer.w1, before)


def test_load_weights_without_copy_keeps_bf16_weights():
    w1, w2 = (w.bfloat16() for w in global_weights(**SMALL))
    layer = epmoe.EPMoE(**SMALL, quant="bf16", backend="local", device="cpu", alignment=16)
    layer.load_weights(w1, w2, copy=False)
    assert layer.w1.data_ptr() == w1.data_ptr() and layer.w2.data_ptr() == w2.data_ptr()


@pytest.mark.parametrize("mode,T", [("auto", 1), ("ll", 4), ("ht", 4)])
def test_inputs_that_need_grad_are_refused_on_every_path(mode, T):
    """No stage has a backward: the layer refuses x / topk_weights that require grad (grad mode
    on) at its boundary, whichever path the call takes; under no_grad the same call runs."""
    layer = epmoe.EPMoE(**SMALL, quant="bf16", backend="local", device="cpu", alignment=16,
                        mode=mode, max_tokens_per_rank=8)  # fmt: skip
    layer.load_weights(*global_weights(**SMALL))
    x, ids, w = tokens(T, seed=7, **SMALL)
    for name, args in (("x", (x.requires_grad_(), ids, w)), ("topk_weights", (x, ids, w))):
        if name == "topk_weights":
            x.requires_grad_(False)
            w.requires_grad_()
        with pytest.raises(ValueError, match=f"EPMoE: {name} expected a tensor that does not"):
            layer(*args)
        with torch.no_grad():
            assert not layer(*args).requires_grad


def test_weights_assigned_as_parameters_stay_buffers():
    """layer.w1 = nn.Parameter(...) (as a loader might) replaces the weight the forward reads."""
    layer = epmoe.EPMoE(**SMALL, quant="bf16", backend="local", device="cpu", alignment=16)
    layer.load_weights(*global_weights(**SMALL))
    x, ids, w = tokens(5, seed=6, **SMALL)
    want = layer(x, ids, w)
    layer.w1 = torch.nn.Parameter(layer.w1.clone(), requires_grad=False)
    assert "w1" in layer._buffers and not dict(layer.named_parameters())
    assert torch.equal(layer(x, ids, w), want)
    layer.w2 = torch.nn.Parameter(torch.zeros_like(layer.w2), requires_grad=False)
    assert not layer(x, ids, w).any()


def test_forward_and_backward_safe_with_grad_weights():
    """Weights that require grad leak no autograd into the layer (no 'no autograd formula')."""
    w1, w2 = (w.requires_grad_() for w in global_weights(**SMALL))
    layer = epmoe.EPMoE(**SMALL, quant="bf16", backend="local", device="cpu", alignment=16)
    layer.load_weights(w1, w2)
    x, ids, w = tokens(5, seed=6, **SMALL)
    out = layer(x, ids, w)
    assert not out.requires_grad


@pytest.mark.interpret
@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("mode", ["ht", "ll"])
def test_trusted_chain_matches_the_checked_chain(quant, mode, monkeypatch):
    """The layer's direct path chains its stages' trusted entries (the launches without the
    metadata checks; on CUDA only): run here on CPU tensors through the Triton interpreter (the
    GEMMs on their reference backend), it agrees with the chain of public ops, which check
    every stage."""
    import importlib

    layer_mod = importlib.import_module("epmoe.layer")
    ops = importlib.import_module("epmoe.ops.gemm._ops")
    monkeypatch.setattr(ops, "_backend", lambda *_: "reference")
    layer = make_layer(quant, mode)
    x, ids, w = tokens(9, seed=1, **SMALL)
    assert layer.path(9) == mode
    trusted = layer._route(layer_mod._TRUSTED, x, ids, w)
    public = layer._route(layer_mod._PUBLIC, x, ids, w)
    check_layer_output(trusted, x, ids, w, *global_weights(**SMALL), quant)
    torch.testing.assert_close(trusted.float(), public.float(), rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------ gates, biases, padded sizes
GATES = [
    "silu:alpha=1.702,limit=7.0,up_offset=1.0",  # gpt-oss / MiniMax-M3
    "gelu_tanh",  # Gemma4
    "silu:limit=7.0,clamp_after=1",  # Step-3.7 / Bailing
    "silu:gate_softcap=4.0,up_softcap=25.0",  # Inkling2
    "relu2:glu=0",  # NemotronH: no gate half
]


def gate_layer(quant, mode, gate, bias=True, **kw):
    """A SMALL-shaped layer with this gate (weights not loaded)."""
    args = dict(SMALL, backend="local", device="cpu", alignment=16, max_tokens_per_rank=32)
    args.update(kw)
    return epmoe.EPMoE(**args, quant=quant, mode=mode, gate=gate, bias=bias)


def gate_problem(gate, H=256, I=128, bias=True, E=8, seed=0):
    """Weights `[E, width, H]` / `[E, H, I]` scaled so the clamps are crossed, and biases."""
    g = torch.Generator().manual_seed(seed)
    width = epmoe.gate.parse(gate).width(I)
    w1 = torch.randn((E, width, H), generator=g) * 3 / H**0.5
    w2 = torch.randn((E, H, I), generator=g) / I**0.5
    b1 = torch.randn((E, width), generator=g) if bias else None
    b2 = torch.randn((E, H), generator=g) * 0.1 if bias else None
    return w1, w2, b1, b2


@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("mode,T", [("ht", 13), ("ll", 13), ("auto", 2)])
def test_gates_and_biases(quant, gate, mode, T):
    """Every gate kind with biases on every path (auto T=2: the per-choice GEMVs) vs the
    references that take the same gate and biases."""
    w1, w2, b1, b2 = gate_problem(gate)
    layer = gate_layer(quant, mode, gate)
    layer.load_weights(w1, w2, b1=b1, b2=b2)
    x, ids, w = tokens(T, seed=T, **SMALL)
    out = layer(x, ids, w)
    qa = epmoe.reference.quantized_moe(x, ids, w, w1, w2, quant, gate, b1, b2)
    dense = epmoe.reference.dense_moe(x, ids, w, w1, w2, gate, b1, b2)
    assert rel_l2(out, qa) < LAYER_VS_QUANT_AWARE
    assert rel_l2(out, dense) < LAYER_VS_DENSE[quant]


@pytest.mark.parametrize("quant", ["fp8", "int8", "bf16"])
@pytest.mark.parametrize("mode,T", [("ht", 11), ("ll", 11), ("auto", 1)])
def test_any_hidden_and_intermediate_size(quant, mode, T):
    """fp8 at sizes that are not multiples of 128 (gpt-oss: 2880): weights padded at load, the
    output has the real H columns."""
    H, I = 200, 72
    gate = GATES[0]
    w1, w2, b1, b2 = gate_problem(gate, H, I)
    args = dict(num_experts=8, hidden_size=H, intermediate_size=I, top_k=3, quant=quant)
    layer = epmoe.EPMoE(**args, mode=mode, backend="local", device="cpu", alignment=16,
                        max_tokens_per_rank=32, gate=gate, bias=True)  # fmt: skip
    layer.load_weights(w1, w2, b1=b1, b2=b2)
    if quant == "fp8":
        assert (layer.hidden_padded, layer.inter_padded) == (256, 128)
        assert layer.w1.shape == (8, 256, 256) and layer.w2.shape == (8, 256, 128)
    x, ids, w = tokens(T, 8, H, 3, seed=T)
    out = layer(x, ids, w)
    assert out.shape == (T, H) and out.dtype == torch.bfloat16
    qa = epmoe.reference.quantized_moe(x, ids, w, w1, w2, quant, gate, b1, b2)
    assert rel_l2(out, qa) < LAYER_VS_QUANT_AWARE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_biases_keep_their_dtype_and_are_copies(dtype):
    """A bf16 bias stays bf16 (half the bytes the kernels read per row; they add it in float32,
    so the output is the float32 copy's), never an alias of the caller's tensor."""
    w1, w2, b1, b2 = gate_problem(GATES[0])
    b1, b2 = b1.to(dtype), b2.to(dtype)
    layer = gate_layer("bf16", "ht", GATES[0])
    layer.load_weights(w1, w2, b1=b1, b2=b2)
    assert (layer.b1.dtype, layer.b2.dtype) == (dtype, dtype)
    assert layer.b1.data_ptr() != b1.data_ptr() and layer.b2.data_ptr() != b2.data_ptr()
    x, ids, w = tokens(13, seed=5, **SMALL)
    wide = gate_layer("bf16", "ht", GATES[0])
    wide.load_weights(w1, w2, b1=b1.float(), b2=b2.float())
    assert torch.equal(layer(x, ids, w), wide(x, ids, w))


def test_load_weights_biases_are_checked():
    layer = gate_layer("bf16", "ht", "silu")
    w1, w2, b1, b2 = gate_problem("silu")
    with pytest.raises(ValueError, match="load_weights: b1 expected a tensor"):
        layer.load_weights(w1, w2)
    with pytest.raises(ValueError, match="load_weights: b2 expected shape"):
        layer.load_weights(w1, w2, b1=b1, b2=b2[:, :8])
    plain = gate_layer("bf16", "ht", "silu", bias=False)
    with pytest.raises(ValueError, match="load_weights: b1 expected None"):
        plain.load_weights(w1, w2, b1=b1, b2=b2)
    nogate = gate_layer("bf16", "ht", "relu2:glu=0", bias=False)
    with pytest.raises(ValueError, match="load_weights: w1 expected shape"):
        nogate.load_weights(w1, w2)
