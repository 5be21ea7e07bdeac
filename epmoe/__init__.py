"""epmoe: every stage of an expert-parallel Mixture-of-Experts layer as a first-class PyTorch op.

``import epmoe`` registers the ``torch.ops.epmoe.*`` ops; it imports neither deep_ep nor deep_gemm
and does not initialize CUDA.
"""

__version__ = "0.1.0"

from epmoe import gate, ops, reference  # noqa: E402  (registers the ops)
from epmoe._checks import set_debug  # noqa: E402
from epmoe.gate import Gate  # noqa: E402
from epmoe.layer import EPMoE  # noqa: E402

__all__ = ["EPMoE", "Gate", "gate", "ops", "reference", "set_debug", "__version__"]
