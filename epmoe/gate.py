"""The gate of an expert MLP: how GEMM1's output becomes GEMM2's input, as one object.

``h = A(gate) * U(up)`` per channel, float32 math, rounded to the activation dtype once:

- ``act`` the activation of the gate half: "silu" (``g * sigmoid(alpha * g)``; alpha 1 is SiLU),
  "gelu_tanh" (GELU, tanh approximation), "gelu" (GELU, erf), "relu", "relu2" (``relu(g)**2``).
- ``limit`` (optional, > 0): the gate is clamped to ``max=limit`` before the activation (or, with
  ``clamp_after``, the activation's output is), the up half to ``[-limit, limit]`` (gpt-oss,
  MiniMax-M3, DeepSeek-V4: before; Step-3.7, Bailing: after).
- ``up_offset``: added to the clamped up half (gpt-oss: ``(up + 1)``).
- ``glu`` False: no gate half, ``h = act(up)`` on GEMM1's `[..., I]` (NemotronH: relu2).
- ``gate_softcap`` / ``up_softcap`` (optional, > 0): soft caps ``c * tanh(x / c)`` of SiLU's
  linear factor (the sigmoid sees the raw gate: act "silu" only) and of the up half (Inkling2:
  ``softcap(g) * sigmoid(g) * softcap(u)``); with ``glu``, without ``limit`` / ``up_offset`` (one
  bound a half).

GEMM1 writes `[..., 2I]` (gate columns, then up columns) when ``glu``, `[..., I]` otherwise. An
op takes the gate as its ``spec`` string ("silu", "silu:alpha=1.702,limit=7,up_offset=1", ...):
a torch.library schema carries strings, and the spec is the object's one canonical spelling.

Shape legend: ``I`` intermediate size (channels of h).
"""

import dataclasses
import functools
import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from epmoe import _checks

ACTS = ("silu", "gelu_tanh", "gelu", "relu", "relu2")
_CODE = {a: i for i, a in enumerate(ACTS)}  # the kernels' ACT constexpr
_FIELDS = ("alpha", "limit", "clamp_after", "up_offset", "glu", "gate_softcap", "up_softcap")
_NEG_LOG2E = tl.constexpr(-1.4426950408889634)
# tanh's odd series near 0: z - z^3 / 3 + 2 z^5 / 15 - 17 z^7 / 315
_TANH_Z3, _TANH_Z5, _TANH_Z7 = (tl.constexpr(c) for c in (-1 / 3, 2 / 15, -17 / 315))


