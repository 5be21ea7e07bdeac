"""The quant schemes as objects: one :class:`QuantScheme` per scheme, the one place that knows
what a scheme's name stands for.

A scheme is W8A8 (or plain bf16): activations and weights share ``act_dtype``. Activations carry
float32 scales `[..., act_scale_cols(H)]` (one per ``act_group`` channels, or one per row when
``act_group`` is None), weights `weight_scale_shape(E, N, Kd)` (one per ``weight_block`` rows x
cols; a None col extent spans the row). Callers compare scheme objects, never names: public
functions and op schemas keep taking the name strings and resolve them with :func:`get`. Adding a
scheme is one instance here plus its kernels.

The pure-torch quantizers below are the schemes' specification (re-exported by
:mod:`epmoe.reference`); the CUDA kernels are byte-exact with them. Shape legend: ``H`` hidden,
``E`` experts, ``N``/``Kd`` GEMM output/reduction dims.
"""

import dataclasses
from typing import Callable, Dict, Optional, Tuple, Union

import torch

from epmoe import _checks

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0  # symmetric range: -128 is never produced
SCALE_EPS = 1e-10  # floor for scales so all-zero groups give q = 0, not NaN
FP8_GROUP = 128  # activation channels per fp8 scale (DeepGEMM's 1x128 groups)
FP8_WEIGHT_BLOCK = 128  # weights are quantized per 128x128 block (DeepSeek-V3 recipe)


