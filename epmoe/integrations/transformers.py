"""Hugging Face transformers experts backends that run :class:`epmoe.EPMoE`.

One call, then any model whose experts class uses ``@use_experts_implementation``::

    import epmoe.integrations.transformers as et

    et.register()
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="epmoe")
    # or from_pretrained(..., experts_implementation="epmoe"), model.set_experts_implementation(...)

Importing this module imports nothing from transformers; :func:`register` does. Backend names (the
name picks the compute scheme):

* ``"epmoe"``: bf16. A bf16 model's ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` are
  epmoe's ``w1`` / ``w2`` already and are used in place (no second copy of the expert weights).
* ``"epmoe_fp8"``: fp8 e4m3 W8A8 (weights per 128x128 block, activations per token per 128
  channels), quantized once; H and I must be multiples of 128.
* ``"epmoe_int8"``: int8 W8A8 (weights per output channel, activations per token), quantized once.

FP8 checkpoints (FineGrainedFP8, 128x128 block scales) dispatch through transformers' second
registry, ``ALL_FP8_EXPERTS_FUNCTIONS``, where the same names are registered: ``"epmoe"`` and
``"epmoe_fp8"`` run the checkpoint's own float8_e4m3fn weights and float32 ``*_scale_inv`` block
scales as they are (HF's ``scale_inv`` multiplies the fp8 code to dequantize, exactly epmoe's
weight scale: :func:`epmoe.reference.dequantize_weights`), ``"epmoe_int8"`` re-quantizes them once.

Per experts module the epmoe state (the :class:`~epmoe.EPMoE` layer, its quantized weights in the
GEMM layout, the mode) is built on the first call and cached on the module (not as a submodule: it
is in no ``state_dict`` and ``.to()`` does not see it). Every eager call compares the source
parameters with what the cache was built from (object, ``data_ptr()``, ``_version``, dtype, device,
shape: no data read, no host sync) and rebuilds on a change: ``load_state_dict`` (in-place copies
bump ``_version``), ``.to()``, reassigned parameters. A rebuild of a quantized cache with unchanged
shapes writes into the same buffers, so captured CUDA graphs stay valid; the call's size never
rebuilds it (a compiled decode step sees the same static inputs at every batch size). Not detectable
without reading the data: writes through ``param.data`` (a tensor with its own version counter);
bf16 caches see those anyway (they are the parameters), quantized ones need :func:`refresh`. Under
``torch.compile`` the check runs when a graph is traced (the build happens then, outside the graph,
so ``fullgraph=True`` holds); after changing the weights of a compiled model call :func:`refresh`.

Each call picks the per-choice GEMVs for a few tokens (``EPMoE.gemv_max_tokens``), LL
(masked layout) for at most ``ll_max_tokens`` tokens and HT (contiguous) above
(``EPMoE(mode="auto")``, a choice from the shape, so a captured decode graph stays valid), on one
process with the local backend. transformers' expert parallelism (``_is_expert_parallel``: the
module holds its rank's experts, routes to other ranks carry ids >= ``num_experts``) maps to -1
routing.

The experts' gate is recognized by what it computes: the class's ``_apply_gate`` (or, without a
gate projection, its ``act_fn``) runs once on a probe and is compared with the gates
:class:`epmoe.gate.Gate` spells (SiLU / GELU-tanh / GELU / ReLU / ReLU² GLUs, gpt-oss's clamped
SwiGLU with alpha, limit and ``up + 1``, a clamp after the activation, Inkling2's softcapped
SwiGLU, no gate half), with alpha, limit and the softcaps read from the module's attributes
(the softcaps also from its ``act_fn``'s). Expert biases run in the kernels (gate/up bias before
the gate, down bias in the weighted gather). Transposed and interleaved gate/up weights are
rearranged once when the state is built; bf16 weights that need no rearrangement stay in place.

Experts epmoe cannot run exactly (a gate none of those equal; a post-expert norm; FP8 checkpoints
with other block sizes, static activation scales, biases or rearranged weights...) run
transformers' own backend (``fallback``, "grouped_mm" by default) with one warning per experts
class naming the reason. So do calls that need gradients (epmoe's ops have no
backward): run inference under ``torch.no_grad()`` / ``torch.inference_mode()`` (``generate()``
does).

Activations: EPMoE computes on bf16 ``[T, H]``; other input dtypes are converted in and out (a
float32 model's experts then run with bf16 weights and activations; the rest of the model stays
float32).

Accuracy (tests/integrations/test_transformers.py, tiny random models of every discovered class,
eager's routing): relative L2 of the logits vs eager <= 1e-2 (bf16), 3e-2 (int8), 8e-2 (fp8).
Greedy tokens of a float32 model equal eager's except at near-ties (eager's top-2 logits closer
than the bf16 experts' error), which the experts' bf16 math can flip.
"""

