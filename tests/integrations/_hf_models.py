"""Tiny random transformers MoE models, discovered in the installed transformers (not listed by
hand): every experts class that uses ``@use_experts_implementation`` and every ``*ForCausalLM`` in
its modeling module, built from one set of tiny sizes plus the model's entry in FIXES. Also what a
model's experts run under each epmoe backend (the record in coverage.json and the README's table)
and a model's FineGrainedFP8 form. Shared by the tests, scripts/hf_coverage.py and the benchmark's
CPU smoke run."""

import functools
import glob
import importlib
import inspect
import os
import pkgutil
import re
import warnings
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

import epmoe

# must be among the discovered models
REQUIRED = (
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "DeepseekV3ForCausalLM",
    "OlmoeForCausalLM",
)
VOCAB = 128
MAX_PARAMS = 4_000_000  # a tiny config that builds a larger model is not tiny: an error
# scheme -> the experts backend that runs it
SCHEMES = {"bf16": "epmoe", "fp8": "epmoe_fp8", "int8": "epmoe_int8"}
FP8_SIZES = dict(hidden=128, intermediate=128)  # fp8 needs multiples of 128
# the schemes that share one tiny model, and whether it is built at FP8_SIZES
BUILDS = ((("bf16", "int8"), False), (("fp8",), True))
FALLBACK = "grouped_mm"  # the integration's default fallback backend
COVERAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "coverage.json")
README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(COVERAGE))), "README.md")
README_MARKERS = ("<!-- coverage:start -->", "<!-- coverage:end -->")  # its coverage section


class Family(NamedTuple):
    module: str  # the modeling module
    experts: Tuple[type, ...]  # its experts classes that use the decorator
    causal_lms: Tuple[type, ...]


