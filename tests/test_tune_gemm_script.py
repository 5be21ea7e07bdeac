"""scripts/tune_gemm.py (the GPU tuner of epmoe/ops/gemm/tuned/<gpu>.json) on CPU: the problems it
enumerates, the winner it keeps, how it merges into a file, and that the file it writes is read back
by epmoe.ops.gemm._tuned as written."""

import importlib.util
import json
import math
import pathlib
import random

import pytest
import torch

from epmoe import reference
from epmoe.ops import gemv
from epmoe.ops.gemm import _select, _triton, _tuned

REPO = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("tune_gemm", REPO / "scripts/tune_gemm.py")
tg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tg)
CONFIGS = tg._configs.CONFIGS
CFG = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)


# ------------------------------------------------------------------------------------- problems
@pytest.mark.parametrize(
    "shape, scheme, gemm1, gemm2",
    [
        ("qwen3-30b-a3b", "bf16", (1536, 2048), (2048, 768)),
        ("W", "int8", (4096, 7168), (7168, 2048)),
        ("mixtral-8x7b", "fp8", (28672, 4096), (4096, 14336)),
        # gpt-oss's 2880 is no multiple of 128: fp8 runs the padded 2944, bf16 the real sizes
        ("gpt-oss-20b", "bf16", (5760, 2880), (2880, 2880)),
        ("gpt-oss-20b", "fp8", (5888, 2944), (2944, 2944)),
    ],
)
def test_gemm_sizes(shape, scheme, gemm1, gemm2):
    assert tg.gemm_sizes(CONFIGS[shape], scheme) == (gemm1, gemm2)


def test_gemm_sizes_of_a_gate_without_a_gate_half():
    cfg = CONFIGS["qwen3-30b-a3b"]
    plain = type(cfg)(**{**cfg.__dict__, "gate": "relu2:glu=0"})  # (NemotronH: GEMM1 writes I)
    assert tg.gemm_sizes(plain, "bf16") == ((768, 2048), (2048, 768))


def test_contiguous_problems():
    cfg = CONFIGS["gpt-oss-20b"]
    E, K = cfg.local_experts, cfg.top_k
    ps = list(tg.contiguous_problems(cfg, "fp8", (16, 128), (8, 4096)))
    assert len(ps) == 2 * 2 * 2  # GEMMs x row blocks x T
    assert {(p.N, p.K) for p in ps} == {(5888, 2944), (2944, 2944)}
    for p in ps:
        assert p.layout == "contiguous" and p.scheme == "fp8" and p.E == E == 32
        assert p.m == p.rows == reference.permuted_rows(p.tokens, K, E, p.block)
        assert p.m % p.block == 0
    assert {(p.block, p.tokens, p.m) for p in ps} == {
        (16, 8, 512), (16, 4096, 16864), (128, 8, 4096), (128, 4096, 20480)
    }  # fmt: skip
    assert tuple(ps[0])[:7] == ("contiguous", "fp8", 5888, 2944, 32, 16, 512)


def test_gate_problems():
    """GEMM1 + gate: every scheme, N = h's channels, K = H, the config's gate and biases."""
    cfg = CONFIGS["gpt-oss-20b"]
    ps = list(tg.gate_problems(cfg, "fp8", (16, 128), (8, 4096)))
    assert len(ps) == 2 * 2 and {(p.N, p.K, p.E) for p in ps} == {(2944, 2944, 32)}
    assert all(p.gate == cfg.gate and p.bias and p.layout == "gate" for p in ps)
    assert [p.m for p in ps] == [reference.permuted_rows(t, 4, 32, b)
                                 for b in (16, 128) for t in (8, 4096)]  # fmt: skip
    (p8,) = tg.gate_problems(cfg, "int8", (16,), (8,))  # (its bf16 h, then quantize's rows)
    assert (p8.N, p8.K, p8.layout) == (2880, 2880, "gate")
    plain = type(cfg)(**{**CONFIGS["qwen3-30b-a3b"].__dict__, "gate": "relu2:glu=0"})
    (p,) = tg.gate_problems(plain, "bf16", (16,), (8,))
    assert (p.N, p.K) == (768, 2048)
    assert len(tg.candidates("gate", "fp8", 16)) >= 1 and len(tg.candidates("gate", "int8", 16))
    assert all(c["BLOCK_N"] == 128 for c in tg.candidates("gate", "fp8", 128))


def test_gather_problems():
    """permute + GEMM1, copying or gathering: every scheme, N = w1's rows, K = H, per row block
    and T, the config's gate and biases; their entries carry those fields."""
    cfg = CONFIGS["gpt-oss-20b"]
    ps = list(tg.gather_problems(cfg, "int8", (16, 128), (8, 4096)))
    assert len(ps) == 2 * 2 and {(p.N, p.K, p.E) for p in ps} == {(5760, 2880, 32)}
    assert all(p.layout == "gather" and p.gate == cfg.gate and p.bias for p in ps)
    assert [p.m for p in ps] == [reference.permuted_rows(t, 4, 32, b)
                                 for b in (16, 128) for t in (8, 4096)]  # fmt: skip
    e = tg.gemm_entry(ps[0], "gather", {}, {"copy": 2.0, "gather": 1.5})
    assert (e["gate"], e["bias"], e["backend"]) == (cfg.gate, True, "gather")
    assert _tuned.problem(e) == ("gather", "int8", 5760, 2880, 32, 16, cfg.gate, True)
    assert "gather" in tg.parse_args([]).layouts


def test_masked_problems():
    cfg = CONFIGS["qwen3-30b-a3b"]  # E 128, top-8
    ps = list(tg.masked_problems(cfg, "bf16", (8, 100, 512, 2048)))
    assert len(ps) == 2 * 3  # 2048 > the LL sizes: no masked problem
    by_t = {p.tokens: p for p in ps if p.N == 1536}
    rows_m = {t: (p.rows, p.m) for t, p in by_t.items()}  # (C, expected_m = ceil(T * 8 / 128))
    assert rows_m == {8: (128, 1), 100: (128, 7), 512: (512, 32)}
    for p in ps:
        assert p.layout == "masked" and p.block == _triton._masked_tiling(p.rows, p.m)[0]
    assert by_t[8].block == 16 and by_t[512].block == 64  # (32 rows per expert reach ~46)


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b", "W"])
def test_default_tokens_reach_every_masked_tile(shape):
    """The table keys masked entries by the row tile: the default run adds one call size for each
    tile of a one-rank LL call (T <= LL_MAX_TOKENS) that TOKENS miss, the most tokens that get
    it (qwen3 / Mixtral: BLOCK_M 32 at T = 320 / 80, where expected_m is 20); --tokens as given."""
    cfg = CONFIGS[shape]
    for scheme in ("bf16", "fp8", "int8"):
        for layout, problems in (("masked", tg.masked_problems),
                                 ("masked_gate", tg.masked_gate_problems)):  # fmt: skip
            tiles = {tg._masked_tile(layout, scheme, t, cfg.top_k, cfg.local_experts)[2]
                     for t in range(1, tg.LL_MAX_TOKENS + 1)}  # fmt: skip
            tokens = tg.every_tile(cfg, scheme, tg.TOKENS, layout)
            assert tokens[: len(tg.TOKENS)] == list(tg.TOKENS)
            assert {p.block for p in problems(cfg, scheme, tokens)} == tiles
    extra = {s: tg.every_tile(CONFIGS[s], "bf16", tg.TOKENS)[len(tg.TOKENS):]
             for s in ("qwen3-30b-a3b", "mixtral-8x7b")}  # fmt: skip
    assert extra == {"qwen3-30b-a3b": [320], "mixtral-8x7b": [80]}
    a = tg.parse_args(["--shapes", shape, "--schemes", "bf16", "--layouts", "masked"])
    assert a.every_tile and a.tokens == list(tg.TOKENS)
    first, _ = tg.selected(a, None, cfg, "bf16")
    assert {p.block for p in first} == tiles
    a = tg.parse_args(["--shapes", shape, "--layouts", "masked", "--tokens", "512"])
    assert not a.every_tile and {p.tokens for p in tg.selected(a, None, cfg, "bf16")[0]} == {512}


