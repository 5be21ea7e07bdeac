"""epmoe.gate: the spec string, bad gates, the reference of every kind against torch's formulas."""

import math

import pytest
import torch
import torch.nn.functional as F

from epmoe import gate as G


@pytest.mark.parametrize(
    "g",
    [
        G.SILU,
        G.Gate("silu", alpha=1.702, limit=7.0, up_offset=1.0),
        G.Gate("silu", limit=7.0, clamp_after=True),
        G.Gate("gelu_tanh"),
        G.Gate("gelu"),
        G.Gate("relu"),
        G.Gate("relu2", glu=False),
        G.Gate("silu", gate_softcap=4.0, up_softcap=25.0),
        G.Gate("gelu", up_softcap=3.0),
    ],
    ids=str,
)
def test_spec_round_trips(g):
    assert G.parse(g.spec) == g and G.get(g.spec) == g
    assert G.get(g) is g and hash(G.parse(g.spec)) == hash(g)


def test_defaults():
    assert G.get(None) is G.SILU and G.SILU.spec == "silu" and G.SILU.is_silu
    assert G.SILU.width(96) == 192 and G.Gate("relu2", glu=False).width(96) == 96


def test_softcaps_spelled_and_off_by_default():
    """The softcaps are spelled only when set, and reach the kernels as 0.0 when off (their
    constexpr branches vanish: the default gate's kernels are the ones it had without them)."""
    g = G.Gate(gate_softcap=4, up_softcap=25)
    assert g.spec == "silu:gate_softcap=4.0,up_softcap=25.0" and not g.is_silu
    assert (g.meta()["GATE_SOFTCAP"], g.meta()["UP_SOFTCAP"]) == (4.0, 25.0)
    assert (G.SILU.meta()["GATE_SOFTCAP"], G.SILU.meta()["UP_SOFTCAP"]) == (0.0, 0.0)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(act="swish"), "Gate: act expected one of"),
        (dict(act="gelu", alpha=2.0), "Gate: alpha expected 1.0 unless act='silu', got 2.0"),
        (dict(limit=0.0), "Gate: limit expected None or a finite float > 0, got 0.0"),
        (dict(limit=math.inf), "Gate: limit expected None or a finite float > 0"),
        (dict(alpha=math.nan), "Gate: alpha expected a finite float"),
        (dict(glu=False, limit=7.0), "Gate: glu expected True with limit"),
        (dict(gate_softcap=0.0), "Gate: gate_softcap expected None or a finite float > 0, got 0.0"),
        (dict(up_softcap=math.inf), "Gate: up_softcap expected None or a finite float > 0"),
        (dict(act="gelu", gate_softcap=4.0), "Gate: gate_softcap expected None unless act='silu'"),
        (dict(act="relu2", glu=False, up_softcap=4.0), "Gate: glu expected True with .* softcaps"),
        (dict(limit=7.0, up_softcap=4.0), "Gate: limit expected None with a softcap, got 7.0"),
        (dict(up_offset=1.0, gate_softcap=4.0), "Gate: up_offset expected 0.0 with a softcap"),
    ],
)
def test_bad_gate(kw, match):
    with pytest.raises(ValueError, match=match):
        G.Gate(**kw)


@pytest.mark.parametrize("spec", ["silu:beta=1", "silu:alpha=x", 3, "nope"])
def test_bad_spec(spec):
    with pytest.raises(ValueError, match="op: gate expected a gate spec"):
        G.parse(spec, "op")


def test_reference_matches_the_models_formulas():
    y = torch.randn(16, 64) * 6
    g, u = y[:, :32], y[:, 32:]
    a, lim = 1.702, 7.0
    gc = g.clamp(max=lim)
    oai = (u.clamp(-lim, lim) + 1) * (gc * torch.sigmoid(a * gc))  # gpt-oss's _apply_gate
    got = G.Gate("silu", alpha=a, limit=lim, up_offset=1.0).reference(y)
    torch.testing.assert_close(got, oai)
    after = F.silu(g).clamp(max=lim) * u.clamp(-lim, lim)  # Step-3.7's, limit after the act
    torch.testing.assert_close(G.Gate("silu", limit=lim, clamp_after=True).reference(y), after)
    torch.testing.assert_close(G.Gate("gelu_tanh").reference(y), F.gelu(g, approximate="tanh") * u)
    torch.testing.assert_close(G.Gate("relu2", glu=False).reference(u), F.relu(u) ** 2)
    torch.testing.assert_close(G.SILU.reference(y), F.silu(g) * u)
    # Inkling2's softcapped SwiGLU: the caps bound the linear gate factor and up, the sigmoid sees
    # the raw gate; the same products in the same order, so the same bits
    inkling = (torch.tanh(g / 4) * 4) * torch.sigmoid(g) * (torch.tanh(u / 25) * 25)
    assert torch.equal(G.Gate(gate_softcap=4.0, up_softcap=25.0).reference(y), inkling)
    capped = g * torch.sigmoid(1.702 * g) * (torch.tanh(u / 3) * 3)  # (an up cap alone)
    torch.testing.assert_close(G.Gate(alpha=1.702, up_softcap=3.0).reference(y), capped)
