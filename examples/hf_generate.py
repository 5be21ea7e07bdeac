"""Generate with a transformers MoE model whose experts run on epmoe, next to transformers' own.

    python examples/hf_generate.py                          # random-init small Qwen3-MoE, CUDA
    python examples/hf_generate.py --device cpu --layers 2  # a smoke run (no compile)
    python examples/hf_generate.py --model Qwen/Qwen3-30B-A3B --layers 8 \
        --impls epmoe_fp8,grouped_mm

The whole integration is two lines::

    import epmoe.integrations.transformers as et
    et.register()  # then experts_implementation="epmoe" (or "epmoe_fp8", "epmoe_int8")

Each implementation generates ``--new-tokens`` greedy tokens for ``--batch`` random prompts of
``--prompt-len`` tokens with a static cache; on CUDA generate() compiles its decode step
(``torch.compile(mode="reduce-overhead")``: CUDA graphs). A first generate() compiles and warms
up; the timed ones then give prefill tokens/s (a one-token generate) and decode tokens/s (the rest
of a full one). Note: on CUDA, generate() itself switches "grouped_mm" to "batched_mm" for the
decode steps (transformers' own choice), so that row is what transformers runs by default.
"""

import argparse
import time

import torch


def small_qwen3_moe(layers: int):
    """A random-init Qwen3-MoE of a few hundred million parameters (H 1024, 32 experts, top-4)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        max_position_embeddings=4096,
    )


def load(args):
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(args.device)
    if args.model is None:
        torch.manual_seed(0)
        with device:
            model = AutoModelForCausalLM.from_config(
                small_qwen3_moe(args.layers or 4), dtype=torch.bfloat16
            )
    elif args.random_init:
        cfg = AutoConfig.from_pretrained(args.model)
        if args.layers:
            cfg.num_hidden_layers = args.layers
        with device:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    else:
        kw = {"num_hidden_layers": args.layers} if args.layers else {}
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.bfloat16, device_map=str(device), **kw
        )
    return model.eval().requires_grad_(False)


def generate(model, ids, new_tokens: int, compile_on: bool):
    from transformers import CompileConfig

    cc = CompileConfig(fullgraph=False, mode="reduce-overhead")
    if compile_on and ids.device.type != "cuda":
        cc._compile_all_devices = True  # generate() compiles on CUDA only otherwise
    out = model.generate(
        ids,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
        compile_config=cc,
        disable_compile=not compile_on,
    )
    return out[:, ids.shape[1] :]


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a checkpoint (default: a small random Qwen3-MoE)")
    p.add_argument("--random-init", action="store_true", help="--model's config, random weights")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    p.add_argument("--impls", default="epmoe,grouped_mm")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--compile", dest="compile", action="store_true", default=None)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    args = p.parse_args(argv)
    compile_on = args.compile if args.compile is not None else args.device.startswith("cuda")

    import epmoe.integrations.transformers as et

    et.register()
    model = load(args)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(1, vocab, (args.batch, args.prompt_len), generator=g).to(args.device)
    results = {}
    with torch.no_grad():
        for impl in args.impls.split(","):
            model.set_experts_implementation(impl)
            generate(model, ids, args.new_tokens, compile_on)  # compile + warm up
            _, prefill_s = timed(lambda: generate(model, ids, 1, compile_on))
            tokens, total_s = timed(lambda: generate(model, ids, args.new_tokens, compile_on))
            decode_s = max(total_s - prefill_s, 1e-9)
            results[impl] = tokens
            print(
                f"{impl:12s} prefill {args.batch * args.prompt_len / prefill_s:10.1f} tok/s   "
                f"decode {args.batch * (args.new_tokens - 1) / decode_s:10.1f} tok/s   "
                f"first tokens {tokens[0, :8].tolist()}",
                flush=True,
            )
    names = list(results)
    for other in names[1:]:
        same = torch.equal(results[names[0]], results[other])
        print(f"{names[0]} tokens == {other} tokens: {same}")
    return results


if __name__ == "__main__":
    main()
