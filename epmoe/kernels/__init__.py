"""Triton kernels and tiny host helpers that several stages (and the communication backends)
share: one floor below ``epmoe.comm`` and ``epmoe.ops``, above the base modules.

- :mod:`epmoe.kernels.gather`: the weighted top-K gather (unpermute, ll_gather) with its row check.
- :mod:`epmoe.kernels.scatter`: the masked-layout (LL) scatter (ll_scatter, the torch backend's
  bucketing of rows per peer).
- :mod:`epmoe.kernels.ids`: the topk_ids offsets of the permute and scatter kernels.
- :mod:`epmoe.kernels.scales`: float32 scales in the row or DeepGEMM layout.
"""
