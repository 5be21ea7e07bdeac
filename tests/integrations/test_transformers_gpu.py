"""transformers integration on one GPU: CUDA-graph decode under torch.compile, static-cache
generate (compiled, with the batch size changing between calls), Inductor fullgraph, and an FP8
checkpoint (FineGrainedFP8) through the FP8 registry."""

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import epmoe.integrations.transformers as et  # noqa: E402
from tests._tol import LAYER_VS_DENSE, rel_l2  # noqa: E402
from tests.integrations import _hf_models as H  # noqa: E402
from tests.integrations._hf_models import SameRouting, logits, same_routing  # noqa: E402
from tests.integrations.test_transformers import held, layers  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = LAYER_VS_DENSE
SIZES = dict(hidden=256, intermediate=128)  # multiples of 128: every scheme runs


@pytest.fixture(autouse=True)
def _registered():
    et.register()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def qwen3(dtype=torch.bfloat16, **kw):
    from transformers import Qwen3MoeForCausalLM

    model = H.build_tiny(Qwen3MoeForCausalLM, dtype=dtype, **dict(SIZES, **kw))
    return model.cuda()


def _ids(model, batch, length, seed=0):
    return H.sample_ids(model, batch, length, seed).cuda()


@pytest.mark.parametrize(
    "impl,scheme", [("epmoe", "bf16"), ("epmoe_fp8", "fp8"), ("epmoe_int8", "int8")]
)
def test_logits_on_cuda(impl, scheme):
    model = qwen3()
    ids = _ids(model, 2, 40)
    ref, (out, msgs) = same_routing(model, ids, impl)
    assert not msgs
    assert rel_l2(out, ref) <= TOL[scheme]
    assert all(layer.device.type == "cuda" and layer.quant == scheme for layer in layers(model))


def test_inductor_fullgraph_matches_eager():
    model = qwen3()
    ids = _ids(model, 2, 16)
    model.set_experts_implementation("epmoe")
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        out = compiled(ids).logits.float()
        ref = model(ids).logits.float()
    assert rel_l2(out, ref) <= TOL["bf16"]


def _decode_kwargs(tokens, position, cache):
    B = tokens.shape[0]
    return dict(
        input_ids=tokens,
        position_ids=torch.full((B, 1), position, device=tokens.device),
        cache_position=torch.tensor([position], device=tokens.device),
        cache=cache,
        use_cache=True,
    )


@pytest.mark.parametrize("batch,path", [(1, "gemv"), (2, "gemv"), (16, "ll")])  # (8 experts, top-2)
def test_decode_steps_replay_cuda_graph(batch, path):
    """Static-cache decode steps through torch.compile(mode="reduce-overhead") (CUDA graphs, each
    of epmoe's decode paths): every replayed step matches the same compiled step run without
    CUDA graphs (same kernels, so a stale or mis-captured replay shows; eager differs from any
    compiled step by Inductor's roundings, which add up over the steps)."""
    from transformers import StaticCache

    model = qwen3()
    model.set_experts_implementation("epmoe")
    prompt, steps = 8, 10
    seq = _ids(model, batch, prompt + steps, seed=batch)
    caches = [StaticCache(config=model.config, max_cache_len=prompt + steps) for _ in range(2)]
    opts = dict(fullgraph=True, dynamic=False)
    graphed = torch.compile(model.forward, mode="reduce-overhead", **opts)
    plain = torch.compile(model.forward, **opts)
    with torch.no_grad():
        for cache in caches:  # the same eager prefill in both
            model(input_ids=seq[:, :prompt], cache=cache, use_cache=True)
        assert all(layer.path(batch) == path for layer in layers(model))
        for i in range(prompt, prompt + steps):
            tok = seq[:, i : i + 1].clone()
            got = graphed(**_decode_kwargs(tok, i, caches[0])).logits.float().clone()
            want = plain(**_decode_kwargs(tok, i, caches[1])).logits.float()
            assert rel_l2(got, want) <= 1e-3, i


def _greedy(model, ids, **kw):
    out = model.generate(
        ids,
        max_new_tokens=16,
        min_new_tokens=16,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
        output_scores=True,
        return_dict_in_generate=True,
        **kw,
    )
    return out.sequences[:, ids.shape[1] :], out.scores


