"""Named model / workload configs: every dimension a benchmark uses comes from here.

``CONFIGS["W"]`` is workload W (DeepSeek-V3-like MoE layer): H 7168, I 2048, 256 experts on 2 ranks
(128 local), top-8; prefill receives 8192 tokens per rank with about half of their choices local,
decode uses the LL masked layout with a 256-row slot per expert and about 8 live rows per expert.
``CONFIGS["small"]`` is a quick shape with the same structure. Select configs for a run with
``EPMOE_BENCH_CONFIGS=W,small`` (default: W).

One-GPU shapes (``ranks=1``: every expert local), used by ``bench_one_gpu.py`` next to W's per-rank
experts (``local_experts`` of W: E 128, H 7168, I 2048, top-8): ``qwen3-30b-a3b`` (Qwen3-30B-A3B's
experts), ``dsv3-1gpu`` (all 256 of DeepSeek-V3's routed experts on one GPU) and ``tiny-1rank`` (CPU
smoke tests). Models whose experts are not plain SiLU GLUs: ``gpt-oss-20b`` (its clamped SwiGLU and
expert biases), ``gpt-oss-20b-silu`` (the same sizes, plain SiLU, no biases: what the gate and
biases cost) and ``gemma4-26b-a4b`` (GELU-tanh GLU); ``mixtral-8x7b`` (8 large experts, top-2);
``tiny-gpt-oss`` and ``tiny-gemma4`` are their CPU smoke shapes. ``gate`` is the experts' gate as an
:class:`epmoe.Gate` spec, ``bias`` whether they have biases, ``hf_experts`` which transformers
experts class computes the same MLP (the grouped_mm baseline of bench_one_gpu.py builds it on the
same weights).
"""

import os
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden: int  # H
    intermediate: int  # I (GEMM1 produces 2I: gate then up)
    num_experts: int  # experts over all ranks
    ranks: int  # expert-parallel ranks
    top_k: int  # K
    prefill_tokens: int  # tokens received per rank in HT prefill (rows of permute's input)
    decode_capacity: int  # T: rows of each expert's slot in the LL masked layout
    decode_rows_per_expert: int  # typical live rows per expert in decode (masked_m)
    alignment: int = 128  # permute row alignment = deep_gemm's contiguous M block
    quant_group: int = 128  # fp8 activation scale group (channels)
    gate: str = "silu"  # the experts' gate, an epmoe.Gate spec
    bias: bool = False  # gate/up bias b1 [E, 2I] and down bias b2 [E, H]
    hf_experts: str = "qwen3_moe"  # transformers' experts class: qwen3_moe, gpt_oss, gemma4
    plain: Optional[str] = None  # the config of the same sizes with plain SiLU and no biases

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ranks

    @property
    def scale_groups(self) -> int:
        return self.hidden // self.quant_group


GPT_OSS_GATE = "silu:alpha=1.702,limit=7.0,up_offset=1.0"  # gpt-oss's clamped SwiGLU