# ------------------------------------------------------------------------------- reference math
def _div(a: torch.Tensor, c: float) -> torch.Tensor:
    """a / c with IEEE division on every device: CUDA turns division by a Python scalar into a
    multiplication by its reciprocal, which differs in the last bit (and so would the scales and,
    through them, the codes of the CPU and CUDA references)."""
    return a / torch.full_like(a, c)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def quantize_fp8(x: torch.Tensor, group_size: int = FP8_GROUP) -> Tuple[torch.Tensor, torch.Tensor]:
    """x: float `[..., H]` -> (float8_e4m3fn `[..., H]`, float32 `[..., H // group_size]`).

    s = max(amax(group) / 448, 1e-10); q = fp8(clamp(x * (1 / s), +-448)), round to nearest even.
    Multiplying by the float32 reciprocal (one division per group, as DeepGEMM's own activation
    cast does) instead of dividing every element keeps the GPU kernels memory bound; it differs
    from x / s by at most one float32 ulp before the 3-bit rounding.
    """
    shape = x.shape
    g = x.float().reshape(*shape[:-1], shape[-1] // group_size, group_size)
    s = _div(g.abs().amax(dim=-1), FP8_MAX).clamp_min(SCALE_EPS)
    q = (g * torch.reciprocal(s).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(shape), s


def quantize_int8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x: float `[..., H]` -> (int8 `[..., H]`, float32 `[..., 1]`), per-row symmetric scale.

    s = max(amax(row) / 127, 1e-10); q = round-half-away(x * (1 / s)) clamped to +-127.
    """
    xf = x.float()
    s = _div(xf.abs().amax(dim=-1, keepdim=True), INT8_MAX).clamp_min(SCALE_EPS)
    q = _round_half_away(xf * torch.reciprocal(s)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, s


def _quantize_bf16(x: torch.Tensor, group_size=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """bf16 "codes" are the values themselves (no copy for bf16 x); no scale column."""
    s = torch.empty((*x.shape[:-1], 0), dtype=torch.float32, device=x.device)
    return x.to(torch.bfloat16), s


def _quantize_int8_rows(x: torch.Tensor, group_size=None) -> Tuple[torch.Tensor, torch.Tensor]:
    return quantize_int8(x)  # (one scale per row whatever the group size)


def dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Inverse of the activation quantizers in float32; the group size is H // s.shape[-1]."""
    groups = s.shape[-1]
    qf = q.float().reshape(*q.shape[:-1], groups, q.shape[-1] // groups)
    return (qf * s.unsqueeze(-1)).reshape(q.shape)


def _quantize_weights_fp8(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """float `[E, N, Kd]` -> float8_e4m3fn `[E, N, Kd]`, float32 `[E, N/128, Kd/128]`."""
    E, N, Kd = w.shape
    b = FP8_WEIGHT_BLOCK
    blocks = w.float().reshape(E, N // b, b, Kd // b, b)
    s = _div(blocks.abs().amax(dim=(2, 4)), FP8_MAX).clamp_min(SCALE_EPS)
    q = (blocks / s[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(E, N, Kd), s


def _quantize_weights_int8(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """float `[E, N, Kd]` -> int8 `[E, N, Kd]`, float32 `[E, N]` (per output channel)."""
    wf = w.float()
    s = _div(wf.abs().amax(dim=-1), INT8_MAX).clamp_min(SCALE_EPS)
    q = _round_half_away(wf / s.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, s


def _weights_bf16(w: torch.Tensor) -> Tuple[torch.Tensor, None]:
    return w.to(torch.bfloat16).contiguous(), None


def dequantize_weights(q: torch.Tensor, s: Optional[torch.Tensor]) -> torch.Tensor:
    """Inverse of the weight quantizers in float32 `[E, N, Kd]`."""
    if s is None:
        return q.float()
    if q.dtype == torch.int8:
        return q.float() * s.unsqueeze(-1)
    E, N, Kd = q.shape
    bn, bk = N // s.shape[1], Kd // s.shape[2]
    blocks = q.float().reshape(E, s.shape[1], bn, s.shape[2], bk)
    return (blocks * s[:, :, None, :, None]).reshape(E, N, Kd)


# -------------------------------------------------------------------------------------- schemes
@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """One quant scheme. Hashable (a dict key, an ``functools.cache`` argument); compare schemes
    with each other (``scheme is FP8`` or ``==``), never with a name: ``FP8 == "fp8"`` is False.

    Attributes:
        name: "bf16", "fp8" or "int8" (also ``str(scheme)``): the string public functions take.
        act_dtype: dtype of the activation and weight codes.
        act_group: channels per activation scale; None: one scale per row (int8), or none (bf16).
        weight_block: rows x cols per weight scale (a None col: the whole row); None: no scales.
        gemv_max_tokens: mode="auto" runs the per-choice GEMVs up to this many tokens on one rank.
        cuda_scale_layout: the activation-scale layout the CUDA GEMMs read ("deepgemm": MN-major,
            TMA-aligned, fp8's for deep_gemm; "row": contiguous rows).
        dispatch_codes: DeepEP's LL dispatch sends the codes itself (fp8); otherwise it sends bf16
            and the layer quantizes after it.
        quantized: False for bf16: no codes and no scales (derived, not a field).
        kernel_code: the kernels' QUANT constexpr: 0 no codes (bf16), 1 scales per channel group
            (fp8), 2 one scale per row (int8) (derived, not a field).
    """

    name: str
    act_dtype: torch.dtype
    act_group: Optional[int]
    weight_block: Optional[Tuple[int, Optional[int]]]
    gemv_max_tokens: int
    cuda_scale_layout: str = "row"
    dispatch_codes: bool = False
    # the reference quantizers (activations: x, group_size -> codes, scales; weights: w -> codes,
    # scales or None); not part of the scheme's identity
    act_quantizer: Optional[Callable] = dataclasses.field(default=None, compare=False, repr=False)
    weight_quantizer: Optional[Callable] = dataclasses.field(
        default=None, compare=False, repr=False
    )

    def __str__(self) -> str:
        return self.name

    def __hash__(self) -> int:
        return hash(self.name)  # (cheaper than the fields' tuple: launch plans are cached on it)

    def __reduce__(self):
        return get, (self.name,)  # unpickled (spawned workers): the registered instance itself

    def __post_init__(self):
        # read on every launch: plain attributes (not fields), set once (see the class doc)
        quantized = self.weight_block is not None
        object.__setattr__(self, "quantized", quantized)
        code = 0 if not quantized else 1 if self.act_group is not None else 2
        object.__setattr__(self, "kernel_code", code)

    @property
    def size_multiple(self) -> int:
        """What GEMM dims (hidden, intermediate, N, Kd) must be a multiple of (1: anything)."""
        sizes = [self.act_group or 1, *(b for b in self.weight_block or () if b is not None)]
        return max(sizes)

    def act_scale_cols(self, hidden: int, group_size: Optional[int] = None) -> int:
        """Columns of the float32 activation scales of rows of ``hidden`` channels
        (``group_size`` overrides ``act_group``, as in :meth:`quantize`)."""
        if not self.quantized:
            return 0
        return hidden // (group_size or self.act_group) if self.act_group else 1

    def weight_scale_shape(self, E: int, N: int, K: int) -> Optional[Tuple[int, ...]]:
        """Shape of the float32 scales of weights `[E, N, K]` (None: the scheme has none)."""
        if self.weight_block is None:
            return None
        rows, cols = self.weight_block
        return (E, N // rows) if cols is None else (E, N // rows, K // cols)

    def check_sizes(self, op: str, **dims: int) -> None:
        """ValueError naming ``op`` and the first dim that is not a multiple the scheme needs."""
        of = self.size_multiple
        if of == 1:
            return
        for arg, v in dims.items():
            _checks.check_multiple(op, arg, v, of, f"for {self.name} ({of}-channel groups)")

    def quantize(
        self, x: torch.Tensor, group_size: Optional[int] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Reference activation quantizer: x float `[..., H]` -> (act_dtype `[..., H]`, float32
        `[..., act_scale_cols(H)]`); ``group_size`` overrides ``act_group`` (fp8 only)."""
        return self.act_quantizer(x, group_size or self.act_group)

    def dequantize(self, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """float32 values of codes q with scales s (bf16: q itself)."""
        return dequantize(q, s) if self.quantized else q.float()

    def quantize_weights(self, w: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Reference weight quantizer: w float `[E, N, Kd]` -> (act_dtype `[E, N, Kd]`, float32
        `weight_scale_shape(E, N, Kd)` or None)."""
        return self.weight_quantizer(w)


BF16 = QuantScheme(
    "bf16", torch.bfloat16, None, None, gemv_max_tokens=8,
    act_quantizer=_quantize_bf16, weight_quantizer=_weights_bf16,
)  # fmt: skip
FP8 = QuantScheme(
    "fp8", FP8_DTYPE, FP8_GROUP, (FP8_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK), gemv_max_tokens=8,
    cuda_scale_layout="deepgemm", dispatch_codes=True, act_quantizer=quantize_fp8,
    weight_quantizer=_quantize_weights_fp8,
)  # fmt: skip
INT8 = QuantScheme(
    "int8", torch.int8, None, (1, None), gemv_max_tokens=4,
    act_quantizer=_quantize_int8_rows, weight_quantizer=_quantize_weights_int8,
)  # fmt: skip

SCHEMES: Dict[str, QuantScheme] = {s.name: s for s in (BF16, FP8, INT8)}
QUANTIZED = tuple(s for s in SCHEMES.values() if s.quantized)
_OF_DTYPE = {s.act_dtype: s for s in SCHEMES.values()}


def get(quant: Union[str, QuantScheme], op: str = "quant", arg: str = "quant") -> QuantScheme:
    """The scheme named ``quant`` (a scheme is returned as is); else ``ValueError("op: arg
    expected one of 'bf16', 'fp8', 'int8', got 'x'")`` (the wording of the project's choices)."""
    if isinstance(quant, QuantScheme):
        return quant
    scheme = SCHEMES.get(quant) if isinstance(quant, str) else None
    if scheme is None:
        raise _checks.fail(op, arg, "one of " + ", ".join(map(repr, SCHEMES)), repr(quant))
    return scheme


def of_dtype(dtype: torch.dtype) -> QuantScheme:
    """The scheme whose codes have ``dtype`` (GEMM operands: bf16, float8_e4m3fn, int8)."""
    scheme = _OF_DTYPE.get(dtype)
    if scheme is None:
        raise _checks.fail("quant", "dtype", "one of " + ", ".join(map(str, _OF_DTYPE)), dtype)
    return scheme