def test_masked_gate_problems():
    """Masked GEMM1 + gate: GEMM1's masked problems with N = h's channels, K = H, the config's gate
    and biases; fp8 candidates of one scale group a tile, none past the accumulators' limit."""
    cfg = CONFIGS["gpt-oss-20b"]  # E 32, top-4
    ps = list(tg.masked_gate_problems(cfg, "fp8", (8, 100, 512, 2048)))
    assert [p.tokens for p in ps] == [8, 100, 512]  # (2048: past the LL sizes)
    assert all((p.N, p.K, p.E, p.layout) == (2944, 2944, 32, "masked_gate") for p in ps)
    assert all(p.gate == cfg.gate and p.bias for p in ps)
    for p in ps:
        assert p.block == _triton.masked_gate_tiling(p.rows, p.m, 1)[0]
        assert p.m == -(-p.tokens * 4 // 32)
    e = tg.gemm_entry(ps[0], "unfused", {}, {"unfused": 2.0})
    assert _tuned.problem(e) == ("masked_gate", "fp8", 2944, 2944, 32, 16, cfg.gate, True)
    assert "masked_gate" in tg.parse_args([]).layouts
    assert tg.candidates("masked_gate", "fp8", 16)
    assert all(c["BLOCK_N"] == 128 for c in tg.candidates("masked_gate", "fp8", 32))
    assert not tg.candidates("masked_gate", "fp8", 64)  # (two 64x128 float32 sums spill)
    assert tg.candidates("masked_gate", "bf16", 64) and tg.candidates("masked_gate", "int8", 64)
    # (so fp8 tiles at most 32 rows: Qwen3 at T = 512, 32 rows an expert, has its candidates)
    qwen3 = {p.tokens: p.block for p in tg.masked_gate_problems(CONFIGS["qwen3-30b-a3b"], "fp8",
                                                                 (512,))}  # fmt: skip
    (bf16,) = tg.masked_gate_problems(CONFIGS["qwen3-30b-a3b"], "bf16", (512,))
    assert qwen3 == {512: 32} and bf16.block == 64 and tg.candidates("masked_gate", "fp8", 32)


def test_gemv_problems():
    """The GEMVs at one token and at several: gemv_up with N = h's channels, K = H and the
    layer's gate and biases; gemv_down N = H, K = I (padded as the layer pads); block = top-K."""
    cfg = CONFIGS["gpt-oss-20b"]  # E 32, top-4, H 2880, I 2880
    ps = list(tg.gemv_problems(cfg, "fp8", tg.parse_args([]).layouts))
    assert [(p.layout, p.m, p.tokens) for p in ps] == [
        ("gemv_up", 1, 1), ("gemv_down", 1, 1), ("gemv_up", 4, 4), ("gemv_down", 4, 4)]  # fmt: skip
    assert all((p.N, p.K, p.E, p.block, p.top_k) == (2944, 2944, 32, 4, 4) for p in ps)
    assert all(p.bias for p in ps) and ps[0].gate == cfg.gate
    up = tg.gemm_entry(ps[0], "triton", {}, {})
    assert _tuned.problem(up) == ("gemv_up", "fp8", 2944, 2944, 32, 4, cfg.gate, True)
    assert _tuned.problem(tg.gemm_entry(ps[1], "triton", {}, {})) == (
        "gemv_down", "fp8", 2944, 2944, 32, 4)  # fmt: skip
    one, several = tg.gemv_problems(CONFIGS["qwen3-30b-a3b"], "bf16", ("gemv_down",))
    assert (one.N, one.K, one.block, one.m, several.m) == (2048, 768, 8, 1, 4)
    # (timed at the most tokens the entry serves too: Qwen3's GEMV cutoff, eight)
    assert (
        (one.tokens, several.tokens)
        == (1, tg.gemv_cutoff(CONFIGS["qwen3-30b-a3b"], "bf16"))
        == (1, 8)
    )
    # (several: at most the layer's GEMV cutoff, two tokens at Mixtral's top-2 of 8)
    assert [p.m for p in tg.gemv_problems(CONFIGS["mixtral-8x7b"], "int8", ("gemv_up",))] == [1, 2]


def test_candidates_are_the_fitting_configs():
    for rb in (16, 32, 64, 128):
        got = tg.candidates("contiguous", "bf16", rb)
        assert got and all(rb % c["BLOCK_M"] == 0 for c in got)
        optional = {"TMA", "PERSISTENT", "SWAP", *_triton._GLUON_KEYS}
        assert all(set(c) - optional == {*CFG} for c in got)
    bf16, int8 = tg.candidates("contiguous", "bf16", 128), tg.candidates("contiguous", "int8", 128)
    assert len(int8) == len(_triton._CONTIGUOUS_CONFIGS)  # (1-byte operands: every tile fits)
    assert bf16 and len(bf16) < len(int8)  # (the 2-byte ones over sm90's shared memory: dropped)
    assert any(c.get("GLUON") for c in bf16)  # (the Gluon kernels take every scheme)
    fp8 = tg.candidates("contiguous", "fp8", 128)
    assert fp8 and all(c["BLOCK_K"] <= 128 for c in fp8)  # (one scale group per K step)
    # fp8 through Gluon: no COOP, tiles within one 128-row weight block, at most 64 outputs a
    # thread
    gluon_fp8 = [c for c in fp8 if c.get("GLUON")]
    assert gluon_fp8 and not any(c.get("COOP") for c in gluon_fp8)
    assert all(c["BLOCK_N"] <= 128 and c["BLOCK_M"] * c["BLOCK_N"] <= 64 * 32 * c["num_warps"]
               for c in gluon_fp8)  # fmt: skip
    masked_fp8 = [c for c in tg.candidates("masked", "fp8", 64) if c.get("GLUON")]
    assert len(masked_fp8) >= 3 and any(c.get("STORE_TMA") for c in masked_fp8)
    assert any(c.get("WS") for c in masked_fp8)
    assert len(fp8) < len(_triton._CONTIGUOUS_CONFIGS)
    assert len(tg.candidates("masked", "int8", 32)) == len(_triton._MASKED_CONFIGS)


# ----------------------------------------------------------------------------------- the winner
def _m(backend, us, config=None, error=""):
    return tg.Measured(backend, config, us, error)


def test_the_fastest_backend_wins_and_the_fastest_config_is_kept():
    slow, fast = dict(CFG, BLOCK_N=128), dict(CFG)
    got = tg.winner([_m("triton", 30.0, slow), _m("triton", 20.0, fast), _m("deep_gemm", 25.0)])
    assert got == ("triton", fast, {"deep_gemm": 25.0, "triton": 20.0})
    got = tg.winner([_m("triton", 30.0, slow), _m("triton", 28.0, fast), _m("deep_gemm", 25.0)])
    assert got == ("deep_gemm", fast, {"deep_gemm": 25.0, "triton": 28.0})


def test_a_backend_that_cannot_run_the_problem_never_wins():
    ms = [_m("triton", 30.0, CFG), _m("deep_gemm", 10.0), _m("grouped_mm", 20.0)]
    assert tg.winner(ms, runnable={"triton", "grouped_mm"})[0] == "grouped_mm"
    backend, _, us = tg.winner(ms, runnable={"triton"})
    assert backend == "triton" and us == {"triton": 30.0}


def test_failed_measurements_are_ignored():
    bad = dict(CFG, BLOCK_N=256)
    ms = [_m("triton", float("nan"), bad), _m("triton", None, bad, "OutOfResources"),
          _m("triton", 40.0, CFG), _m("deep_gemm", None, error="RuntimeError")]  # fmt: skip
    assert tg.winner(ms) == ("triton", CFG, {"triton": 40.0})
    # no Triton config ran: no entry (the table's entries carry one)
    assert tg.winner([_m("triton", None, CFG, "x"), _m("deep_gemm", 5.0)]) is None
    assert tg.winner([]) is None


def test_a_gemv_entry_keeps_the_default_unless_beaten_by_the_margin():
    def choice(best_us, default_us):
        return tg.gemv_choice([tg.Measured("triton", {"block_n": 8}, best_us),
                               tg.Measured("triton", {"block_n": 16}, default_us),
                               tg.Measured("default", {"block_n": 16}, default_us)])  # fmt: skip

    close = 100.0 * (1 - tg.GEMV_MARGIN) + 0.5
    assert choice(close, 100.0) == ("triton", {"block_n": 16}, {"default": 100.0, "triton": close})
    assert choice(90.0, 100.0)[1] == {"block_n": 8}
    assert choice(100.0, 90.0)[1] == {"block_n": 16}
    no_default = [tg.Measured("triton", {"block_n": 8}, 5.0)]
    assert tg.gemv_choice(no_default) == ("triton", {"block_n": 8}, {"triton": 5.0})
    assert tg.gemv_choice([tg.Measured("triton", {"block_n": 8}, None, "failed")]) is None


def test_the_log_ranks_every_measurement_that_ran():
    tma = dict(CFG, TMA=True)
    ms = [_m("triton", 30.0, CFG), _m("deep_gemm", 25.0), _m("triton", None, tma, "x"),
          _m("triton", float("nan"), tma), _m("triton", 20.0, tma)]  # fmt: skip
    lines = tg.ranking(ms)
    assert [ln.split()[:2] for ln in lines] == [["20.00", "triton"], ["25.00", "deep_gemm"],
                                                ["30.00", "triton"]]  # fmt: skip
    assert '"TMA": true' in lines[0] and lines[1].endswith("deep_gemm")


def test_path_entries():
    cfg = CONFIGS["qwen3-30b-a3b"]
    # up to the GEMV cutoff (qwen3 fp8: 8) the GEMVs against LL; above the LL sizes HT only
    assert tg.gemv_cutoff(cfg, "fp8") == 8 and tg.gemv_cutoff(cfg, "int8") == 4
    assert tg.path_variants(8, 8) == [("gemv", 0), ("ll", 0)]
    assert tg.path_variants(512) == [("ll", 0)] + [("ht", a) for a in tg.PATH_ALIGNMENTS]
    assert tg.path_variants(9, 8) == tg.path_variants(512)
    assert tg.path_variants(513) == [("ht", a) for a in tg.HT_ALIGNMENTS]
    p = tg.path_entry(cfg, "fp8", 8, {"gemv": 100.0, "ll": 98.0})  # (within PATH_MARGIN)
    assert (p["path"], p["alignment"]) == ("gemv", 0)
    p = tg.path_entry(cfg, "fp8", 8, {"gemv": 100.0, "ll": 90.0})
    assert (p["path"], p["alignment"], p["us"]) == ("ll", 0, {"gemv": 100.0, "ll": 90.0})
    p = tg.path_entry(cfg, "fp8", 8, {"gemv": None, "ll": 90.0})  # (the GEMVs timed: no margin)
    assert p["path"] == "ll"
    p = tg.path_entry(cfg, "fp8", 4096, {"ht@128": 500.0, "ht@64": 480.0})
    assert (p["path"], p["alignment"], p["t"]) == ("ht", 64, 4096)
    p = tg.path_entry(cfg, "fp8", 32, {"ll": 90.0, "ht@128": 120.0, "ht@16": 84.0, "ht@32": None})
    assert (p["path"], p["alignment"], p["t"]) == ("ht", 16, 32)
    assert (p["E"], p["H"], p["I"], p["K"]) == (128, 2048, 768, 8)
    assert p["us"] == {"ll": 90.0, "ht@128": 120.0, "ht@16": 84.0}
    p = tg.path_entry(cfg, "fp8", 32, {"ll": 80.0, "ht@16": 84.0})
    assert (p["path"], p["alignment"]) == ("ll", 0)
    # a win within PATH_MARGIN (3%) keeps LL; HT alone still gives an HT entry
    p = tg.path_entry(cfg, "fp8", 32, {"ll": 86.0, "ht@16": 84.0, "ht@64": 85.0})
    assert (p["path"], p["alignment"]) == ("ll", 0)
    p = tg.path_entry(cfg, "fp8", 32, {"ht@64": 85.0, "ht@16": 86.0})
    assert (p["path"], p["alignment"]) == ("ht", 64)
    assert tg.path_entry(cfg, "fp8", 32, {"ll": None}) is None


# ------------------------------------------------------------------------------------ the file
def _entry(scheme, block, m, backend="triton", us=10.0, N=256, K=512, E=4, layout="contiguous"):
    p = tg.Problem(layout, scheme, N, K, E, block, m, 0, m, 2)
    return tg.gemm_entry(p, backend, dict(CFG), {backend: us})


def _path(t, path="ll", alignment=0, scheme="fp8"):
    return dict(scheme=scheme, E=4, H=512, I=256, K=2, t=t, path=path, alignment=alignment,
                us={"ll": 1.0})  # fmt: skip


HEADER = dict(device="NVIDIA H200", triton="3.x", torch="2.x", date="d", commit="c")


def test_merge_replaces_same_keys_and_keeps_the_rest_in_order():
    old = dict(device="NVIDIA H200", triton="old", note="kept", entries=[
        _entry("fp8", 128, 256, us=50.0), _entry("fp8", 128, 4096), _entry("bf16", 16, 64)],
        paths=[_path(32), _path(128)])  # fmt: skip
    new = [_entry("fp8", 128, 256, backend="deep_gemm", us=40.0), _entry("int8", 16, 64)]
    doc = tg.merge(old, new, [_path(32, "ht", 16)], HEADER)
    keys = [tg.entry_key(e) for e in doc["entries"]]
    assert keys == sorted(keys) and len(keys) == 4
    replaced = [e for e in doc["entries"] if tg.entry_key(e) == tg.entry_key(new[0])]
    assert replaced == [new[0]]  # (the old entry of that key is gone)
    assert _entry("fp8", 128, 4096) in doc["entries"] and _entry("bf16", 16, 64) in doc["entries"]
    assert [(p["t"], p["path"]) for p in doc["paths"]] == [(32, "ht"), (128, "ll")]
    assert doc["triton"] == "3.x" and doc["note"] == "kept"
    # deterministic: the same document whatever order the inputs come in
    shuffled = dict(old, entries=old["entries"][::-1], paths=old["paths"][::-1])
    assert tg.dumps(tg.merge(shuffled, new[::-1], [_path(32, "ht", 16)], HEADER)) == tg.dumps(doc)
    assert tg.merge(None, [], [], HEADER) == dict(HEADER, entries=[], paths=[])


@pytest.fixture
def tuned_dir(h200_table):
    return h200_table


def test_a_written_file_reads_back(tuned_dir):
    entries = [_entry("fp8", 128, m, backend="deep_gemm" if m > 1000 else "triton")
               for m in (4096, 256)]  # fmt: skip
    entries[1]["config"]["BLOCK_N"] = 128
    masked = _entry("bf16", 16, 2, layout="masked", backend="bmm")
    paths = [_path(128, "ht", 16), _path(32)]
    random.Random(0).shuffle(entries)
    doc = tg.merge(None, entries + [masked], paths, HEADER)
    path = tuned_dir / _tuned.file_name("NVIDIA H200")
    tg.write(path, doc)
    assert json.loads(path.read_text()) == doc
    assert not list(tuned_dir.glob("*.tmp"))
    dev = torch.device("cuda", 0)
    cfg = _tuned.lookup("contiguous", "fp8", 256, 512, 4, 128, 100, dev)
    assert cfg == dict(CFG, BLOCK_N=128)  # (the m 256 entry: the smallest m >= 100)
    assert _tuned.lookup("contiguous", "fp8", 256, 512, 4, 128, 9999, dev) == CFG
    assert _tuned.backend("contiguous", "fp8", 256, 512, 4, 128, 300, dev) == "deep_gemm"
    assert _tuned.backend("contiguous", "fp8", 256, 512, 4, 128, 200, dev) == "triton"
    assert _tuned.lookup("masked", "bf16", 256, 512, 4, 16, 2, dev) == CFG
    assert _tuned.lookup("contiguous", "fp8", 256, 512, 4, 64, 100, dev) is None  # (no entry)
    got = _tuned.paths("fp8", 4, 512, 256, 2, dev)
    assert [(p["t"], p["path"], p["alignment"]) for p in got] == [(32, "ll", 0), (128, "ht", 16)]


def test_reading_table_points_the_ops_at_a_document(tuned_dir):
    """The path layers read this run's entries (whatever --out / --dry-run), then the real table."""
    (tuned_dir / "nvidia_h200.json").write_text(json.dumps(dict(entries=[], paths=[])))
    dev = torch.device("cuda", 0)
    doc = tg.merge(None, [_entry("fp8", 128, 256)], [], HEADER)
    with tg.reading_table(doc, "NVIDIA H200"):
        assert _tuned.DIR != tuned_dir
        assert _tuned.lookup("contiguous", "fp8", 256, 512, 4, 128, 1, dev) == CFG
    assert _tuned.DIR == tuned_dir
    assert _tuned.lookup("contiguous", "fp8", 256, 512, 4, 128, 1, dev) is None


def test_main_needs_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tg.main(["--dry-run", "--shapes", "qwen3-30b-a3b"]) == 2
    assert "CUDA" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown shape"):
        tg.parse_args(["--shapes", "nope"])


GPT_OSS = "silu:alpha=1.702,limit=7.0,up_offset=1.0"


@pytest.mark.parametrize(
    "sizes, scheme, gate, bias",
    [
        ((2048, 768, 128, 8), "bf16", "silu", False),
        ((4096, 14336, 8, 2), "int8", "silu", False),
        ((2880, 2880, 32, 4), "fp8", GPT_OSS, True),  # (fp8 pads 2880 to 2944)
        ((1024, 384, 16, 4), "bf16", "gelu_tanh", False),
    ],
)
def test_a_layer_of_ones_own_tunes_what_its_epmoe_looks_up(sizes, scheme, gate, bias):
    """--layer H I E K (--gate, --bias): a shape of those sizes, alone without --shapes, whose
    problems cover every one the EPMoE of that layer looks up (what its untuned-table warning
    names, :meth:`EPMoE.tuning_problems`) and whose path entries are the ones it reads."""
    import epmoe

    H, I, E, K = sizes  # noqa: E741
    argv = ["--layer", *map(str, sizes), "--schemes", scheme, "--gate", gate] + \
        (["--bias"] if bias else [])  # fmt: skip
    a = tg.parse_args(argv)
    (name,) = a.shapes
    cfg = a.configs[name]
    first, later = tg.selected(a, None, cfg, scheme)
    problems = first + [p for _, ps in later for p in ps]
    tuned = {(p.layout, p.scheme, p.N, p.K, p.E) + ((p.gate, p.bias) if p.layout in
             _tuned._LAYER_KEYED else ()) for p in problems}  # fmt: skip
    layer = epmoe.EPMoE(E, H, I, K, quant=scheme, mode="auto", gate=gate, bias=bias, device="cpu")
    looked_up = {p[:5] + (p[5:] if p[0] in _tuned._LAYER_KEYED else ()) for p in
                 layer.tuning_problems()}  # fmt: skip
    assert looked_up and looked_up <= tuned
    assert _tuned.layer_key(tg.layer_sizes(cfg, scheme)) == _tuned.layer_key(dict(
        scheme=scheme, E=E, H=H, I=I, K=K, gate=layer.gate.spec, bias=bias))  # fmt: skip
    assert tg.parse_args(argv + ["--shapes", "W"]).shapes == ["W", name]


def test_layer_arguments_are_checked():
    with pytest.raises(SystemExit, match="--layer 2048 0 8 2: EPMoE: intermediate_size expected"):
        tg.parse_args(["--layer", "2048", "0", "8", "2"])
    with pytest.raises(SystemExit, match="--gate expected a gate spec"):
        tg.parse_args(["--layer", "2048", "768", "8", "2", "--gate", "nope"])
    with pytest.raises(SystemExit, match="--gate / --bias describe --layer's experts"):
        tg.parse_args(["--bias"])
    assert tg.parse_args([]).shapes == list(tg.SHAPES)


# ------------------------------------------------------------- the GPU code path, on CPU tensors
@pytest.fixture
def cpu_tuner(monkeypatch):
    """A Tuner on CPU tensors: each timing runs the call once (the Triton kernels under
    TRITON_INTERPRET=1, the layers on their CPU kernels) and reports a fixed µs per backend."""
    calls = []

    def time_us(self, fn):
        fn()
        calls.append(fn)
        return 10.0 + len(calls)  # (later measurements slower: the first config wins)

    monkeypatch.setattr(tg.Tuner, "time_us", time_us)
    monkeypatch.setattr(_select, "_runs", lambda name, *args: name == "triton")
    # (GEMVs: two candidates a kernel on one routing, the interpreter's time)
    monkeypatch.setattr(gemv, "UP_CANDIDATES", ((8, 512, 4), (16, 512, 8)))
    monkeypatch.setattr(gemv, "DOWN_CANDIDATES", ((8, 128, 4), (16, 128, 8)))
    monkeypatch.setattr(tg, "GEMV_ROUTINGS", 1)
    return tg.Tuner(torch.device("cpu"), iters=1, deadline=float("inf")), calls


@pytest.mark.interpret
@pytest.mark.parametrize("scheme", ["int8", "fp8", "bf16"])
def test_gemm_entries_run_every_candidate(cpu_tuner, bf16_dots, scheme):
    tuner, calls = cpu_tuner
    cfg = CONFIGS["tiny-1rank"]  # H 256, I 128, E 8, top-2
    problems = list(tg.contiguous_problems(cfg, scheme, (16,), (4,)))
    problems += list(tg.masked_problems(cfg, scheme, (4,)))
    entries = list(tuner.gemm_entries(problems))
    assert [tg.entry_key(e) for e in entries] == [p[:7] for p in problems]
    n = sum(len(tg.candidates(p.layout, scheme, p.block)) for p in problems)
    assert len(calls) == n and tuner.errors == 0
    for e, p in zip(entries, problems, strict=True):
        assert e["backend"] == "triton"
        assert e["config"] == tg.candidates(p.layout, scheme, p.block)[0]


@pytest.mark.interpret
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_gate_entries_time_the_fused_kernel_and_the_unfused_pair(cpu_tuner, bf16_dots, scheme):
    tuner, calls = cpu_tuner
    cfg = CONFIGS["tiny-gpt-oss"]  # the clamped gate with biases; fp8 pads H / I
    (p,) = tg.gate_problems(cfg, scheme, (16,), (4,))
    (e,) = tuner.gemm_entries([p])
    n = len(tg.candidates("gate", scheme, 16))
    # (every config, the unfused pair, then its GEMM1 alone)
    assert len(calls) == n + 2 and tuner.errors == 0
    assert set(e["us"]) == {"triton", "unfused"} and e["backend"] == "triton"
    assert e["config"] == tg.candidates("gate", scheme, 16)[0] and e["layout"] == "gate"


@pytest.mark.interpret
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_masked_gate_entries_time_the_fused_kernel_and_the_unfused_pair(
    cpu_tuner, bf16_dots, scheme
):
    tuner, calls = cpu_tuner
    cfg = CONFIGS["tiny-gpt-oss"]  # the clamped gate with biases; fp8 pads H / I
    (p,) = tg.masked_gate_problems(cfg, scheme, (4,))
    (e,) = tuner.gemm_entries([p])
    n = len(tg.candidates("masked_gate", scheme, p.block))
    assert n and len(calls) == n + 2 and tuner.errors == 0  # (every config, the pair, its GEMM1)
    assert set(e["us"]) == {"triton", "unfused"} and e["backend"] == "triton"
    assert e["config"] == tg.candidates("masked_gate", scheme, p.block)[0]
    assert (e["layout"], e["gate"], e["bias"]) == ("masked_gate", cfg.gate, True)


@pytest.mark.interpret
@pytest.mark.parametrize("layout", ["gate", "masked_gate"])
def test_the_unfused_pairs_gemm1_alone_is_logged_and_never_an_entry(
    cpu_tuner, bf16_dots, monkeypatch, capsys, layout
):
    tuner, calls = cpu_tuner

    def time_us(self, fn):  # (later measurements faster: GEMM1 alone, timed last, the fastest)
        fn()
        calls.append(fn)
        return 100.0 - len(calls)

    monkeypatch.setattr(tg.Tuner, "time_us", time_us)
    cfg = CONFIGS["tiny-1rank"]
    if layout == "gate":
        (p,) = tg.gate_problems(cfg, "bf16", (16,), (4,))
    else:
        (p,) = tg.masked_gate_problems(cfg, "bf16", (4,))
    (e,) = tuner.gemm_entries([p])
    assert e["backend"] == "unfused" and set(e["us"]) == {"triton", "unfused"}
    log = capsys.readouterr().out.splitlines()
    assert log[0].split()[1] == tg.UNFUSED_GEMM1 and log[1].split()[1] == "unfused"


@pytest.mark.interpret
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "int8"])
def test_gemv_entries_time_every_fitting_config(cpu_tuner, monkeypatch, scheme):
    """Each GEMV problem times every candidate that fits, pinned (CONFIG's fields, no table), on
    GEMV_ROUTINGS routings, launched as the layer launches it (the ids check on), and keeps the
    fastest as the entry's config; outputs are checked against the default config's."""
    tuner, calls = cpu_tuner
    monkeypatch.setattr(tg, "GEMV_ROUTINGS", 2)
    checks, setup = [], gemv._check_setup
    monkeypatch.setattr(
        gemv, "_check_setup", lambda t, check: checks.append(check) or setup(t, check)
    )
    cfg = CONFIGS["tiny-gpt-oss"]  # the clamped gate with biases; fp8 pads H / I
    problems = list(tg.gemv_problems(cfg, scheme, ("gemv_up", "gemv_down")))
    entries = list(tuner.gemm_entries(problems))
    assert checks and all(checks)  # (launched with the ids check on, as the layer launches them)

    def fitting(p):
        up = p.layout == "gemv_up"
        return [c for c in (gemv.UP_CANDIDATES if up else gemv.DOWN_CANDIDATES)
                if gemv.fits("up" if up else "down", scheme, c, p.K, p.top_k)]  # fmt: skip

    def default(p):
        kernel = "up" if p.layout == "gemv_up" else "down"
        with gemv.override():
            return gemv.launch_config(kernel, scheme, p.tokens, p.N, p.K, p.E, p.top_k,
                                      tuner.device, p.gate, p.bias)  # fmt: skip

    # (every fitting candidate, and the default where it is none of them)
    n = sum(len(fitting(p)) + (default(p) not in fitting(p)) for p in problems)
    assert len(calls) == n * tg.GEMV_ROUTINGS and tuner.errors == 0
    assert [tg.entry_key(e) for e in entries] == [tg.entry_key(tg.gemm_entry(p, "", {}, {}))
                                                   for p in problems]  # fmt: skip
    for e, p in zip(entries, problems, strict=True):
        first = fitting(p)[0]
        assert e["config"] == dict(block_n=first[0], block_k=first[1], num_warps=first[2])
        assert e["backend"] == "triton" and set(e["us"]) == {"triton", "default"}


