"""Stage contracts: each op declares the metadata it accepts once, and its checks derive from that.

A :class:`Contract` lists an op's parameters and the steps that constrain them, in the order the
full check reports them: :class:`Tensor` arguments (dtypes, rank or shape in terms of other
arguments' dims and static ints, optional, same device as the first tensor), static arguments
(:class:`Choice`, :class:`PositiveInt`, :class:`Multiple`), and the few rules a table cannot say
(:class:`Rule`, :class:`Case` for a branch on an argument, :class:`Let` for a derived value).
Expressions are Python source over the parameters (``"x.shape[0]"``, ``"w.shape[0] + 1"``) and the
contract's constants.

From the one declaration come three functions, generated once per contract:

- ``ok(*args)``: the one-pass metadata check (bool), each tensor attribute read once, devices
  compared as ints (``get_device``), dtypes by identity; no per-call allocation beyond the frame.
- ``direct(*args)``: ``ok`` and every tensor a plain ``torch.Tensor`` without grad on the first
  tensor's CUDA device: with :func:`epmoe._eager.calm` a public function may then launch straight
  away.
- ``check(*args)``: ``ok`` or raise the first violation as ``ValueError("op: arg expected X, got
  Y")`` (:mod:`epmoe._checks`). Metadata only, so fake implementations call it too (no data_ptr,
  no value read).

Value checks (ids in range, capacities) are not metadata: they stay in the kernels and
:func:`epmoe._checks.check_values`.
"""

import re
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

from epmoe import _checks

Expr = Union[str, int]
Message = Union[str, Callable[["_Args"], object]]


class _Bad(Exception):
    """Raised by the generated ``check`` on its first failed test (then the full check runs)."""


_ERRORS = (AttributeError, TypeError, IndexError, KeyError, ZeroDivisionError, _Bad)
_SHAPE_REF = re.compile(r"\b([A-Za-z_]\w*)\.shape\b")


