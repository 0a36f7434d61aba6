"""A SmolLM-sized Llama (135M parameters, random weights) or a Qwen3-Next hybrid of about 100M through zoo.hf:
load time and peak memory, and greedy generation tokens/s against transformers on the same machine,
alternating in one run.

    python -m benchmarks.hf [--model smol | qwen3_next] [--new-tokens 64] [--batches 1 8] [--repeats 3]

Needs torch and transformers (a separate venv with this project, as benchmarks/peers.py: never part
of `make test`). transformers writes the folder (SmolLM-135M's shapes: width 576, 30 layers, 9 heads
of 64 with 3 kv heads, SwiGLU 1536, vocabulary 49152, tied embeddings; float32, 540 MB); the zoo
loads it in a fresh process (load seconds and that process's peak resident memory); then both
greedy-decode `new_tokens` tokens after a 32-token prompt, the zoo through infer.generate (one
jitted loop, compile excluded by a warm-up run) and transformers through model.generate (its KV
cache, do_sample=False), each figure the best of `repeats` alternating runs. --model qwen3_next: Gated
DeltaNet and gated attention 3:1 over 8 layers of width 512, an MoE of 16 experts of 256 (top 2) with a
gated shared expert of 512 per layer, vocabulary 32768, untied (98.5M parameters; transformers runs its
torch forms of the delta rule on a CPU).
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import print_table, save_json

SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
QWEN3_NEXT = dict(vocab_size=32768, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                  linear_key_head_dim=64, linear_value_head_dim=64, num_experts=16, num_experts_per_tok=2,
                  moe_intermediate_size=256, shared_expert_intermediate_size=512, intermediate_size=1024,
                  max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
MODELS = {"smol": ("LlamaConfig", SMOL), "qwen3_next": ("Qwen3NextConfig", QWEN3_NEXT)}
LOAD = """
import json, resource, sys, time
t = time.perf_counter()
import zoo.hf
import jax
model, _ = zoo.hf.load(sys.argv[1])
jax.block_until_ready(jax.tree.leaves(model))
seconds = time.perf_counter() - t
print(json.dumps({"load_s": seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf")
    p.add_argument("--model", choices=list(MODELS), default="smol")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    try:
        import torch
        import transformers
    except ImportError:
        sys.exit("benchmarks.hf needs torch and transformers (pip install torch transformers in a separate venv)")
    import infer
    import zoo.hf

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / args.model
        torch.manual_seed(0)
        config_class, options = MODELS[args.model]
        hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**options),
                                                           dtype=torch.float32)
        hf.save_pretrained(folder)
        params = sum(p.numel() for p in hf.parameters())
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        out = subprocess.run([sys.executable, "-c", LOAD, str(folder)], capture_output=True, text=True, check=True)
        load = json.loads(out.stdout.splitlines()[-1])
        print(f"# {params / 1e6:.1f}M parameters, {size / 2**20:.0f} MiB of safetensors; zoo.hf.load "
              f"{load['load_s']:.2f} s, peak resident memory {load['peak_rss_mb']:.0f} MiB (one process, imports "
              "included)")
        model, _ = zoo.hf.load(folder)
        hf.eval()
        rows = []
        for B in args.batches:
            prompts = np.random.default_rng(B).integers(3, options["vocab_size"], (B, 32))
            zoo_run = lambda: infer.generate(model, prompts.tolist(), max_new_tokens=args.new_tokens)  # noqa: E731

            def hf_run():
                with torch.no_grad():
                    return hf.generate(torch.tensor(prompts), max_new_tokens=args.new_tokens,
                                       min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

            zoo_run()  # compile
            times = {"zoo": [], "transformers": []}
            for _ in range(args.repeats):
                for name, fn in (("zoo", zoo_run), ("transformers", hf_run)):
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
            z, h = (B * args.new_tokens / min(times[k]) for k in ("zoo", "transformers"))
            rows.append({"batch": B, "zoo_tok_s": round(z, 1), "transformers_tok_s": round(h, 1),
                         "zoo_over_transformers": round(z / h, 2)})
        print_table(rows, ["batch", "zoo_tok_s", "transformers_tok_s", "zoo_over_transformers"])
        save_json(f"hf_{args.model}", [{**load, "params": params, "torch": torch.__version__,
                          "transformers": transformers.__version__}] + rows)


if __name__ == "__main__":
    main()
