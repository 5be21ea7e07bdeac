"""One declaration per stage: the `torch.ops.epmoe` op, its public function, the layer's entries.

A stage module declares its op once, from its parts::

    @stage(contract=CONTRACT, fake=_fake, reference=_reference, cuda=_permute_triton,
           result=_result)
    def permute(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, ...) -> Tuple[...]:
        '''The public docstring (dtypes and `[shape]`s).'''

The signature (its annotations) is the op's schema; the body is never run. From the declaration:

- ``torch.ops.epmoe.<name>``, defined on one :class:`torch.library.Library` (no custom_op Python
  wrappers on the dispatcher path): a CUDA kernel (contract check, then ``cuda`` with
  ``wrap_triton`` off so its Triton kernels launch directly), a CPU kernel (contract check, then
  ``reference``, the pure-torch spec), the fake (contract check, then ``fake``: outputs from shapes
  only) and no autograd kernel: an input that would need a gradient is a ``ValueError``.
  ``triton=True`` stages decompose into ``cuda`` under torch.compile's functionalization for
  non-CPU tensors, so Inductor sees their Triton kernels (``wrap_triton``); for CPU tensors the op
  stays opaque and the compiled graph calls the same CPU kernel eager runs (compiled == eager bytes,
  which Inductor's rewrites of the reference would break).
- The public function (what this decorator returns, with the declared signature and docstring):
  the usual eager call, plain CUDA tensors and nothing tracing (:func:`epmoe._eager.calm`, the
  contract's one-pass ``direct``), calls ``cuda`` straight away (its first argument's device made
  current: Triton launches on the current device) and skips the dispatcher's 30-50 µs; any other
  call checks the contract (our ``ValueError`` before the schema's) and calls the op.
- ``fn.launch``: ``cuda`` with the ``chain`` arguments (its result wrapped), the layer's entry on
  its direct path: inputs checked at the layer's boundary or made by the stage before;
  ``wrap_triton`` off and the inputs' device current, both set once per layer call
  (:func:`epmoe._eager.no_wrap`, :func:`epmoe._eager.on_device`).
- ``fn.chained``: the op with the declared ``chain`` arguments (e.g. ``check=False``: rows
  written by the chain's own permute need no row check), the layer's entry under torch.compile.
- ``fn.op``: the OpOverload; ``fn.reference``, ``fn.fake``, ``fn.cuda``, ``fn.contract``: the
  parts.
"""

import inspect
from typing import Callable, Dict, Optional, Sequence

import torch
from torch._library import triton as _triton_lib

from epmoe import _checks, _eager
from epmoe._contract import Contract

LIB = torch.library.Library("epmoe", "FRAGMENT")  # every epmoe op is defined here
_wrap = _triton_lib.wrap_triton_enabled  # (thread-local; .value False: Triton launches directly)
_wrapping = _triton_lib.is_wrap_triton_enabled


def stage(
    *,
    contract: Contract,
    fake: Callable,
    reference: Callable,
    cuda: Callable,
    triton: bool = True,
    result: Optional[Callable] = None,
    chain: Optional[Dict[str, object]] = None,
    mutates: Sequence[str] = (),
    tags: Sequence[torch.Tag] = (),
    name: Optional[str] = None,
) -> Callable:
    """Declare a stage from its parts (see the module doc); returns the decorator of its signature.

    Args:
        contract: the metadata contract; its parameters are a subset of the signature's.
        fake: outputs from shapes only (same arguments as the op).
        reference: the pure-torch implementation; the op's CPU kernel.
        cuda: the CUDA implementation (Triton launches through :func:`epmoe._launch.kernel`, or
            library calls); also what Inductor traces for ``triton=True`` stages.
        triton: ``cuda`` consists of Triton launches and torch ops (decomposed under compile);
            False: an opaque op (library kernels such as deep_gemm / deep_ep, communication).
        result: ``result(out, *args)`` -> the public return value (e.g. a NamedTuple), or None.
        chain: keyword arguments the layer's compiled chain passes (``fn.chained``).
        mutates: names of arguments the op writes (``out=`` variants).
        tags: torch.Tag s of the op (e.g. ``cudagraph_unsafe``).
        name: the op's name (default: the signature function's).
    """

    def declare(signature: Callable) -> Callable:
        op_name = name or signature.__name__
        qualname = f"epmoe::{op_name}"
        params = list(inspect.signature(signature).parameters.values())
        names = [p.name for p in params]
        missing = [n for n in contract.params if n not in names]
        if missing:
            raise TypeError(f"stage {op_name}: contract parameters {missing} not in the signature")
        schema = torch.library.infer_schema(signature, mutates_args=tuple(mutates))
        LIB.define(op_name + schema, tags=tuple(tags))
        checked = _checked(contract.op, contract, params)  # (errors name the contract's op)
        LIB.impl(op_name, _kernel(checked, cuda, off=True), "CUDA")
        LIB.impl(op_name, _kernel(checked, reference, off=False), "CPU")
        LIB.impl(op_name, torch.library.fallthrough_kernel, "Autograd")
        torch.library.register_fake(qualname, _kernel(checked, fake, off=False), lib=LIB)
        op = getattr(torch.ops.epmoe, op_name).default
        if triton:
            _decompose_off_cpu(qualname, _kernel(checked, cuda, off=False))
        fn = _public(signature, params, contract, cuda, op, result, chain or {})
        fn.op, fn.contract, fn.fake, fn.reference, fn.cuda = op, contract, fake, reference, cuda
        return fn

    return declare


