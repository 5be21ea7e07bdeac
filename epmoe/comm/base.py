"""The communicator interface every dispatch/combine backend implements.

Shape legend: ``T`` tokens on this rank, ``K`` top-k, ``H`` hidden, ``S`` scale columns, ``P`` world
size, ``E`` local experts, ``Et`` global experts (P*E), ``N`` received rows, ``C`` = P *
max_tokens_per_rank.

HT dispatch (N = world * ht_capacity(T) in the worst case) returns the list [recv_x `[N, H]`,
recv_scales `[N, S]` (S = 0 without scales),
recv_topk_ids int64 `[N, K]` (local ids, -1 for experts elsewhere and on padding rows),
recv_topk_weights float32 `[N, K]`, expert_counts int32 `[E]`, *handle]; the handle is tensors only
and handle[0] is is_token_in_rank bool `[T, P]` (its shape gives T to combine's fake). HT combine
sums rows home, unweighted.

LL dispatch returns [recv_x `[E, C, H]`, recv_scales `[E, C, H/128]` (`[E, C, 0]` unless fp8),
masked_m int32 `[E]`, *handle]; LL combine applies topk_weights at the source and returns `[T, H]`.
"""

from typing import List, Optional

import torch

from epmoe import _checks


class Communicator:
    """Static description of one expert-parallel group plus its dispatch/combine implementation."""

    name = "base"

    def __init__(
        self,
        rank: int,
        world_size: int,
        num_experts: int,
        hidden_size: int,
        max_tokens_per_rank: Optional[int] = None,
    ):
        if num_experts % world_size != 0:
            raise _checks.fail(
                "EPMoE", "num_experts", f"a multiple of the world size {world_size}", num_experts
            )
        self.rank = rank
        self.world_size = world_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // world_size
        self.hidden_size = hidden_size
        self.max_tokens_per_rank = max_tokens_per_rank
        self.key = 0  # set by the registry

    # Each rank keeps experts [rank * E, (rank + 1) * E).
    @property
    def expert_range(self):
        e = self.num_local_experts
        return self.rank * e, (self.rank + 1) * e

    def ht_capacity(self, num_tokens):
        """Slots each rank reserves per peer in worst-case HT dispatch (N = world * capacity).

        max_tokens_per_rank when set (ranks may then hold different T <= it), else T itself, in
        which case every rank must pass the same T (the static-shape contract of a captured
        prefill)."""
        if self.max_tokens_per_rank:
            if isinstance(num_tokens, int) and num_tokens > self.max_tokens_per_rank:
                raise _checks.fail(
                    "dispatch",
                    "x",
                    f"at most max_tokens_per_rank={self.max_tokens_per_rank} "
                    "tokens for worst-case dispatch",
                    num_tokens,
                )
            return self.max_tokens_per_rank
        return num_tokens

    @property
    def ll_capacity(self) -> int:
        return self.world_size * int(self.max_tokens_per_rank or 0)

    def ht_dispatch(
        self, x, topk_ids, topk_weights, x_scales, worst_case: bool
    ) -> List[torch.Tensor]:
        raise NotImplementedError

    def ht_dispatch_fake(self, x, topk_ids, topk_weights, x_scales, worst_case: bool):
        raise NotImplementedError

    def ht_combine(self, y, handle: List[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def ll_dispatch(self, x, topk_ids, x_scales, use_fp8: bool) -> List[torch.Tensor]:
        raise NotImplementedError

    def ll_dispatch_fake(self, x, topk_ids, x_scales, use_fp8: bool):
        raise NotImplementedError

    def ll_combine(self, y, topk_ids, topk_weights, handle: List[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def ll_combine_out(self, out, y, topk_ids, topk_weights, handle: List[torch.Tensor]) -> None:
        """ll_combine into a preallocated bf16 `[T, H]` ``out``; backends that can write in place
        (deep_ep) override this."""
        out.copy_(self.ll_combine(y, topk_ids, topk_weights, handle))

    def close(self) -> None:
        pass
