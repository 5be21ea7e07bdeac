"""The integration's gate recognition and weight arrangement on the experts classes that are not
SiLU-GLU `[E, 2I, H]`: each is recognized as the gate it computes, its weights arranged once, and
epmoe's output matches the class's own forward (the discovery-wide check is test_transformers.py's
test_every_experts_class; this one names what each class must be recognized as)."""

import warnings

import pytest
import torch

pytest.importorskip("transformers")

import epmoe.integrations.transformers as et  # noqa: E402
from tests._tol import LAYER_VS_DENSE, rel_l2  # noqa: E402
from tests.integrations import _hf_models as H  # noqa: E402

OAI = "silu:alpha=1.702,limit=7.0,up_offset=1.0"
# experts class -> the gate epmoe must recognize (limits as the tiny configs set them)
EXPECTED = {
    "GptOssExperts": OAI,  # interleaved gate/up, transposed, biases
    "MiniMaxM3VLExperts": OAI,
    "Gemma4TextExperts": "gelu_tanh",
    "NemotronHExperts": "relu2:glu=0",  # no gate projection
    "AriaExperts": "silu",  # transposed weights
    "BeamExperts": "silu",  # SiLU-GLU in float32: the same gate
    "DeepseekV4Experts": "silu:limit=10.0",
    "HYV4Experts": "silu:limit=10.0",
    "BailingHybridExperts": "silu",  # limit None in its config: plain SiLU
    # softcapped SwiGLU, the caps read from its act_fn's Softcap modules
    "Inkling2Experts": "silu:gate_softcap=4.0,up_softcap=25.0",
    "Inkling2LoopExperts": "silu:gate_softcap=4.0,up_softcap=25.0",
}
CLASSES = {c.__name__: (f, c) for f in H.discover() for c in f.experts}


@pytest.fixture(autouse=True)
def _registered():
    et.register()
    et._WARNED.clear()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_gate_recognized_and_run(name):
    if name not in CLASSES:
        pytest.skip(f"{name} is not in the installed transformers")
    family, cls = CLASSES[name]
    m = H.build_experts(cls, family)
    assert m is not None, f"{name} must build"
    gate, why = et._recognize_gate(m)
    assert why is None and gate.spec == EXPECTED[name]
    ids, w = H.routing(16, m.num_experts, 2, torch.bfloat16)
    w1, w2, b1, b2 = et._arranged(m)
    assert w1.shape == (m.num_experts, gate.width(w2.shape[2]), w2.shape[1])
    assert (b1 is not None) == bool(getattr(m, "has_bias", False))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, w2.shape[1], dtype=torch.bfloat16, generator=g)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        own = type(m).forward.__wrapped__(m, x, ids, w)
        out = _epmoe(m, x, ids, w)
    layer = et.cached_layer(m)
    assert layer is not None and layer.gate.spec == EXPECTED[name]
    assert layer.bias == bool(getattr(m, "has_bias", False))
    assert rel_l2(out, own) <= LAYER_VS_DENSE["bf16"]


def _epmoe(m, x, ids, w):
    from transformers.integrations import moe

    return moe.ALL_EXPERTS_FUNCTIONS["epmoe"](m, x, ids, w)


def test_interleaved_rows_are_rearranged_once():
    """gpt-oss's interleaved gate/up rows become epmoe's gate-then-up rows: the arranged w1's
    first half is the even rows of the module's (transposed) gate_up_proj."""
    if "GptOssExperts" not in CLASSES:
        pytest.skip("no gpt-oss in the installed transformers")
    family, cls = CLASSES["GptOssExperts"]
    m = H.build_experts(cls, family)
    w1, _, b1, _ = et._arranged(m)
    gu = m.gate_up_proj.detach().transpose(1, 2)  # [E, 2I, H], rows g0, u0, g1, u1, ...
    inter = w1.shape[1] // 2
    assert torch.equal(w1[:, :inter], gu[:, 0::2]) and torch.equal(w1[:, inter:], gu[:, 1::2])
    assert torch.equal(b1[:, :inter], m.gate_up_proj_bias.detach()[:, 0::2])


def test_a_gate_epmoe_does_not_compute_falls_back_with_its_reason():
    """A gate none of epmoe's equal (here: SiLU with a factor 0.5 on the output) is a fallback
    with the class named, not a silent mismatch."""
    family, cls = CLASSES["Qwen3MoeExperts"]
    m = H.build_experts(cls, family)

    class Halved(cls):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return 0.5 * self.act_fn(gate) * up

    m.__class__ = Halved
    gate, why = et._recognize_gate(m)
    assert gate is None and "Halved._apply_gate" in why
    assert et._unsupported(m, "bf16", False) == why
