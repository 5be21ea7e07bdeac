"""epmoe._checks on CPU: value checks raise ValueError on CPU tensors and become a functional
assert while tracing; kernels assert values themselves only on direct CUDA launches."""

import pytest
import torch

from epmoe import _checks


def test_check_values_cpu_raises_with_the_op_and_arg():
    _checks.check_values(torch.tensor(True), "permute", "topk_ids", "ids in [0, 4) or -1")
    with pytest.raises(ValueError, match=r"permute: topk_ids expected ids in \[0, 4\) or -1"):
        _checks.check_values(torch.tensor(False), "permute", "topk_ids", "ids in [0, 4) or -1")


def test_check_shape_names_each_dimension():
    _checks.check_shape("EPMoE", "x", torch.zeros(3, 8), (None, 8))
    for bad in (torch.zeros(2, 3, 8), torch.zeros(3, 4)):
        with pytest.raises(ValueError, match=r"EPMoE: x expected shape \[any, 8\], got \["):
            _checks.check_shape("EPMoE", "x", bad, (None, 8))


def test_check_ids_cpu():
    _checks.check_ids(torch.tensor([[-1, 0], [3, 2]]), 4, "unpermute", "inv_perm")
    for bad in ([[4, 0]], [[-2, 0]]):
        with pytest.raises(ValueError, match="unpermute: inv_perm expected ids in"):
            _checks.check_ids(torch.tensor(bad), 4, "unpermute", "inv_perm")


def test_check_values_under_compile_is_a_graph_assert():
    def f(ok, x):
        _checks.check_values(ok, "op", "arg", "something")
        return x + 1

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert torch.equal(compiled(torch.tensor(True), torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(RuntimeError):
        compiled(torch.tensor(False), torch.ones(2))


def test_check_codes_raises_the_first_failed_check_and_is_one_assert_traced():
    cases = (("ids in [0, 4) or -1", "values outside it"), ("at most 3 a row", "more"))
    _checks.check_codes(torch.tensor(0, dtype=torch.int32), "op", "arg", cases)
    for code, msg in ((1, r"ids in \[0, 4\) or -1, got values"), (2, "at most 3 a row, got more"),
                      (3, r"ids in \[0, 4\)")):  # fmt: skip
        with pytest.raises(ValueError, match="op: arg expected " + msg):
            _checks.check_codes(torch.tensor(code, dtype=torch.int32), "op", "arg", cases)

    def f(code, x):
        _checks.check_codes(code, "op", "arg", cases)
        return x + 1

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(
        torch.tensor(0, dtype=torch.int32), torch.ones(2)
    )
    asserts = [n for n in gm.graph.nodes if "assert_async" in str(n.target)]
    assert len(asserts) == 1 and "and at most 3 a row" in str(asserts[0].args)


def test_in_kernel_asserts_only_on_direct_launches_off_debug():
    """CPU tensors (the interpreter) and fake tensors (torch.compile) are not direct launches, so
    they keep the check after the kernels; debug mode never asserts in a kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    t = torch.zeros(2)
    assert not _checks.direct_launch(t)
    with FakeTensorMode() as mode:
        assert not _checks.direct_launch(mode.from_tensor(t))
    assert _checks.assert_in_kernel(True) and not _checks.assert_in_kernel(False)
    before = _checks.debug_enabled()
    _checks.set_debug(True)
    try:
        assert not _checks.assert_in_kernel(True)
    finally:
        _checks.set_debug(before)
    assert _checks.assert_build(True) == dict(debug=True, sanitize_overflow=False)
    assert _checks.assert_build(False) == {}