def test_generate_static_cache_compiled_replays():
    """generate() with a static cache auto-compiles its decode step (reduce-overhead): two runs
    give the same tokens (graph replays), and the tokens are eager's up to near-ties."""
    from transformers import CompileConfig

    model = qwen3()
    model.set_experts_implementation("epmoe")
    ids = _ids(model, 2, 8)
    cc = CompileConfig(fullgraph=True, mode="reduce-overhead")
    first, _ = _greedy(model, ids, compile_config=cc)
    again, scores = _greedy(model, ids, compile_config=cc)
    assert torch.equal(first, again)
    eager, eager_scores = _greedy(model, ids, disable_compile=True)
    for row in range(ids.shape[0]):
        diff = (eager[row] != again[row]).nonzero()
        if diff.numel():
            t = int(diff[0])
            a = eager_scores[t][row].float()
            top = a.topk(2).values
            delta = float((a - scores[t][row].float()).abs().max())
            assert float(top[0] - top[1]) <= 2 * delta, (t, delta)


def test_fp8_checkpoint_through_fp8_registry(tmp_path):
    """A FineGrainedFP8 model (experts quantized by transformers at load, 128x128 blocks):
    "epmoe" runs its own fp8 weights and scales (no copy), within the fp8 tolerance of the bf16
    model it came from."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    bf16 = qwen3()
    bf16.save_pretrained(tmp_path)
    qcfg = FineGrainedFP8Config(
        weight_block_size=(128, 128),
        modules_to_not_convert=[".*self_attn", "lm_head", ".*mlp.gate", ".*embed_tokens"],
    )
    try:
        fp8 = AutoModelForCausalLM.from_pretrained(
            tmp_path,
            quantization_config=qcfg,
            experts_implementation="epmoe",
            dtype=torch.bfloat16,
            device_map="cuda",
            # (transformers 5.25 kernelizes norms and rotary from the Hub by default, fetching
            # them on CUDA: not what this test is about, and the GPU machine has no network)
            use_kernels=False,
        ).eval()
    except ImportError as e:  # accelerate missing
        pytest.skip(str(e))
    experts = H.experts_modules(fp8)
    assert experts and all(type(m).__name__ == "FP8Experts" for m in experts)
    ids = _ids(fp8, 2, 24)
    same = SameRouting(bf16)
    ref = logits(bf16, ids, "eager")
    same.remove()
    replay = SameRouting(fp8)
    replay.calls, replay.replay = same.calls, True
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with torch.no_grad():
            out = fp8(ids).logits.float()
    replay.remove()
    assert not H.epmoe_warnings(rec)
    for m in experts:
        layer = et.cached_layer(m)
        assert layer.quant == "fp8"
        assert layer.w1.data_ptr() == m.gate_up_proj.data_ptr()
        assert layer.w2.data_ptr() == m.down_proj.data_ptr()
    assert rel_l2(out, ref) <= TOL["fp8"]


# -------------------------------------------------- compiled generate, the batch size changing
BATCHES = (1, 64, 1)  # one model: the decode step compiled at 1, recompiled at 64, 1 again
PROMPT, NEW = 8, 16
# relative L2 of a compiled step's logits vs eager generate's, same experts backend: Inductor's
# roundings of the bf16 attention, norms and router on top, which can flip a router's near-tie
# (0.029 measured on the H200 at batch 64); a stale or mis-captured graph is ~1
COMPILED_VS_EAGER = {"bf16": 5e-2, "fp8": TOL["fp8"]}
# case -> (the model's weights, experts backend, the scheme epmoe runs)
GENERATE = {
    "bf16": ("bf16", "epmoe", "bf16"),
    "epmoe_fp8": ("bf16", "epmoe_fp8", "fp8"),
    "fp8_checkpoint": ("fp8", "epmoe", "fp8"),
}


@pytest.fixture(scope="module")
def real_shaped():
    """{"bf16": 2 layers of Qwen3-30B-A3B (its per-layer shapes from benchmarks/bench_hf.py: H 2048,
    I 768, 128 experts, top-8, 32 / 4 heads of 128; a 1024-token vocabulary), random bf16 on the
    GPU; "fp8": the same in its FineGrainedFP8 form (H.fp8_checkpoint)}, built once."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from benchmarks.bench_hf import QWEN3_30B_A3B

    et.register()  # (module fixtures come before the autouse one)
    cfg = Qwen3MoeConfig(**dict(QWEN3_30B_A3B, num_hidden_layers=2, vocab_size=1024))
    torch.manual_seed(0)
    with torch.device("cuda"):
        bf16 = AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, experts_implementation="epmoe"
        )
    bf16 = bf16.eval().requires_grad_(False)
    models = {"bf16": bf16, "fp8": H.fp8_checkpoint(copy.deepcopy(bf16))}
    yield models
    models.clear()