import ctypes
import inspect
import itertools
import numbers
import warnings
import weakref
from typing import Callable, Dict, Optional, Tuple

import torch

from epmoe import _checks, quant, reference
from epmoe import gate as _gate
from epmoe.layer import DEFAULT_ALIGNMENT, EPMoE
from epmoe.ops import gemm

# backend name -> compute scheme: "epmoe" bf16, "epmoe_<scheme>" each quantized scheme
NAMES: Dict[str, quant.QuantScheme] = {
    "epmoe": quant.BF16,
    **{f"epmoe_{s}": s for s in quant.QUANTIZED},
}
FALLBACKS = ("grouped_mm", "batched_mm", "eager")
FP8_BLOCK = quant.FP8.weight_block
_STATE = "_epmoe_state"  # attribute of the experts module holding its _State
_CONFIG = {"fallback": "grouped_mm", "ll_max_tokens": None}
_REGISTRIES: Dict[bool, object] = {}  # fp8 registry? -> transformers' ExpertsInterface instance
_WARNED = set()  # (experts class, reason, fallback) already warned about
# the decorator's options epmoe runs either way (the weights are arranged at build)
_LAYOUT_OPTIONS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")
# the decorator's options epmoe runs one way: the value it runs, and the reason to fall back
_KNOWN_OPTIONS = {
    "has_post_expert_norm": (False, "a post-expert norm (has_post_expert_norm=True)"),
}
# module attributes a gate's alpha / limit are read from (gpt-oss, MiniMax-M3, DeepSeek-V4, ...)
_ALPHA_ATTRS = ("alpha", "swiglu_alpha")
_LIMIT_ATTRS = ("limit", "swiglu_limit")
# the softcaps: attributes of the module (FP8Experts: floats) or of its act_fn (Inkling2's
# SoftcappedSwiGLU: Softcap modules, each holding its ``softcap``)
_GATE_SOFTCAP_ATTRS, _UP_SOFTCAP_ATTRS = ("gate_softcap",), ("up_softcap",)
_NEW_OPTIONS: Dict[str, object] = {}  # options of the installed decorator epmoe does not know
_CALL = ("hidden_states", "top_k_index", "top_k_weights")  # the experts calling convention
# other spellings of the same arguments (gpt-oss: the router's top-k indices and their weights)
_CALL_SYNONYMS = {"router_indices": "top_k_index", "routing_weights": "top_k_weights"}


