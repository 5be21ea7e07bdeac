"""transformers integration on CPU: every MoE model the installed transformers has (discovered, see
_hf_models) through ``experts_implementation="epmoe"`` / ``"epmoe_fp8"`` / ``"epmoe_int8"``."""

import copy
import json
import os
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from transformers.integrations import moe  # noqa: E402

import epmoe.integrations.transformers as et  # noqa: E402
from epmoe import reference  # noqa: E402
from tests._tol import LAYER_VS_DENSE, LAYER_VS_QUANT_AWARE, rel_l2  # noqa: E402
from tests.integrations import _hf_models as H  # noqa: E402
from tests.integrations._hf_models import (  # noqa: E402
    epmoe_warnings,
    logits,
    run_model,
    same_routing,
)

FAMILIES = H.discover()
EXPERTS = [(f, c) for f in FAMILIES for c in f.experts]
LMS = [lm for f in FAMILIES for lm in f.causal_lms]
REQUIRED = [lm for lm in LMS if lm.__name__ in H.REQUIRED]
# relative L2 error of a float32 model's logits with epmoe experts vs eager, by scheme (the experts
# run bf16 / fp8 / int8 math, everything else stays float32): the layer tolerances of tests/_tol.py
TOL = LAYER_VS_DENSE
# models whose tiny random logits carry the experts' quantization error further than most: Gemma4
# fp8 (its experts layer is 0.066 from float32, as Qwen3-MoE's 0.062; its logits 0.07-0.10 by seed)
MODEL_TOL_FACTOR = {("Gemma4ForCausalLM", "fp8"): 1.5}
NAME = H.SCHEMES  # scheme -> backend name
FP8_SIZES = H.FP8_SIZES
REGENERATE = "regenerate it with `python scripts/hf_coverage.py`"


def _id(x):
    return x.__name__ if isinstance(x, type) else getattr(x, "module", str(x)).split(".")[-1]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: on tiny models more only wait on each other (pytest -n 2 on 2 cores
    runs this module about 4x slower with torch's default of one thread a core)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _registered():
    et.register()
    et._WARNED.clear()
    yield
    et.register()


def layers(model):
    return [et.cached_layer(m) for m in H.experts_modules(model)]


def held(model):
    """Each cached layer with its buffers' addresses (what cudagraph trees take as static)."""
    return [(la, [(n, b.data_ptr()) for n, b in la.named_buffers()]) for la in layers(model)]


def build(lm, dtype=torch.float32, **kw):
    """A new tiny ``lm``: a model that cannot be built fails the test with its reason, one that
    needs an optional package that is not installed skips naming it."""
    try:
        return H.build_tiny(lm, dtype=dtype, **kw)
    except ImportError as e:
        assert lm.__name__ not in H.REQUIRED, f"{lm.__name__} must build: {e}"
        pytest.skip(f"{lm.__name__} needs a package that is not installed: {e}")


def lm_named(name):
    return next(lm for lm in LMS if lm.__name__ == name)


class Shared:
    """Tiny float32 models, one per size (H.BUILDS), and what each scheme's backend does with
    them: built once a module for the tests that only switch experts backends."""

    def __init__(self):
        self.models, self.outcomes = {}, {}

    def model(self, lm, fp8=False):
        if (lm, fp8) not in self.models:
            self.models[lm, fp8] = build(lm, **(FP8_SIZES if fp8 else {}))
        return self.models[lm, fp8]

    def outcome(self, lm):
        """scheme -> (its model, H.Outcome), every scheme (eager's routing)."""
        if lm not in self.outcomes:
            self.outcomes[lm] = {}
            for schemes, fp8 in H.BUILDS:
                model = self.model(lm, fp8)
                for scheme, got in H.outcomes(model, schemes).items():
                    self.outcomes[lm][scheme] = model, got
        return self.outcomes[lm]


@pytest.fixture(scope="module")
def shared():
    s = Shared()
    yield s
    s.models.clear()
    s.outcomes.clear()


def load_coverage():
    if not os.path.exists(H.COVERAGE):
        return {}
    with open(H.COVERAGE) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------- registration
def test_registered_in_both_registries():
    from transformers.integrations import finegrained_fp8

    assert et.register() == ("epmoe", "epmoe_fp8", "epmoe_int8")
    for name in et.NAMES:
        assert name in moe.ALL_EXPERTS_FUNCTIONS
        assert name in finegrained_fp8.ALL_FP8_EXPERTS_FUNCTIONS
    with pytest.raises(ValueError, match="fallback"):
        et.register(fallback="nope")


def test_discovery_finds_the_required_models():
    names = {lm.__name__ for lm in LMS}
    assert set(H.REQUIRED) <= names
    assert len(EXPERTS) >= len(H.REQUIRED)


def test_from_config_one_call():
    lm = lm_named("Qwen3MoeForCausalLM")
    from transformers import AutoModelForCausalLM

    cfg = H.tiny_config(lm.config_class)
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="epmoe")
    with torch.no_grad():
        model(H.sample_ids(model))
    assert all(isinstance(layer, et.EPMoE) for layer in layers(model))