@pytest.mark.interpret
def test_a_several_token_gemv_entry_is_timed_up_to_the_most_tokens_it_serves(
    cpu_tuner, monkeypatch
):
    """The several-token entry serves every count from 2 to the layer's GEMV cutoff: its
    candidates are timed on routings of m tokens and of the cutoff's (Problem.tokens), summed."""
    tuner, calls = cpu_tuner
    tokens, setup = [], gemv._check_setup
    monkeypatch.setattr(
        gemv, "_check_setup", lambda t, check: tokens.append(t.shape[0]) or setup(t, check)
    )
    one, several = tg.gemv_problems(CONFIGS["tiny-gpt-oss"], "bf16", ("gemv_down",))
    p = several._replace(tokens=3)  # (as at a cutoff above GEMV_TOKENS' several)
    (e,) = tuner.gemm_entries([p])
    runs = len(calls)  # (one time_us a routing)
    assert runs and runs % 2 == 0 and tuner.errors == 0
    # (each candidate timed on a routing of m tokens and one of the cutoff's; its output checked
    # on the first)
    assert set(tokens) == {2, 3} and tokens.count(3) == runs // 2 and e["m"] == 2


def test_a_config_that_fails_is_skipped(cpu_tuner, monkeypatch):
    tuner, _ = cpu_tuner
    real = _triton.masked_triton

    def boom(*args, config=None, **kw):
        if config["BLOCK_N"] == 128:
            raise RuntimeError("out of resource: shared memory")
        return real(*args, config=config, **kw)

    monkeypatch.setattr(_triton, "masked_triton", boom)
    (p,) = [p for p in tg.masked_problems(CONFIGS["tiny-1rank"], "int8", (4,)) if p.K == 128]
    (e,) = tuner.gemm_entries([p])
    wide = sum(c["BLOCK_N"] == 128 for c in tg.candidates("masked", "int8", p.block))
    assert 0 < wide and tuner.errors == wide and e["config"]["BLOCK_N"] != 128
    with pytest.raises(tg.OutOfTime):
        list(tg.Tuner(torch.device("cpu"), iters=1, deadline=0.0).gemm_entries([p]))