def _generate(model, ids, **kw):
    """(new tokens `[B, NEW]`, per-step logits `[NEW, B, V]` float32) of greedy generate() with
    the static cache set on the model's generation config."""
    out = model.generate(
        ids,
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
        **kw,
    )
    return out.sequences[:, ids.shape[1] :], torch.stack(out.scores).float()


def _assert_greedy_matches(want, got, tol):
    """``got``'s tokens are ``want``'s up to near-ties: per row, the logits of every step up to
    its first differing token within ``tol`` (relative L2) of ``want``'s, and at that token
    ``want``'s top-2 margin below twice the largest logit difference (the min_new_tokens mask's
    -inf entries left out)."""
    (want_tok, want_scores), (tok, scores) = want, got
    assert tok.shape == want_tok.shape
    for row in range(tok.shape[0]):
        diff = (tok[row] != want_tok[row]).nonzero()
        first = int(diff[0]) if diff.numel() else NEW - 1
        a, b = want_scores[: first + 1, row], scores[: first + 1, row]
        finite = torch.isfinite(a) & torch.isfinite(b)
        assert torch.equal(finite, torch.isfinite(a)), row  # the same masked entries
        err = rel_l2(b[finite], a[finite])
        assert err <= tol, (row, first, err)
        if diff.numel():
            a, b = a[-1][finite[-1]], b[-1][finite[-1]]
            top = a.topk(2).values
            delta = float((a - b).abs().max())
            assert float(top[0] - top[1]) <= 2 * delta, (row, first, delta)


@pytest.mark.parametrize("logs", [False, True], ids=["", "cudagraph_logs"])
@pytest.mark.parametrize("case", list(GENERATE))
def test_compiled_generate_changing_batch(real_shaped, case, logs):
    """generate() with ``generation_config.cache_implementation = "static"`` compiles its decode
    step on CUDA (transformers' default CompileConfig: Inductor, mode="reduce-overhead", so CUDA
    graphs through cudagraph trees). Batch 1, then 64 (a recompile and new graphs; epmoe's GEMV
    path, then LL), then 1 again on the same model: no exception, and each call's tokens are eager
    generate's (disable_compile=True, same backend) up to near-ties. ``cudagraph_logs``: the same
    with torch._logging.set_logs(cudagraphs=True) (TORCH_LOGS=cudagraphs), under which cudagraph
    trees once raised "length mismatch between inputs, recorded_data_ptr, and placeholders"."""
    weights, impl, scheme = GENERATE[case]
    model = real_shaped[weights]
    model.set_experts_implementation(impl)
    model.generation_config.cache_implementation = "static"
    model.__dict__.pop("_compiled_call", None)  # compiled afresh (dynamo was reset)
    ids = _ids(model, max(BATCHES), PROMPT)
    eager = {b: _generate(model, ids[:b], disable_compile=True) for b in set(BATCHES)}
    before = held(model)
    if logs:
        torch._logging.set_logs(cudagraphs=True)
    try:
        runs = [(b, _generate(model, ids[:b])) for b in BATCHES]
    finally:
        if logs:
            torch._logging.set_logs()
    assert "_compiled_call" in model.__dict__  # generate compiled its decode step
    assert held(model) == before  # the graphs' static inputs: epmoe's cache was not rebuilt
    for b, got in runs:
        _assert_greedy_matches(eager[b], got, COMPILED_VS_EAGER[scheme])
    for layer in layers(model):
        assert layer.device.type == "cuda" and layer.quant == scheme