def register(fallback: str = "grouped_mm", ll_max_tokens: Optional[int] = None) -> Tuple[str, ...]:
    """Register the epmoe experts backends with transformers (idempotent; a later call updates
    the settings).

    Args:
        fallback: transformers' backend for experts epmoe cannot run exactly: "grouped_mm"
            (transformers' default), "batched_mm" or "eager" (the class's own forward).
        ll_max_tokens: calls of at most this many tokens take the LL (masked) path, larger ones
            HT (default: the layer's, :data:`epmoe.layer.AUTO_LL_MAX_TOKENS`).
    Returns:
        The registered names: ("epmoe", "epmoe_fp8", "epmoe_int8").
    """
    _checks.check_choice("register", "fallback", fallback, FALLBACKS)
    if ll_max_tokens is not None:
        _checks.check_positive_int("register", "ll_max_tokens", ll_max_tokens)
    from transformers.integrations import moe

    _CONFIG.update(fallback=fallback, ll_max_tokens=ll_max_tokens)
    _NEW_OPTIONS.clear()
    known = (*_KNOWN_OPTIONS, *_LAYOUT_OPTIONS, "experts_interface")
    for p in inspect.signature(moe.use_experts_implementation).parameters.values():
        if p.kind == p.KEYWORD_ONLY and p.name not in known:
            _NEW_OPTIONS[p.name] = p.default  # a newer transformers: its default is what we know
    _REGISTRIES[False] = moe.ALL_EXPERTS_FUNCTIONS
    for name, scheme in NAMES.items():
        moe.ExpertsInterface.register(name, _make_backend(name, scheme, fp8=False))
    try:
        from transformers.integrations import finegrained_fp8
    except ImportError:  # a transformers build without the FP8 integration
        finegrained_fp8 = None
    fp8_registry = getattr(finegrained_fp8, "ALL_FP8_EXPERTS_FUNCTIONS", None)
    if fp8_registry is not None:
        _REGISTRIES[True] = fp8_registry
        for name, scheme in NAMES.items():
            type(fp8_registry).register(name, _make_backend(name, scheme, fp8=True))
    return tuple(NAMES)


def refresh(model: torch.nn.Module) -> int:
    """Rebuild the epmoe state of every experts module of ``model`` that has one, now (after
    weights changed in a way the per-call check cannot see, or under torch.compile). Quantized
    weights are written into the existing buffers when their shapes are unchanged.

    Returns:
        The number of experts modules rebuilt.
    """
    n = 0
    for m in model.modules():
        st = m.__dict__.get(_STATE)
        if st is not None and st.layer is not None:
            st.snapshot = None
            _prepare(m, st.name, NAMES[st.name], st.fp8, st.layer.top_k, False)
            n += 1
    return n


def cached_layer(module: torch.nn.Module) -> Optional[EPMoE]:
    """The EPMoE layer cached on an experts module, or None (not built yet, or a fallback)."""
    st = module.__dict__.get(_STATE)
    return None if st is None else st.layer


class _State:
    """What one experts module runs: an EPMoE layer, or transformers' fallback (reason set)."""

    def __init__(self, name: str, fp8: bool):
        self.name, self.fp8 = name, fp8
        self.layer: Optional[EPMoE] = None
        self.key = None  # the layer's configuration
        self.reason: Optional[str] = None
        self.gate: Optional[_gate.Gate] = None  # the recognized gate
        self.snapshot = None  # the source parameters the state was built from
        self.fallback: Optional[Callable] = None

    def __deepcopy__(self, memo):
        # a copied model has other parameters: its copy rebuilds on the first call
        return _State(self.name, self.fp8)

    def __getstate__(self):
        return {"name": self.name, "fp8": self.fp8}

    def __setstate__(self, d):
        self.__init__(d["name"], d["fp8"])


def _make_backend(name: str, scheme: quant.QuantScheme, fp8: bool) -> Callable:
    scheme_name = scheme.name  # (a constant argument of _prepare_by_id under torch.compile)

    def experts_forward(self, hidden_states, top_k_index, top_k_weights):
        """transformers experts backend: hidden_states float `[T, H]`, top_k_index int `[T, K]`,
        top_k_weights float `[T, K]` -> `[T, H]` in hidden_states' dtype."""
        needs_grad = torch.is_grad_enabled() and _wants_grad(self, hidden_states, fp8)
        # the module goes in by id: torch.compile (2.11) folds only constant arguments of an
        # assume_constant_result function, and id() of a module is one
        use = _prepare_by_id(id(self), name, scheme_name, fp8, top_k_index.shape[-1], needs_grad)
        st = getattr(self, _STATE)
        if not use:
            return st.fallback(self, hidden_states, top_k_index, top_k_weights)
        return _run(st.layer, self, hidden_states, top_k_index, top_k_weights)

    experts_forward.__name__ = experts_forward.__qualname__ = f"{name}_experts_forward"
    experts_forward.__doc__ += f" (epmoe scheme {scheme_name!r}{', FP8 checkpoint' if fp8 else ''})"
    return experts_forward


