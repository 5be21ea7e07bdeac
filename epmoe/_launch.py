"""Triton launches of the stage kernels, and the host-side size helpers they use.

:func:`kernel` is the one door every stage launches through: ``kernel(k)[grid](*args, **meta)``.

- Under ``TRITON_INTERPRET=1`` (CPU tensors) it is the bare kernel.
- While ``wrap_triton`` is on (torch.compile tracing, the triton op's traced body) it is
  ``wrap_triton(k)``, so Inductor sees and compiles the kernel itself.
- Otherwise (eager calls, the dispatcher's eager call, CUDA-graph capture of either) it is a
  direct launch: the first call of each specialization goes through Triton's own ``run``
  (compiling if needed) and keeps the compiled kernel; later calls with the same specialization
  call its launcher straight away. Triton's ``run`` re-binds and re-specializes every argument
  and rebuilds its cache key on each call, which is most of a small kernel's host time.

The direct key is what Triton specializes on: the device, every keyword (constexprs and launch
options), each tensor's dtype and 16-byte alignment, each int's ``== 1`` / multiple-of-16 / 32-bit
range, a TMA tensor descriptor's dtype and tile, and the type of any other argument. A runtime
scalar passed by keyword is keyed by its value (a runtime tensor by keyword is never cached).
Profiler launch hooks, when set, send every launch through Triton's own path.

Programmatic dependent launch (PDL, sm90+): a kernel with a ``PDL`` constexpr starts with
:func:`pdl`, and its direct launches set ``PDL`` and Triton's ``launch_pdl``. Its programs then
become resident while the kernel before it in the stream runs its last wave, and wait there
(``griddepcontrol.wait``) until that kernel has finished and its writes are visible: the launch
gap between the layer's kernels goes. Traced launches (Inductor's) and the interpreter keep
``PDL`` off.

:func:`imin` / :func:`imax` are ``min`` / ``max`` that stay symbolic on SymInts; :func:`at_least`
/ :func:`at_most` compare a size that may be symbolic.
:func:`pow2` and :func:`cdiv` replace ``triton.next_power_of_2`` / ``triton.cdiv`` on the host:
those are Triton constexpr functions, which unwrap every argument on each call.
"""

import functools
import os
from typing import Any, Callable, Dict, Tuple

import torch
import triton
import triton.language as tl
from torch._library import triton as _triton_lib
from torch.library import wrap_triton
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter

# Triton releases whose launcher takes (grid, stream, function, packed metadata, launch metadata,
# enter hook, exit hook, *all bound arguments); others launch through Triton's own run
_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
_CACHED = (3, 6) <= _VERSION < (4, 0)

_wrap_enabled = _triton_lib.is_wrap_triton_enabled
_Tensor = torch.Tensor
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_SCALARS = (int, float, bool)
# TMA descriptor classes kernels take (Triton's; epmoe.ops.gemm._gluon adds Gluon's on import)
DESCRIPTORS = {TensorDescriptor}
_PDL = dict(PDL=True, launch_pdl=True)  # (a direct launch's keywords of a kernel with PDL)


@triton.jit
def pdl(ON: tl.constexpr):
    """The first statement of a kernel with a ``PDL`` constexpr (see the module doc), run by every
    program before any load or store: with ON, lets the next kernel launch
    (griddepcontrol.launch_dependents) and waits for the kernels before this one
    (griddepcontrol.wait): every program waits, so the chain of waits keeps the stream's order."""
    if ON:
        gdc_launch_dependents()
        gdc_wait()


def _has_pdl(fn) -> bool:
    """Whether JITFunction ``fn`` takes a ``PDL`` constexpr (starts with :func:`pdl`)."""
    return any(p.name == "PDL" and p.is_constexpr for p in getattr(fn, "params", ()))


@functools.cache
def _pdl_device(dev: int) -> bool:
    """Whether CUDA device ``dev`` takes PDL launches (sm90 and later)."""
    return torch.cuda.get_device_capability(dev)[0] >= 9


def pow2(n):
    """Smallest power of two >= n (1 for n <= 1); ints or SymInts."""
    if type(n) is int:
        return 1 if n <= 1 else 1 << (n - 1).bit_length()
    return triton.next_power_of_2(n)


