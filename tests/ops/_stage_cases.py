"""Inputs and comparisons shared by the Triton-kernel tests (interpret, GPU) of the local stages."""

import contextlib
import dataclasses
import importlib
from typing import Iterator, Optional

import torch

from epmoe import gate as gate_mod
from epmoe import reference
from tests import _routing, _tol

# epmoe.ops re-exports functions named like some modules: import the modules themselves.
quantize_mod = importlib.import_module("epmoe.ops.quantize")
permute_mod = importlib.import_module("epmoe.ops.permute")
unpermute_mod = importlib.import_module("epmoe.ops.unpermute")
activation_mod = importlib.import_module("epmoe.ops.activation")


# gates of the activation tests: every activation, each gate field set somewhere (limit before and
# after, up offset, alpha, the softcaps), and no gate half (NemotronH's relu2)
ACT_GATES = (
    "silu:alpha=1.702,limit=7,up_offset=1",
    "silu:limit=3,clamp_after=1",
    "gelu_tanh:limit=5",
    "gelu",
    "relu:up_offset=-0.5",
    "relu2",
    "silu:gate_softcap=2,up_softcap=3",  # Inkling2's softcaps (smaller: they act)
    "relu2:glu=0",
)
# gates of the GEMV tests
GEMV_GATES = (
    "silu:alpha=1.702,limit=7,up_offset=1",  # gpt-oss
    "silu:limit=7,clamp_after=1",
    "gelu_tanh",
    "gelu",
    "relu",
    "silu:gate_softcap=2,up_softcap=3",  # Inkling2's softcaps (smaller: they act)
    "relu2:glu=0",  # NemotronH: no gate half
)


def gate_width(spec: str, inter: int) -> int:
    """y's columns for ``inter`` outputs of the gate ``spec`` (Gate.width)."""
    return gate_mod.parse(spec).width(inter)


def set_config(monkeypatch, module, **fields) -> None:
    """For this test, ``module``'s launch config (CONFIG) with ``fields`` replaced."""
    monkeypatch.setattr(module, "CONFIG", dataclasses.replace(module.CONFIG, **fields))


POISON_BYTES = (0xFF, 0x7F)  # NaN in every float format here; 0x7f7f... never a valid index


def routing(
    m: int, k: int, e: int, gen: torch.Generator, kind: str = "random", local: float = 0.5
) -> torch.Tensor:
    """int64 `[m, k]` local expert ids; "random" keeps a ``local`` fraction and sets the rest to -1.

    kind: "random" (distinct experts per token when k <= e), "one_expert" (every choice -> e - 1),
    "all_neg" (all -1).
    """
    if kind == "all_neg":
        return torch.full((m, k), -1, dtype=torch.int64)
    if kind == "one_expert":
        return torch.full((m, k), e - 1, dtype=torch.int64)
    return _routing.random_ids(m, k, e, p_none=1.0 - local, gen=gen)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """1-byte payloads compared bitwise (fp8 NaN != NaN otherwise); others unchanged."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.bool else t


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    a, b = as_bytes(actual), as_bytes(expected)
    if not torch.equal(a, b):
        bad = (a != b).nonzero()
        idx = [tuple(i) for i in bad[:4].tolist()]
        pairs = [(float(actual[i].float()), float(expected[i].float())) for i in idx]
        raise AssertionError(
            f"{what}: {bad.shape[0]} elements differ, first at {idx} (actual, expected): {pairs}"
        )


def assert_permute_equal(out, ref) -> None:
    """All index outputs exact; payload and scale rows exact where m_indices >= 0."""
    x, s, m_idx, inv, offs, src = (t.cpu() for t in out)
    rx, rs, rm, ri, ro, rsrc = ref
    assert_equal(m_idx, rm, "m_indices")
    assert_equal(inv, ri, "inv_perm")
    assert_equal(offs, ro, "expert_offsets")
    assert_equal(src, rsrc, "src_rows")
    live = rm >= 0
    assert_equal(x[live], rx[live], "x rows")
    assert s.shape == rs.shape, (s.shape, rs.shape)
    assert_equal(s[live], rs[live], "scale rows")


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    _tol.assert_close(actual.cpu(), expected.cpu())


def masked_rows(e: int, t: int, masked_m: Optional[torch.Tensor]) -> torch.Tensor:
    """bool `[e, t]`: rows a masked op must write."""
    if masked_m is None:
        return torch.ones((e, t), dtype=torch.bool)
    return torch.arange(t)[None, :] < masked_m.cpu()[:, None].clamp(max=t)


@contextlib.contextmanager
def poisoned_empty(byte: int) -> Iterator[None]:
    """Every torch.empty / torch.empty_strided inside the block comes back filled with ``byte``
    (NaN / 0x7f poison), so an output element the kernels never write shows up as a mismatch
    against the reference."""
    real = {name: getattr(torch, name) for name in ("empty", "empty_strided")}

    def poisoned(factory):
        def make(*args, **kwargs):
            t = factory(*args, **kwargs)
            if t.numel():
                t.untyped_storage().fill_(byte)
            return t

        return make

    for name, factory in real.items():
        setattr(torch, name, poisoned(factory))
    try:
        yield
    finally:
        for name, factory in real.items():
            setattr(torch, name, factory)


def reference_permute(x, ids, e, a, scales=None):
    return reference.permute(x.cpu(), ids.cpu(), e, a, None if scales is None else scales.cpu())
