"""epmoe.quant: each scheme's fields describe what its reference quantizers actually return;
get() / of_dtype() resolve names and dtypes (and reject the rest); schemes are hashable values."""

import dataclasses
import functools
import pickle

import pytest
import torch

from epmoe import quant, reference

E, N, K, T = 2, 256, 384, 5


@pytest.mark.parametrize("scheme", list(quant.SCHEMES.values()), ids=str)
def test_fields_match_the_reference_quantizers(scheme, seed):
    x = torch.randn(T, K, dtype=torch.bfloat16)
    q, s = scheme.quantize(x)
    assert q.dtype == scheme.act_dtype and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (T, scheme.act_scale_cols(K))
    if scheme.act_group:
        assert s.shape[-1] * scheme.act_group == K
    assert torch.equal(scheme.dequantize(q, s), q.float() if not scheme.quantized else
                       reference.dequantize(q, s))  # fmt: skip

    w = torch.randn(E, N, K)
    wq, ws = scheme.quantize_weights(w)
    assert wq.dtype == scheme.act_dtype and wq.shape == w.shape
    shape = scheme.weight_scale_shape(E, N, K)
    assert (ws is None) == (shape is None) == (scheme.weight_block is None)
    if ws is not None:
        assert ws.dtype == torch.float32 and tuple(ws.shape) == shape
        rows, cols = scheme.weight_block
        assert ws.shape[1] * rows == N
        assert cols is None and ws.dim() == 2 or ws.shape[2] * cols == K
    assert scheme.quantized == (scheme.weight_block is not None) == (scheme is not quant.BF16)


@pytest.mark.parametrize("scheme", quant.QUANTIZED, ids=str)
def test_the_scheme_is_the_reference_bit_for_bit(scheme, seed):
    x = torch.randn(3, T, K) * 4
    q, s = scheme.quantize(x)
    rq, rs = reference.quantize(x, scheme.name)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    w = torch.randn(E, N, K)
    wq, ws = scheme.quantize_weights(w)
    rwq, rws = reference.quantize_weights(w, scheme.name)
    assert torch.equal(wq.view(torch.uint8), rwq.view(torch.uint8)) and torch.equal(ws, rws)


def test_scale_granularity(seed):
    # scaling one group (fp8) / one row (int8) / one weight block moves exactly its own scale
    x = torch.randn(T, K)
    x2 = x.clone()
    x2[1, :128] *= 8
    s, s2 = quant.FP8.quantize(x)[1], quant.FP8.quantize(x2)[1]
    assert (s != s2).nonzero().tolist() == [[1, 0]]
    s, s2 = quant.INT8.quantize(x)[1], quant.INT8.quantize(x2)[1]
    assert (s != s2).nonzero().tolist() == [[1, 0]]
    w = torch.randn(E, N, K)
    w2 = w.clone()
    w2[1, 128:, 256:] *= 8
    s, s2 = quant.FP8.quantize_weights(w)[1], quant.FP8.quantize_weights(w2)[1]
    assert (s != s2).nonzero().tolist() == [[1, 1, 2]]
    w2 = w.clone()
    w2[1, 3, :] *= 8
    s, s2 = quant.INT8.quantize_weights(w)[1], quant.INT8.quantize_weights(w2)[1]
    assert (s != s2).nonzero().tolist() == [[1, 3]]


def test_group_size_overrides_fp8_groups(seed):
    x = torch.randn(T, 256)
    q, s = quant.FP8.quantize(x, group_size=64)
    assert s.shape == (T, 4) == (T, quant.FP8.act_scale_cols(256, 64))
    assert quant.INT8.quantize(x, group_size=64)[1].shape == (T, 1)
    assert quant.INT8.act_scale_cols(256, 64) == 1 and quant.BF16.act_scale_cols(256, 64) == 0
    assert torch.equal(s, reference.quantize_fp8(x, 64)[1])


def test_facts():
    assert quant.SCHEMES == {"bf16": quant.BF16, "fp8": quant.FP8, "int8": quant.INT8}
    assert quant.QUANTIZED == (quant.FP8, quant.INT8)
    assert [s.act_dtype for s in quant.SCHEMES.values()] == [
        torch.bfloat16, torch.float8_e4m3fn, torch.int8
    ]  # fmt: skip
    assert [s.act_group for s in quant.SCHEMES.values()] == [None, 128, None]
    assert [s.weight_block for s in quant.SCHEMES.values()] == [None, (128, 128), (1, None)]
    assert [s.gemv_max_tokens for s in quant.SCHEMES.values()] == [8, 8, 4]
    assert [s.act_scale_cols(512) for s in quant.SCHEMES.values()] == [0, 4, 1]
    assert [s.weight_scale_shape(2, 256, 512) for s in quant.SCHEMES.values()] == [
        None, (2, 2, 4), (2, 256)
    ]  # fmt: skip
    assert [str(s) for s in quant.SCHEMES.values()] == ["bf16", "fp8", "int8"]
    assert [s.size_multiple for s in quant.SCHEMES.values()] == [1, 128, 1]
    # the reference's constants come from here (one source)
    assert reference.QUANT_SCHEMES == ("bf16", "fp8", "int8")
    assert reference.FP8_WEIGHT_BLOCK == quant.FP8.weight_block[0] == quant.FP8.act_group
    assert reference.SCHEME_OF_DTYPE == {s.act_dtype: s.name for s in quant.SCHEMES.values()}


def test_check_sizes():
    quant.FP8.check_sizes("EPMoE", hidden_size=256, intermediate_size=384)
    with pytest.raises(
        ValueError,
        match=r"^EPMoE: intermediate_size expected a multiple of 128 for fp8 \(128-channel "
        r"groups\), got 200$",
    ):
        quant.FP8.check_sizes("EPMoE", hidden_size=256, intermediate_size=200)
    for scheme in (quant.BF16, quant.INT8):
        scheme.check_sizes("EPMoE", hidden_size=200, intermediate_size=7)


def test_get():
    for name, scheme in quant.SCHEMES.items():
        assert quant.get(name) is scheme and quant.get(scheme) is scheme
    for bad in ("fp4", "FP8", None, 8):
        with pytest.raises(
            ValueError, match=rf"^EPMoE: quant expected one of 'bf16', 'fp8', 'int8', got {bad!r}$"
        ):
            quant.get(bad, "EPMoE")
    with pytest.raises(ValueError, match=r"^quant: quant expected one of"):
        quant.get("nf4")
    with pytest.raises(ValueError, match=r"^warmup: scheme expected one of .*, got 'nf4'$"):
        quant.get("nf4", "warmup", "scheme")


def test_of_dtype():
    for scheme in quant.SCHEMES.values():
        assert quant.of_dtype(scheme.act_dtype) is scheme
    for bad in (torch.float16, torch.float32, torch.uint8):
        with pytest.raises(ValueError, match=rf"^quant: dtype expected one of .*, got {bad}$"):
            quant.of_dtype(bad)


def test_hashable_values_not_names():
    d = {quant.FP8: 1, quant.INT8: 2, quant.BF16: 3}
    assert d[quant.get("fp8")] == 1 and len(set(quant.SCHEMES.values())) == 3
    assert quant.FP8 != "fp8" and "fp8" not in d  # compare objects, never names
    with pytest.raises(dataclasses.FrozenInstanceError):
        quant.FP8.act_group = 64
    assert pickle.loads(pickle.dumps(quant.INT8)) is quant.INT8

    @functools.cache
    def cols(scheme):
        return scheme.act_scale_cols(256)

    assert cols(quant.FP8) == 2 and cols(quant.FP8) == 2 and cols.cache_info().hits == 1