def _checked(op: str, contract: Contract, params) -> Callable:
    """The op kernels' argument step: (args, kwargs) -> every argument, defaults filled in, after
    the contract check and the refusal of inputs that need grad."""
    names = [p.name for p in params]
    sig, call = _signature_source(params)
    full = _compile(f"def full({sig}):\n    return ({call},)\n", _defaults(params))["full"]
    picked = ", ".join(contract.params)
    pick = _compile(f"def pick({', '.join(names)}):\n    return ({picked},)\n", {})["pick"]

    def check(args, kwargs):
        a = full(*args, **kwargs)
        contract.check(*pick(*a))
        if torch.is_grad_enabled():
            grads = {n: t for n, t in zip(names, a, strict=True) if isinstance(t, torch.Tensor)}
            _checks.check_no_grad(op, **grads)
        return a

    return check


def _kernel(check: Callable, impl: Callable, off: bool) -> Callable:
    """An op kernel: ``check`` then ``impl``; ``off``: with wrap_triton off (direct launches)."""
    if not off:

        def kernel(*args, **kwargs):
            return impl(*check(args, kwargs))

        return kernel

    def kernel_off(*args, **kwargs):
        a = check(args, kwargs)
        with _eager.no_wrap(), _eager.on_device(a[0]):
            return impl(*a)

    return kernel_off


def _decompose_off_cpu(qualname: str, impl: Callable) -> None:
    """Under torch.compile's functionalization, non-CPU calls run ``impl`` (Inductor then sees its
    Triton kernels, as ``torch.library.triton_op`` arranges); CPU calls stay one opaque node."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    known = (torch.Tensor, FakeTensor, FunctionalTensor)

    def rule(mode, func, types, args, kwargs):
        from torch.export._trace import custom_triton_ops_decomposition_disabled

        if _device_type(args, kwargs) == "cpu" or custom_triton_ops_decomposition_disabled():
            return mode.__torch_dispatch__(func, types, args, kwargs)
        if any(not issubclass(t, known) for t in types):
            return NotImplemented
        with mode:
            return impl(*args, **kwargs)

    torch.library.register_torch_dispatch(qualname, FunctionalTensorMode, rule, lib=LIB)


def _device_type(args, kwargs) -> str:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device.type
    return ""


def _public(signature, params, contract, cuda, op, result, chain) -> Callable:
    """The public function, ``fn.launch`` and ``fn.chained``, generated with the declared signature
    (one frame per call, arguments by name: no binding at run time)."""
    sig, call = _signature_source(params)  # (locals start with _: parameters may be named out)
    picked = ", ".join(contract.params)
    wrap = (lambda expr: f"_result({expr}, {call})") if result is not None else (lambda e: e)
    chained_call = ", ".join(f"_c_{p.name}" if p.name in chain else p.name for p in params)
    src = f"""
def {signature.__name__}({sig}):
    if _calm() and _direct({picked}):
        prev = _wrapping()
        _wrap.value = False
        try:
            with _on_device({params[0].name}):
                _out = _cuda({call})
        finally:
            _wrap.value = prev
    else:
        if not _compiling():
            _check({picked})
        _out = _op({call})
    return {wrap("_out")}

def launch({sig}):
    return {wrap(f"_cuda({chained_call})")}

def chained({sig}):
    return {wrap(f"_op({chained_call})")}
"""
    # (no __name__ in these globals: Dynamo finds an inlined function's globals by module name,
    # and two stages of one module would share one)
    ns = _compile(src, dict(
        _on_device=_eager.on_device,
        _calm=_eager.calm, _direct=contract.direct, _check=contract.check, _wrap=_wrap,
        _wrapping=_wrapping,
        _cuda=cuda, _op=op, _result=result, _compiling=torch.compiler.is_compiling,
        **_defaults(params), **{f"_c_{k}": v for k, v in chain.items()},
    ))  # fmt: skip
    fn = ns[signature.__name__]
    fn.__doc__, fn.__module__ = signature.__doc__, signature.__module__
    fn.__qualname__ = signature.__qualname__
    fn.__signature__ = inspect.signature(signature)
    fn.launch = ns["launch"] if result is not None or chain else cuda  # (no frame of its own)
    fn.chained = ns["chained"]
    return fn


def _signature_source(params):
    """(parameter list with defaults as names _d<i>, the call's argument list)."""
    sig, call = [], []
    for i, p in enumerate(params):
        sig.append(p.name if p.default is p.empty else f"{p.name}=_d{i}")
        call.append(p.name)
    return ", ".join(sig), ", ".join(call)


def _defaults(params) -> dict:
    """The names _d<i> the generated signatures give their defaults."""
    return {f"_d{i}": p.default for i, p in enumerate(params)}


def _compile(src: str, ns: dict) -> dict:
    """``ns`` after running generated source ``src`` in it (its own globals)."""
    exec(compile(src, "<epmoe stage>", "exec"), ns)
    return ns
