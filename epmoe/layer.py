"""EPMoE: the expert-parallel MoE layer, chaining the stage ops for both modes.

HT (prefill): quantize -> ht_dispatch -> permute -> grouped_gemm (gate+up) -> silu_and_mul(_quant)
-> grouped_gemm (down) -> unpermute -> ht_combine.
LL (decode): ll_dispatch -> [quantize] -> masked grouped_gemm -> silu_and_mul(_quant) -> masked
grouped_gemm -> ll_combine.
GEMM1 and the activation run as one kernel (grouped_gemm_gate, grouped_gemm_masked_gate) where
this GPU's tuned table measured that faster: the same bytes, the "act" record without "gemm1".
"auto": per-choice GEMVs for a few tokens on one rank, LL up to ``ll_max_tokens`` tokens per call,
HT above (chosen from the shape, not the data).

On one rank with the local backend nothing is sent: HT permutes the caller's x, ids and weights
directly and unpermute's output is the result; LL scatters tokens into the masked layout with one
kernel (quantization fused, ops.ll_scatter) and gathers them back, weighted, with another
(ops.ll_gather).

Shapes: x bf16 `[T, H]`, topk_ids int64 `[T, K]` GLOBAL expert ids or -1, topk_weights float32 `[T,
K]` -> bf16 `[T, H]`. Weights are loaded global (w1 `[Et, 2I, H]` gate rows first, or `[Et, I,
H]` for a gate without a gate half; w2 `[Et, H, I]`; optional biases b1 `[Et, 2I]` / b2 `[Et, H]`);
each rank keeps experts [rank*E, (rank+1)*E) and quantizes them once. The gate
(:mod:`epmoe.gate`) runs in the activation stage, b1 there too (before the gate) and b2 in the
weighted gather (unpermute, ll_gather, gemv_down): no extra pass over the activations.

Sizes a scheme cannot run as they are (fp8: H or I not a multiple of 128, gpt-oss's 2880) are
padded: the weights with zeros at load (``hidden_padded``, ``inter_padded``), the activations inside
the quantizing kernels (codes wider than x); the gathers write only the H real columns.

Stage outputs of a real forward pass can be recorded (for checks and per-stage benchmarks) without
a second copy of the chain: ``with layer.record_stages() as rec: out = layer(x, ids, w)``, then
``rec["permute"]`` is permute's result as GEMM1 consumed it (see :class:`StageRecord`).
"""

import contextlib
import math
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from epmoe import _checks, _eager, comm, reference
from epmoe import gate as _gate
from epmoe import quant as _quant
from epmoe._contract import Contract, Rule, Tensor
from epmoe.ops import activation as _act
from epmoe.ops import combine as _combine
from epmoe.ops import dispatch as _dispatch
from epmoe.ops import gemm
from epmoe.ops import gemv as _gemv
from epmoe.ops.gemm import (
    _tuned,
    fuses_gate,
    fuses_masked_gate,
    gathers,
    grouped_gemm_contiguous,
    grouped_gemm_gate,
    grouped_gemm_masked,
    grouped_gemm_masked_gate,
    masked_row_block,
    smallest_row_block,
)
from epmoe.ops.ll_gather import ll_gather
from epmoe.ops.ll_scatter import ll_scatter
from epmoe.ops.permute import permute
from epmoe.ops.quantize import quantize
from epmoe.ops.unpermute import unpermute

OP = "EPMoE"
DEFAULT_ALIGNMENT = 128  # deep_gemm's contiguous-layout M tile; CPU accepts any positive int
MODES = ("ht", "ll", "auto")
# mode="auto": LL (masked) up to this many tokens per call, HT (contiguous) above (the measured
# crossover: benchmarks/results/h200/RESULTS.md)
AUTO_LL_MAX_TOKENS = 512
# the per-choice GEMVs read an expert's weights once per choice, the masked GEMM once per touched
# expert: "auto" keeps the GEMVs while a call's expected choices per touched expert stay within
# this (the measured crossover: docs/kernels.md, "per-choice GEMVs")
GEMV_MAX_REREADS = 1.25
# load_weights quantizes this many weight rows at a time (a multiple of the fp8 128-row block):
# the float32 transient stays below one expert's float32 copy
LOAD_ROWS = 512
_WEIGHTS = ("w1", "w1_scale", "w2", "w2_scale", "b1", "b2")
# the stages each path records, in order ("quantize" only where it runs: HT fp8 / int8, LL int8)
HT_STAGES = ("quantize", "dispatch", "permute", "gemm1", "act", "gemm2", "unpermute", "combine")
LL_STAGES = ("ll_dispatch", "quantize", "gemm1", "act", "gemm2", "ll_combine")
# one rank, local backend: HT has no dispatch / combine; LL scatters and gathers instead
LOCAL_HT_STAGES = ("quantize", "permute", "gemm1", "act", "gemm2", "unpermute")
LOCAL_LL_STAGES = ("ll_scatter", "gemm1", "act", "gemm2", "ll_gather")
# one rank, mode "auto", a few tokens: the per-choice GEMVs
GEMV_STAGES = ("gemv_gate_up", "gemv_down")
STAGES = tuple(dict.fromkeys(HT_STAGES + LL_STAGES + LOCAL_LL_STAGES + GEMV_STAGES))

