"""epmoe._launch: host size helpers and the direct-launch key (CPU; launches: test_launch_gpu)."""

import pytest
import torch

from epmoe import _launch


@pytest.mark.parametrize("n", [-3, 0, 1, 2, 3, 4, 5, 127, 128, 129, 4095, 4096, 4097])
def test_pow2_matches_definition(n):
    want = 1
    while want < n:
        want *= 2
    assert _launch.pow2(n) == want


@pytest.mark.parametrize("a,b", [(0, 4), (1, 4), (4, 4), (5, 4), (127, 128), (129, 128)])
def test_cdiv(a, b):
    assert _launch.cdiv(a, b) == -(-a // b)


def test_key_separates_what_triton_specializes_on():
    x = torch.zeros(64, dtype=torch.float32)
    base = _launch._key(0, (x, 7), {"BLOCK": 16})
    assert base == _launch._key(0, (torch.ones(64), 9), {"BLOCK": 16})  # same specialization
    assert base != _launch._key(1, (x, 7), {"BLOCK": 16})  # device
    assert base != _launch._key(0, (x, 7), {"BLOCK": 32})  # constexpr
    assert base != _launch._key(0, (x, 7), {"BLOCK": 16, "num_warps": 8})  # launch option
    assert base != _launch._key(0, (x.half(), 7), {"BLOCK": 16})  # dtype
    assert base != _launch._key(0, (x[1:], 7), {"BLOCK": 16})  # 16-byte alignment
    assert base != _launch._key(0, (x, 1), {"BLOCK": 16})  # == 1
    assert base != _launch._key(0, (x, 32), {"BLOCK": 16})  # multiple of 16
    assert base != _launch._key(0, (x, 2**31), {"BLOCK": 16})  # 64-bit int
    assert base != _launch._key(0, (x, True), {"BLOCK": 16})  # bool is not int
    assert base != _launch._key(0, (x, 7.0), {"BLOCK": 16})  # float
    p = torch.nn.Parameter(x)  # tensor subclasses keyed like tensors
    assert _launch._key(0, (p, 7), {"BLOCK": 16}) == base