def _wants_grad(module, hidden_states, fp8: bool) -> bool:
    if hidden_states.requires_grad:
        return True
    if fp8:  # FP8 checkpoint weights are not trained through
        return False
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(module, name, None)
        if isinstance(w, torch.Tensor) and w.requires_grad:
            return True
    return False


def _run(layer: EPMoE, module, x, top_k_index, top_k_weights):
    shape, dtype = x.shape, x.dtype
    x = x.reshape(-1, shape[-1])
    if dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)
    T = x.shape[0]
    ids = top_k_index.reshape(T, -1).to(torch.int64).contiguous()
    w = top_k_weights.reshape(T, -1).to(torch.float32).contiguous()
    if getattr(module, "_is_expert_parallel", False):  # routes to other ranks' experts
        ids = ids.masked_fill(ids >= module.num_experts, -1)
    pad = layer.top_k - ids.shape[1]
    if pad > 0:  # fewer choices than the layer was built for (e.g. an EP placeholder call)
        ids = torch.nn.functional.pad(ids, (0, pad), value=-1)
        w = torch.nn.functional.pad(w, (0, pad))
    out = layer(x.contiguous(), ids, w)
    if dtype != torch.bfloat16:
        out = out.to(dtype)
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------- state
@torch._dynamo.assume_constant_result  # under torch.compile: runs once at trace time, not traced
def _prepare_by_id(
    key: int, name: str, scheme: str, fp8: bool, top_k: int, needs_grad: bool
) -> bool:
    """:func:`_prepare` of the live module whose id() is ``key`` (the caller holds it)."""
    module = ctypes.cast(key, ctypes.py_object).value
    return _prepare(module, name, scheme, fp8, top_k, needs_grad)


def _prepare(module, name: str, scheme, fp8: bool, top_k: int, needs_grad: bool) -> bool:
    """Make sure ``module`` has a current _State for backend ``name`` (``scheme``: its scheme or
    the scheme's name); True: run its EPMoE layer, False: run its fallback."""
    scheme = quant.get(scheme)
    st = module.__dict__.get(_STATE)
    if st is None or st.name != name or st.fp8 != fp8:  # a new name drops the old layer
        st = _State(name, fp8)
        object.__setattr__(module, _STATE, st)  # a plain attribute: no submodule, no state_dict
    st.fallback = _fallback_fn(module, fp8)
    if needs_grad:
        _warn_once(
            type(module),
            "this call needs gradients and epmoe's ops have no backward (run inference under "
            "torch.no_grad() or torch.inference_mode())",
        )
        return False
    snap = _snapshot(module, fp8)
    layer_ok = st.layer is None or (
        st.layer.top_k >= top_k and st.key[-1] == _CONFIG["ll_max_tokens"]
    )
    if st.snapshot == snap and layer_ok:
        if st.reason is not None:
            _warn_once(type(module), st.reason)
        return st.reason is None
    st.reason = _unsupported(module, scheme, fp8)
    if st.reason is not None:
        st.layer, st.key, st.snapshot = None, None, snap
        _warn_once(type(module), st.reason)
        return False
    _build(st, module, scheme, fp8, top_k)
    st.snapshot = snap
    return True


def _w1_name(module) -> str:
    return "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"


