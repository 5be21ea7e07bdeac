"""torch.library.opcheck with the one known limitation of fp8 on CPU worked around."""

import torch

ALL = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# For calls whose outputs have unspecified rows (padding, rows past masked_m): the AOT test compares
# two runs' values; the specified rows are compared against the reference by the op's own tests.
NO_VALUE_COMPARE = ALL[:3]


def opcheck(op, args, kwargs=None, utils=ALL):
    """Run every opcheck utility; test_schema is skipped for float8 inputs because its mutation
    check multiplies the inputs, which float8 does not implement ("mul_cpu_reduced_float",
    "mul_cuda")."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    tensors += [
        t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)
    ]
    fp8 = any(t.dtype == torch.float8_e4m3fn for t in tensors)
    utils = tuple(u for u in utils if not (fp8 and u == "test_schema"))
    torch.library.opcheck(op, args, kwargs, test_utils=utils)
