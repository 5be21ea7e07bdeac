"""torch.library helpers shared by the op modules: a triton_op whose CPU kernel stays opaque.

torch.compile decomposes a ``torch.library.triton_op`` into its body (under FunctionalTensorMode),
on every device: on CUDA that is the point (Inductor sees the Triton launches), but on CPU the
body runs the pure-torch reference, which Inductor then recompiles with its own float
rewrites (``x / s`` as ``x * (1 / s)``, fused SiLU, reordered sums): fp8 / int8 codes then differ
from eager. :func:`cpu_opaque` keeps the op itself in the graph for CPU inputs, so the compiled
graph calls the registered CPU kernel, the same function eager runs: compiled == eager, bit for
bit.

A lower floor than every stage module (imports only torch).
"""

import torch


def cpu_opaque(op) -> None:
    """Make triton_op ``op`` opaque to torch.compile for CPU tensors (decomposed as before on
    every other device). Call once, after its ``register_kernel("cpu")``."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    decompose = getattr(op, "_torch_dispatch_fns", {}).get(FunctionalTensorMode)
    if decompose is None:  # (a torch without triton_op's rule there: left as it is)
        return

    def rule(mode, func, types, args, kwargs):
        if _first_device(args, kwargs) == "cpu":
            return mode.__torch_dispatch__(func, types, args, kwargs)  # the op, as a graph node
        return decompose(mode, func, types, args, kwargs)

    op.register_torch_dispatch(FunctionalTensorMode, rule)


def _first_device(args, kwargs) -> str:
    """Device type of the first tensor argument (an op's tensors share one device)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device.type
    return ""
