"""silu_and_mul(_quant): formula (gate first), fused == unfused, opcheck (CPU)."""

import pytest
import torch
import torch.nn.functional as F

from epmoe import ops
from tests._opcheck import opcheck


@pytest.mark.parametrize("shape", [(6, 64), (2, 3, 256), (0, 32)])
def test_silu_and_mul_formula(shape, seed):
    y = torch.randn(shape).bfloat16()
    h = ops.silu_and_mul(y)
    inter = shape[-1] // 2
    want = (F.silu(y[..., :inter].float()) * y[..., inter:].float()).bfloat16()
    assert h.shape == (*shape[:-1], inter) and h.dtype == torch.bfloat16
    torch.testing.assert_close(h, want, atol=0, rtol=0)


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_fused_equals_unfused(scheme, seed):
    y = torch.randn(5, 512).bfloat16()
    q, s = ops.silu_and_mul_quant(y, scheme)
    q2, s2 = ops.quantize(ops.silu_and_mul(y), scheme)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


def test_masked_rows(seed):
    y = torch.randn(2, 4, 256).bfloat16()
    m = torch.tensor([1, 4], dtype=torch.int32)
    q, s = ops.silu_and_mul_quant(y, "fp8", masked_m=m)
    q2, s2 = ops.quantize(ops.silu_and_mul(y), "fp8")
    for e, n in enumerate(m.tolist()):
        assert torch.equal(q[e, :n].view(torch.uint8), q2[e, :n].view(torch.uint8))
        assert torch.equal(s[e, :n], s2[e, :n])


def test_activation_opcheck(seed):
    y = torch.randn(3, 256).bfloat16()
    opcheck(torch.ops.epmoe.silu_and_mul.default, (y,))
    opcheck(torch.ops.epmoe.silu_and_mul_quant.default, (y, "fp8", None, 128))
    y3 = torch.randn(2, 3, 256).bfloat16()
    m = torch.tensor([0, 2], dtype=torch.int32)
    opcheck(torch.ops.epmoe.silu_and_mul_quant.default, (y3, "int8", m, 128))
    mi = torch.tensor([0, 0, -1], dtype=torch.int32)
    offs = torch.tensor([0, 2], dtype=torch.int32)
    opcheck(torch.ops.epmoe.silu_and_mul.default, (y, None, mi, offs))
    opcheck(torch.ops.epmoe.silu_and_mul_quant.default, (y, "fp8", None, 128, mi, "row", offs))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: ops.silu_and_mul(torch.zeros(2, 5)), "silu_and_mul: y.shape\\[-1\\] expected"),
        (lambda: ops.silu_and_mul_quant(torch.zeros(2, 200), "fp8"), "silu_and_mul_quant: y.shape"),
        (lambda: ops.silu_and_mul_quant(torch.zeros(2, 256), "int4"), "silu_and_mul_quant: scheme"),
        (
            lambda: ops.silu_and_mul_quant(
                torch.zeros(2, 256), "fp8", torch.zeros(2, dtype=torch.int32)
            ),
            "silu_and_mul_quant: masked_m expected None for a 2-D y",
        ),
        (
            lambda: ops.silu_and_mul(torch.zeros(2, 4), expert_offsets=torch.zeros(2)),
            "silu_and_mul: expert_offsets expected dtype torch.int32",
        ),
        (
            lambda: ops.silu_and_mul(
                torch.zeros(2, 3, 4), expert_offsets=torch.zeros(2, dtype=torch.int32)
            ),
            "silu_and_mul: expert_offsets expected None for a 3-D y",
        ),
        (
            lambda: ops.silu_and_mul_quant(
                torch.zeros(2, 256), "fp8", expert_offsets=torch.zeros(0, dtype=torch.int32)
            ),
            "silu_and_mul_quant: expert_offsets expected \\[E \\+ 1\\]",
        ),
    ],
)
def test_activation_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_fast_path_takes_plain_tensors_only():
    """The public functions' one-pass fast path (the contract's ``direct``): y and expert_offsets
    must be plain tensors without grad, as _eager.direct asks of every tensor; a Parameter or a
    tensor that needs grad goes the dispatcher's way (built here to accept CPU tensors)."""
    import importlib

    A = importlib.import_module("epmoe.ops.activation")
    direct = A.CONTRACT._build("direct", direct=True, cuda_attr="is_cpu")
    y = torch.zeros((4, 8))
    offs = torch.zeros(3, dtype=torch.int32)
    mi = torch.zeros(4, dtype=torch.int32)
    b = torch.zeros((2, 8))
    assert direct(y, None, None, None, "silu", None) and direct(y, None, None, offs, "silu", None)
    assert direct(y, None, mi, None, "gelu", b)
    assert not direct(torch.nn.Parameter(y), None, None, None, "silu", None)
    assert not direct(y.clone().requires_grad_(), None, None, offs, "silu", None)
    assert not direct(y, None, None, torch.nn.Parameter(offs, requires_grad=False), "silu", None)
    assert not direct(y, None, mi, None, "silu", torch.nn.Parameter(b))
    assert not direct(y, None, mi, None, "swish", None)
