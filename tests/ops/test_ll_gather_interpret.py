"""The ll_gather launch (the weighted top-K gather kernel) on CPU tensors under TRITON_INTERPRET=1,
against the contract (with a down-projection bias, a narrower output), and its row check."""

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
    KG._ll_gather_plan.cache_clear()  # (its launch is planned from GATHER_BYTES)
    if request.param == "small_blocks":
        monkeypatch.setattr(KG, "GATHER_BYTES", 128)
    yield request.param
    KG._ll_gather_plan.cache_clear()


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
    KG._ll_gather_launch(y, rows, w, out, check=False)  # the chain's unchecked launch: same bytes
    assert torch.equal(out, L.gather_oracle(y, rows, w))


def test_gather_bad_row_raises():
    y = torch.zeros((2, 3, 16), dtype=torch.bfloat16)
    out = torch.empty((2, 16), dtype=torch.bfloat16)
    for bad in (6, -2):
        rows = torch.tensor([[0, 5], [-1, bad]], dtype=torch.int32)
        with pytest.raises(ValueError, match=r"ll_gather: rows expected rows in \[0, 6\) or -1"):
            KG._ll_gather_launch(y, rows, None, out)
        KG._ll_gather_launch(y, rows, None, out, check=False)  # unchecked: the row never read


@pytest.mark.parametrize(
    "bias_dtype,weighted",
    [(torch.bfloat16, True), (torch.float16, False), (torch.float32, True)],
)
def test_gather_bias_hidden(bias_dtype, weighted, blocks):
    """bias[r // C] added to each row before the weighting, the first Ho columns: the oracle's
    bytes; poisoned rows past the live slots and past Ho never read."""
    gen = torch.Generator().manual_seed(6)
    E, C, H, T, K = 3, 4, 256, 7, 3
    y = torch.randn((E, C + 1, H), generator=gen).bfloat16()[:, 1:]  # strided slots
    rows = torch.randint(-1, E * C, (T, K), generator=gen, dtype=torch.int32)
    for r in set(range(E * C)) - set(rows.flatten().tolist()):
        y[r // C, r % C] = float("nan")
    w = random_weights(T, K, gen) if weighted else None
    b = (torch.randn((E, H + 4), generator=gen) * 2).to(bias_dtype)[:, 4:]  # strided
    for hidden in (H, 160, 1):
        y[..., hidden:] = float("nan")  # (past Ho: never read)
        out = torch.empty((T, hidden), dtype=torch.bfloat16)
        KG._ll_gather_launch(y, rows, w, out, b)
        assert torch.equal(out, L.gather_oracle(y, rows, w, b, hidden))
        assert torch.equal(out, reference.ll_gather(y, rows, w, b, hidden))
        KG._ll_gather_launch(y, rows, w, out, b, check=False)
        assert torch.equal(out, reference.ll_gather(y, rows, w, b, hidden))
        KG._ll_gather_launch(y, rows, w, out)  # no bias: the first Ho columns
        assert torch.equal(out, reference.ll_gather(y, rows, w, None, hidden))


def test_gather_op_bias_hidden():
    """The public functions on CPU run the reference: the kernel's bytes."""
    from epmoe.ops.ll_gather import _ll_gather_cuda, ll_gather

    gen = torch.Generator().manual_seed(7)
    y = torch.randn((2, 5, 200), generator=gen).bfloat16()
    rows = torch.randint(-1, 10, (6, 2), generator=gen, dtype=torch.int32)
    w = random_weights(6, 2, gen)
    b = torch.randn((2, 200), generator=gen).bfloat16()
    got = _ll_gather_cuda(y, rows, w, True, b, 130)
    assert got.shape == (6, 130)
    assert torch.equal(got, ll_gather(y, rows, w, bias=b, hidden=130))