def _sources(module, fp8: bool):
    """(w1, w2, b1, b2[, s1, s2]) as the module holds them (None where absent)."""
    up = _w1_name(module)
    names = (up, "down_proj", up + "_bias", "down_proj_bias")
    if fp8:
        names += (up + "_scale_inv", "down_proj_scale_inv")
    out = [getattr(module, n, None) for n in names]
    if not getattr(module, "has_bias", False):
        out[2] = out[3] = None
    return tuple(out)


def _arranged(module):
    """(w1 `[E, width, H]`, w2 `[E, H, I]`, b1 `[E, width]` or None, b2 `[E, H]` or None) in
    epmoe's layout: the module's own tensors (detached) where its layout is epmoe's, transposed
    views, and one rearranged copy of interleaved gate/up rows."""
    w1, w2, b1, b2 = (None if t is None else t.detach() for t in _sources(module, False))
    if getattr(module, "is_transposed", False):  # stored `[E, H, width]` / `[E, I, H]`
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    if getattr(module, "has_gate", True) and not getattr(module, "is_concatenated", True):
        w1 = torch.cat((w1[:, 0::2], w1[:, 1::2]), dim=1)  # rows g0, u0, g1, u1, ... -> g..., u...
        if b1 is not None:
            b1 = torch.cat((b1[:, 0::2], b1[:, 1::2]), dim=1)
    return w1, w2, b1, b2


def _snapshot(module, fp8: bool):
    """What the cache depends on, read without touching the data."""
    out = []
    for t in _sources(module, fp8):
        if not isinstance(t, torch.Tensor):
            out.append(None)
            continue
        try:
            version = t._version
        except RuntimeError:  # inference tensors have no version counter
            version = None
        try:
            ptr = t.data_ptr()
        except RuntimeError:  # e.g. a DTensor
            ptr = None
        out.append((weakref.ref(t), ptr, version, t.dtype, t.device, tuple(t.shape)))
    return tuple(out)


def _fallback_fn(module, fp8: bool) -> Callable:
    name = _CONFIG["fallback"]
    if name == "eager":
        return type(module).forward.__wrapped__  # the class's own forward, under the decorator
    return _REGISTRIES[fp8][name]


def _warn_once(cls: type, reason: str) -> None:
    key = (cls, reason, _CONFIG["fallback"])
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(
        f"epmoe: {cls.__name__} runs transformers' {_CONFIG['fallback']!r} experts backend "
        f"instead: {reason}",
        UserWarning,
        stacklevel=4,
    )


def _runs(scheme: quant.QuantScheme, fp8: bool) -> quant.QuantScheme:
    """The scheme the layer runs: an FP8 checkpoint runs as fp8 (its own codes and scales) on the
    bf16 backend, requantized on the other quantized ones."""
    return quant.FP8 if fp8 and not scheme.quantized else scheme