FORWARD = Contract(
    OP,
    "x topk_ids topk_weights hidden_size top_k device",
    Tensor("x", (torch.bfloat16,), shape=(None, "hidden_size")),
    Rule(
        "x.device == device",
        "x",
        lambda a: f"device {a.device} (the layer's)",
        lambda a: a.x.device,
    ),
    Tensor("topk_ids", (torch.int64,), shape=("x.shape[0]", "top_k")),
    Tensor("topk_weights", (torch.float32,), shape=("x.shape[0]", "top_k")),
)


class _Stages(NamedTuple):
    """The stage functions the forward pass chains."""

    quantize: Callable
    ht_dispatch: Callable
    permute: Callable
    grouped_gemm_contiguous: Callable
    grouped_gemm_masked: Callable
    grouped_gemm_gate: Callable
    grouped_gemm_masked_gate: Callable
    silu_and_mul: Callable
    silu_and_mul_quant: Callable
    unpermute: Callable
    ht_combine: Callable
    ll_dispatch: Callable
    ll_combine: Callable
    ll_scatter: Callable
    ll_gather: Callable
    gemv_gate_up: Callable
    gemv_down: Callable


# every stage the forward pass chains, each declared once (epmoe._stage.stage): the public function
# checks its inputs, .chained is its op with the chain's arguments, .launch its CUDA launch
STAGE_TABLE = _Stages(
    quantize, _dispatch.ht_dispatch, permute, grouped_gemm_contiguous, grouped_gemm_masked,
    grouped_gemm_gate, grouped_gemm_masked_gate, _act.silu_and_mul, _act.silu_and_mul_quant,
    unpermute, _combine.ht_combine, _dispatch.ll_dispatch, _combine.ll_combine, ll_scatter,
    ll_gather, _gemv.gemv_gate_up, _gemv.gemv_down,
)  # fmt: skip
# the table's three views: record_stages(replace=...) hooks stand between stages: each checks
_PUBLIC = STAGE_TABLE
# torch.compile, CPU, ...: the ops with the chain's arguments
_CHAINED = _Stages(*(f.chained for f in STAGE_TABLE))
# eager plain CUDA inputs checked at the layer's boundary: the launches without the checks
_TRUSTED = _Stages(*(f.launch for f in STAGE_TABLE))


def _check_config(
    num_experts, hidden_size, intermediate_size, top_k, quant, mode, max_tokens_per_rank,
    ll_max_tokens,
) -> Optional[int]:  # fmt: skip
    """EPMoE's static arguments (ValueError naming the bad one); returns ll_max_tokens with
    "auto"'s default filled in."""
    for name, v in (
        ("num_experts", num_experts),
        ("hidden_size", hidden_size),
        ("intermediate_size", intermediate_size),
        ("top_k", top_k),
    ):
        _checks.check_positive_int(OP, name, v)
    _quant.get(quant, OP)
    _checks.check_choice(OP, "mode", mode, MODES)
    if mode == "ll":
        _checks.check_positive_int(OP, "max_tokens_per_rank", max_tokens_per_rank)
    if mode == "auto":
        ll_max_tokens = AUTO_LL_MAX_TOKENS if ll_max_tokens is None else ll_max_tokens
        _checks.check_positive_int(OP, "ll_max_tokens", ll_max_tokens)
    elif ll_max_tokens is not None:
        raise _checks.fail(OP, "ll_max_tokens", "None unless mode='auto'", ll_max_tokens)
    return ll_max_tokens


def expected_rereads(num_tokens: int, num_experts: int, top_k: int) -> float:
    """Choices per touched expert of a call, expected under uniform routing: T*K over the expected
    distinct experts E * (1 - (1 - K/E)**T). 1.0 when no two choices share an expert."""
    share = min(top_k / num_experts, 1.0)  # (top_k > num_experts: every expert, repeats)
    touched = num_experts * (1.0 - (1.0 - share) ** num_tokens)
    return num_tokens * top_k / touched


def gemv_max_tokens(scheme, num_experts: int, top_k: int) -> int:
    """The most tokens "auto" sends to the per-choice GEMVs on one rank: up to the scheme's
    ``gemv_max_tokens``, while :func:`expected_rereads` stays within GEMV_MAX_REREADS (a call that
    re-reads shared experts' weights per choice goes to the masked GEMM, which reads each once)."""
    n = 0
    while n < scheme.gemv_max_tokens and (
        expected_rereads(n + 1, num_experts, top_k) <= GEMV_MAX_REREADS
    ):
        n += 1
    return n


class StageRecord:
    """The per-stage outputs of the forward passes run inside :meth:`EPMoE.record_stages`.

    Each value is the stage's own result, not a copy, exactly as the next stage consumed it:

    - "quantize", "act": tuple (codes, scales float32 or None), as ``quantize`` /
      ``silu_and_mul(_quant)`` return them (bf16 act: (bf16 `[M_sum, I]` or `[E, C, I]`, None)).
    - "dispatch" / "ll_dispatch": the dispatch op's NamedTuple; "permute": ``PermuteResult``;
      "ll_scatter": tuple (x `[E, C, H]`, scales, masked_m int32 `[E]`, rows int32 `[T, K]`).
    - "gemm1", "gemm2": bf16 `[M_sum, N]` (HT) or `[E, C, N]` (LL); "unpermute", "combine",
      "ll_combine", "ll_gather": bf16 `[T, H]` (HT unpermute: `[M, H]`, M received rows).

    A backend may reuse its receive buffers (DeepEP LL): read the record before the next forward
    pass. ``record[stage]`` is the stage's latest output; ``names`` the stages in the order run.
    """

    def __init__(self, replace: Optional[Dict[str, Callable]] = None):
        self.stages: List[Tuple[str, object]] = []
        self._replace = dict(replace or {})

    def _add(self, stage: str, value):
        fn = self._replace.get(stage)
        if fn is not None:
            value = fn(value)
        self.stages.append((stage, value))
        return value

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(name for name, _ in self.stages)

    def __contains__(self, stage: str) -> bool:
        return any(name == stage for name, _ in self.stages)

    def __getitem__(self, stage: str):
        for name, value in reversed(self.stages):
            if name == stage:
                return value
        raise KeyError(f"StageRecord: stage {stage!r} was not recorded (recorded: {self.names})")

    def __len__(self) -> int:
        return len(self.stages)


