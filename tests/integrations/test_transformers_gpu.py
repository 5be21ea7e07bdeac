"""transformers integration on one GPU: CUDA-graph decode under torch.compile, static-cache
generate, Inductor fullgraph, and an FP8 checkpoint (FineGrainedFP8) through the FP8 registry."""

import warnings

import pytest
import torch

pytest.importorskip("transformers")

import epmoe.integrations.transformers as et  # noqa: E402
from tests._tol import LAYER_VS_DENSE, rel_l2  # noqa: E402
from tests.integrations import _hf_models as H  # noqa: E402
from tests.integrations.test_transformers import (  # noqa: E402
    SameRouting,
    layers,
    logits,
    same_routing,
)

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


@pytest.mark.parametrize("batch,path", [(1, "gemv"), (8, "gemv"), (16, "ll")])
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
    assert not [w for w in rec if str(w.message).startswith("epmoe:")]
    for m in experts:
        layer = et.cached_layer(m)
        assert layer.quant == "fp8"
        assert layer.w1.data_ptr() == m.gate_up_proj.data_ptr()
        assert layer.w2.data_ptr() == m.down_proj.data_ptr()
    assert rel_l2(out, ref) <= TOL["fp8"]