def _unsupported(module, scheme, fp8: bool) -> Optional[str]:
    """Why ``module`` cannot run as gate(x W1^T + b1) W2^T + b2 on EPMoE, or None (``scheme``: the
    backend's scheme or its name)."""
    scheme = quant.get(scheme)
    for attr, (ok, reason) in _KNOWN_OPTIONS.items():
        if bool(getattr(module, attr, ok)) != ok:
            return reason
    for attr, default in _NEW_OPTIONS.items():
        value = getattr(module, attr, default)
        if value != default:
            return f"experts option {attr}={value!r}, which epmoe does not know"
    why = _calling_convention(type(module))
    if why:
        return why
    gate, why = _recognize_gate(module)
    if why:
        return why
    w1, w2, b1, b2 = _sources(module, False)[:4]
    up = _w1_name(module)
    if not (isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor)):
        return f"no {up} / down_proj tensors"
    if any(type(t).__name__ == "DTensor" for t in (w1, w2, b1, b2)):
        return "sharded (DTensor) expert weights"
    if w1.dim() != 3 or w2.dim() != 3:
        return f"{up} {tuple(w1.shape)} / down_proj {tuple(w2.shape)} not 3-D"
    transposed = getattr(module, "is_transposed", False)
    E, width, H = (w1.shape[0], w1.shape[2], w1.shape[1]) if transposed else tuple(w1.shape)
    I = gate.inter(width)
    if gate.width(I) != width:
        return f"{up} {tuple(w1.shape)} has an odd gate/up width {width}"
    want = (E, I, H) if transposed else (E, H, I)
    if tuple(w2.shape) != want:
        return f"down_proj {tuple(w2.shape)} is not {want} for {up} {tuple(w1.shape)}"
    if getattr(module, "has_bias", False):
        for name, b, n in ((up + "_bias", b1, width), ("down_proj_bias", b2, H)):
            if not isinstance(b, torch.Tensor) or tuple(b.shape) != (E, n):
                got = tuple(b.shape) if isinstance(b, torch.Tensor) else b
                return f"{name} {got}, not {(E, n)}"
    if getattr(module, "num_experts", E) != E:
        return f"{E} experts in {up} but num_experts={module.num_experts}"
    devices = {t.device for t in (w1, w2, b1, b2) if t is not None}
    if len(devices) != 1 or w1.device.type not in ("cpu", "cuda"):
        return f"weights on {', '.join(sorted(map(str, devices)))}"
    if fp8:
        return _fp8_unsupported(module, E, H, I)
    if any(t.dtype not in _checks.FLOAT_DTYPES for t in (w1, w2, b1, b2) if t is not None):
        return f"expert weights of dtype {w1.dtype} / {w2.dtype}"
    return None


def _recognize_gate(module) -> Tuple[Optional[_gate.Gate], Optional[str]]:
    """(the :class:`epmoe.gate.Gate` the module's gate computes, None) or (None, why not): its
    ``_apply_gate`` (``act_fn`` without a gate half) runs on a probe that crosses every clamp,
    and the gates spelled from its attributes are compared with what it returns."""
    cls = type(module)
    has_gate = bool(getattr(module, "has_gate", True))
    g = torch.Generator().manual_seed(0)
    n = 64
    gate = torch.cat((torch.linspace(-12.0, 12.0, n), torch.randn(3 * n, generator=g) * 4))
    up = torch.cat((torch.linspace(12.0, -12.0, n), torch.randn(3 * n, generator=g) * 4))
    gate, up = gate.reshape(4, n), up.reshape(4, n)
    try:
        with torch.no_grad():
            if not has_gate:
                out = module.act_fn(up.clone())
            else:
                interleaved = not getattr(module, "is_concatenated", True)
                y = (
                    torch.stack((gate, up), -1).flatten(1)
                    if interleaved
                    else torch.cat((gate, up), 1)
                )
                out = cls._apply_gate(module, y)
    except Exception as e:  # a gate that needs more than a float32 CPU tensor
        return None, f"its gate could not be probed ({type(e).__name__}: {e})"
    y = torch.cat((gate, up), 1) if has_gate else up
    if isinstance(out, torch.Tensor) and out.shape == (4, n):
        for cand in _candidates(module, has_gate):
            if torch.allclose(out.float(), cand.reference(y), rtol=1e-5, atol=1e-6):
                return cand, None
    if not has_gate:
        act = getattr(module, "act_fn", None)
        name = getattr(act, "__name__", type(act).__name__)
        return None, f"activation {name} (no gate projection), none of {', '.join(_gate.ACTS)}"
    return None, f"its gate ({cls.__name__}._apply_gate) computes none of epmoe's gates"