def imin(a, b):
    """min(a, b) for ints; ``torch.sym_min`` when either is a SymInt (min() would guard on it)."""
    if type(a) is int and type(b) is int:
        return a if a <= b else b
    return torch.sym_min(a, b)


def imax(a, b):
    """max(a, b) for ints; ``torch.sym_max`` when either is a SymInt."""
    if type(a) is int and type(b) is int:
        return a if a >= b else b
    return torch.sym_max(a, b)


def cdiv(a, b):
    """ceil(a / b) for ints or SymInts."""
    return (a + b - 1) // b


def at_least(n, lo: int) -> bool:
    """n >= lo. A symbolic n (torch.compile) is guarded on when backed; an unbacked one (exact-size
    HT dispatch) gives False instead of a data-dependent error (callers take either answer)."""
    if type(n) is int:
        return n >= lo
    return torch.fx.experimental.symbolic_shapes.guard_or_false(n >= lo)


def at_most(n, hi: int) -> bool:
    """n <= hi, like :func:`at_least` (an unbacked n gives False)."""
    if type(n) is int:
        return n <= hi
    return torch.fx.experimental.symbolic_shapes.guard_or_false(n <= hi)


def kernel(k):
    """The launchable form of Triton kernel ``k`` for the current context (see the module doc)."""
    if _INTERPRET:
        return k
    if _wrap_enabled():
        return wrap_triton(k)
    return direct(k)


def direct(k):
    """The direct launch of ``k`` whatever the context (callers that know nothing traces them)."""
    d = _DIRECT.get(id(k))
    if d is None:
        d = _DIRECT[id(k)] = _Direct(k) if _CACHED and not _is_autotuner(k) else _Plain(k)
    return d


def _is_autotuner(k) -> bool:
    return not isinstance(k, triton.runtime.jit.JITFunction)


class _Plain:
    """Triton's own launch (releases or kernel kinds the cached launch does not cover)."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid) -> Callable:
        return self.fn[grid]


class _Direct:
    """Cached launches of one JITFunction (see the module doc)."""

    __slots__ = ("fn", "cache", "runtime", "defaults", "pdl")

    def __init__(self, fn):
        self.fn = fn
        self.cache: Dict[Tuple, Any] = {}
        self.runtime = {p.name for p in fn.params if not p.is_constexpr}
        self.defaults = {p.name: p.default for p in fn.params}
        self.pdl = _has_pdl(fn)

    def __getitem__(self, grid) -> Callable:
        if callable(grid):  # (a grid of the meta-parameters: Triton's own launch)
            return self.fn[grid]
        return lambda *args, **meta: self.launch(grid, args, meta)

    def launch(self, grid, args, meta) -> None:
        dev = torch._C._cuda_getDevice()
        if self.pdl and "PDL" not in meta and _pdl_device(dev):  # (a caller's own PDL stands)
            meta = {**meta, **_PDL}
        if _hooked():
            self.fn[grid](*args, **meta)
            return
        key = _key(dev, args, meta)
        hit = self.cache.get(key)
        if hit is None:
            self._first(grid, args, meta, key)
            return
        run, function, packed, rest = hit
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(dev)
        run(grid[0], g1, g2, stream, function, packed, None, None, None, *args, *rest)

    def _first(self, grid, args, meta, key) -> None:
        """Triton's own launch (it compiles on a miss); the compiled kernel is kept for the key."""
        compiled = self.fn[grid](*args, **meta)
        if compiled is None or any(n in self.runtime and type(v) not in _SCALARS
                                   for n, v in meta.items()):  # fmt: skip
            return  # (a runtime tensor by keyword: the key holds keywords by value)
        names = self.fn.arg_names[len(args) :]
        rest = tuple(meta[n] if n in meta else self.defaults[n] for n in names)
        self.cache[key] = (compiled.run, compiled.function, compiled.packed_metadata, rest)


