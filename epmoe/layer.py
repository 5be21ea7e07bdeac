"""EPMoE: the expert-parallel MoE layer, chaining the stage ops for both modes.

HT (prefill): quantize -> ht_dispatch -> permute -> grouped_gemm (gate+up) -> silu_and_mul(_quant)
-> grouped_gemm (down) -> unpermute -> ht_combine.
LL (decode): ll_dispatch -> [quantize] -> masked grouped_gemm -> silu_and_mul(_quant) -> masked
grouped_gemm -> ll_combine.

Shapes: x bf16 `[T, H]`, topk_ids int64 `[T, K]` GLOBAL expert ids or -1, topk_weights float32 `[T,
K]` -> bf16 `[T, H]`. Weights are loaded global (w1 `[Et, 2I, H]` gate rows first, w2 `[Et, H, I]`);
each rank keeps experts [rank*E, (rank+1)*E) and quantizes them once.
"""

from typing import Optional

import torch
from torch import nn

from epmoe import _checks, comm, reference
from epmoe.ops import (
    gemm,
    grouped_gemm,
    ht_combine,
    ht_dispatch,
    ll_combine,
    ll_dispatch,
    permute,
    quantize,
    silu_and_mul,
    silu_and_mul_quant,
    unpermute,
)
from epmoe.ops.gemm import contiguous_row_block

OP = "EPMoE"
DEFAULT_ALIGNMENT = 128  # deep_gemm's contiguous-layout M tile; CPU accepts any positive int