@dataclasses.dataclass(frozen=True)
class Gate:
    """One gate (see the module docstring). Hashable: kernels' launch plans are cached on it."""

    act: str = "silu"
    alpha: float = 1.0
    limit: Optional[float] = None
    clamp_after: bool = False
    up_offset: float = 0.0
    glu: bool = True
    gate_softcap: Optional[float] = None
    up_softcap: Optional[float] = None

    def __post_init__(self):
        _checks.check_choice("Gate", "act", self.act, ACTS)
        for name in ("alpha", "up_offset"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v)):
                raise _checks.fail("Gate", name, "a finite float", v)
            object.__setattr__(self, name, float(v))
        if self.alpha != 1.0 and self.act != "silu":
            raise _checks.fail("Gate", "alpha", "1.0 unless act='silu'", self.alpha)
        for name in ("limit", "gate_softcap", "up_softcap"):
            v = getattr(self, name)
            if v is not None:
                if not (isinstance(v, (int, float)) and math.isfinite(v)) or v <= 0:
                    raise _checks.fail("Gate", name, "None or a finite float > 0", v)
                object.__setattr__(self, name, float(v))
        capped = self.gate_softcap is not None or self.up_softcap is not None
        clamped = self.limit is not None or self.up_offset or self.clamp_after
        if not self.glu and (clamped or capped):
            raise _checks.fail(
                "Gate", "glu", "True with limit / up_offset / clamp_after / softcaps", False
            )
        if self.gate_softcap is not None and self.act != "silu":
            raise _checks.fail("Gate", "gate_softcap", "None unless act='silu'", self.gate_softcap)
        if capped and self.limit is not None:
            raise _checks.fail("Gate", "limit", "None with a softcap", self.limit)
        if capped and self.up_offset:
            raise _checks.fail("Gate", "up_offset", "0.0 with a softcap", self.up_offset)

    # ------------------------------------------------------------------------------- spelling
    @property
    def spec(self) -> str:
        """The canonical string: the act, then each field that differs from the default."""
        default = Gate()
        parts = [f"{f}={_fmt(getattr(self, f))}" for f in _FIELDS
                 if getattr(self, f) != getattr(default, f)]  # fmt: skip
        return self.act + (":" + ",".join(parts) if parts else "")

    def __str__(self) -> str:
        return self.spec

    @property
    def is_silu(self) -> bool:
        """The plain SiLU-GLU (silu(gate) * up)."""
        return self == SILU

    def width(self, inter: int) -> int:
        """Columns GEMM1 writes for ``inter`` channels of h: 2I (gate and up) or I."""
        return 2 * inter if self.glu else inter

    def inter(self, width: int) -> int:
        """Channels of h of GEMM1's ``width`` columns (the inverse of :meth:`width`)."""
        return width // 2 if self.glu else width

    # ------------------------------------------------------------------------------- reference
    def reference(self, y: torch.Tensor) -> torch.Tensor:
        """y float `[..., width(I)]` -> float32 `[..., I]` (not rounded)."""
        yf = y.float()
        if not self.glu:
            return self._act(yf)
        inter = y.shape[-1] // 2
        g, u = yf[..., :inter], yf[..., inter:]
        if self.limit is not None:
            u = u.clamp(-self.limit, self.limit)
            if not self.clamp_after:
                g = g.clamp(max=self.limit)
        if self.up_softcap is not None:
            u = self._softcap(u, self.up_softcap)
        a = self._act(g)
        if self.limit is not None and self.clamp_after:
            a = a.clamp(max=self.limit)
        # (no + 0.0: it would turn an up value of -0.0 into +0.0, and so the sign of a zero h)
        return a * (u + self.up_offset if self.up_offset else u)

    def _act(self, g: torch.Tensor) -> torch.Tensor:
        if self.act == "silu" and self.gate_softcap is not None:  # (Inkling2's order of products)
            return self._softcap(g, self.gate_softcap) * torch.sigmoid(self.alpha * g)
        if self.act == "silu":  # (alpha 1: torch's own SiLU, the bits the plain SiLU-GLU had)
            return F.silu(g) if self.alpha == 1.0 else g * torch.sigmoid(self.alpha * g)
        if self.act == "gelu_tanh":
            return F.gelu(g, approximate="tanh")
        if self.act == "gelu":
            return F.gelu(g)
        r = torch.relu(g)
        return r * r if self.act == "relu2" else r

    @staticmethod
    def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
        return torch.tanh(x / cap) * cap  # (as transformers' Softcap modules compute it)

    # ------------------------------------------------------------------------------- kernels
    def meta(self) -> dict:
        """The constexprs of :func:`gate_h` for this gate (splat into a launch's meta)."""
        return dict(
            ACT=_CODE[self.act], ALPHA=self.alpha, LIMIT=self.limit or 0.0,
            CLAMP_AFTER=self.clamp_after, UP_OFFSET=self.up_offset, GLU=self.glu,
            GATE_SOFTCAP=self.gate_softcap or 0.0, UP_SOFTCAP=self.up_softcap or 0.0,
        )  # fmt: skip


def _fmt(v) -> str:
    if isinstance(v, bool):
        return str(int(v))
    return repr(float(v)) if isinstance(v, float) else str(v)


SILU = Gate()
# what a bad spec is told it should have been (parse's ValueError, and the ops' contracts)
SPEC_EXPECTED = f"a gate spec such as 'silu:alpha=1.702,limit=7' (act in {ACTS}, fields {_FIELDS})"


@functools.lru_cache(maxsize=256)
def parse(spec: str, op: str = "gate", arg: str = "gate") -> Gate:
    """The Gate a spec string names (ValueError naming ``op`` / ``arg`` otherwise)."""
    if not isinstance(spec, str):
        raise _checks.fail(op, arg, SPEC_EXPECTED, repr(spec))
    act, _, rest = spec.partition(":")
    kw = {}
    try:
        for item in filter(None, rest.split(",")):
            name, _, value = item.partition("=")
            if name not in _FIELDS:
                raise ValueError(name)
            kw[name] = bool(int(value)) if name in ("clamp_after", "glu") else float(value)
        return Gate(act, **kw)
    except ValueError:
        raise _checks.fail(op, arg, SPEC_EXPECTED, repr(spec)) from None


def is_spec(spec) -> bool:
    """Whether ``spec`` names a gate (the op contracts' test; their full check raises parse's
    ValueError)."""
    try:
        parse(spec)
    except (ValueError, TypeError):  # (TypeError: an unhashable non-string)
        return False
    return True


