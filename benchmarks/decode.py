"""Time per generated token and decode-state bytes against context length, per mixer kind.

    python -m benchmarks.decode [--contexts 256 1024 4096 16384] [--kinds mha gqa mqa ...]

Each model (d_model 256, 4 layers, 8 heads where the kind has heads, batch 1) prefills `context`
tokens, then greedy-decodes 32 tokens inside one jitted lax.scan; the figure is that scan's time / 32,
the minimum of 15 runs interleaved across the contexts. A Transformer's KV cache grows with the
context, so its cost per token does too; a recurrent kind's state does not, nor does sinks_window's
ring-buffer cache (4 attention sinks + a 252-token window, layers/attention.py).
"""

import argparse
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import print_table, save_json, timeit, tree_bytes
from infer.generate import DECODE_OPTIONS
from layers import FoXCache, KVCache, LatentCache
from zoo import LanguageModel
from zoo.config import from_dict

KINDS = {
    "mha": {"kind": "attention", "num_heads": 8},
    "gqa": {"kind": "attention", "num_heads": 8, "num_kv_heads": 2},
    "mqa": {"kind": "attention", "num_heads": 8, "num_kv_heads": 1},
    "fox": {"kind": "fox", "num_heads": 8},
    # DeepSeek-V2's proportions (head_dim 128, kv_lora_rank 512 = 4 x 128, rope_dim 64 = 128 / 2) at head_dim 32
    "mla": {"kind": "mla", "num_heads": 8, "kv_lora_rank": 128, "rope_dim": 16},
    "moba": {"kind": "moba", "num_heads": 8, "block_size": 64, "top_k": 3},
    "nsa": {"kind": "nsa", "num_heads": 8, "block_len": 32, "stride": 16, "select_len": 64, "num_selected": 4,
            "window": 128},
    "sinks_window": {"kind": "attention", "num_heads": 8, "window": 252, "sinks": 4},  # a ring of 4 + 252 + 16 slots
    "linear_attention": {"kind": "linear_attention", "num_heads": 8},
    "retnet": {"kind": "retnet", "num_heads": 8},
    "gla": {"kind": "gla", "num_heads": 8, "conv_size": 4},
    "deltanet": {"kind": "deltanet", "num_heads": 8},
    "gated_deltanet": {"kind": "gated_deltanet", "num_heads": 8},
    "mamba": {"kind": "mamba"},
    "mamba2": {"kind": "mamba2", "head_dim": 64},
    "mamba3": {"kind": "mamba3", "head_dim": 64, "state_size": 64},  # mamba2's state size (its default)
    "rwkv6": {"kind": "rwkv6", "head_dim": 64},
    "rwkv7": {"kind": "rwkv7", "head_dim": 64},
    "s4d": {"kind": "s4d", "state_size": 64},
    "hyena": {"kind": "hyena"},
    "hgrn2": {"kind": "hgrn2", "num_heads": 8},
    "lightning": {"kind": "lightning", "num_heads": 8},
    "kda": {"kind": "kda", "num_heads": 8},
    "gated_deltanet2": {"kind": "gated_deltanet2", "num_heads": 8},
    "comba": {"kind": "comba", "num_heads": 8},
    "rglru": {"kind": "rglru", "num_heads": 8},
    "mlstm": {"kind": "mlstm", "num_heads": 4},
    "slstm": {"kind": "slstm", "num_heads": 4},
    "mesanet": {"kind": "mesanet", "num_heads": 8},
    "stickbreaking": {"kind": "stickbreaking", "num_heads": 8},
    "loglinear_mamba2": {"kind": "loglinear_mamba2", "head_dim": 64},
    "ttt_linear": {"kind": "ttt_linear", "num_heads": 4},
    "titans": {"kind": "titans", "num_heads": 4},
    "gsa": {"kind": "gsa", "num_heads": 4},
    "path_attention": {"kind": "path_attention", "num_heads": 8},
    "gated_deltaproduct": {"kind": "gated_deltaproduct", "num_heads": 8},
}
STEPS = 32
CACHES = {KVCache: ("k", "v"), FoXCache: ("k", "v", "c"), LatentCache: ("kv",)}  # per-token arrays: kv_cache_MiB


@functools.partial(jax.jit, static_argnums=0)
def prefill(graphdef, params, tokens, state):
    return nnx.merge(graphdef, params).decode(tokens, state)


@functools.partial(jax.jit, static_argnums=0, compiler_options=DECODE_OPTIONS)
def decode_steps(graphdef, params, token, state):
    model = nnx.merge(graphdef, params)

    def step(carry, _):
        tok, state = carry
        logits, state = model.decode(tok, state)
        return (jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32), state), None

    return jax.lax.scan(step, (token, state), None, length=STEPS)[0]


def prepare(model, context: int, chunk: int = 1024):
    """The model's graphdef, params and decode state after prefilling `context` random tokens."""
    graphdef, params = nnx.split(model)
    state = model.init_state(1, context + STEPS)
    tokens = jax.random.randint(jax.random.key(0), (1, context), 1, 256)
    for start in range(0, context, chunk):  # prefill in chunks: bounded memory at 16K
        _, state = prefill(graphdef, params, tokens[:, start:start + chunk], state)
    return graphdef, params, tokens[:, -1:], state


def mixer(kind: str) -> dict:
    """The mixer config of a name of KINDS or of any registered mixer kind: its KINDS settings (attention as mha,
    configs/transformer.yaml's), else the kind's defaults."""
    return KINDS.get("mha" if kind == "attention" else kind, {"kind": kind})


def measure(kind: str, contexts: list[int], repeats: int = 15) -> list[dict]:
    """Time per token at each context of the kind's model (d_model 256, 4 layers)."""
    cfg = from_dict({"model": {"d_model": 256, "num_layers": 4, "max_seq_len": 32768, "mixer": mixer(kind)}}).model
    return [{"kind": kind, **row} for row in measure_model(LanguageModel(cfg, rngs=nnx.Rngs(0)), contexts, repeats)]


def measure_model(model, contexts: list[int], repeats: int = 15) -> list[dict]:
    """Time per token at each context, the runs of all contexts interleaved and the minimum taken: on a
    shared machine other work only ever adds time, so the minimum is the least disturbed figure."""
    runs = [prepare(model, c) for c in contexts]
    for r in runs:
        jax.block_until_ready(decode_steps(*r))  # compile
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, r in enumerate(runs):
            best[i] = min(best[i], timeit(decode_steps, *r, repeats=1, warmup=False))
    rows = []
    for context, (_, _, _, state), seconds in zip(contexts, runs, best):
        caches = [s for s in jax.tree.leaves(state, is_leaf=lambda x: type(x) in CACHES) if type(s) in CACHES]
        rows.append({"context": context, "ms_per_token": round(1000 * seconds / STEPS, 3),
                     "time_vs_first": round(seconds / best[0], 2), "state_MiB": round(tree_bytes(state) / 2 ** 20, 3),
                     "kv_cache_MiB": round(sum(getattr(c, f).nbytes for c in caches for f in CACHES[type(c)]) / 2 ** 20,
                                           3)})
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    args = p.parse_args()
    rows = []
    for kind in args.kinds:
        rows += measure(kind, args.contexts)
        print(*rows[-len(args.contexts):], sep="\n", flush=True)
    print(f"\ndevice: {jax.devices()[0].device_kind}, jax {jax.__version__}, batch 1, d_model 256, 4 layers")
    print_table(rows, ["kind", "context", "ms_per_token", "time_vs_first", "state_MiB", "kv_cache_MiB"])
    save_json("decode", rows)


if __name__ == "__main__":
    main()