class _Args(dict):
    """The full check's namespace: parameters, derived values and constants, also as attributes
    (for the message callables of :class:`Rule`)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class _Gen:
    """Code generation state of one function: constants, bound shapes, indentation."""

    def __init__(self, contract: "Contract", direct: bool, fail: str, cuda_attr: str):
        self.c, self.direct, self.fail, self.cuda_attr = contract, direct, fail, cuda_attr
        self.lines: List[str] = []
        self.depth = 2
        self.shapes: Dict[str, str] = {}  # (and "<device>" once _D is bound)

    def const(self, value) -> str:
        name = f"_c{len(self.c._globals)}"
        self.c._globals[name] = value
        return name

    def expr(self, src: Expr) -> str:
        if isinstance(src, int):
            return str(src)
        return _SHAPE_REF.sub(lambda m: self.shapes.get(m.group(1), m.group(0)), src)

    def line(self, text: str) -> None:
        self.lines.append("    " * self.depth + text)

    def unless(self, cond: str) -> None:
        self.line(f"if not ({cond}): {self.fail}")

    def block(self, head: str, steps: Sequence["_Step"]) -> None:
        self.line(head)
        saved = dict(self.shapes)
        self.depth += 1
        self.line("pass")
        for step in steps:
            step.emit(self)
        self.depth -= 1
        self.shapes = saved


def _eval(src: Expr, ns: _Args):
    return src if isinstance(src, int) else eval(_compiled(src), ns)  # noqa: S307 (own source)


_CODE: Dict[str, object] = {}


def _compiled(src: str):
    code = _CODE.get(src)
    if code is None:
        code = _CODE[src] = compile(src, f"<contract {src}>", "eval")
    return code


def _message(m: Message, ns: _Args):
    return m(ns) if callable(m) else m


class _Step:
    def emit(self, g: _Gen) -> None:
        raise NotImplementedError

    def full(self, op: str, ns: _Args) -> None:
        raise NotImplementedError


class Shape(_Step):
    """Tensor ``name`` has this shape: a tuple of int / expression / None (any size) entries, or
    one expression giving the whole shape (``"inv_perm.shape"``, ``"(*a.shape[:-1], 1)"``)."""

    def __init__(self, name: str, shape: Union[str, Sequence[Optional[Expr]]]):
        self.name, self.shape = name, shape

    def emit(self, g: _Gen) -> None:
        s = g.shapes.get(self.name, f"{self.name}.shape")
        if isinstance(self.shape, str):
            g.unless(f"{s} == {g.expr(self.shape)}")
            return
        parts = [f"len({s}) == {len(self.shape)}"]
        parts += [f"{s}[{i}] == {g.expr(e)}" for i, e in enumerate(self.shape) if e is not None]
        g.unless(" and ".join(parts))

    def full(self, op: str, ns: _Args) -> None:
        if isinstance(self.shape, str):
            want = tuple(_eval(self.shape, ns))
        else:
            want = tuple(None if e is None else _eval(e, ns) for e in self.shape)
        _checks.check_shape(op, self.name, ns[self.name], want)


class Tensor(_Step):
    """A tensor argument: dtype among ``dtypes`` (a tuple, or an expression giving one), rank among
    ``ndim`` or ``shape`` (see :class:`Shape`), on the first tensor's device (``device=False``:
    not checked), None allowed when ``optional``."""

    def __init__(
        self,
        name: str,
        dtypes: Union[None, str, Sequence[torch.dtype]],
        ndim: Optional[Sequence[int]] = None,
        shape: Union[None, str, Sequence[Optional[Expr]]] = None,
        optional: bool = False,
        device: bool = True,
    ):
        self.name, self.dtypes, self.ndim, self.optional, self.device = (
            name, dtypes if dtypes is None or isinstance(dtypes, str) else tuple(dtypes), ndim,
            optional, device,
        )  # fmt: skip
        self.shape = None if shape is None else Shape(name, shape)
        # integer tensors cannot require grad: the direct check skips the read for them
        self.grad = not isinstance(self.dtypes, tuple) or any(
            d.is_floating_point for d in self.dtypes
        )

    def emit(self, g: _Gen) -> None:
        if self.optional:
            g.block(f"if {self.name} is not None:", [_Required(self)])
        else:
            _Required(self).emit(g)

    def full(self, op: str, ns: _Args) -> None:
        t = ns[self.name]
        if self.optional and t is None:
            return
        if self.dtypes is None:
            _checks.check_tensor(op, self.name, t)
        else:
            dtypes = _eval(self.dtypes, ns) if isinstance(self.dtypes, str) else self.dtypes
            _checks.check_dtype(op, self.name, t, dtypes)
        if self.ndim is not None:
            _checks.check_ndim(op, self.name, t, tuple(self.ndim))
        if self.shape is not None:
            self.shape.full(op, ns)
        first = ns["__first__"]
        if self.device and self.name != first:
            _checks.check_device(op, self.name, t, ns[first])


class _Required(_Step):
    """The generated tests of a (present) Tensor."""

    def __init__(self, t: Tensor):
        self.t = t

    def emit(self, g: _Gen) -> None:
        t, n = self.t, self.t.name
        first = n == g.c.first
        if g.direct:  # plain tensors without grad (see _eager.calm), the first on CUDA
            test = f"type({n}) is _Tensor" + (f" and not {n}.requires_grad" if t.grad else "")
            g.unless(test + (f" and {n}.{g.cuda_attr}" if first else ""))
        if t.dtypes is None:
            pass
        elif isinstance(t.dtypes, str):
            g.unless(f"{n}.dtype in ({g.expr(t.dtypes)})")
        elif len(t.dtypes) == 1:
            g.unless(f"{n}.dtype is {g.const(t.dtypes[0])}")
        else:
            g.unless(f"{n}.dtype in {g.const(t.dtypes)}")
        if t.shape is not None or n in g.c._shape_refs:  # (read once, kept for later steps)
            g.line(f"_S_{n} = {n}.shape")
            g.shapes[n] = f"_S_{n}"
        if t.ndim is not None:
            nd = tuple(t.ndim)
            rank = f"len(_S_{n})" if n in g.shapes else f"{n}.dim()"
            g.unless(f"{rank} == {nd[0]}" if len(nd) == 1 else f"{rank} in {nd}")
        if t.shape is not None:
            t.shape.emit(g)
        if t.device and not first:
            if "<device>" not in g.shapes:  # the first tensor's device, read where first needed
                f = g.c.first
                g.line(f"_D = {f}.get_device()")
                if not g.direct:  # CPU and meta share get_device() -1: compare those as devices
                    g.line(f"_XD = None if _D >= 0 else {f}.device")
                g.shapes["<device>"] = "_D"
            same = f"{n}.get_device() == _D"
            g.unless(same if g.direct else f"{same} if _XD is None else {n}.device == _XD")


class Choice(_Step):
    """Static argument ``name`` is one of ``choices``."""

    def __init__(self, name: str, choices: Sequence[object]):
        self.name, self.choices = name, tuple(choices)

    def emit(self, g: _Gen) -> None:
        g.unless(f"{self.name} in {g.const(self.choices)}")

    def full(self, op: str, ns: _Args) -> None:
        _checks.check_choice(op, self.name, ns[self.name], self.choices)


class PositiveInt(_Step):
    """Static argument ``name`` (reported as ``label``, default the name) is a positive int, not
    a bool."""

    def __init__(self, name: str, label: Optional[str] = None):
        self.name, self.label = name, label or name

    def emit(self, g: _Gen) -> None:
        g.unless(f"type({self.name}) is int and {self.name} > 0")

    def full(self, op: str, ns: _Args) -> None:
        _checks.check_positive_int(op, self.label, ns[self.name])


class Multiple(_Step):
    """``value`` (an expression, reported as ``label``) is a multiple of ``of``."""

    def __init__(self, label: str, value: Expr, of: Expr, why: str = ""):
        self.label, self.value, self.of, self.why = label, value, of, why

    def emit(self, g: _Gen) -> None:
        g.unless(f"({g.expr(self.value)}) % ({g.expr(self.of)}) == 0")

    def full(self, op: str, ns: _Args) -> None:
        v, of = _eval(self.value, ns), _eval(self.of, ns)
        _checks.check_multiple(op, self.label, v, of, self.why)


class Rule(_Step):
    """``cond`` (an expression) holds, else ``arg`` expected ``expected``, got ``got`` (strings,
    or callables of the arguments, e.g. ``lambda a: list(a.w.shape)``)."""

    def __init__(self, cond: str, arg: str, expected: Message, got: Message):
        self.cond, self.arg, self.expected, self.got = cond, arg, expected, got

    def emit(self, g: _Gen) -> None:
        g.unless(g.expr(self.cond))

    def full(self, op: str, ns: _Args) -> None:
        if not _eval(self.cond, ns):
            raise _checks.fail(op, self.arg, _message(self.expected, ns), _message(self.got, ns))


class Case(_Step):
    """The steps ``then`` when ``cond`` holds, else ``otherwise``."""

    def __init__(self, cond: str, then: Sequence[_Step], otherwise: Sequence[_Step] = ()):
        self.cond, self.then, self.otherwise = cond, tuple(then), tuple(otherwise)

    def emit(self, g: _Gen) -> None:
        g.block(f"if {g.expr(self.cond)}:", self.then)
        if self.otherwise:
            g.block("else:", self.otherwise)

    def full(self, op: str, ns: _Args) -> None:
        for step in self.then if _eval(self.cond, ns) else self.otherwise:
            step.full(op, ns)


class Let(_Step):
    """A derived value ``name = expr`` for the steps after it."""

    def __init__(self, name: str, expr: str):
        self.name, self.src = name, expr

    def emit(self, g: _Gen) -> None:
        g.line(f"{self.name} = {g.expr(self.src)}")

    def full(self, op: str, ns: _Args) -> None:
        ns[self.name] = _eval(self.src, ns)


def _sources(steps: Sequence[_Step]):
    """Every expression of the steps (to find the shapes later steps read)."""
    for s in steps:
        if isinstance(s, Case):
            yield s.cond
            yield from _sources(s.then + s.otherwise)
        elif isinstance(s, Tensor):
            yield s.dtypes if isinstance(s.dtypes, str) else None
            if s.shape is not None:
                yield from _sources([s.shape])
        elif isinstance(s, Shape):
            yield from [s.shape] if isinstance(s.shape, str) else s.shape
        else:
            yield from (getattr(s, a, None) for a in ("cond", "value", "of", "src"))


def masked_m_steps(x: str) -> List[_Step]:
    """masked_m: None, or (for a 3-D ``x``) int32/int64 `[E]` on x's device."""
    rank = Rule(f"len({x}.shape) == 3", "masked_m", f"None for a 2-D {x}", "a tensor")
    t = Tensor("masked_m", _checks.INDEX_DTYPES, shape=(f"{x}.shape[0]",))
    return [Case("masked_m is not None", [rank, t])]