class EPMoE(nn.Module):
    """Expert-parallel MoE layer.

    Args:
        num_experts: global expert count Et (a multiple of the group size).
        hidden_size: H. intermediate_size: I. top_k: K.
        quant: "bf16", "fp8" (e4m3, activations 1x128, weights 128x128) or "int8" (per token / per
            output channel).
        gate: the expert MLP's gate, a :class:`epmoe.gate.Gate` or its spec string (default
            "silu": silu(gate) * up).
        bias: whether the experts have biases (b1 `[Et, width]`, b2 `[Et, H]` in load_weights).
        mode: "ht" (prefill, contiguous layout), "ll" (decode, masked layout) or "auto" (one rank:
            GEMVs up to ``gemv_max_tokens`` tokens (see :func:`gemv_max_tokens`) unless this
            GPU's measured paths found LL faster; LL up to ``ll_max_tokens`` tokens, HT above;
            chosen from the shape, so a graph captured at one size stays valid).
        group: torch.distributed process group, or None for one rank.
        backend: "auto", "local", "torch" or "deepep".
        alignment: permute row alignment (HT), default 128 (deep_gemm's row block); on CUDA any
            multiple of :func:`epmoe.ops.gemm.smallest_row_block` (16: our Triton GEMMs run what
            deep_gemm cannot; fewer padding rows).
        max_tokens_per_rank: LL capacity per rank (required for "ll"); in "ht" the worst-case
            receive bound (see ``worst_case``).
        worst_case: HT dispatch with the static worst-case receive size (no host sync, graph-safe).
            With one rank every HT call is static.
        ll_max_tokens: "auto" only: the LL capacity and the largest call that takes LL (default
            AUTO_LL_MAX_TOKENS). With several ranks "auto" sends HT calls with exact dispatch.
        device: where weights live (default: CUDA when available, else CPU).
        **backend_kwargs: passed to the communicator (deepep: num_nvl_bytes, num_sms, ...).
    """

    # the open StageRecord of record_stages(), None otherwise (the forward's only recording cost)
    _stage_record: Optional[StageRecord] = None

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        top_k: int,
        quant: str = "bf16",
        mode: str = "ht",
        group=None,
        backend: str = "auto",
        alignment: Optional[int] = None,
        max_tokens_per_rank: Optional[int] = None,
        worst_case: bool = False,
        device=None,
        ll_max_tokens: Optional[int] = None,
        gate=None,
        bias: bool = False,
        **backend_kwargs,
    ):
        super().__init__()
        ll_max_tokens = _check_config(
            num_experts, hidden_size, intermediate_size, top_k, quant, mode,
            max_tokens_per_rank, ll_max_tokens,
        )  # fmt: skip
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        # the measured paths on this GPU may pick another alignment per call size (not a given one)
        alignment_given = alignment is not None
        if alignment is None:
            alignment = DEFAULT_ALIGNMENT
        _checks.check_positive_int(OP, "alignment", alignment)
        block = smallest_row_block(quant, self.device)
        _checks.check_multiple(OP, "alignment", alignment, block, "(the grouped GEMM row block)")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size, self.top_k = intermediate_size, top_k
        self.scheme, self.mode, self.alignment = _quant.get(quant), mode, alignment
        self.gate, self.bias = _gate.get(gate, OP, "gate"), bool(bias)
        self._gate_spec = self.gate.spec
        # sizes the scheme runs (fp8: multiples of 128): zero weights beyond H / I
        of = self.scheme.size_multiple
        self.hidden_padded = reference.round_up(hidden_size, of)
        self.inter_padded = reference.round_up(intermediate_size, of)
        self._padded = self.hidden_padded != hidden_size
        self.worst_case = bool(worst_case)
        self.max_tokens_per_rank = max_tokens_per_rank
        # the LL capacity per rank: the largest call LL takes
        self.ll_max_tokens = max_tokens_per_rank if mode == "ll" else ll_max_tokens
        self.comm = comm.create(
            backend,
            group,
            num_experts,
            self.hidden_padded,  # (several ranks move padded rows: x is padded on entry)
            max_tokens_per_rank=self.ll_max_tokens if mode == "auto" else max_tokens_per_rank,
            device=self.device,
            **backend_kwargs,
        )
        self.comm_key = self.comm.key
        self.num_local_experts = self.comm.num_local_experts
        # one rank, local backend: no dispatch or combine ops at all
        self.local = self.comm.world_size == 1 and self.comm.name == "local"
        # call size -> (path, alignment, LL expected_m), filled per call: what a call of that size
        # runs, from the shape only
        self._plans: Dict[int, Tuple[str, int, int]] = {}
        self._gemv_max_tokens, self._gemv_set = 0, False
        if mode == "auto" and self.local:
            self._gemv_max_tokens = gemv_max_tokens(self.scheme, num_experts, top_k)
        # "auto" on one rank above the GEMV cutoff: the path and alignment measured fastest on this
        # GPU for each call size (the tuned table, scripts/tune_gemm.py); [] -> the rules above
        # (a given alignment is kept: then the sizes measured fastest on HT follow the rules)
        self._measured: List[Dict] = []
        if mode == "auto" and self.local:
            self._measured = _tuned.paths(
                self.scheme, num_experts, hidden_size, intermediate_size, top_k, device,
                self._gate_spec, self.bias,
            )  # fmt: skip
        self._alignment_given = alignment_given
        # HT / LL may run GEMM1 and the gate as one kernel: only where this GPU's table has
        # measured it
        self._may_fuse, self._may_fuse_ll = (_tuned.has(
            layout, self.scheme, self.inter_padded, self.hidden_padded, self.num_local_experts,
            device, self._gate_spec, self.bias,
        ) for layout in ("gate", "masked_gate"))  # fmt: skip
        # HT's GEMM1 may read its rows of x itself (permute copying none): where measured faster
        self._may_gather = _tuned.has(
            "gather", self.scheme, self.gate.width(self.inter_padded), self.hidden_padded,
            self.num_local_experts, device, self._gate_spec, self.bias,
        )  # fmt: skip
        if mode == "auto" and self.worst_case and not self.local:
            raise _checks.fail(OP, "worst_case", "False with mode='auto' on several ranks", True)
        # masked-layout rows per expert: on one rank a multiple of the masked GEMM's row block
        # (deep_gemm would otherwise copy into a padded buffer on every call)
        self.ll_capacity = 0
        if self.ll_max_tokens:
            self.ll_capacity = (
                reference.round_up(self.ll_max_tokens, masked_row_block(quant, self.device))
                if self.local
                else self.comm.ll_capacity
            )
        for name in _WEIGHTS:
            self.register_buffer(name, None)
        # what the forward pass reads on every call, from the configuration only: kept, not
        # recomputed per call (host time at small T)
        self.quant = self.scheme.name  # (the scheme's name, as the stages take it)
        self._scale_layout = self.scheme.cuda_scale_layout if device.type == "cuda" else "row"
        # one rank pads inside the kernels: the codes' width (x keeps its H columns; several ranks
        # widen x on entry) and the gathers' output columns (H of the padded rows); else None
        self._width = self.hidden_padded if self._padded and self.local else None
        self._hidden = hidden_size if self._padded and self.local else None
        # a GPU whose tuned table lacks this layer's GEMMs runs them untuned: said once
        no_paths = mode == "auto" and self.local and not self._measured
        _tuned.note_untuned(self._sizes(), self.tuning_problems(), device, self._tune_command(),
                            paths_missing=no_paths)  # fmt: skip

    def _sizes(self) -> str:
        """This layer's problem in words (the untuned-table warning's key)."""
        return (f"{self.quant} experts of H {self.hidden_size}, I {self.intermediate_size}, "
                f"{self.num_local_experts} on this GPU, top-{self.top_k}"
                + (f", gate {self._gate_spec}" if not self.gate.is_silu else "")
                + (", biases" if self.bias else ""))  # fmt: skip

    def tuning_problems(self) -> List[Tuple]:
        """The tuned table's problems ((layout, scheme, N, K, E, gate, bias) each) this layer's
        calls look up on a GPU: both GEMMs of each layout its mode runs (HT: contiguous and GEMM1
        + gate; LL: masked and masked GEMM1 + gate) and, where it takes them, the GEMVs."""
        w, h, i = self.gate.width(self.inter_padded), self.hidden_padded, self.inter_padded
        e, q, g = self.num_local_experts, self.quant, (self._gate_spec, self.bias)
        out: List[Tuple] = []
        if self.mode != "ll":
            out += [("contiguous", q, w, h, e, *g), ("contiguous", q, h, i, e, *g),
                    ("gate", q, i, h, e, *g)]  # fmt: skip
        if self.ll_max_tokens:
            out += [("masked", q, w, h, e, *g), ("masked", q, h, i, e, *g),
                    ("masked_gate", q, i, h, e, *g)]  # fmt: skip
        if self._gemv_max_tokens:
            out += [("gemv_up", q, i, h, e, *g), ("gemv_down", q, h, i, e, *g)]
        return out

    def _tune_command(self) -> str:
        """The tuner's command line for this layer's entries (scripts/tune_gemm.py --layer)."""
        return (f"python scripts/tune_gemm.py --layer {self.hidden_size} {self.intermediate_size} "
                f"{self.num_local_experts} {self.top_k}"
                + (f" --gate '{self._gate_spec}'" if not self.gate.is_silu else "")
                + (" --bias" if self.bias else "") + f" --schemes {self.quant}"
                + (" --paths" if self.mode == "auto" and self.local else ""))  # fmt: skip

    def __setattr__(self, name: str, value) -> None:
        # the weights stay buffers (the forward reads the buffer dict), a Parameter assigned too
        if name in _WEIGHTS and isinstance(value, torch.nn.Parameter):
            value = value.detach()
        super().__setattr__(name, value)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts} (local {self.num_local_experts}), H={self.hidden_size}, "
            f"I={self.intermediate_size}, top_k={self.top_k}, quant={self.quant}, "
            + (f"gate={self.gate.spec}, " if not self.gate.is_silu else "")
            + ("bias=True, " if self.bias else "")
            + f"mode={self.mode}, "
            + (f"ll_max_tokens={self.ll_max_tokens}, " if self.mode == "auto" else "")
            + f"backend={self.comm.name}, world={self.world_size}"
        )

    # ------------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_weights(
        self,
        w1: torch.Tensor,
        w2: torch.Tensor,
        copy: bool = True,
        b1: Optional[torch.Tensor] = None,
        b2: Optional[torch.Tensor] = None,
    ) -> None:
        """Keep and quantize this rank's experts, on the layer's device.

        The weights are converted a few hundred rows at a time (LOAD_ROWS), so beyond the final
        weights at most a fraction of one expert's float32 copy is held: all of DeepSeek-V3's 256
        experts load on one GPU. The layer keeps no reference to ``w1`` / ``w2`` and its weights
        never require grad.

        Args:
            w1: float `[Et, 2I, H]` (gate rows, then up rows; `[Et, I, H]` for a gate without a
                gate half). w2: float `[Et, H, I]`. Any device.
            copy: bf16 only: False keeps this rank's slice of w1 / w2 itself when it is already
                bf16, contiguous and on the layer's device (no second copy of the weights; the
                layer then sees later in-place edits). Ignored for fp8 / int8 and padded sizes.
            b1: float `[Et, 2I]` (`[Et, I]`) gate / up bias, b2: float `[Et, H]` down bias; both
                required with ``bias=True``, refused otherwise; kept in their dtype (the kernels
                add them in float32: a bf16 bias is half the bytes each row reads).
        """
        Et, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        width = self.gate.width(I)
        for name, w, shape in (("w1", w1, (Et, width, H)), ("w2", w2, (Et, H, I))):
            _checks.check_dtype("load_weights", name, w, _checks.FLOAT_DTYPES)
            _checks.check_shape("load_weights", name, w, shape)
        for name, b, shape in (("b1", b1, (Et, width)), ("b2", b2, (Et, H))):
            if not self.bias:
                if b is not None:
                    raise _checks.fail("load_weights", name, "None (the layer has bias=False)", b)
                continue
            if b is None:
                raise _checks.fail("load_weights", name, f"a tensor {list(shape)}", None)
            _checks.check_dtype("load_weights", name, b, _checks.FLOAT_DTYPES)
            _checks.check_shape("load_weights", name, b, shape)
        lo, hi = self.comm.expert_range
        Hp, Ip, halves = self.hidden_padded, self.inter_padded, self.gate.width(1)
        pads = dict(w1=(halves, I, Ip, Hp), w2=(1, H, Hp, Ip), b1=(halves, I, Ip), b2=(1, H, Hp))
        for name, w in (("w1", w1), ("w2", w2)):
            w = reference.pad_experts(w.detach()[lo:hi], *pads[name])
            q, s = self._convert(w, copy and not self._padded_any)
            q, s = gemm.prepare_weights(q, s, self.quant, self.device)
            setattr(self, name, q)
            setattr(self, name + "_scale", s)
        for name, b in (("b1", b1), ("b2", b2)):
            if b is not None:
                b = reference.pad_experts(b.detach()[lo:hi, :, None], *pads[name], 1)[..., 0]
                b = b.to(device=self.device, memory_format=torch.contiguous_format, copy=True)
                setattr(self, name, b)

    @property
    def _padded_any(self) -> bool:
        return (self.hidden_padded, self.inter_padded) != (self.hidden_size, self.intermediate_size)

    def _convert(self, w: torch.Tensor, copy: bool):
        """This rank's experts w float `[E, N, Kd]` -> (weights, scales) on the layer's device."""
        E, N, Kd = w.shape
        if not self.scheme.quantized:
            in_place = w.dtype == torch.bfloat16 and w.device == self.device and w.is_contiguous()
            if not copy and in_place:
                return w, None
            out = torch.empty((E, N, Kd), dtype=torch.bfloat16, device=self.device)
            out.copy_(w)  # (a fresh tensor even when w is one already: never an alias)
            return out, None
        # N and Kd are multiples of the weight block (checked in init); whole row blocks at a time
        blk = self.scheme.weight_block[0]
        rows = math.gcd(N, LOAD_ROWS) if blk > 1 else LOAD_ROWS
        shape = self.scheme.weight_scale_shape(E, N, Kd)
        s = torch.empty(shape, dtype=torch.float32, device=self.device)
        q = torch.empty((E, N, Kd), dtype=self.scheme.act_dtype, device=self.device)
        for e in range(E):
            for r in range(0, N, rows):
                qc, sc = reference.quantize_weights(
                    w[e : e + 1, r : r + rows].to(self.device), self.quant
                )
                q[e, r : r + rows] = qc[0]
                s[e, r // blk : r // blk + sc.shape[1]] = sc[0]
        return q, s

    # ------------------------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """x bf16 `[T, H]`, topk_ids int64 `[T, K]` global ids or -1, topk_weights float32 `[T, K]`
        -> bf16 `[T, H]`."""
        args = (x, topk_ids, topk_weights, self.hidden_size, self.top_k, self.device)
        # checked once here: on the direct path the stages run without their own checks
        chained = self._trusts_stages()
        direct = _eager.calm() and FORWARD.direct(*args) and chained
        if not direct:
            FORWARD.check(*args)
            _checks.check_no_grad(OP, x=x, topk_weights=topk_weights)
        if self._buffers["w1"] is None:  # (buffers read from the dict: no Module.__getattr__)
            raise RuntimeError("EPMoE: call load_weights(w1, w2) before the forward pass")
        if not direct:
            return self._forward(_CHAINED if chained else _PUBLIC, x, topk_ids, topk_weights)
        with _eager.no_wrap(), _eager.on_device(x):  # kernels launch directly, on x's device
            return self._forward(_TRUSTED, x, topk_ids, topk_weights)

    def _forward(self, st, x, topk_ids, topk_weights):
        if self._padded and not self.local:  # several ranks move rows of the padded width
            x = reference.widen(x, self.hidden_padded)
            out = self._route(st, x, topk_ids, topk_weights)
            return out[:, : self.hidden_size].contiguous()
        return self._route(st, x, topk_ids, topk_weights)

    def _route(self, st, x, topk_ids, topk_weights):
        T = x.shape[0]
        if torch.compiler.is_compiling():  # (a dict written in a traced frame guards the graph)
            path, alignment, em = self._plan_of(T)  # (T may be symbolic: computed)
        else:
            plan = self._plans.get(T)
            if plan is None:
                plan = self._plans[T] = self._plan_of(T)
            path, alignment, em = plan
        if path == "gemv":
            return self._forward_gemv(st, x, topk_ids, topk_weights)
        if path == "ll":
            return self._forward_ll(st, x, topk_ids, topk_weights, em)
        return self._forward_ht(st, x, topk_ids, topk_weights, alignment)

    def _plan_of(self, num_tokens) -> Tuple[str, int, int]:
        """:meth:`plan`, and the LL path's expected rows per expert (0 on the other paths)."""
        path, alignment = self.plan(num_tokens)
        return path, alignment, self.expected_m(num_tokens) if path == "ll" else 0

    def _trusts_stages(self) -> bool:
        """A stage may take the previous stage's output unchecked: no record_stages(replace=...)
        hook stands between them."""
        rec = self._stage_record
        return rec is None or not rec._replace

    def uses_ll(self, num_tokens) -> bool:
        """Whether a call of ``num_tokens`` tokens takes the LL (masked) path: mode "ll", or "auto"
        with at most ``ll_max_tokens`` tokens where this GPU's measured path says LL (or has none
        for the size): a function of the shape only."""
        if self.mode != "auto":
            return self.mode == "ll"
        if num_tokens > self.ll_max_tokens:
            return False
        measured = self._measured_path(num_tokens)
        return measured is None or measured["path"] != "ht"  # (a "gemv" entry, GEMVs not taken)

    def _measured_path(self, num_tokens) -> Optional[Dict]:
        """The tuned path entry of a call size (the smallest measured size >= it), or None: none
        measured, or an HT entry while the alignment was given."""
        p = next((p for p in self._measured if num_tokens <= p["t"]), None)
        return None if p is not None and p["path"] == "ht" and self._alignment_given else p

    @property
    def gemv_max_tokens(self) -> int:
        """ "auto" on one rank: GEMVs up to this many tokens (0 with several ranks or another mode)
        where this GPU's measured paths do not say the masked GEMMs win; settable, e.g. to compare
        paths: a set value is followed as it is, measured paths or not."""
        return self._gemv_max_tokens

    @gemv_max_tokens.setter
    def gemv_max_tokens(self, value: int) -> None:
        self._gemv_max_tokens, self._gemv_set = int(value), True
        self._plans.clear()

    def plan(self, num_tokens) -> Tuple[str, int]:
        """(path, permute alignment) of a call of ``num_tokens`` tokens: "gemv", "ll" or "ht",
        and the alignment the HT path permutes to (the layer's, or this GPU's measured one)."""
        if self.uses_gemv(num_tokens):
            return "gemv", self.alignment
        if self.uses_ll(num_tokens):
            return "ll", self.alignment
        measured = self._measured_path(num_tokens) if self.mode == "auto" else None
        return "ht", measured["alignment"] if measured is not None else self.alignment

    def uses_gemv(self, num_tokens) -> bool:
        """Whether a call of ``num_tokens`` tokens runs the per-choice GEMVs: mode "auto" on one
        rank (local backend) with at most ``gemv_max_tokens`` tokens (from the shape), unless a
        measured path that timed the GEMVs at a size <= the call's found the masked GEMMs faster
        (their weight reads grow with the experts a call touches, the GEMVs' with its choices)."""
        if not (self.gemv_max_tokens > 0 and num_tokens <= self.gemv_max_tokens):
            return False
        return self._gemv_set or not any(
            p["path"] != "gemv" and "gemv" in p.get("us", ()) and p["t"] <= num_tokens
            for p in self._measured
        )

    def path(self, num_tokens) -> str:
        """The path a call of ``num_tokens`` tokens takes: "gemv", "ll" or "ht"."""
        return self.plan(num_tokens)[0]

    @contextlib.contextmanager
    def record_stages(self, replace: Optional[Dict[str, Callable]] = None):
        """Record every stage's output of the eager forward passes run inside the block.

        ``with layer.record_stages() as rec: out = layer(x, ids, w)``; then ``rec["permute"]``
        is permute's result (see :class:`StageRecord` for each stage's value). Nothing is recorded
        while torch.compile traces the layer (the compiled graph is the same with or without a
        record), nor outside the block.

        Args:
            replace: stage name -> function of the stage's output returning the value the next
                stage consumes instead (and that is recorded): a selftest hook that shows a check
                catches a wrong stage. Eager only.
        Yields:
            StageRecord.
        """
        for stage in replace or {}:
            _checks.check_choice("record_stages", "replace", stage, STAGES)
        if self._stage_record is not None:
            raise RuntimeError("EPMoE.record_stages: already recording (blocks do not nest)")
        rec = StageRecord(replace)
        self._stage_record = rec
        try:
            yield rec
        finally:
            self._stage_record = None

    def _emit(self, stage: str, value):
        """A stage's output on its way to the next stage: recorded inside record_stages(), else
        returned as is (one attribute read; skipped while compiling, so no graph change)."""
        rec = self._stage_record
        if rec is None or torch.compiler.is_compiling():
            return value
        return rec._add(stage, value)

    def _act(self, st, y, masked_m=None, m_indices=None, expert_offsets=None):
        # expert_offsets: the kernels skip the unused tail of the static M_sum bound
        gate, bias = self._gate_spec, self._buffers["b1"]
        if not self.scheme.quantized:
            h = st.silu_and_mul(y, masked_m, m_indices, expert_offsets, gate=gate, bias=bias)
            return h, None
        # fp8 scales in deep_gemm's layout (MN-major, TMA-aligned): no transpose before GEMM2
        return st.silu_and_mul_quant(
            y,
            self.quant,
            masked_m=masked_m,
            m_indices=m_indices,
            scale_layout=self._scale_layout,
            expert_offsets=expert_offsets,
            gate=gate,
            bias=bias,
        )

    def _forward_ht(self, st, x, topk_ids, topk_weights, alignment=None):
        """``st``: the stage functions, _TRUSTED or _PUBLIC (see forward); ``alignment``: the
        permute alignment of this call size (None: the layer's)."""
        alignment = alignment or self.alignment
        scales = None
        if self.scheme.quantized:
            x, scales = self._emit("quantize", st.quantize(x, self.quant, width=self._width))
        if self.local:  # one rank: permute reads the caller's tensors, unpermute's output is out
            return self._experts_ht(st, x, scales, topk_ids, topk_weights, alignment)
        worst = self.worst_case and self.mode == "ht"
        d = self._emit(
            "dispatch", st.ht_dispatch(x, topk_ids, topk_weights, self.comm_key, scales, worst)
        )
        y = self._experts_ht(st, d.x, d.x_scales, d.topk_ids, d.topk_weights, alignment)
        return self._emit("combine", st.ht_combine(y, d.handle, self.comm_key))

    def _experts_ht(self, st, x, scales, topk_ids, topk_weights, alignment):
        """permute -> GEMM1 -> activation -> GEMM2 -> unpermute on rows with local ids."""
        E = self.num_local_experts
        gather = self._may_gather and gathers(
            self.scheme, self.device, self.gate.width(self.inter_padded), self.hidden_padded, E,
            alignment, reference.permuted_rows(*topk_ids.shape, E, alignment), self._gate_spec,
            self.bias,
        )  # fmt: skip
        # gathering: permute makes the index outputs only; GEMM1 reads x's rows through src_rows
        p = st.permute(
            x[:, :0] if gather else x,
            topk_ids,
            E,
            alignment,
            None if gather else scales,
            scale_layout=self._scale_layout,
        )
        p, b = self._emit("permute", p), self._buffers
        a, a_s, a_rows = (x, scales, p.src_rows) if gather else (p.x, p.x_scales, None)
        # (rows: permute writes only -1 or [0, E); padding rows and the unused tail are skipped)
        rows, offsets, mm = p.m_indices, p.expert_offsets, st.grouped_gemm_contiguous
        if self._may_fuse and fuses_gate(
            self.scheme, self.device, self.inter_padded, self.hidden_padded, E, alignment,
            rows.shape[0], self._gate_spec, self.bias,
        ):  # fmt: skip
            # (this GPU measured GEMM1 and the gate faster as one kernel at this size)
            h, hs = st.grouped_gemm_gate(
                a, b["w1"], rows, a_s, b["w1_scale"], self._gate_spec, b["b1"],
                scale_layout=self._scale_layout, alignment=alignment, trusted=True, a_rows=a_rows,
            )  # fmt: skip
            h, hs = self._emit("act", (h, hs if self.scheme.quantized else None))
        else:
            y = mm(a, b["w1"], rows, a_s, b["w1_scale"], offsets, True, alignment, a_rows)
            y = self._emit("gemm1", y)
            h, hs = self._emit("act", self._act(st, y, None, rows, offsets))
        y = mm(h, b["w2"], rows, hs, b["w2_scale"], offsets, True, alignment)
        y = self._emit("gemm2", y)
        b2 = b["b2"]
        out = st.unpermute(
            y, p.inv_perm, topk_weights, bias=b2, m_indices=None if b2 is None else p.m_indices,
            hidden=self._hidden,
        )  # fmt: skip
        return self._emit("unpermute", out)

    @torch.no_grad()
    def warmup(self, token_counts=None) -> None:
        """Compile every GEMM kernel this layer launches (deep_gemm JIT, Triton autotune) for the
        given per-rank token counts, so nothing compiles later inside CUDA-graph capture. No-op on
        CPU.

        Args:
            token_counts: per-rank batch sizes that will run (default: max_tokens_per_rank).
        """
        if self.device.type != "cuda" or self.w1 is None:
            return
        default = self.ll_max_tokens if self.mode != "ht" else self.max_tokens_per_rank
        counts = sorted(set(token_counts or [default or 1]), reverse=True)
        plans = {t: self.plan(t) for t in counts}
        ll = sorted({self.expected_m(t) for t in counts if plans[t][0] == "ll"})
        # HT sizes by alignment, largest first: the largest drives INT8 autotuning
        ht: Dict[int, List[int]] = {}
        for t in counts:
            if plans[t][0] == "ht":
                ht.setdefault(plans[t][1], []).append(t)
        E, H, I = self.num_local_experts, self.hidden_padded, self.inter_padded
        for gemm1, (w, s), (n, k) in (
            (True, (self.w1, self.w1_scale), (self.gate.width(I), H)),
            (False, (self.w2, self.w2_scale), (H, I)),
        ):
            # (GEMM1 as the forward pass runs it: fused with the gate where measured faster)
            gate = dict(gate=self._gate_spec, bias=self.b1) if gemm1 else {}
            for alignment, sizes in ht.items():
                cap = self.max_tokens_per_rank if self.worst_case and not self.local else None
                rows = [self.world_size * (cap or t) for t in sizes]
                m = [reference.permuted_rows(r, self.top_k, E, alignment) for r in rows]
                gemm.warmup(
                    self.quant, E, n, k, self.device, contiguous_m=m, w=w, w_scales=s,
                    alignment=alignment, **gate,
                )  # fmt: skip
            for em in ll:  # (LL sizes by their expected rows per expert)
                gemm.warmup(
                    self.quant, E, n, k, self.device, masked_t=self.ll_capacity, expected_m=em,
                    w=w, w_scales=s, **gate,
                )  # fmt: skip

    def expected_m(self, num_tokens: Optional[int] = None) -> int:
        """Static hint of rows per local expert in an LL call of ``num_tokens`` tokens per rank
        (default: the capacity) under uniform routing: the masked GEMMs size their tiles (and
        pick their backend) by it, so a T = 32 call is not tiled for the capacity's rows."""
        t = self.ll_max_tokens if num_tokens is None else min(num_tokens, self.ll_max_tokens)
        return max(1, -(-(self.world_size * t * self.top_k) // self.num_experts))

    def _forward_ll(self, st, x, topk_ids, topk_weights, em):
        """``em``: the masked GEMMs' expected rows per expert at this call size."""
        # (the communicator's LL capacity is ll_max_tokens: checked here for the trusted chain)
        if x.shape[0] > self.ll_max_tokens:
            raise _checks.fail(
                "ll_dispatch",
                "x",
                f"at most max_tokens_per_rank={self.ll_max_tokens} tokens",
                x.shape[0],
            )
        if self.local:  # one rank: one scatter kernel (quantization fused), one gather kernel
            scattered = st.ll_scatter(
                x,
                topk_ids,
                self.num_local_experts,
                self.ll_capacity,
                self.quant,
                scale_layout=self._scale_layout,
                width=self._width,
            )
            a, s, masked_m, rows = self._emit("ll_scatter", scattered)
            y = self._experts_ll(st, a, s if self.scheme.quantized else None, masked_m, em)
            b2 = self._buffers["b2"]
            out = st.ll_gather(y, rows, topk_weights, bias=b2, hidden=self._hidden)
            return self._emit("ll_gather", out)
        codes = self.scheme.dispatch_codes  # (fp8: DeepEP sends the codes and their scales)
        d = st.ll_dispatch(x, topk_ids, self.comm_key, use_fp8=codes)
        d = self._emit("ll_dispatch", d)
        a, s = d.x, d.x_scales
        if self.scheme.quantized and not codes:
            a, s = self._emit("quantize", st.quantize(a, self.quant, masked_m=d.masked_m))
        y = self._experts_ll(st, a, s, d.masked_m, em)
        if self._buffers["b2"] is not None:  # (the backends' weighted combine takes no bias)
            y = (y.float() + self._buffers["b2"][:, None, :]).to(y.dtype)
        out = st.ll_combine(y, topk_ids, topk_weights, d.handle, self.comm_key)
        return self._emit("ll_combine", out)

    def _forward_gemv(self, st, x, topk_ids, topk_weights):
        """One rank, a few tokens: gate/up GEMVs + SiLU, then down GEMVs + the weighted sum."""
        b = self._buffers
        h = st.gemv_gate_up(x, topk_ids, b["w1"], b["w1_scale"], gate=self._gate_spec, bias=b["b1"])
        h = self._emit("gemv_gate_up", h)
        out = st.gemv_down(
            h, topk_ids, topk_weights, b["w2"], b["w2_scale"], bias=b["b2"], hidden=self._hidden
        )
        return self._emit("gemv_down", out)

    def _experts_ll(self, st, a, s, masked_m, expected_m):
        """Masked GEMM1 -> activation -> masked GEMM2 on the `[E, C, *]` layout."""
        # (the counts come from a dispatch that clamps them to the capacity)
        kw = dict(masked_m=masked_m, expected_m=expected_m, trusted=True)
        mm, b = st.grouped_gemm_masked, self._buffers
        E, T = a.shape[:2]
        if self._may_fuse_ll and fuses_masked_gate(
            self.scheme, self.device, self.inter_padded, self.hidden_padded, E, T, expected_m,
            self._gate_spec, self.bias,
        ):  # fmt: skip
            # (this GPU measured GEMM1 and the gate faster as one kernel at this size)
            h, hs = st.grouped_gemm_masked_gate(
                a, b["w1"], masked_m, s, b["w1_scale"], self._gate_spec, b["b1"],
                self._scale_layout, expected_m, True,
            )  # fmt: skip
            h, hs = self._emit("act", (h, hs if self.scheme.quantized else None))
        else:
            y = mm(a, b["w1"], a_scales=s, w_scales=b["w1_scale"], **kw)
            y = self._emit("gemm1", y)
            h, hs = self._emit("act", self._act(st, y, masked_m))
        y = mm(h, b["w2"], a_scales=hs, w_scales=b["w2_scale"], **kw)
        return self._emit("gemm2", y)
