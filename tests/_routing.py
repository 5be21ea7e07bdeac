"""Random routings shared by the tests (seeded by the caller)."""

import torch


def random_ids(M, K, E, p_none=0.2, gen=None):
    """int64 `[M, K]`: distinct experts per token in [0, E) (repeats only if K > E); about
    p_none of the entries are -1."""
    if E >= K:
        ids = torch.rand((M, E), generator=gen).argsort(dim=1)[:, :K]
    else:
        ids = torch.randint(0, E, (M, K), generator=gen)
    drop = torch.rand((M, K), generator=gen) < p_none
    return torch.where(drop, -1, ids).long()


def random_weights(M, K, gen=None):
    """float32 `[M, K]` positive routing weights that sum to one per token."""
    w = torch.rand((M, K), generator=gen) + 0.1
    return w / w.sum(dim=1, keepdim=True)