CONFIGS: Dict[str, ModelConfig] = {
    "W": ModelConfig(
        name="W",
        hidden=7168,
        intermediate=2048,
        num_experts=256,
        ranks=2,
        top_k=8,
        prefill_tokens=8192,
        decode_capacity=256,
        decode_rows_per_expert=8,
    ),
    "small": ModelConfig(
        name="small",
        hidden=1024,
        intermediate=512,
        num_experts=16,
        ranks=2,
        top_k=4,
        prefill_tokens=1024,
        decode_capacity=64,
        decode_rows_per_expert=4,
    ),
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3-30b-a3b",
        hidden=2048,
        intermediate=768,
        num_experts=128,
        ranks=1,
        top_k=8,
        prefill_tokens=4096,
        decode_capacity=128,
        decode_rows_per_expert=8,
    ),
    "dsv3-1gpu": ModelConfig(
        name="dsv3-1gpu",
        hidden=7168,
        intermediate=2048,
        num_experts=256,
        ranks=1,
        top_k=8,
        prefill_tokens=4096,
        decode_capacity=128,
        decode_rows_per_expert=4,
    ),
    "tiny-1rank": ModelConfig(
        name="tiny-1rank",
        hidden=256,
        intermediate=128,
        num_experts=8,
        ranks=1,
        top_k=2,
        prefill_tokens=64,
        decode_capacity=16,
        decode_rows_per_expert=4,
    ),
    # openai/gpt-oss-20b's config.json: H 2880, I 2880, 32 local experts, 4 per token, biases,
    # swiglu_alpha 1.702 and swiglu_limit 7.0 (GptOssExperts: (clamp(up, -7, 7) + 1) * g *
    # sigmoid(1.702 g), g = clamp(gate, max=7))
    "gpt-oss-20b": ModelConfig(
        name="gpt-oss-20b",
        hidden=2880,
        intermediate=2880,
        num_experts=32,
        ranks=1,
        top_k=4,
        prefill_tokens=4096,
        decode_capacity=128,
        decode_rows_per_expert=4,
        gate=GPT_OSS_GATE,
        bias=True,
        hf_experts="gpt_oss",
        plain="gpt-oss-20b-silu",
    ),
    "gpt-oss-20b-silu": ModelConfig(
        name="gpt-oss-20b-silu",
        hidden=2880,
        intermediate=2880,
        num_experts=32,
        ranks=1,
        top_k=4,
        prefill_tokens=4096,
        decode_capacity=128,
        decode_rows_per_expert=4,
    ),
    # google/gemma-4-26B-A4B's config.json (text_config): hidden_size 2816, moe_intermediate_size
    # 704, num_experts 128, top_k_experts 8, hidden_activation gelu_pytorch_tanh, no expert biases
    # (Gemma4TextExperts has none). transformers' Gemma4TextConfig defaults are the dense E2B's
    # (enable_moe_block False, num_experts None), so the sizes come from the checkpoint's config.
    "gemma4-26b-a4b": ModelConfig(
        name="gemma4-26b-a4b",
        hidden=2816,
        intermediate=704,
        num_experts=128,
        ranks=1,
        top_k=8,
        prefill_tokens=4096,
        decode_capacity=128,
        decode_rows_per_expert=8,
        gate="gelu_tanh",
        hf_experts="gemma4",
    ),
    # mistralai/Mixtral-8x7B's experts (config.json: hidden 4096, intermediate 14336, 8 local
    # experts, 2 per token; SiLU GLU without biases): few large experts, so choices share experts
    # from T = 2 (the path choice by expected re-reads)
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b",
        hidden=4096,
        intermediate=14336,
        num_experts=8,
        ranks=1,
        top_k=2,
        prefill_tokens=4096,
        decode_capacity=128,
        decode_rows_per_expert=8,
    ),
    # CPU smoke shapes of the two: sizes no multiple of 128 (fp8 pads them, as at 2880)
    "tiny-gpt-oss": ModelConfig(
        name="tiny-gpt-oss",
        hidden=200,
        intermediate=72,
        num_experts=8,
        ranks=1,
        top_k=2,
        prefill_tokens=64,
        decode_capacity=16,
        decode_rows_per_expert=4,
        gate=GPT_OSS_GATE,
        bias=True,
        hf_experts="gpt_oss",
    ),
    "tiny-gemma4": ModelConfig(
        name="tiny-gemma4",
        hidden=192,
        intermediate=88,
        num_experts=8,
        ranks=1,
        top_k=2,
        prefill_tokens=64,
        decode_capacity=16,
        decode_rows_per_expert=4,
        gate="gelu_tanh",
        hf_experts="gemma4",
    ),
}


def selected(default: str = "W") -> List[ModelConfig]:
    """Configs named in EPMOE_BENCH_CONFIGS (comma-separated), else ``default``."""
    names = [n.strip() for n in os.environ.get("EPMOE_BENCH_CONFIGS", default).split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"EPMOE_BENCH_CONFIGS: unknown config(s) {unknown}; known {list(CONFIGS)}")
    return [CONFIGS[n] for n in names]


def received_routing(
    cfg: ModelConfig, tokens: int, gen: torch.Generator, rank: int = 0
) -> torch.Tensor:
    """LOCAL top-k ids int64 `[tokens, K]` of the tokens one rank receives.

    K distinct global experts per token chosen uniformly (so about 1/ranks of the choices are
    local); other ranks' experts are mapped to -1.
    """
    glob = torch.rand((tokens, cfg.num_experts), generator=gen).argsort(dim=1)[:, : cfg.top_k]
    lo = rank * cfg.local_experts
    local = (glob >= lo) & (glob < lo + cfg.local_experts)
    return torch.where(local, glob - lo, -1)


def decode_masked_m(
    cfg: ModelConfig, gen: torch.Generator, rows: Optional[int] = None
) -> torch.Tensor:
    """int32 `[E]` live rows per expert around ``rows`` (default cfg.decode_rows_per_expert):
    uniform in [rows / 2, 3 rows / 2], at most the slot capacity."""
    rows = cfg.decode_rows_per_expert if rows is None else rows
    lo, hi = max(rows // 2, 0), min(rows + rows // 2, cfg.decode_capacity)
    return torch.randint(lo, hi + 1, (cfg.local_experts,), generator=gen, dtype=torch.int32)
