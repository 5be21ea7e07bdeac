"""torch.library.opcheck with the one known limitation of fp8 on CPU worked around."""

import torch

ALL = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck(op, args, kwargs=None):
    """Run every opcheck utility; test_schema is skipped for float8 CPU inputs because its mutation
    check multiplies the inputs, which CPU float8 does not implement ("mul_cpu_reduced_float")."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    fp8_cpu = any(t.dtype == torch.float8_e4m3fn and t.device.type == "cpu" for t in tensors)
    utils = tuple(u for u in ALL if not (fp8_cpu and u == "test_schema"))
    torch.library.opcheck(op, args, kwargs, test_utils=utils)
