"""The ll_gather launch (the weighted top-K gather kernel) on CPU tensors under TRITON_INTERPRET=1,
against the contract, and its row check."""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)

import torch  # noqa: E402

from epmoe import reference  # noqa: E402
from epmoe.kernels import gather as KG  # noqa: E402
from tests._routing import random_weights  # noqa: E402
from tests.ops import _ll_cases as L  # noqa: E402

pytestmark = pytest.mark.interpret
QUANTS = ("bf16", "fp8", "int8")


@pytest.fixture(params=["default", "small_blocks"])
def blocks(request, monkeypatch):
    """Default tiling, and tiny blocks: rows span several column chunks."""
    if request.param == "small_blocks":
        monkeypatch.setattr(KG, "GATHER_BYTES", 128)
    return request.param


@pytest.mark.parametrize("weighted", [True, False])
def test_gather(weighted, blocks):
    gen = torch.Generator().manual_seed(4)
    E, C, H, T, K = 3, 4, 200, 7, 3  # H = 200: a partial chunk
    y = torch.randn((E, C + 1, H), generator=gen).bfloat16()[:, 1:]  # strided slots
    rows = torch.randint(-1, E * C, (T, K), generator=gen, dtype=torch.int32)
    rows = rows.t().contiguous().t()
    w = random_weights(T, K, gen) if weighted else None
    out = torch.empty((T, H), dtype=torch.bfloat16)
    KG._ll_gather_launch(y, rows, w, out)
    assert torch.equal(out, L.gather_oracle(y, rows, w))
    assert torch.equal(out, reference.ll_gather(y, rows, w))
    KG._ll_gather_launch(y, rows.long(), w, out)
    assert torch.equal(out, L.gather_oracle(y, rows, w))
    KG._ll_gather_launch(y, rows, w, out, False)  # the chain's unchecked launch: same bytes
    assert torch.equal(out, L.gather_oracle(y, rows, w))


def test_gather_bad_row_raises():
    y = torch.zeros((2, 3, 16), dtype=torch.bfloat16)
    out = torch.empty((2, 16), dtype=torch.bfloat16)
    for bad in (6, -2):
        rows = torch.tensor([[0, 5], [-1, bad]], dtype=torch.int32)
        with pytest.raises(ValueError, match=r"ll_gather: rows expected rows in \[0, 6\) or -1"):
            KG._ll_gather_launch(y, rows, None, out)
        KG._ll_gather_launch(y, rows, None, out, False)  # unchecked: no error, the row never read