# a config whose output is wrong (RS, 2026-12-06: rows differing from the GEMM's) or that writes
# nothing is skipped like one that fails to launch, contiguous and masked; a right one passes
@pytest.mark.interpret
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
@pytest.mark.parametrize("fault", ["off", "silent"])
def test_a_config_with_a_wrong_output_is_skipped(cpu_tuner, monkeypatch, layout, fault):
    tuner, _ = cpu_tuner
    name = f"{layout}_triton"
    real = getattr(_triton, name)

    def faulty(*args, config=None, out=None, **kw):
        if config["BLOCK_N"] != 128:
            return real(*args, config=config, out=out, **kw)
        if fault == "off":  # (one sampled row off by a little more than the tolerance)
            y = real(*args, config=config, out=out, **kw)
            return y.mul_(1 + 3 * tg.CHECK_TOL)
        return out  # (writes nothing)

    monkeypatch.setattr(_triton, name, faulty)
    cfg = CONFIGS["tiny-1rank"]
    if layout == "contiguous":
        (p,) = [p for p in tg.contiguous_problems(cfg, "int8", (16,), (4,)) if p.K == 256]
    else:
        (p,) = [p for p in tg.masked_problems(cfg, "int8", (4,)) if p.K == 128]
    (e,) = tuner.gemm_entries([p])
    wide = sum(c["BLOCK_N"] == 128 for c in tg.candidates(layout, "int8", p.block))
    assert 0 < wide and tuner.errors == wide and e["config"]["BLOCK_N"] != 128