class EPMoE(nn.Module):
    """Expert-parallel MoE layer.

    Args:
        num_experts: global expert count Et (a multiple of the group size).
        hidden_size: H. intermediate_size: I. top_k: K.
        quant: "bf16", "fp8" (e4m3, activations 1x128, weights 128x128) or "int8" (per token / per
            output channel).
        mode: "ht" (prefill, contiguous layout) or "ll" (decode, masked layout).
        group: torch.distributed process group, or None for one rank.
        backend: "auto", "local", "torch" or "deepep".
        alignment: permute row alignment (HT); a multiple of the GEMM backend's row block (128 on
        CUDA).
        max_tokens_per_rank: LL capacity per rank (required for LL).
        worst_case: HT dispatch with the static worst-case receive size (no host sync, graph-safe).
        device: where weights live (default: CUDA when available, else CPU).
        **backend_kwargs: passed to the communicator (deepep: num_nvl_bytes, num_sms, ...).
    """

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
        **backend_kwargs,
    ):
        super().__init__()
        for name, v in (
            ("num_experts", num_experts),
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
            ("top_k", top_k),
        ):
            _checks.check_positive_int(OP, name, v)
        _checks.check_choice(OP, "quant", quant, reference.QUANT_SCHEMES)
        _checks.check_choice(OP, "mode", mode, ("ht", "ll"))
        if quant == "fp8":
            _checks.check_multiple(
                OP, "hidden_size", hidden_size, 128, "for fp8 (128-channel groups)"
            )
            _checks.check_multiple(
                OP, "intermediate_size", intermediate_size, 128, "for fp8 (128-channel groups)"
            )
        if mode == "ll":
            _checks.check_positive_int(OP, "max_tokens_per_rank", max_tokens_per_rank)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        if alignment is None:
            alignment = DEFAULT_ALIGNMENT
        _checks.check_positive_int(OP, "alignment", alignment)
        block = contiguous_row_block(quant, self.device)
        _checks.check_multiple(OP, "alignment", alignment, block, "(the grouped GEMM row block)")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size, self.top_k = intermediate_size, top_k
        self.quant, self.mode, self.alignment = quant, mode, alignment
        self.worst_case = bool(worst_case)
        self.max_tokens_per_rank = max_tokens_per_rank
        self.comm = comm.create(
            backend,
            group,
            num_experts,
            hidden_size,
            max_tokens_per_rank=max_tokens_per_rank,
            device=self.device,
            **backend_kwargs,
        )
        self.comm_key = self.comm.key
        self.num_local_experts = self.comm.num_local_experts
        self.register_buffer("w1", None)
        self.register_buffer("w1_scale", None)
        self.register_buffer("w2", None)
        self.register_buffer("w2_scale", None)

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
            f"mode={self.mode}, "
            f"backend={self.comm.name}, world={self.world_size}"
        )

    # ------------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_weights(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Keep and quantize this rank's experts.

        Args:
            w1: float `[Et, 2I, H]` (gate rows, then up rows). w2: float `[Et, H, I]`.
        """
        Et, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        _checks.check_dtype("load_weights", "w1", w1, _checks.FLOAT_DTYPES)
        _checks.check_dtype("load_weights", "w2", w2, _checks.FLOAT_DTYPES)
        _checks.check_shape("load_weights", "w1", w1, (Et, 2 * I, H))
        _checks.check_shape("load_weights", "w2", w2, (Et, H, I))
        lo, hi = self.comm.expert_range
        for name, w in (("w1", w1), ("w2", w2)):
            q, s = reference.quantize_weights(w[lo:hi].to(self.device), self.quant)
            q, s = gemm.prepare_weights(q, s, self.quant, self.device)
            setattr(self, name, q)
            setattr(self, name + "_scale", s)

    # ------------------------------------------------------------------------------------ forward
    def _validate(self, x, topk_ids, topk_weights) -> None:
        _checks.check_dtype(OP, "x", x, (torch.bfloat16,))
        _checks.check_shape(OP, "x", x, (None, self.hidden_size))
        _checks.check_dtype(OP, "topk_ids", topk_ids, (torch.int64,))
        _checks.check_shape(OP, "topk_ids", topk_ids, (x.shape[0], self.top_k))
        _checks.check_dtype(OP, "topk_weights", topk_weights, (torch.float32,))
        _checks.check_shape(OP, "topk_weights", topk_weights, (x.shape[0], self.top_k))
        if x.device != self.device:
            raise _checks.fail(OP, "x", f"device {self.device} (the layer's)", x.device)
        _checks.check_device(OP, "topk_ids", topk_ids, x)
        _checks.check_device(OP, "topk_weights", topk_weights, x)
        if self.w1 is None:
            raise RuntimeError("EPMoE: call load_weights(w1, w2) before the forward pass")

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """x bf16 `[T, H]`, topk_ids int64 `[T, K]` global ids or -1, topk_weights float32 `[T, K]`
        -> bf16 `[T, H]`."""
        self._validate(x, topk_ids, topk_weights)
        if self.mode == "ht":
            return self._forward_ht(x, topk_ids, topk_weights)
        return self._forward_ll(x, topk_ids, topk_weights)

    def _act(self, y, masked_m=None, m_indices=None, expert_offsets=None):
        # expert_offsets: the kernels skip the unused tail of the static M_sum bound
        if self.quant == "bf16":
            return silu_and_mul(y, masked_m, m_indices, expert_offsets), None
        # fp8 scales in deep_gemm's layout (MN-major, TMA-aligned): no transpose before GEMM2
        return silu_and_mul_quant(
            y,
            self.quant,
            masked_m=masked_m,
            m_indices=m_indices,
            scale_layout=self._scale_layout(),
            expert_offsets=expert_offsets,
        )

    def _scale_layout(self) -> str:
        return "deepgemm" if self.quant == "fp8" and self.device.type == "cuda" else "row"

    def _forward_ht(self, x, topk_ids, topk_weights):
        scales = None
        if self.quant != "bf16":
            x, scales = quantize(x, self.quant)
        d = ht_dispatch(x, topk_ids, topk_weights, self.comm_key, scales, self.worst_case)
        p = permute(
            d.x,
            d.topk_ids,
            self.num_local_experts,
            self.alignment,
            d.x_scales,
            scale_layout=self._scale_layout(),
        )
        y = grouped_gemm(
            p.x,
            self.w1,
            m_indices=p.m_indices,
            a_scales=p.x_scales,
            w_scales=self.w1_scale,
            expert_offsets=p.expert_offsets,
        )
        # padding rows and the unused tail are skipped
        h, hs = self._act(y, m_indices=p.m_indices, expert_offsets=p.expert_offsets)
        y = grouped_gemm(
            h,
            self.w2,
            m_indices=p.m_indices,
            a_scales=hs,
            w_scales=self.w2_scale,
            expert_offsets=p.expert_offsets,
        )
        y = unpermute(y, p.inv_perm, d.topk_weights)
        return ht_combine(y, d.handle, self.comm_key)

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
        counts = sorted(set(token_counts or [self.max_tokens_per_rank or 1]), reverse=True)
        E, H, I = self.num_local_experts, self.hidden_size, self.intermediate_size
        for (w, s), (n, k) in (
            ((self.w1, self.w1_scale), (2 * I, H)),
            ((self.w2, self.w2_scale), (H, I)),
        ):
            if self.mode == "ht":  # largest first: it drives INT8 autotuning
                rows = [
                    self.world_size
                    * (
                        self.max_tokens_per_rank
                        if self.worst_case and self.max_tokens_per_rank
                        else t
                    )
                    for t in counts
                ]
                m = [reference.permuted_rows(r, self.top_k, E, self.alignment) for r in rows]
                gemm.warmup(self.quant, E, n, k, self.device, contiguous_m=m, w=w, w_scales=s)
            else:
                gemm.warmup(
                    self.quant,
                    E,
                    n,
                    k,
                    self.device,
                    masked_t=self.comm.ll_capacity,
                    expected_m=self.expected_m(),
                    w=w,
                    w_scales=s,
                )

    def expected_m(self) -> int:
        """Static hint of rows per local expert in LL (uniform routing at full capacity)."""
        rows = self.world_size * self.max_tokens_per_rank * self.top_k
        return max(1, -(-rows // self.num_experts))

    def _forward_ll(self, x, topk_ids, topk_weights):
        d = ll_dispatch(x, topk_ids, self.comm_key, use_fp8=self.quant == "fp8")
        a, s = d.x, d.x_scales
        if self.quant == "int8":
            a, s = quantize(a, "int8", masked_m=d.masked_m)
        em = self.expected_m()
        y = grouped_gemm(
            a, self.w1, masked_m=d.masked_m, a_scales=s, w_scales=self.w1_scale, expected_m=em
        )
        h, hs = self._act(y, d.masked_m)
        y = grouped_gemm(
            h, self.w2, masked_m=d.masked_m, a_scales=hs, w_scales=self.w2_scale, expected_m=em
        )
        return ll_combine(y, topk_ids, topk_weights, d.handle, self.comm_key)
