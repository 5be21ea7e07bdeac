"""The one-rank backend ("local"): no collective at all.

LL dispatch is the ll_scatter kernel on the caller's tokens (one kernel, fp8 quantization fused;
handle = [rows int32 `[T, K]`, e*C + slot of each (t, k) or -1]) and LL combine is the ll_gather
kernel with the weights (one kernel), so the layout is the one ``base`` documents with C =
max_tokens_per_rank. HT dispatch / combine are :class:`epmoe.comm.torch_dist.TorchComm`'s for a
group of one (copies of the inputs, N = T, or the static worst-case N; the layer itself skips them
on one rank).
"""

import torch

from epmoe import _checks
from epmoe.comm._masked import gather, scatter
from epmoe.comm.base import Communicator
from epmoe.comm.torch_dist import TorchComm


class LocalComm(Communicator):
    name = "local"

    def __init__(self, num_experts, hidden_size, max_tokens_per_rank=None):
        super().__init__(0, 1, num_experts, hidden_size, max_tokens_per_rank)
        self._ht = TorchComm(None, num_experts, hidden_size, max_tokens_per_rank)

    # ------------------------------------------------------------------------------------------ HT
    def ht_dispatch(self, x, topk_ids, topk_weights, x_scales, worst_case):
        return self._ht.ht_dispatch(x, topk_ids, topk_weights, x_scales, worst_case)

    def ht_dispatch_fake(self, x, topk_ids, topk_weights, x_scales, worst_case):
        return self._ht.ht_dispatch_fake(x, topk_ids, topk_weights, x_scales, worst_case)

    def ht_combine(self, y, handle):
        return self._ht.ht_combine(y, handle)

    # ------------------------------------------------------------------------------------------ LL
    def ll_dispatch(self, x, topk_ids, x_scales, use_fp8):
        if x_scales is not None:
            raise _checks.fail("ll_dispatch", "x_scales", "None (LL quantizes itself)", "a tensor")
        quant = "fp8" if use_fp8 else "bf16"
        return list(scatter(x, topk_ids, self.num_local_experts, self.ll_capacity, quant))

    def ll_dispatch_fake(self, x, topk_ids, x_scales, use_fp8):
        E, C, H = self.num_local_experts, self.ll_capacity, x.shape[1]
        return [
            x.new_empty((E, C, H), dtype=torch.float8_e4m3fn if use_fp8 else x.dtype),
            x.new_empty((E, C, H // 128 if use_fp8 else 0), dtype=torch.float32),
            x.new_empty((E,), dtype=torch.int32),
            x.new_empty(tuple(topk_ids.shape), dtype=torch.int32),
        ]

    def ll_combine(self, y, topk_ids, topk_weights, handle):
        return gather(y, handle[0], topk_weights)

    def ll_combine_out(self, out, y, topk_ids, topk_weights, handle):
        gather(y, handle[0], topk_weights, out=out)