def sizes(hidden=64, intermediate=32, experts=8, top_k=2, layers=2) -> Dict[str, object]:
    """Config attributes set when the config class has them (per-model spellings of one size)."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=intermediate,
        expert_intermediate_size=intermediate,
        shared_expert_intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=hidden // 4,
        num_experts=experts,
        n_routed_experts=experts,
        num_local_experts=experts,
        moe_num_experts=experts,
        num_experts_per_tok=top_k,
        moe_k=top_k,
        top_k=top_k,
        moe_topk=top_k,
        max_position_embeddings=256,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=0,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        kv_lora_rank=16,
        q_lora_rank=32,
        n_shared_experts=1,
        num_shared_experts=1,
        sliding_window=64,
        decoder_sparse_step=1,
        moe_layer_freq=1,
        enable_moe_block=True,
        top_k_experts=top_k,
        vocab_size_per_layer_input=VOCAB,
    )


_SWA_HEADS = dict(swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_head_dim=16)
_INKLING2 = dict(_SWA_HEADS, unpadded_vocab_size=VOCAB)
_GATED_DELTA_NET = dict(  # Qwen3-Next-style linear attention: 32 value heads of 128 by default
    layer_types=lambda n: ["linear_attention"] * (n - 1) + ["full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)
# What sizes() gets wrong for one model, by config class name (applied over it; a callable value
# takes the number of layers). Each line says why.
FIXES: Dict[str, Dict[str, object]] = {
    # attention only every 6th layer (8 layers built, 8 s a forward); 128-wide linear heads
    "BailingHybridConfig": dict(layer_group_size=2, head_dim=16),
    # MLA-like with its own head_dim (512) and grouped output projection (o_lora_rank 1024)
    "DeepseekV4Config": dict(
        head_dim=32, o_lora_rank=16, o_groups=2, index_n_heads=4, index_head_dim=16, index_topk=8
    ),
    # a 32768-wide first dense block and 8192-wide shared expert
    "ErgoConfig": dict(first_dense_intermediate_size=64, shared_intermediate_size=32),
    # all layers Mamba by default (no attention layer: masks fail); 128 Mamba heads
    "GraniteMoeHybridConfig": dict(
        layer_types=lambda n: ["linear_attention"] * (n - 1) + ["attention"],
        mamba_n_heads=8,
        mamba_d_state=16,
        shared_intermediate_size=64,
    ),
    # 64 sliding-window heads of 128 (6M parameters at the fp8 sizes)
    "InklingTextConfig": _SWA_HEADS,
    # a 200k-row output head (unpadded_vocab_size) and 48 sliding-window heads of 128
    "Inkling2TextConfig": _INKLING2,
    # Inkling2's, and its looped layers (6 to 18 by default) within the tiny model's
    "Inkling2LoopTextConfig": dict(
        _INKLING2,
        n_layers_per_attn_res_block=1,
        loop_layer_index_start=1,
        loop_layer_index_end=lambda n: n,
        loop_num_passes=2,
    ),
    # attention every 8th layer and experts every 2nd: 8 layers (4M parameters at the fp8 sizes)
    "JambaConfig": dict(
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0
    ),
    # every 4th layer attention (none in 2 or 4 layers); 32 linear heads of 128
    "KimiLinearConfig": dict(
        layer_types=lambda n: ["linear_attention"] * (n - 1) + ["full_attention"],
        linear_num_heads=4,
        linear_head_dim=16,
    ),
    # the first 2 layers dense (mlp_only_layers), 3584 wide
    "Kolibri1_1Config": dict(mlp_only_layers=[]),
    # layer_types has no default; the first 2 layers are dense
    "Lfm2MoeConfig": dict(
        layer_types=lambda n: ["conv"] * (n - 1) + ["full_attention"], num_dense_layers=0
    ),
    # its rotary width is head_dim, which must be the rope dim; 256 zero experts of 264 choices
    "LongcatFlashConfig": dict(head_dim=8, zero_expert_num=4),
    # sliding-window layers double the KV heads, which must not exceed the query heads
    "MiMoV2FlashConfig": dict(num_key_value_heads=2),
    # a 3072-wide shared expert (shared_intermediate_size): 4M parameters at the fp8 sizes
    "MiniMaxM3VLTextConfig": dict(shared_intermediate_size=64),
    # 128 Mamba heads of 64 and a 7688-wide shared expert (6M parameters at the fp8 sizes)
    "NemotronHConfig": dict(
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        moe_shared_expert_intermediate_size=64,
    ),
    # attention every 4th layer (4 layers built); 32 linear heads of 128 (5M at the fp8 sizes)
    "Qwen3NextConfig": _GATED_DELTA_NET,
    "Qwen3_5MoeTextConfig": _GATED_DELTA_NET,
    # indexed-attention layers need the QSA indexer sizes (None by default); 32 linear heads
    "Qwen4ExpTextConfig": dict(
        _GATED_DELTA_NET,
        layer_types=lambda n: ["linear_attention"] * (n - 1) + ["indexed_attention"],
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=32,  # at least the rotary dim (head_dim at the fp8 sizes)
        indexer_budget=8,
        indexer_compress_ratio=4,
        hc_lowrank=16,
    ),
}


@functools.cache
def _wrapper_code():
    from transformers.integrations import moe

    class _Probe(torch.nn.Module):
        def __init__(self, config):
            super().__init__()

        def forward(self, x):
            return x

    return moe.use_experts_implementation(_Probe).forward.__code__


def is_experts_class(cls) -> bool:
    """Whether ``cls`` went through ``@use_experts_implementation`` (its forward is the
    decorator's dispatching wrapper)."""
    return getattr(getattr(cls, "forward", None), "__code__", None) is _wrapper_code()


def experts_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules of ``model`` whose class or a base class went through the decorator (Ergo's
    experts subclass its decorated projections and call them through ``super().forward``)."""
    return [m for m in model.modules() if any(is_experts_class(c) for c in type(m).__mro__)]


@functools.cache
def discover() -> Tuple[Family, ...]:
    """Every modeling module of the installed transformers whose source uses the decorator."""
    import transformers.models as tm

    out = []
    for info in sorted(pkgutil.iter_modules(tm.__path__), key=lambda i: i.name):
        for path in sorted(glob.glob(os.path.join(tm.__path__[0], info.name, "modeling_*.py"))):
            with open(path) as f:
                if "@use_experts_implementation" not in f.read():
                    continue
            name = f"transformers.models.{info.name}.{os.path.basename(path)[:-3]}"
            try:
                mod = importlib.import_module(name)
            except Exception:  # an optional dependency of that model is missing
                continue
            own = [c for c in vars(mod).values() if isinstance(c, type)]
            own = [c for c in own if c.__module__ == mod.__name__]
            experts = tuple(c for c in own if is_experts_class(c))
            lms = tuple(c for c in own if c.__name__.endswith("ForCausalLM"))
            if experts:
                out.append(Family(name, experts, lms))
    return tuple(out)


def tiny_config(config_class, **kw):
    """``config_class`` with the tiny sizes it has attributes for (derived fields computed by its
    own constructor), then its entry of :data:`FIXES`."""
    base = config_class()
    args = {k: v for k, v in sizes(**kw).items() if _scalar_attr(base, k)}
    if _scalar_attr(base, "qk_rope_head_dim"):  # MLA: head_dim is the rope dim
        args.pop("head_dim", None)
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if getattr(base, k, None) is not None:
            args[k] = 1
    fix = FIXES.get(config_class.__name__, {})
    fix = {k: v(kw.get("layers", 2)) if callable(v) else v for k, v in fix.items()}
    try:
        return config_class(**{**args, **fix})
    except Exception as e:  # a validator rejects one generic size (e.g. top_k=1 only): its default
        for k in list(args):
            try:
                return config_class(**{**{a: v for a, v in args.items() if a != k}, **fix})
            except Exception:
                continue
        raise ValueError(f"no tiny config for {config_class.__name__}: {e}") from e


def _scalar_attr(config, name: str) -> bool:
    """Whether ``config`` has ``name`` as a scalar (a per-layer attribute, which refuses a global
    read, counts)."""
    try:
        v = getattr(config, name)
    except AttributeError:
        return False
    except Exception:  # AmbiguousGlobalPerLayerAttributeError: set per layer from the global
        return True
    return not isinstance(v, (list, dict))


class TooLarge(ValueError):
    """A tiny config that builds more than MAX_PARAMS parameters."""


def build_tiny(lm_class, dtype=torch.float32, seed: int = 0, impl: str = "eager", **kw):
    """A random-init tiny ``lm_class`` with at least one experts module that runs a forward.
    Tries 2, 4 and 8 layers (hybrid models put their attention layers further in).

    Raises:
        TooLarge: the tiny config builds more than :data:`MAX_PARAMS` parameters.
        ImportError: the model needs an optional package that is not installed.
        RuntimeError: no layer count builds and runs it (each attempt's exception named, the
            last one chained).
    """
    name, tried, last = lm_class.__name__, [], None
    for layers in (kw.pop("layers", None) or 2, 4, 8):
        try:
            cfg = tiny_config(lm_class.config_class, layers=layers, **kw)
            with torch.device("meta"):
                probe = lm_class._from_config(cfg, experts_implementation=impl)
            n = sum(p.numel() for p in probe.parameters())
            if n > MAX_PARAMS:
                raise TooLarge(
                    f"{name}: its tiny config of {layers} layers has {n:,} parameters, more than "
                    f"MAX_PARAMS={MAX_PARAMS:,} (shrink it in FIXES)"
                )
            if not experts_modules(probe):
                tried.append(f"{layers} layers: no experts module")
                continue
            torch.manual_seed(seed)
            model = lm_class._from_config(cfg, dtype=dtype, experts_implementation=impl).eval()
            with torch.no_grad():
                model(sample_ids(model, 1, 4))
            return model
        except (ImportError, TooLarge):
            raise
        except Exception as e:
            tried.append(f"{layers} layers: {type(e).__name__}: {e}")
            last = e
    raise RuntimeError(f"{name}: no tiny model runs ({'; '.join(tried)})") from last


def sample_ids(model, batch=2, length=12, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    vocab = min(VOCAB, model.config.get_text_config().vocab_size)
    return torch.randint(2, vocab, (batch, length), generator=g)


def build_experts(cls, family: Family, dtype=torch.bfloat16, seed: int = 0, **kw):
    """One module of experts class ``cls`` with random weights: constructed from a tiny config of
    its configuration module, else taken from a tiny model of its family."""
    conf = importlib.import_module(family.module.replace(".modeling_", ".configuration_"))
    from transformers import PretrainedConfig

    for cc in vars(conf).values():
        if not (isinstance(cc, type) and issubclass(cc, PretrainedConfig)):
            continue
        if cc.__module__ != conf.__name__:
            continue
        try:
            cfg = tiny_config(cc, **kw)
            cfg._experts_implementation = "eager"
            torch.manual_seed(seed)
            m = _construct(cls, cfg, sizes(**kw)["moe_intermediate_size"])
        except Exception:
            continue
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02)
        return m.to(dtype)
    for lm in family.causal_lms:
        model = build_tiny(lm, dtype=dtype, seed=seed, **kw)
        found = [m for m in experts_modules(model) if type(m) is cls]
        if found:
            return found[0]
    return None


def _construct(cls, cfg, intermediate: int):
    """cls(cfg); classes whose config holds several intermediate sizes take one as an argument."""
    try:
        return cls(cfg)
    except Exception:
        names = [p for p in inspect.signature(cls.__init__).parameters if "intermediate" in p]
        if not names:
            raise
        return cls(cfg, **{n: intermediate for n in names})


def routing(num_tokens: int, num_experts: int, top_k: int, dtype, seed: int = 0):
    """Distinct experts per token, softmax weights: (ids int64 `[T, K]`, weights `[T, K]`)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    w = torch.softmax(torch.randn(num_tokens, top_k, generator=g), dim=-1).to(dtype)
    return ids, w


def own_call(m, x, ids, w):
    """(x, ids, weights, output) of a call the experts module's own forward accepts: the top-k
    routing as given, else one route a row (Ergo's projections: x repeated K times, ids `[T*K, 1]`,
    unit weights, as its model calls them); None when its forward takes neither."""
    own = type(m).forward.__wrapped__
    T, K = ids.shape
    calls = ((x, ids, w), (x.repeat_interleave(K, 0), ids.reshape(-1, 1), w.new_ones(T * K, 1)))
    for cx, cids, cw in calls:
        try:
            out = own(m, cx, cids, cw)
        except Exception:
            continue
        if isinstance(out, torch.Tensor) and out.shape == cx.shape:
            return cx, cids, cw, out
    return None


# ------------------------------------------------------------------------ same routing, coverage
def logits(model, ids, impl):
    model.set_experts_implementation(impl)
    with torch.no_grad():
        return model(ids).logits.float()


def epmoe_warnings(record) -> List[str]:
    """The messages of epmoe's warnings but a GPU's untuned-table note (a GPU run's tiny shapes)."""
    return [str(w.message) for w in record if str(w.message).startswith("epmoe:")
            and not issubclass(w.category, epmoe.UntunedWarning)]  # fmt: skip


def run_model(model, ids, impl):
    """(logits, the epmoe warnings of the call)."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = logits(model, ids, impl)
    return out, epmoe_warnings(rec)


class SameRouting:
    """Record the (top_k_index, top_k_weights) every experts call of one forward gets, then hand
    the recorded ones to the same calls of later forwards (``replay()`` before each): the runs
    differ only in what the experts compute (a bf16-sized change can flip a near-tie of a router
    in a deep model, and a flip changes its token's later positions through attention)."""

    def __init__(self, model):
        self.calls, self.replay, self.n = [], False, 0
        self.hooks = [
            m.register_forward_pre_hook(self.hook, with_kwargs=True) for m in experts_modules(model)
        ]

    def hook(self, module, args, kwargs):
        args = list(args)
        names = ("hidden_states", "top_k_index", "top_k_weights")
        for n in names[len(args) :]:  # a keyword call
            args.append(kwargs.pop(n))
        if not self.replay:
            self.calls.append((args[1].clone(), args[2].clone()))
        else:
            args[1], args[2] = self.calls[self.n]
            self.n += 1
        return tuple(args), kwargs

    def replay_next(self):
        """Replay the recorded calls from the first on the next forward."""
        assert not self.replay or self.n == len(self.calls), (self.n, len(self.calls))
        self.replay, self.n = True, 0

    def remove(self):
        for h in self.hooks:
            h.remove()


def same_routing(model, ids, impl):
    """(eager logits, (``impl`` logits, epmoe warnings)) with eager's routing in both runs."""
    same = SameRouting(model)
    try:
        ref = logits(model, ids, "eager")
        same.replay_next()
        out = run_model(model, ids, impl)
    finally:
        same.remove()
    assert same.n == len(same.calls)
    return ref, out


class Outcome(NamedTuple):
    """One model through one scheme's backend, with eager's routing."""

    cell: str  # "epmoe", or "fallback: <reasons>" (coverage.json's value)
    on_epmoe: int  # experts modules that ran an EPMoE layer
    modules: int  # experts modules
    err: float  # relative L2 of the logits vs eager's
    exact: Optional[bool]  # every module fell back: the logits are exactly the fallback's
    warnings: Tuple[str, ...]  # the call's epmoe warnings


def outcomes(model, schemes=tuple(SCHEMES), ids=None) -> Dict[str, Outcome]:
    """Run ``model`` (float32) through each scheme's backend with eager's routing (one eager run,
    recorded and replayed into each): what its experts ran, as the integration reports it, and
    how far its logits are from eager's. scheme -> Outcome."""
    import epmoe.integrations.transformers as et
    from tests._tol import rel_l2

    ids = sample_ids(model) if ids is None else ids
    mods = experts_modules(model)
    same, out, fallback = SameRouting(model), {}, None
    try:
        ref = logits(model, ids, "eager")
        for scheme in schemes:
            et._WARNED.clear()  # warned once per class and process: this call's warnings say why
            same.replay_next()
            got, msgs = run_model(model, ids, SCHEMES[scheme])
            reasons = fallback_reasons(mods, msgs)
            exact = None
            if len(reasons) == len(mods):
                if fallback is None:  # the same for every scheme
                    same.replay_next()
                    fallback = logits(model, ids, FALLBACK)
                exact = torch.equal(got, fallback)
            n = len(mods) - len(reasons)
            out[scheme] = Outcome(
                _cell(reasons, len(mods)), n, len(mods), rel_l2(got, ref), exact, tuple(msgs)
            )
    finally:
        same.remove()
    return out


def _cell(reasons: Dict[int, str], modules: int) -> str:
    why = "; ".join(dict.fromkeys(reasons.values()))
    if not reasons:
        return "epmoe"
    if len(reasons) == modules:
        return "fallback: " + why
    return f"fallback ({len(reasons)} of {modules} experts modules): {why}"


_WARNING = re.compile(r"epmoe: (\w+) runs transformers' .*? experts backend instead: (.*)", re.S)


def fallback_reasons(modules, msgs) -> Dict[int, str]:
    """index -> why, for each experts module in ``modules`` that has no EPMoE layer after a call:
    the integration's reason (its ``_epmoe_state.reason``, else the warning naming its class)."""
    import epmoe.integrations.transformers as et

    said = {}
    for msg in msgs:
        m = _WARNING.match(msg)
        if m:
            said.setdefault(m[1], m[2])
    out = {}
    for i, m in enumerate(modules):
        if et.cached_layer(m) is not None:
            continue
        state = m.__dict__.get("_epmoe_state")
        if state is None:
            out[i] = "not called"
            continue
        out[i] = getattr(state, "reason", None) or said.get(type(m).__name__, "no reason given")
    return out


def coverage_table(coverage: Dict[str, Dict[str, str]]) -> str:
    """The README's coverage section: a summary line and model | bf16 | fp8 | int8, a fallback's
    reason without its parenthesized details (coverage.json has them)."""
    n = len(coverage)
    on = {s: sum(c.get(s) == "epmoe" for c in coverage.values()) for s in SCHEMES}
    lines = [
        "Experts on epmoe, by scheme: " + ", ".join(f"{s} {on[s]} of {n}" for s in SCHEMES) + ".",
        "",
        "| model | " + " | ".join(SCHEMES) + " |",
        "| --- |" + " --- |" * len(SCHEMES),
    ]
    for name, cells in coverage.items():
        row = [_short(cells.get(s, "?")).replace("|", "\\|") for s in SCHEMES]
        lines.append(f"| {name.removesuffix('ForCausalLM')} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _short(cell: str) -> str:
    m = re.fullmatch(r"fallback(?: \((\d+ of \d+) experts modules\))?: (.*)", cell, re.S)
    if m is None:  # "epmoe" or an error
        return cell
    why = re.sub(r" \([^()]*\)", "", m[2])
    return f"{m[1]} modules: {why}" if m[1] else why


# ----------------------------------------------------------------------------- FP8 checkpoints
def fp8_checkpoint(model):
    """``model`` (bf16, changed in place and returned) as transformers loads its FineGrainedFP8
    checkpoint (128x128 weight blocks, dynamic activation scales), without a file or accelerate:
    each experts module replaced by transformers' FP8Experts through ``replace_with_fp8_linear``
    (every other module kept) and filled with its weights quantized by transformers' own
    ``Fp8Quantize`` (float8_e4m3fn codes, float32 ``*_scale_inv`` per block)."""
    from types import SimpleNamespace

    from transformers import FineGrainedFP8Config
    from transformers.integrations import finegrained_fp8 as f8

    qcfg = FineGrainedFP8Config(weight_block_size=(128, 128))
    old = {n: m for n, m in model.named_modules() if n.endswith(".experts")}
    keep = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    f8.replace_with_fp8_linear(model, modules_to_not_convert=keep, quantization_config=qcfg)
    quantize = f8.Fp8Quantize(SimpleNamespace(quantization_config=qcfg))
    with torch.no_grad():
        for name, src in old.items():
            dst = model.get_submodule(name)
            for proj in ("gate_up_proj", "down_proj"):
                for k, t in quantize.convert({proj: getattr(src, proj).detach()}).items():
                    setattr(dst, k, torch.nn.Parameter(t, requires_grad=False))
    return model