def _candidates(module, has_gate: bool):
    """The gates to compare a module's with, plain SiLU first: every act, and alpha / limit /
    softcaps from the module's attributes (the softcaps also from its act_fn's)."""
    if not has_gate:
        return [_gate.Gate(act, glu=False) for act in _gate.ACTS]

    def values(attrs, keep, owners=(module,)):
        found = (getattr(o, a, None) for o in owners for a in attrs)
        found = (getattr(v, "softcap", v) for v in found)  # (a Softcap module: its value)
        return [float(v) for v in found if isinstance(v, numbers.Real) and keep(float(v))]

    def finite(v):
        return 0 < v < float("inf")

    alphas = dict.fromkeys([1.0, *values(_ALPHA_ATTRS, lambda v: v > 0)])
    limits = dict.fromkeys([None, *values(_LIMIT_ATTRS, finite)])
    owners = (module, getattr(module, "act_fn", None))
    gate_caps = dict.fromkeys([None, *values(_GATE_SOFTCAP_ATTRS, finite, owners)])
    up_caps = dict.fromkeys([None, *values(_UP_SOFTCAP_ATTRS, finite, owners)])
    out = []
    for act, alpha, limit, after, offset, gate_cap, up_cap in itertools.product(
        _gate.ACTS, alphas, limits, (False, True), (0.0, 1.0), gate_caps, up_caps
    ):
        if after and limit is None:  # (the gate without clamp_after again)
            continue
        try:
            out.append(_gate.Gate(act, alpha, limit, after, offset, True, gate_cap, up_cap))
        except ValueError:  # a combination no Gate has (alpha of a GELU, a limit and a softcap)
            pass
    return out


def _calling_convention(cls: type) -> Optional[str]:
    """Why ``cls``'s own forward is not ``forward(hidden_states, top_k_index, top_k_weights)``,
    or None."""
    own = getattr(cls.forward, "__wrapped__", cls.forward)
    try:
        params = list(inspect.signature(own).parameters)[1:]
    except (TypeError, ValueError):
        return f"{cls.__name__}.forward has no signature to read"
    if tuple(_CALL_SYNONYMS.get(p, p) for p in params[:3]) != _CALL or any(
        p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in list(inspect.signature(own).parameters.values())[4:]
    ):
        return f"{cls.__name__}.forward takes ({', '.join(params)}), not ({', '.join(_CALL)})"
    return None


def _fp8_unsupported(module, E: int, H: int, I: int) -> Optional[str]:
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        return f"activation_scheme={module.activation_scheme!r} (epmoe quantizes per token)"
    block = getattr(module, "block_size", None)
    if block is None or tuple(block) != FP8_BLOCK:
        return f"FP8 weight blocks {block}, not 128x128"
    for attr, runs in (("has_gate", True), ("has_bias", False), ("is_transposed", False),
                       ("is_concatenated", True)):  # fmt: skip
        if bool(getattr(module, attr, runs)) != runs:
            return f"an FP8 checkpoint with {attr}={not runs}"
    if H % FP8_BLOCK[0] or I % FP8_BLOCK[0]:
        return f"an FP8 checkpoint of sizes H {H}, I {I} (epmoe runs its codes at multiples of 128)"
    w1, w2, _, _, s1, s2 = _sources(module, True)
    if w1.dtype != quant.FP8.act_dtype or w2.dtype != quant.FP8.act_dtype:
        return f"FP8 checkpoint weights of dtype {w1.dtype} (epmoe takes float8_e4m3fn)"
    for s, (n, k) in ((s1, (2 * I, H)), (s2, (H, I))):
        want = quant.FP8.weight_scale_shape(E, n, k)
        if not isinstance(s, torch.Tensor) or tuple(s.shape) != want or s.device != w1.device:
            got = None if not isinstance(s, torch.Tensor) else tuple(s.shape)
            return f"weight scales {got}, not {want} on {w1.device}"
        if s.dtype not in (torch.float32, getattr(torch, "float8_e8m0fnu", torch.float32)):
            return f"weight scales of dtype {s.dtype}"
    return None