@pytest.mark.interpret
def test_a_gemv_config_with_a_wrong_output_is_skipped(cpu_tuner, monkeypatch):
    """A GEMV candidate whose output is off (here: every 8-column one) never becomes the entry."""
    tuner, _ = cpu_tuner
    real = gemv._down_launch

    def faulty(*plan):
        launch, narrow = real(*plan), gemv.CONFIG.down_int8[0] == 8

        def run(*tensors):  # (h, ids, weights, w2, scales, bias, out, flag)
            launch(*tensors)
            if narrow:
                tensors[6].mul_(1 + 3 * tg.CHECK_TOL)

        return run

    monkeypatch.setattr(gemv, "_down_launch", faulty)
    cfg = CONFIGS["tiny-1rank"]
    (p,) = [p for p in tg.gemv_problems(cfg, "int8", ("gemv_down",)) if p.m > 1]
    (e,) = tuner.gemm_entries([p])
    narrow = sum(c[0] == 8 and gemv.fits("down", "int8", c, p.K, p.top_k)
                 for c in gemv.DOWN_CANDIDATES)  # fmt: skip
    assert 0 < narrow and tuner.errors == narrow and e["config"]["block_n"] != 8


def test_output_check_reads_the_sampled_rows_of_each_layout():
    gen = torch.Generator().manual_seed(5)
    E, N, K = 4, 32, 64
    w = torch.randint(-127, 128, (E, N, K), dtype=torch.int8, generator=gen)
    w_s = torch.rand((E, N), generator=gen) * 1e-2 + 1e-3
    m_idx = torch.tensor([0] * 5 + [-1] * 3 + [2] * 8 + [3] * 1 + [-1] * 7)
    a = torch.randint(-127, 128, (m_idx.numel(), K), dtype=torch.int8, generator=gen)
    a_s = torch.rand((m_idx.numel(), 1), generator=gen) * 1e-2 + 1e-3
    picks = tg.sample_picks(m_indices=m_idx)
    assert [e for e, _ in picks] == [0, 2, 3]
    assert [r.tolist() for _, r in picks] == [[0, 1, 3, 4], [8, 10, 13, 15], [16]]
    want = reference.grouped_gemm_contiguous(a, w, m_idx, a_s, w_s)
    y = torch.empty_like(want)
    check = tg.output_check(a, a_s, w, w_s, picks, y)
    assert check(lambda: y.copy_(want)) is None
    assert check(lambda: None) is not None  # (y left NaN)
    bad = want.clone()
    bad[10] += 1.0
    assert "wrong output" in check(lambda: bad)
    bad[10] = want[10]
    bad[5] = 1e4  # (a padding row: never sampled)
    assert check(lambda: bad) is None
    counts = torch.tensor([3, 0, 9, 1], dtype=torch.int32)
    a3 = torch.randint(-127, 128, (E, 9, K), dtype=torch.int8, generator=gen)
    s3 = torch.rand((E, 9, 1), generator=gen) * 1e-2 + 1e-3
    picks = tg.sample_picks(counts=counts)
    assert [(e, i[0], i[1].tolist()) for e, i in picks] == [(0, 0, [0, 1, 2]), (2, 2, [0, 3, 5, 8]),
                                                          (3, 3, [0])]  # fmt: skip
    want3 = reference.grouped_gemm_masked(a3, w, counts, s3, w_s)
    y3 = torch.empty_like(want3)
    check = tg.output_check(a3, s3, w, w_s, picks, y3)
    assert check(lambda: want3) is None
    want3[2, 3] *= 2
    assert check(lambda: want3) is not None