# ---------------------------------------------------------------------------- every experts class
@pytest.mark.parametrize("family,cls", EXPERTS, ids=[c.__name__ for _, c in EXPERTS])
def test_every_experts_class(family, cls):
    """Each decorated experts class: epmoe within the bf16 / int8 tolerance of the class's own
    forward, or (classes outside the contract) one warning naming the class and exactly the
    fallback's output."""
    m = H.build_experts(cls, family)
    if m is None:
        pytest.skip(f"no tiny config constructs {cls.__name__}")
    ids, w = H.routing(16, m.num_experts, 2, torch.bfloat16)
    hidden = m.down_proj.shape[2 if getattr(m, "is_transposed", False) else 1]
    x = torch.randn(16, hidden, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        call = H.own_call(m, x, ids, w)
        if call is None:  # reported (pytest -ra), not failed: transformers' forward is not ours
            why = "takes neither top-k routing nor one route a row"
            pytest.skip(f"{cls.__name__}'s own forward {why}")
        x, ids, w, ref = call
        gmm = moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"](m, x, ids, w)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            out = moe.ALL_EXPERTS_FUNCTIONS["epmoe"](m, x, ids, w)
            again = moe.ALL_EXPERTS_FUNCTIONS["epmoe"](m, x, ids, w)
        msgs = epmoe_warnings(rec)
        assert out.dtype == x.dtype and out.shape == x.shape
        assert torch.equal(out, again)
        if et.cached_layer(m) is None:  # outside the contract
            assert len(msgs) == 1 and cls.__name__ in msgs[0], msgs
            assert torch.equal(out, gmm)
            return
        assert not msgs
        assert rel_l2(out, ref) <= TOL["bf16"]
        out8 = moe.ALL_EXPERTS_FUNCTIONS["epmoe_int8"](m, x, ids, w)
        assert rel_l2(out8, ref) <= TOL["int8"]


# ------------------------------------------------------------------------------------- whole models
@pytest.mark.parametrize("lm", LMS, ids=[lm.__name__ for lm in LMS])
def test_every_model(lm, shared):
    """Every discovered model, float32 with eager's routing, through each backend: where its
    experts run on epmoe its logits are within the scheme's tolerance of eager's (no warning);
    where they all fall back, one warning names the class and the logits are exactly the
    fallback's. What ran is what tests/integrations/coverage.json records: a model recorded on
    epmoe that falls back is a regression; any other difference means the file is stale."""
    want = load_coverage().get(lm.__name__)
    problems = []
    if want is None:
        problems.append(f"not in coverage.json: {REGENERATE}")
    for scheme, (model, got) in shared.outcome(lm).items():
        names = {type(m).__name__ for m in H.experts_modules(model)}
        tol = TOL[scheme] * MODEL_TOL_FACTOR.get((lm.__name__, scheme), 1.0)
        if got.on_epmoe and got.err > tol:
            problems.append(f"{scheme}: logits {got.err:.2e} from eager's, over {tol}")
        if got.on_epmoe == got.modules and got.warnings:
            problems.append(f"{scheme}: on epmoe, yet warned {got.warnings}")
        if not got.on_epmoe and not got.exact:
            problems.append(f"{scheme}: falls back, not exactly {H.FALLBACK}'s logits")
        if not got.on_epmoe and not all(n in " ".join(got.warnings) for n in names):
            problems.append(f"{scheme}: falls back, no warning names {names}: {got.warnings}")
        was = (want or {}).get(scheme)
        if was == "epmoe" and got.cell != "epmoe":
            problems.append(f"{scheme}: regression: on epmoe in coverage.json, now {got.cell}")
        elif want is not None and was != got.cell:
            problems.append(
                f"{scheme}: coverage.json is stale ({was!r}, now {got.cell!r}): " + REGENERATE
            )
    assert not problems, f"{lm.__name__}:\n  " + "\n  ".join(problems)


def test_coverage_lists_every_model():
    """coverage.json has one entry a discovered model, each with every scheme; the README's
    coverage section is its table."""
    cov = load_coverage()
    assert list(cov) == [lm.__name__ for lm in LMS], REGENERATE
    assert all(list(cells) == list(H.SCHEMES) for cells in cov.values()), REGENERATE
    start, end = H.README_MARKERS
    with open(H.README) as f:
        section = f.read().split(start, 1)[1].split(end, 1)[0]
    assert section.strip() == H.coverage_table(cov), REGENERATE


@pytest.mark.parametrize("lm", REQUIRED, ids=_id)
def test_bf16_model_uses_weights_in_place(lm):
    """A bf16 model: the layer's w1 / w2 are HF's gate_up_proj / down_proj (no second copy)."""
    model = build(lm, dtype=torch.bfloat16)
    ids = H.sample_ids(model)
    ref, (out, _) = same_routing(model, ids, "epmoe")
    assert rel_l2(out, ref) <= TOL["bf16"]
    for m in H.experts_modules(model):
        layer = et.cached_layer(m)
        assert layer.w1.data_ptr() == m.gate_up_proj.data_ptr()
        assert layer.w2.data_ptr() == m.down_proj.data_ptr()


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
@pytest.mark.parametrize("lm", REQUIRED, ids=_id)
def test_quantized_model_logits(lm, scheme, shared):
    """epmoe_fp8 / epmoe_int8 within their tolerance of eager (eager's routing); the weights are
    quantized once."""
    model = shared.model(lm, fp8=True)
    ids = H.sample_ids(model)
    ref, (out, _) = same_routing(model, ids, NAME[scheme])
    assert rel_l2(out, ref) <= TOL[scheme]
    first = [(layer, layer.w1) for layer in layers(model)]
    assert all(layer.quant == scheme for layer, _ in first)
    free = logits(model, ids, NAME[scheme])
    assert torch.equal(logits(model, ids, NAME[scheme]), free)
    assert [(layer, layer.w1) for layer in layers(model)] == first  # no re-quantization


@pytest.mark.parametrize("lm", REQUIRED, ids=_id)
def test_greedy_generate_matches_eager(lm, shared):
    """16 greedy tokens of a float32 model equal eager's. The experts run bf16 math, so a token may
    only differ where eager's top-2 logits are closer than the experts' error can move them: at a
    first divergence, eager's margin must be below twice the largest logit difference there,
    and that difference within the bf16 tolerance."""
    model = shared.model(lm)
    ids = H.sample_ids(model, batch=2, length=8)
    kw = dict(
        max_new_tokens=16,
        min_new_tokens=16,
        do_sample=False,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    model.set_experts_implementation("eager")
    ref = model.generate(ids, **kw)
    model.set_experts_implementation("epmoe")
    out = model.generate(ids, **kw)
    new_ref, new_out = ref.sequences[:, ids.shape[1] :], out.sequences[:, ids.shape[1] :]
    assert new_ref.shape == new_out.shape == (2, 16)
    for row in range(2):
        diff = (new_ref[row] != new_out[row]).nonzero()
        if diff.numel() == 0:
            continue
        step = int(diff[0])
        a, b = ref.scores[step][row], out.scores[step][row]
        finite = torch.isfinite(a) & torch.isfinite(b)
        delta = float((a[finite] - b[finite]).abs().max())
        top = a[finite].topk(2).values
        margin = float(top[0] - top[1])
        assert margin <= 2 * delta, (step, margin, delta)
        assert delta <= TOL["bf16"] * float(a[finite].abs().max())


# ------------------------------------------------------------------------------------ torch.compile
@pytest.mark.parametrize("name", ["Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"])
def test_compile_fullgraph_cold(name):
    """torch.compile(model, fullgraph=True) with no eager call first: the epmoe state is built at
    trace time, outside the graph, with no graph break; same logits as eager epmoe."""
    torch._dynamo.reset()
    model = build(lm_named(name), dtype=torch.bfloat16)
    model.set_experts_implementation("epmoe")
    for m in H.experts_modules(model):
        m.__dict__.pop(et._STATE, None)
    ids = H.sample_ids(model)
    explain = torch._dynamo.explain(model)
    with torch.no_grad():
        info = explain(ids)
    assert info.graph_break_count == 0, info.break_reasons
    for m in H.experts_modules(model):
        m.__dict__.pop(et._STATE, None)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        out = compiled(ids).logits
        assert all(isinstance(layer, et.EPMoE) for layer in layers(model))
        ref = model(ids).logits
    torch._dynamo.reset()
    assert torch.equal(out, ref)


# ------------------------------------------------------------------------------------ fallbacks
def test_fallback_warns_once_and_is_exact():
    """Qwen3-MoE with a tanh GLU (none of epmoe's gates): one warning for its experts class (every
    layer), exactly grouped_mm's logits; with fallback="eager", eager's."""
    model = build(lm_named("Qwen3MoeForCausalLM"))
    for m in H.experts_modules(model):
        m.act_fn = torch.nn.Tanh()
    ids = H.sample_ids(model)
    out, msgs = run_model(model, ids, "epmoe")
    assert len(msgs) == 1 and "Qwen3MoeExperts" in msgs[0] and "'grouped_mm'" in msgs[0]
    assert "computes none of epmoe's gates" in msgs[0]
    assert torch.equal(out, logits(model, ids, "grouped_mm"))
    et.register(fallback="eager")
    et._WARNED.clear()
    out, msgs = run_model(model, ids, "epmoe")
    assert len(msgs) == 1 and "'eager'" in msgs[0]
    assert torch.equal(out, logits(model, ids, "eager"))


def test_gradients_fall_back():
    """A call that needs gradients runs grouped_mm (epmoe has no backward) and says so once."""
    model = build(lm_named("Qwen3MoeForCausalLM"))
    ids = H.sample_ids(model)
    model.set_experts_implementation("grouped_mm")
    ref = model(ids).logits
    model.set_experts_implementation("epmoe")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = model(ids).logits
        out.sum().backward()
    msgs = epmoe_warnings(rec)
    assert len(msgs) == 1 and "gradients" in msgs[0]
    assert torch.equal(out, ref)
    assert all(m.gate_up_proj.grad is not None for m in H.experts_modules(model))
    with torch.no_grad():  # the same module then runs epmoe
        model(ids)
    assert all(isinstance(layer, et.EPMoE) for layer in layers(model))


@pytest.mark.parametrize(
    "attrs,reason",
    [
        ({"block_size": (64, 64)}, "blocks"),
        ({"activation_scheme": "static"}, "activation_scheme"),
        ({"act_fn": torch.nn.Tanh()}, "computes none of epmoe's gates"),
    ],
)
def test_fp8_checkpoint_outside_contract(attrs, reason):
    m = fp8_experts()
    for k, v in attrs.items():
        setattr(m, k, v)
    assert reason in et._unsupported(m, "bf16", fp8=True)


def test_fp8_checkpoint_clamped_swiglu_is_recognized():
    """FP8Experts' clamped SwiGLU (gpt-oss-style alpha / limit, or a limit alone) runs on epmoe
    as the gate it computes."""
    m = fp8_experts()
    m.swiglu_alpha, m.limit = 1.702, 7.0
    assert et._unsupported(m, "bf16", fp8=True) is None
    assert et._recognize_gate(m)[0].spec == "silu:alpha=1.702,limit=7.0,up_offset=1.0"
    m.swiglu_alpha = None
    assert et._recognize_gate(m)[0].spec == "silu:limit=7.0"


def test_fp8_checkpoint_softcapped_swiglu_is_recognized():
    """FP8Experts' softcapped SwiGLU (Inkling2's, its caps plain float attributes) runs on epmoe
    as the gate it computes."""
    m = fp8_experts()
    m.gate_softcap, m.up_softcap = 4.0, 10.0
    assert et._unsupported(m, "bf16", fp8=True) is None
    assert et._recognize_gate(m)[0].spec == "silu:gate_softcap=4.0,up_softcap=10.0"


def test_unknown_decorator_option_falls_back(monkeypatch):
    """An option a newer transformers adds to @use_experts_implementation, set away from its
    default on a module: epmoe does not know what it means, so it falls back and names it."""
    m = qwen3_experts()
    assert et._unsupported(m, "bf16", fp8=False) is None
    monkeypatch.setitem(et._NEW_OPTIONS, "has_router_scale", False)
    assert et._unsupported(m, "bf16", fp8=False) is None  # at its default: nothing changes
    m.has_router_scale = True
    assert "has_router_scale=True" in et._unsupported(m, "bf16", fp8=False)


def test_other_calling_convention_falls_back():
    """An experts class whose own forward is not (hidden_states, top_k_index, top_k_weights):
    the weights fit, yet it falls back naming its signature, and runs exactly the fallback."""
    base = type(qwen3_experts())

    class RoutingMapExperts(base):
        def forward(self, hidden_states, routing_map, probs, extra):
            raise AssertionError("not called")

    cls = moe.use_experts_implementation(RoutingMapExperts)
    m = qwen3_experts()
    m.__class__ = cls
    why = et._unsupported(m, "bf16", fp8=False)
    assert "RoutingMapExperts.forward takes (hidden_states, routing_map" in why
    assert et._calling_convention(base) is None


# ------------------------------------------------------------------------------ cache and weights
@pytest.mark.parametrize("scheme", ["bf16", "int8"])
def test_rebuild_after_load_state_dict(scheme):
    """load_state_dict after the cache was built: the next call sees the new weights (a quantized
    cache is rewritten in place: same layer, same buffers)."""
    lm = lm_named("Qwen3MoeForCausalLM")
    dtype = torch.bfloat16 if scheme == "bf16" else torch.float32
    a, b = build(lm, dtype=dtype, seed=0), build(lm, dtype=dtype, seed=1)
    ids = H.sample_ids(a)
    before = logits(a, ids, NAME[scheme])
    want = logits(b, ids, NAME[scheme])
    kept = [(layer, layer.w1.data_ptr(), layer.w1_scale) for layer in layers(a)]
    a.load_state_dict(b.state_dict())
    after = logits(a, ids, NAME[scheme])
    assert not torch.equal(before, want)
    assert torch.equal(after, want)
    if scheme == "int8":
        assert [(la, la.w1.data_ptr(), la.w1_scale) for la in layers(a)] == kept


@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_cache_stays_across_batch_sizes(scheme):
    """Batch 1, then 64, then 1 on the same model: the same cached layers holding the same buffers
    (no rebuild by call size), so a compiled, CUDA-graphed decode step sees the same static inputs
    at every batch size; what changes with the size lives inside each call."""
    a = build(lm_named("Qwen3MoeForCausalLM"), dtype=torch.bfloat16)
    ids = H.sample_ids(a, batch=64, length=3)

    logits(a, ids[:1], NAME[scheme])
    first = held(a)
    assert first and all(la is not None and la.quant == scheme for la, _ in first)
    for batch in (64, 1):
        logits(a, ids[:batch], NAME[scheme])
        assert held(a) == first, batch


def test_rebuild_after_to_dtype():
    lm = lm_named("Qwen3MoeForCausalLM")
    model = build(lm)
    ids = H.sample_ids(model)
    logits(model, ids, "epmoe")  # float32 weights: a bf16 copy
    model.to(torch.bfloat16)
    ref, (out, _) = same_routing(model, ids, "epmoe")
    assert rel_l2(out, ref) <= TOL["bf16"]
    for m in H.experts_modules(model):  # rebuilt on the bf16 parameters, in place
        assert et.cached_layer(m).w1.data_ptr() == m.gate_up_proj.data_ptr()


def test_refresh_sees_writes_through_data():
    lm = lm_named("Qwen3MoeForCausalLM")
    model = build(lm)
    ids = H.sample_ids(model)
    before = logits(model, ids, "epmoe_int8")
    with torch.no_grad():
        for m in H.experts_modules(model):
            m.gate_up_proj.data.mul_(2)  # its own version counter: not detectable per call
    assert torch.equal(logits(model, ids, "epmoe_int8"), before)
    assert et.refresh(model) == len(H.experts_modules(model))
    assert not torch.equal(logits(model, ids, "epmoe_int8"), before)


def test_state_is_not_model_state():
    model = build(lm_named("Qwen3MoeForCausalLM"))
    ids = H.sample_ids(model)
    keys = list(model.state_dict())
    out = logits(model, ids, "epmoe")
    assert list(model.state_dict()) == keys
    twin = copy.deepcopy(model)
    assert torch.equal(logits(twin, ids, "epmoe"), out)
    for m, t in zip(H.experts_modules(model), H.experts_modules(twin), strict=True):
        assert et.cached_layer(t) is not et.cached_layer(m)
        assert et.cached_layer(t).w1.data_ptr() != m.gate_up_proj.data_ptr()


# ------------------------------------------------------------------------------- routing details
def qwen3_experts(dtype=torch.bfloat16):
    fam = next(f for f in FAMILIES if f.module.endswith("qwen3_moe.modeling_qwen3_moe"))
    return H.build_experts(fam.experts[0], fam, dtype=dtype)


def test_expert_parallel_sentinels_are_dropped():
    """transformers EP: ids >= num_experts (other ranks' experts) contribute nothing, whatever
    their weight."""
    m = qwen3_experts()
    m._is_expert_parallel = True
    ids, w = H.routing(16, m.num_experts, 2, torch.bfloat16)
    sentinel = ids.clone()
    sentinel[::2, 1] = m.num_experts
    kept = w.clone()
    kept[::2, 1] = 0
    with torch.no_grad():
        x = torch.randn(16, m.down_proj.shape[1], dtype=torch.bfloat16)
        out = moe.ALL_EXPERTS_FUNCTIONS["epmoe"](m, x, sentinel, w)
        ref = moe.ALL_EXPERTS_FUNCTIONS["epmoe"](m, x, ids, kept)
        gmm = moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"](m, x, sentinel, kept)
    assert torch.equal(out, ref)
    assert rel_l2(out, gmm) <= TOL["bf16"]


def test_fewer_choices_than_built():
    """A call with fewer choices per token than the layer was built for (transformers' EP
    placeholder call) pads with -1."""
    m = qwen3_experts()
    ids, w = H.routing(8, m.num_experts, 2, torch.bfloat16)
    x = torch.randn(8, m.down_proj.shape[1], dtype=torch.bfloat16)
    f = moe.ALL_EXPERTS_FUNCTIONS["epmoe"]
    with torch.no_grad():
        f(m, x, ids, w)
        layer = et.cached_layer(m)
        one = f(m, x, ids[:, :1], w[:, :1])
        ref = type(m).forward.__wrapped__(m, x, ids[:, :1], w[:, :1])
    assert et.cached_layer(m) is layer and layer.top_k == 2
    assert rel_l2(one, ref) <= TOL["bf16"]


# -------------------------------------------------------------------------------- FP8 checkpoints
def fp8_experts(seed=0):
    """transformers' FP8Experts (what FineGrainedFP8 puts in a model), filled with epmoe-quantized
    random weights: float8_e4m3fn `[E, N, K]`, float32 `*_scale_inv` `[E, N/128, K/128]`."""
    from transformers import Qwen3MoeConfig
    from transformers.integrations import finegrained_fp8 as f8

    cls = moe.use_experts_implementation(
        f8.FP8Experts, experts_interface=f8.ALL_FP8_EXPERTS_FUNCTIONS
    )
    cfg = Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=128, num_experts=4)
    m = cls(cfg, block_size=(128, 128))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(m, name)
            q, s = reference.quantize_weights(torch.randn(p.shape, generator=g) * 0.05, "fp8")
            p.copy_(q)
            getattr(m, name + "_scale_inv").copy_(s)
    return m


def test_fp8_scale_convention_matches_transformers():
    """HF's weight_scale_inv multiplies the fp8 code (transformers' own dequantize), as epmoe's
    weight scale does: the checkpoint's scales are used as they are."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    m = fp8_experts()
    q, s = m.gate_up_proj.detach(), m.gate_up_proj_scale_inv.detach()
    hf = _dequantize_fp8_weight(q, s, [128, 128], torch.float32)
    assert torch.equal(hf, reference.dequantize_weights(q, s))


@pytest.mark.parametrize(
    "name,scheme", [("epmoe", "fp8"), ("epmoe_fp8", "fp8"), ("epmoe_int8", "int8")]
)
def test_fp8_registry_uses_checkpoint_weights(name, scheme):
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS

    m = fp8_experts()
    w1 = reference.dequantize_weights(m.gate_up_proj.detach(), m.gate_up_proj_scale_inv.detach())
    w2 = reference.dequantize_weights(m.down_proj.detach(), m.down_proj_scale_inv.detach())
    ids, w = H.routing(24, 4, 2, torch.bfloat16)
    x = torch.randn(24, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        out = ALL_FP8_EXPERTS_FUNCTIONS[name](m, x, ids, w)
    layer = et.cached_layer(m)
    assert layer.quant == scheme
    assert rel_l2(out, reference.dense_moe(x, ids, w, w1, w2)) <= TOL[scheme]
    assert rel_l2(out, reference.quantized_moe(x, ids, w, w1, w2, scheme)) <= LAYER_VS_QUANT_AWARE
    if scheme == "fp8":  # the checkpoint's own tensors: no copy, no re-quantization
        assert layer.w1.data_ptr() == m.gate_up_proj.data_ptr()
        assert layer.w1_scale.data_ptr() == m.gate_up_proj_scale_inv.data_ptr()
        assert layer.w2.data_ptr() == m.down_proj.data_ptr()


def test_mode_auto_and_its_threshold():
    """The layer is EPMoE(mode="auto"): LL up to ll_max_tokens tokens, HT above; a new threshold
    from register() applies on the next call."""
    from epmoe.layer import AUTO_LL_MAX_TOKENS

    m = qwen3_experts()
    ids, w = H.routing(8, m.num_experts, 2, torch.bfloat16)
    x = torch.randn(8, m.down_proj.shape[1], dtype=torch.bfloat16)
    f = moe.ALL_EXPERTS_FUNCTIONS["epmoe"]
    with torch.no_grad():
        ref = type(m).forward.__wrapped__(m, x, ids, w)
        ll = f(m, x, ids, w)
        layer = et.cached_layer(m)
        assert layer.mode == "auto" and layer.ll_max_tokens == AUTO_LL_MAX_TOKENS
        assert layer.uses_ll(8)
        et.register(ll_max_tokens=4)
        ht = f(m, x, ids, w)
    layer = et.cached_layer(m)
    assert layer.ll_max_tokens == 4 and not layer.uses_ll(8)
    assert rel_l2(ll, ref) <= TOL["bf16"] and rel_l2(ht, ref) <= TOL["bf16"]


def test_fp8_checkpoint_model_runs_on_epmoe():
    """A tiny Qwen3-MoE in its FineGrainedFP8 form (H.fp8_checkpoint: transformers' FP8Experts
    and Fp8Quantize, what the GPU generate tests compile): "epmoe" runs the checkpoint's own codes
    and scales (no copy), within the fp8 tolerance of the bf16 model's eager logits (same
    routing)."""
    bf16 = build(lm_named("Qwen3MoeForCausalLM"), dtype=torch.bfloat16, **FP8_SIZES)
    ids = H.sample_ids(bf16)
    same = H.SameRouting(bf16)
    ref = logits(bf16, ids, "eager")
    same.remove()
    fp8 = H.fp8_checkpoint(copy.deepcopy(bf16))
    experts = H.experts_modules(fp8)
    assert experts and all(type(m).__name__ == "FP8Experts" for m in experts)
    replay = H.SameRouting(fp8)
    replay.calls = same.calls
    replay.replay_next()
    out, msgs = run_model(fp8, ids, "epmoe")
    replay.remove()
    assert not msgs
    assert rel_l2(out, ref) <= TOL["fp8"]
    for m in experts:
        layer = et.cached_layer(m)
        assert layer.quant == "fp8" and layer.w1.data_ptr() == m.gate_up_proj.data_ptr()
