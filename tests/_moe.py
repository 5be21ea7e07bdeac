"""A small MoE problem shared by the layer, comm and compile tests (seeded, same on every rank)."""

import torch

import epmoe
from epmoe import reference
from tests._routing import random_ids, random_weights
from tests._tol import LAYER_VS_DENSE, LAYER_VS_QUANT_AWARE, rel_l2

SMALL = dict(num_experts=8, hidden_size=256, intermediate_size=128, top_k=3)


def global_weights(num_experts, hidden_size, intermediate_size, seed=0, **_):
    g = torch.Generator().manual_seed(seed)
    w1 = (
        torch.randn((num_experts, 2 * intermediate_size, hidden_size), generator=g)
        / hidden_size**0.5
    )
    w2 = (
        torch.randn((num_experts, hidden_size, intermediate_size), generator=g)
        / intermediate_size**0.5
    )
    return w1, w2


def small_layer(quant, mode, worst_case=False, **kw):
    """An EPMoE of the SMALL shape on CPU (local backend unless ``kw`` says otherwise), with the
    weights of :func:`global_weights` loaded."""
    args = dict(backend="local", worst_case=worst_case, device="cpu")
    args.update(kw)
    layer = epmoe.EPMoE(**SMALL, quant=quant, mode=mode, **args)
    layer.load_weights(*global_weights(**SMALL))
    return layer


def tokens(T, num_experts, hidden_size, top_k, seed, **_):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((T, hidden_size), generator=g).bfloat16()
    return x, random_ids(T, top_k, num_experts, 0.15, g), random_weights(T, top_k, g)


def check_layer_output(out, x, ids, w, w1, w2, quant):
    """Both references of the core issue: quant-aware and dense float32."""
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    if x.shape[0] == 0:
        return
    dense = reference.dense_moe(x, ids, w, w1, w2)
    qa = reference.quantized_moe(x, ids, w, w1, w2, quant)
    e_qa, e_dense = rel_l2(out, qa), rel_l2(out, dense)
    assert e_qa < LAYER_VS_QUANT_AWARE, f"{quant}: rel L2 vs quant-aware reference {e_qa:.4f}"
    assert e_dense < LAYER_VS_DENSE[quant], f"{quant}: rel L2 vs dense_moe {e_dense:.4f}"