def test_gate_check_reads_h_of_the_masked_layout():
    """The bf16 gate check of the masked layout: sampled slot rows (expert, rows) of h `[E, T, I]`;
    rows past the counts are never sampled."""
    from epmoe import gate as G

    gen = torch.Generator().manual_seed(7)
    E, T, I, K = 3, 8, 16, 32
    g = G.get("silu")
    w = torch.randn((E, 2 * I, K), generator=gen).to(torch.bfloat16)
    a = torch.randn((E, T, K), generator=gen).to(torch.bfloat16)
    counts = torch.tensor([5, 0, 8], dtype=torch.int32)
    h = g.reference(reference.grouped_gemm_masked(a, w, torch.full((E,), T)).float())
    h = h.to(torch.bfloat16)
    check = tg.gate_check(a, w, g, tg.sample_picks(counts=counts))
    assert check(lambda: (h, None)) is None
    bad = h.clone()
    bad[0, 6], bad[1] = 1e4, 1e4  # (past the counts: never sampled)
    assert check(lambda: (bad, None)) is None
    bad[2, 7] += 1.0
    assert "wrong output" in check(lambda: (bad, None))


def test_gate_check_reads_h_of_the_sampled_rows():
    from epmoe import gate as G

    gen = torch.Generator().manual_seed(6)
    E, I, K = 3, 16, 32
    g = G.get("silu")
    w = torch.randn((E, 2 * I, K), generator=gen).to(torch.bfloat16)
    m_idx = torch.tensor([0] * 4 + [-1] * 4 + [2] * 6 + [-1] * 2)
    a = torch.randn((m_idx.numel(), K), generator=gen).to(torch.bfloat16)
    y = reference.grouped_gemm_contiguous(a, w, m_idx)
    h = g.reference(y.float()).to(torch.bfloat16)
    check = tg.gate_check(a, w, g, tg.sample_picks(m_indices=m_idx))
    assert check(lambda: (h, None)) is None
    bad = h.clone()
    bad[10] += 1.0
    assert "wrong output" in check(lambda: (bad, None))
    bad[10], bad[5] = h[10], 1e4  # (a padding row: never sampled)
    assert check(lambda: (bad, None)) is None
    assert check(lambda: (torch.full_like(h, math.nan), None)) is not None