def _tensors(steps: Sequence[_Step]):
    for s in steps:
        if isinstance(s, Tensor):
            yield s
        elif isinstance(s, Case):
            yield from _tensors(s.then + s.otherwise)


class Contract:
    """The metadata contract of one op (see the module docstring).

    Args:
        op: the op's name in messages.
        params: its parameter names in call order, space-separated (tensors, static arguments,
            and values the caller supplies such as a communicator's ``hidden_size``).
        *steps: Tensor / Shape / Choice / PositiveInt / Multiple / Rule / Case / Let, in the order
            the full check reports them; the first Tensor is the device reference.
        consts: names the expressions may use besides the parameters (``torch`` always).
    """

    def __init__(self, op: str, params: str, *steps: _Step, consts: Optional[dict] = None):
        self.op, self.params, self.steps = op, tuple(params.split()), steps
        tensors = list(_tensors(steps))
        self.first = tensors[0].name if tensors else None
        srcs = [e for e in _sources(steps) if isinstance(e, str)]
        self._shape_refs = {m.group(1) for e in srcs for m in _SHAPE_REF.finditer(e)}
        self.consts = dict(torch=torch, **(consts or {}))
        self._globals = dict(self.consts, _Tensor=torch.Tensor, _ERRORS=_ERRORS, _Bad=_Bad)
        self._globals["_full"] = self.full
        self.ok = self._build("ok", direct=False)
        self.direct = self._build("direct", direct=True)
        self.check = self._build("check", direct=False)

    def _build(self, kind: str, direct: bool, cuda_attr: str = "is_cuda") -> Callable:
        """Generate ``ok``, ``direct`` or ``check`` (``cuda_attr``: the device test of ``direct``,
        a knob for timing the check on CPU tensors)."""
        fail = "raise _Bad" if kind == "check" else "return False"
        g = _Gen(self, direct, fail, cuda_attr)
        for step in self.steps:
            step.emit(g)
        sig = ", ".join(self.params)
        head = [f"def {kind}({sig}):", "    try:"]
        if kind == "check":
            tail = ["        return", "    except _ERRORS:", "        pass", f"    _full({sig})"]
        else:
            tail = ["        return True", "    except _ERRORS:", "        return False"]
        src = "\n".join(head + (g.lines or ["        pass"]) + tail)
        ns = self._globals
        exec(compile(src, f"<contract {self.op} {kind}>", "exec"), ns)  # noqa: S102 (own source)
        fn = ns.pop(kind)
        fn.__doc__ = f"{self.op}: the contract's {kind} (generated from its declaration)."
        fn.source = src
        return fn

    def full(self, *args) -> None:
        """The full check: raise the first violation (in declaration order) as a ValueError."""
        ns = _Args(self.consts)
        ns.update(zip(self.params, args, strict=True))
        ns["__first__"] = self.first
        for step in self.steps:
            step.full(self.op, ns)


__all__ = [
    "Case", "Choice", "Contract", "Let", "Multiple", "PositiveInt", "Rule", "Shape", "Tensor",
    "masked_m_steps",
]  # fmt: skip