def _key(dev, args, meta) -> Tuple:
    key = [dev, *meta.items()]
    for a in args:
        c = a.__class__
        if c is int:
            key.append((a == 1, a & 15 == 0, _I32_MIN <= a <= _I32_MAX))
        elif c is _Tensor or isinstance(a, _Tensor):
            key.append(a.dtype)
            key.append(a.data_ptr() & 15 == 0)
        elif c in DESCRIPTORS:  # (Triton specializes on its dtype and tile)
            key.append((a.base.dtype, tuple(a.block_shape)))
        else:
            key.append(c)
    return tuple(key)


class Prepared:
    """One launch of kernel ``fn`` whose grid, trailing arguments ``tail`` and keywords ``meta``
    are fixed (a function of sizes, strides and dtypes: see :func:`memo`); call it with the
    leading tensor arguments. Launched as :func:`kernel` would, and on the direct path from its
    own cache of the compiled kernel, keyed by the device and each tensor's dtype and 16-byte
    alignment (the rest of Triton's specialization is fixed with the tail and meta)."""

    __slots__ = ("fn", "grid", "tail", "meta", "hits", "pdl")

    def __init__(self, fn, grid: Tuple, tail: Tuple, meta: Dict[str, Any]):
        self.fn = fn
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.tail = tuple(tail)
        self.pdl = _has_pdl(fn) and "PDL" not in meta
        # (PDL given off: Inductor's kernel wrapper wants every argument, defaults included)
        self.meta = {**meta, "PDL": False} if self.pdl else meta
        self.hits: Dict[Tuple, Any] = {}

    def __call__(self, *tensors) -> None:
        self._launch(tensors, _wrap_enabled())

    def untraced(self, *tensors) -> None:
        """The launch from code no trace ever runs (a dispatcher kernel's body, on real tensors):
        direct whatever the wrap_triton flag, which is on by default outside a triton op."""
        self._launch(tensors, False)

    def _direct_meta(self, dev: int) -> Dict[str, Any]:
        """The keywords of a direct launch on device ``dev``: PDL on where the kernel takes it."""
        return {**self.meta, **_PDL} if self.pdl and _pdl_device(dev) else self.meta

    def _launch(self, tensors, wrap: bool) -> None:
        if _INTERPRET or wrap:
            kernel(self.fn)[self.grid](*tensors, *self.tail, **self.meta)
            return
        if not _CACHED:
            direct(self.fn)[self.grid](*tensors, *self.tail, **self.meta)
            return
        dev = torch._C._cuda_getDevice()
        if _hooked():
            direct(self.fn)[self.grid](*tensors, *self.tail, **self._direct_meta(dev))
            return
        key = [dev]
        for t in tensors:
            if t.__class__ in DESCRIPTORS:  # (its tile is the meta's: fixed here)
                t = t.base
            key.append(t.dtype)
            key.append(t.data_ptr() & 15 == 0)
        key = tuple(key)
        hit = self.hits.get(key)
        if hit is None:
            args = (*tensors, *self.tail)
            meta = self._direct_meta(dev)
            d = direct(self.fn)
            d.launch(self.grid, args, meta)
            hit = d.cache.get(_key(dev, args, meta)) if isinstance(d, _Direct) else None
            if hit is not None:
                self.hits[key] = hit
            return
        run, function, packed, rest = hit
        g = self.grid
        stream = torch._C._cuda_getCurrentRawStream(dev)
        run(g[0], g[1], g[2], stream, function, packed, None, None, None, *tensors, *self.tail,
            *rest)  # fmt: skip


def memo(plan: Callable) -> Callable:
    """``plan(*args)`` cached on its arguments (sizes, strides, dtypes, flags: hashable); computed
    afresh when one is a SymInt (torch.compile's symbolic sizes are unhashable; traced once)."""
    cached = functools.lru_cache(maxsize=4096)(plan)

    @functools.wraps(plan)
    def get(*args):
        try:
            return cached(*args)
        except TypeError:  # (an unhashable SymInt among the arguments)
            return plan(*args)

    get.cache_clear = cached.cache_clear
    return get


def _hooked() -> bool:
    """A launch hook is installed (e.g. a Triton profiler): launches must go through Triton."""
    rt = triton.knobs.runtime
    for h in (rt.launch_enter_hook, rt.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):
            return True
    return False


_DIRECT: Dict[int, Any] = {}