def test_paths_time_every_variant(cpu_tuner, monkeypatch):
    tuner, calls = cpu_tuner
    cfg = CONFIGS["tiny-gpt-oss"]  # (biases, a gate of its own, sizes no multiple of 128)
    (p,) = tuner.paths(cfg, "bf16", [8], lambda t, g: [("ll", 0), ("ht", 128), ("ht", 16)])
    assert len(calls) == 3 and (p["path"], p["alignment"], p["t"]) == ("ll", 0, 8)
    assert list(p["us"]) == ["ll", "ht@128", "ht@16"]
    # above the LL sizes: HT's alignments only, on the HT layers made once
    p, q = tuner.paths(
        cfg, "bf16", [8, 16], lambda t, g: [("ht", 16)] if t > 8 else [("ht", 16), ("ll", 0)]
    )
    assert len(calls) == 6 and list(p["us"]) == ["ht@16", "ll"] and list(q["us"]) == ["ht@16"]
    assert (q["path"], q["alignment"], q["t"]) == ("ht", 16, 16)
    assert (p["E"], p["H"], p["I"], p["K"]) == (8, 200, 72, 2)
    # up to the GEMV cutoff (the tuner's to the variants): the GEMVs timed against LL, each on
    # GEMV_ROUTINGS routings (the same ones), its time the sum
    monkeypatch.setattr(tg, "GEMV_ROUTINGS", 3)
    (p,) = tuner.paths(cfg, "bf16", [1], tg.path_variants)
    assert tg.gemv_cutoff(cfg, "bf16") >= 1 and list(p["us"]) == ["gemv", "ll"]
    assert len(calls) == 12 and p["path"] in ("gemv", "ll")
    gemv_ids, ll_ids = [[c.args[1] for c in calls[i : i + 3]] for i in (6, 9)]
    assert all(torch.equal(a, b) for a, b in zip(gemv_ids, ll_ids, strict=True))
    assert not torch.equal(gemv_ids[0], gemv_ids[1]) and not torch.equal(gemv_ids[1], gemv_ids[2])
    assert p["us"]["gemv"] == sum(range(17, 20))  # (the fixed timer's 7th-9th µs, summed)


def test_entries_record_a_digest_of_the_candidates_they_timed(monkeypatch):
    """A GEMM entry's "tried" digests the candidate configs timed on its problem: the same list
    the same digest, a candidate added another; GEMV entries digest the GEMV configs that fit,
    "gather" entries (no candidates) carry none."""
    cfg = CONFIGS["qwen3-30b-a3b"]
    masked = next(iter(tg.masked_problems(cfg, "bf16", (32,))))
    contiguous = next(iter(tg.contiguous_problems(cfg, "int8", (128,), (4096,))))
    digest = tg.gemm_entry(masked, "triton", {}, {})["tried"]
    assert len(digest) == 10 and digest == tg.tried(masked) != tg.tried(contiguous)
    more = [*_triton._MASKED_CONFIGS, _triton._cfg(4, 2, BLOCK_N=32, BLOCK_K=128)]
    monkeypatch.setattr(_triton, "_MASKED_CONFIGS", more)
    assert tg.tried(masked) != digest  # (a candidate added)
    assert tg.tried(contiguous) == tg.gemm_entry(contiguous, "", {}, {})["tried"]
    up, down = list(tg.gemv_problems(cfg, "bf16", ("gemv_up", "gemv_down")))[:2]
    before = tg.tried(down)
    monkeypatch.setattr(gemv, "DOWN_CANDIDATES", gemv.DOWN_CANDIDATES[:1])
    assert tg.tried(down) != before and tg.gemm_entry(up, "", {}, {})["tried"] == tg.tried(up)
    (gather,) = list(tg.gather_problems(cfg, "fp8", (128,), (4096,)))
    assert "tried" not in tg.gemm_entry(gather, "copy", {}, {})


