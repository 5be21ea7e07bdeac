"""Tiny random transformers MoE models, discovered in the installed transformers (not listed by
hand): every experts class that uses ``@use_experts_implementation`` and every ``*ForCausalLM`` in
its modeling module. Shared by the tests and the benchmark's CPU smoke run."""

import functools
import glob
import importlib
import inspect
import os
import pkgutil
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

# must be among the discovered models
REQUIRED = (
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "DeepseekV3ForCausalLM",
    "OlmoeForCausalLM",
)
VOCAB = 128
MAX_PARAMS = 4_000_000  # a tiny config that still builds a larger model is not tiny: skipped


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
    return [m for m in model.modules() if is_experts_class(type(m))]


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
    own constructor)."""
    base = config_class()
    args = {k: v for k, v in sizes(**kw).items() if _scalar_attr(base, k)}
    if _scalar_attr(base, "qk_rope_head_dim"):  # MLA: head_dim is the rope dim
        args.pop("head_dim", None)
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if getattr(base, k, None) is not None:
            args[k] = 1
    try:
        return config_class(**args)
    except Exception:  # a validator rejects one size (e.g. top_k=1 only): keep its default
        for k in list(args):
            try:
                return config_class(**{a: v for a, v in args.items() if a != k})
            except Exception:
                continue
    raise ValueError(f"no tiny config for {config_class.__name__}")


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


def build_tiny(
    lm_class, dtype=torch.float32, seed: int = 0, impl: str = "eager", **kw
) -> Optional[torch.nn.Module]:
    """A random-init tiny ``lm_class`` with at least one experts module that runs a forward, or
    None. Tries 2, 4 and 8 layers (hybrid models put their attention layers further in)."""
    for layers in (kw.pop("layers", None) or 2, 4, 8):
        try:
            cfg = tiny_config(lm_class.config_class, layers=layers, **kw)
            with torch.device("meta"):
                probe = lm_class._from_config(cfg, experts_implementation=impl)
            if sum(p.numel() for p in probe.parameters()) > MAX_PARAMS:
                return None
            torch.manual_seed(seed)
            model = lm_class._from_config(cfg, dtype=dtype, experts_implementation=impl).eval()
            if not experts_modules(model):
                continue
            with torch.no_grad():
                model(sample_ids(model, 1, 4))
            return model
        except Exception:
            continue
    return None


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
        if model is not None:
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