def get(gate: Union[str, Gate, None], op: str = "gate", arg: str = "gate") -> Gate:
    """A Gate from a Gate, a spec string or None (SiLU)."""
    if gate is None:
        return SILU
    return gate if isinstance(gate, Gate) else parse(gate, op, arg)


# the op contracts' gate argument: whether it names a gate and whether the gate has a gate half
# (y is [..., 2I]; the default's test is one string compare: host time), with the names those
# expressions read
CONTRACT_CONSTS = dict(_gate_ok=is_spec, _parse=parse)
OK = "gate == 'silu' or _gate_ok(gate)"
GLU = "gate == 'silu' or _parse(gate).glu"


# ---------------------------------------------------------------------------------- jit helpers
@triton.jit
def _approx(x, OP: tl.constexpr):
    """One MUFU instruction per element (PTX ``OP``.approx.ftz.f32: ex2 or rcp)."""
    return tl.inline_asm_elementwise(
        OP + ".approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _sigmoid_mul(g, z, SCALE: tl.constexpr, FAST: tl.constexpr):
    """g * sigmoid(SCALE * z) in float32: two MUFU instructions on the GPU (ex2, rcp; SCALE folded
    into the ex2 argument's constant; flush-to-zero only touches exp(-z) < 2^-126, where
    sigmoid = 1 either way), torch's formula under the interpreter (which runs no PTX)."""
    if FAST:
        return g * _approx(1.0 + _approx(z * (SCALE * _NEG_LOG2E), "ex2"), "rcp")
    else:
        zs = z * SCALE if SCALE != 1.0 else z  # (SCALE 1: no multiply, the plain SiLU's code)
        return g / (1.0 + tl.exp(-zs))


@triton.jit
def _softcap(x, CAP: tl.constexpr):
    """CAP * tanh(x / CAP) of float32 x: tanh(z) = (1 - e) / (1 + e) with e = exp(-2|z|), and
    near 0, where 1 - e cancels, its odd series to z^7 (|z| < 1/8: within 2e-9 of tanh)."""
    z = x / CAP
    z2 = z * z
    e = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - e) / (1.0 + e)
    near0 = z + z * z2 * (_TANH_Z3 + z2 * (_TANH_Z5 + z2 * _TANH_Z7))
    return tl.where(z2 < 0.015625, near0, tl.where(z < 0.0, -t, t)) * CAP


@triton.jit
def _act(g, ACT: tl.constexpr, ALPHA: tl.constexpr, GATE_SOFTCAP: tl.constexpr,
         FAST: tl.constexpr):  # fmt: skip
    """The gate's activation of float32 g (codes as in ACTS)."""
    if ACT == 0:  # silu (alpha); GATE_SOFTCAP caps its linear factor, the sigmoid sees g
        f = _softcap(g, GATE_SOFTCAP) if GATE_SOFTCAP > 0 else g
        return _sigmoid_mul(f, g, ALPHA, FAST)
    elif ACT == 1:  # gelu_tanh: 0.5 g (1 + tanh(z)) = g sigmoid(2 z)
        return _sigmoid_mul(g, g + 0.044715 * g * g * g, 1.5957691216057308, FAST)
    elif ACT == 2:  # gelu (erf)
        return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    elif ACT == 3:
        return tl.maximum(g, 0.0)
    else:  # relu2
        r = tl.maximum(g, 0.0)
        return r * r


@triton.jit
def gate_h(g, u, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
           CLAMP_AFTER: tl.constexpr, UP_OFFSET: tl.constexpr, GLU: tl.constexpr,
           GATE_SOFTCAP: tl.constexpr, UP_SOFTCAP: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """float32 h of loaded float32 gate / up values (``g`` unused without GLU: h = act(u))."""
    if not GLU:
        return _act(u, ACT, ALPHA, 0.0, FAST)
    else:
        if LIMIT > 0:
            u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
            if not CLAMP_AFTER:
                g = tl.minimum(g, LIMIT)
        if UP_SOFTCAP > 0:
            u = _softcap(u, UP_SOFTCAP)
        a = _act(g, ACT, ALPHA, GATE_SOFTCAP, FAST)
        if LIMIT > 0 and CLAMP_AFTER:
            a = tl.minimum(a, LIMIT)
        if UP_OFFSET != 0.0:  # (+ 0.0 would cost an add and turn -0.0 into +0.0)
            u = u + UP_OFFSET
        return a * u