def test_stale_selects_what_is_missing_or_tuned_on_other_candidates():
    cfg = CONFIGS["qwen3-30b-a3b"]
    ps = list(tg.contiguous_problems(cfg, "fp8", (16, 128), (32,)))
    fresh, older, other = (tg.gemm_entry(p, "triton", dict(CFG), {"triton": 1.0}) for p in ps[:3])
    del older["tried"]  # (an entry from before the digest)
    other["tried"] = "0123456789"
    old = dict(entries=[fresh, older, other], paths=[])
    assert tg.stale(old, ps) == ps[1:] and tg.stale(None, ps) == ps
    (gather,) = list(tg.gather_problems(cfg, "fp8", (128,), (32,)))
    assert tg.stale(dict(entries=[tg.gemm_entry(gather, "copy", {}, {})]), [gather]) == []


def test_list_prints_the_problems_a_run_would_tune(tmp_path, monkeypatch, capsys):
    """--list: the selected problems (after --stale / --resume), no GPU and no tuning; without a
    GPU the table comes from --out."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "t.json"
    argv = ["--list", "--shapes", "mixtral-8x7b", "--schemes", "int8", "--layouts",
            "contiguous,gather", "--row-blocks", "128", "--tokens", "4096"]  # fmt: skip
    assert tg.main(argv) == 2 and "--out" in capsys.readouterr().err
    assert tg.main(argv + ["--out", str(out)]) == 0  # (no table yet: every problem)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "3 problems" and len(lines) == 5
    assert [ln.split()[1:3] for ln in lines[1:4]] == [["contiguous", "int8"]] * 2 + [
        ["gather", "int8"]]  # fmt: skip
    a = tg.parse_args(argv + ["--out", str(out)])
    first, later = tg.selected(a, None, CONFIGS["mixtral-8x7b"], "int8")
    e = tg.gemm_entry(first[0], "triton", dict(CFG), {"triton": 1.0})
    tg.write(out, tg.merge(None, [e], [], HEADER))
    assert tg.main(argv + ["--out", str(out), "--stale"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "2 problems"
    assert tg.listing(tg.parse_args(argv + ["--paths-only"]), None).endswith("0 problems")
    with pytest.raises(SystemExit):
        tg.parse_args(["--resume", "--stale"])


def test_resume_skips_what_the_file_has():
    cfg = CONFIGS["qwen3-30b-a3b"]
    problems = list(tg.contiguous_problems(cfg, "fp8", (16, 128), (32,)))
    entry = tg.gemm_entry(problems[1], "triton", dict(CFG), {"triton": 1.0})
    path = dict(tg.layer_sizes(cfg, "fp8"), t=128, path="ll", alignment=0, us={})
    old = dict(entries=[entry], paths=[path])
    todo, ts = tg.pending(old, problems, cfg, "fp8", [32, 128, 512])
    assert todo == problems[:1] + problems[2:] and ts == [32, 512]
    assert tg.pending(old, problems, cfg, "bf16", [128])[1] == [128]  # (another layer)
    assert tg.pending(None, problems) == (problems, [])


@pytest.mark.interpret
def test_a_run_writes_merges_and_resumes(cpu_tuner, tuned_dir, capsys, monkeypatch):
    """run() end to end on CPU tensors: GEMM entries and paths written after each shape x scheme,
    read back by _tuned; --resume measures nothing the file has; --dry-run writes nothing."""
    tuner, calls = cpu_tuner
    every = tg.candidates  # (two configs a kernel: every candidate runs in the tests above)
    monkeypatch.setattr(tg, "candidates", lambda *args: every(*args)[:2])
    out = tuned_dir / _tuned.file_name("NVIDIA H200")
    old = _entry("fp8", 128, 4096)  # (another problem: kept)
    tg.write(out, tg.merge(None, [old], [], HEADER))
    argv = ["--shapes", "tiny-1rank", "--schemes", "int8", "--row-blocks", "16", "--tokens", "4",
            "--paths"]  # fmt: skip
    doc = tg.run(tg.parse_args(argv), tuner, "NVIDIA H200", out)
    assert json.loads(out.read_text()) == doc and old in doc["entries"]
    assert {(e["layout"], e["N"], e["K"]) for e in doc["entries"] if e != old} == {
        (layout, 256, k) for layout in ("contiguous", "masked") for k in (256, 128)
    } | {("gather", 256, 256), ("gate", 128, 256), ("masked_gate", 128, 256)} | {  # (fused)
        ("gemv_up", 128, 256), ("gemv_down", 256, 128)}  # fmt: skip
    (g,) = [e for e in doc["entries"] if e["layout"] == "gather"]
    assert set(g["us"]) == {"copy", "gather"} and g["backend"] == "copy"  # (the first timed)
    (p,) = doc["paths"]
    assert (p["t"], p["E"], p["H"], p["I"], p["K"], p["scheme"]) == (4, 8, 256, 128, 2, "int8")
    dev = torch.device("cuda", 0)
    assert _tuned.lookup("contiguous", "int8", 256, 128, 8, 16, 1, dev) is not None
    assert _tuned.paths("int8", 8, 256, 128, 2, dev) == doc["paths"]
    assert "wrote" in capsys.readouterr().out

    n = len(calls)
    again = tg.run(tg.parse_args(argv + ["--resume"]), tuner, "NVIDIA H200", out)
    assert len(calls) == n and again["entries"] == doc["entries"]
    again = tg.run(tg.parse_args(argv + ["--stale"]), tuner, "NVIDIA H200", out)
    assert len(calls) == n and again["entries"] == doc["entries"]  # (every entry's digest: today's)
    before = out.read_text()
    tg.run(tg.parse_args(argv + ["--dry-run", "--layouts", "masked"]), tuner, "NVIDIA H200", out)
    assert out.read_text() == before and len(calls) > n
    assert '"entries": [' in capsys.readouterr().out  # (the merged file, printed)


def test_a_spent_budget_stops_cleanly(tuned_dir, capsys):
    out = tuned_dir / "t.json"
    tuner = tg.Tuner(torch.device("cpu"), iters=1, deadline=0.0)
    args = tg.parse_args(["--shapes", "tiny-1rank", "--schemes", "int8", "--tokens", "4"])
    doc = tg.run(args, tuner, "NVIDIA H200", out)
    assert doc["entries"] == [] and json.loads(out.read_text()) == doc
    assert "budget of" in capsys.readouterr().out
