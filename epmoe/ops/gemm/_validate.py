"""Input contracts of the grouped GEMM (:mod:`epmoe._contract`): the operands and their scales,
then the row argument of each layout (m_indices and expert_offsets, or masked_m)."""

import torch

from epmoe import _checks
from epmoe import gate as _gate
from epmoe._contract import Case, Choice, Contract, Multiple, Rule, Shape, Tensor
from epmoe._range import range_ok
from epmoe.ops.gemm._select import A_DTYPES, OP, scheme_of

_F32 = (torch.float32,)


def _operands(masked: bool):
    """a, w and the scales their scheme (a's dtype) asks for."""
    steps = [
        Tensor("a", A_DTYPES, ndim=(3,) if masked else (2,)),
        Tensor("w", "(a.dtype,)", ndim=(3,)),
        Rule(
            "w.shape[2] == a.shape[-1]",
            "w",
            lambda n: f"shape [E, N, {n.a.shape[-1]}] (K of a)",
            lambda n: list(n.w.shape),
        ),
    ]
    if masked:
        steps.append(
            Rule(
                "a.shape[0] == w.shape[0]",
                "a",
                lambda n: f"shape [{n.w.shape[0]}, T, {n.a.shape[-1]}] (E of w)",
                lambda n: list(n.a.shape),
            )
        )
    bf16 = [
        Rule(f"{name} is None", name, "None for bf16 operands", "a tensor")
        for name in ("a_scales", "w_scales")
    ]
    fp8 = [
        Multiple("K", "a.shape[-1]", 128, "(fp8 scale blocks)"),
        Multiple("N", "w.shape[1]", 128, "(fp8 weight blocks)"),
        Shape("a_scales", "(*a.shape[:-1], a.shape[-1] // 128)"),
        Shape("w_scales", "(w.shape[0], w.shape[1] // 128, a.shape[-1] // 128)"),
    ]
    int8 = [Shape("a_scales", "(*a.shape[:-1], 1)"), Shape("w_scales", "(w.shape[0], w.shape[1])")]
    quantized = [
        Rule(
            "a_scales is not None and w_scales is not None",
            "a_scales/w_scales",
            lambda n: f"tensors for {scheme_of(n.a.dtype)} operands",
            "None",
        ),
        Tensor("a_scales", _F32),
        Tensor("w_scales", _F32),
        Case("a.dtype is FP8", fp8, int8),
    ]
    return (*steps, Case("a.dtype is BF16", bf16, quantized))


_CONSTS = dict(BF16=torch.bfloat16, FP8=torch.float8_e4m3fn)


def _rows():
    """m_indices (one per row of a, or with a_rows one per row a_rows names) and a_rows."""
    return Case(
        "a_rows is None",
        [Tensor("m_indices", _checks.INT32, shape=("a.shape[0]",))],
        [
            Tensor("a_rows", _checks.INT32, ndim=(1,)),
            Tensor("m_indices", _checks.INT32, shape=("a_rows.shape[0]",)),
        ],
    )


CONTIGUOUS = Contract(
    OP,
    "a w m_indices a_scales w_scales expert_offsets a_rows",
    *_operands(masked=False),
    _rows(),
    Tensor("expert_offsets", _checks.INT32, shape=("w.shape[0] + 1",), optional=True),
    consts=_CONSTS,
)
MASKED = Contract(
    OP,
    "a w masked_m a_scales w_scales",
    *_operands(masked=True),
    Tensor("masked_m", _checks.INT32, shape=("w.shape[0]",)),
    consts=_CONSTS,
)


OP_GATE = "grouped_gemm_gate"
OP_MASKED_GATE = "grouped_gemm_masked_gate"


def _gate_steps():
    """The gate (its halves in w's rows), the bias rows and the output scales of GEMM1 + gate."""
    return (
        Rule(_gate.OK, "gate", _gate.SPEC_EXPECTED, lambda n: repr(n.gate)),
        Case(
            _gate.GLU,
            [Multiple("w.shape[1]", "w.shape[1]", 2, "(gate and up halves)")],
        ),
        Case(
            "a.dtype is FP8",
            [Case(_gate.GLU, [Multiple("I", "w.shape[1] // 2", 128, "(fp8 output groups)")])],
        ),
        Tensor("bias", _checks.FLOAT_DTYPES, shape=("w.shape[0]", "w.shape[1]"), optional=True),
        Choice("scale_layout", ("row", "deepgemm")),
    )


# GEMM1 + gate: the contiguous / masked operands and rows, then the gate's arguments
GATE = Contract(
    OP_GATE,
    "a w m_indices a_scales w_scales gate bias scale_layout a_rows",
    *_operands(masked=False),
    _rows(),
    *_gate_steps(),
    consts=dict(_CONSTS, **_gate.CONTRACT_CONSTS),
)
MASKED_GATE = Contract(
    OP_MASKED_GATE,
    "a w masked_m a_scales w_scales gate bias scale_layout",
    *_operands(masked=True),
    Tensor("masked_m", _checks.INT32, shape=("w.shape[0]",)),
    *_gate_steps(),
    consts=dict(_CONSTS, **_gate.CONTRACT_CONSTS),
)


def _check_counts(masked_m: torch.Tensor, t: int, op: str = OP) -> None:
    ok = range_ok(masked_m, 0, t + 1)
    _checks.check_values(ok, op, "masked_m", f"counts in [0, {t}]")
