"""epmoe: every stage of an expert-parallel Mixture-of-Experts layer as a first-class PyTorch op.

``import epmoe`` registers the ``torch.ops.epmoe.*`` ops; it imports neither deep_ep nor deep_gemm
and does not initialize CUDA.
"""

__version__ = "0.1.0"

import triton as _triton  # noqa: E402

# the kernels' Gluon and PDL APIs (pyproject.toml's floor): say so instead of a failed import
_TRITON = tuple(int(p) for p in _triton.__version__.split(".")[:2] if p.isdigit())
if _TRITON < (3, 6):
    raise ImportError(f"epmoe needs triton>=3.6, found triton {_triton.__version__}")

from epmoe import gate, ops, reference  # noqa: E402  (registers the ops)
from epmoe._checks import set_debug  # noqa: E402
from epmoe.gate import Gate  # noqa: E402
from epmoe.layer import EPMoE  # noqa: E402
from epmoe.ops.gemm._tuned import UntunedWarning  # noqa: E402

__all__ = [
    "EPMoE", "Gate", "UntunedWarning", "gate", "ops", "reference", "set_debug", "__version__",
]  # fmt: skip