def _build(st: _State, module, scheme: quant.QuantScheme, fp8: bool, top_k: int) -> None:
    """(Re)build st.layer from the module's current weights; reuse the layer and its buffers when
    the configuration is unchanged."""
    st.gate = gate = _recognize_gate(module)[0]
    w1, w2, b1, b2 = _arranged(module)
    E, H, I = w1.shape[0], w2.shape[1], w2.shape[2]
    runs = _runs(scheme, fp8)
    k = max(top_k, st.layer.top_k if st.layer is not None else 0)
    bias = b1 is not None
    key = (E, H, I, k, runs, w1.device, gate, bias, _CONFIG["ll_max_tokens"])
    if st.layer is None or st.key != key:
        st.layer, st.key = None, None  # free the old weights first
        st.layer, st.key = _new_layer(E, H, I, k, runs, w1.device, gate, bias), key
    layer = st.layer
    if fp8 and runs is quant.FP8:  # the checkpoint's own codes and scales, as they are
        s1 = module.gate_up_proj_scale_inv.detach()
        s2 = module.down_proj_scale_inv.detach()
        for n, q, s in (("w1", w1, s1), ("w2", w2, s2)):
            q, s = gemm.prepare_weights(q, s, runs, layer.device)
            setattr(layer, n, q)
            setattr(layer, n + "_scale", s)
        return
    old = {n: getattr(layer, n) for n in ("w1", "w1_scale", "w2", "w2_scale", "b1", "b2")}
    if fp8:  # another scheme from the checkpoint's fp8: dequantize one expert at a time
        _requantize_fp8(layer, module, runs)
    else:  # bf16, contiguous, unpadded: HF's tensors in place
        layer.load_weights(w1, w2, copy=False, b1=b1, b2=b2)
    if not runs.quantized:
        return
    for n, t in old.items():  # same shapes: write into the old buffers (graphs keep pointers)
        new = getattr(layer, n)
        if t is not None and new is not None and t.shape == new.shape and t.dtype == new.dtype:
            t.copy_(new)
            setattr(layer, n, t)


@torch.no_grad()
def _requantize_fp8(layer: EPMoE, module, scheme: quant.QuantScheme) -> None:
    for n, q, s in (
        ("w1", module.gate_up_proj, module.gate_up_proj_scale_inv),
        ("w2", module.down_proj, module.down_proj_scale_inv),
    ):
        E, N, K = q.shape
        wq = torch.empty((E, N, K), dtype=scheme.act_dtype, device=layer.device)
        ws_shape = scheme.weight_scale_shape(E, N, K)
        ws = torch.empty(ws_shape, dtype=torch.float32, device=layer.device)
        for e in range(E):
            w = reference.dequantize_weights(q[e : e + 1].detach(), s[e : e + 1].detach().float())
            wq[e : e + 1], ws[e : e + 1] = scheme.quantize_weights(w.to(layer.device))
        wq, ws = gemm.prepare_weights(wq, ws, scheme, layer.device)
        setattr(layer, n, wq)
        setattr(layer, n + "_scale", ws)


def _alignment(scheme: quant.QuantScheme, device) -> Optional[int]:
    block = gemm.contiguous_row_block(scheme, device)
    return None if block == DEFAULT_ALIGNMENT else block


def _new_layer(
    E: int, H: int, I: int, top_k: int, scheme: quant.QuantScheme, device, gate, bias: bool
) -> EPMoE:
    kw = dict(
        gate=gate,
        bias=bias,
        num_experts=E,
        hidden_size=H,
        intermediate_size=I,
        top_k=top_k,
        quant=scheme.name,
        backend="local",
        device=device,
        # the default backend's row block (CPU and torch._grouped_mm: 1, no padding rows); the
        # layer's default (None) lets this GPU's measured alignment per call size apply
        alignment=_alignment(scheme, device),
    )
    try:
        return EPMoE(mode="auto", ll_max_tokens=_CONFIG["ll_max_tokens"], **kw)
    except ValueError:  # a layer without mode="auto": HT, static on one rank
        return EPMoE(mode="ht", worst_case=True, **kw)
