"""Softmax attention on this machine: the zoo's XLA forms against the reference and
jax.nn.dot_product_attention (XLA implementation), forward and forward+backward.

    python -m benchmarks.attention [--repeats 15]

Cases: training shapes (B=8, T=256, H=4, K=32, MHA and one kv head, forward+backward) and long
prefill (B=1, T=4096, H=4, one kv head, forward only). Causal. Each figure is the minimum over
`repeats` runs, the forms of a case interleaved; ratios divide by the zoo form in the same run.
"""

import argparse
import time

import jax
import jax.numpy as jnp

from benchmarks.common import print_table, save_json
from kernels.attention import attention_reference, attention_xla

FORMS = {
    "zoo xla": attention_xla,
    "reference": attention_reference,
    "jax.nn.dot_product_attention": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                                  implementation="xla"),
}
CASES = [  # (name, B, T, H, G, K, backward)
    ("train MHA", 8, 256, 4, 4, 32, True),
    ("train MQA", 8, 256, 4, 1, 32, True),
    ("prefill MQA", 1, 4096, 4, 1, 32, False),
]


def _fn(attn, backward):
    if not backward:
        return jax.jit(attn)
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v) * q[..., :1]), argnums=(0, 1, 2)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    rows = []
    for name, B, T, H, G, K, backward in CASES:
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (B, T, H, K))
        k, v = (jax.random.normal(key, (B, T, G, K)) for key in keys[1:])
        fns = {form: _fn(f, backward) for form, f in FORMS.items()}
        for f in fns.values():
            jax.block_until_ready(f(q, k, v))
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(args.repeats):
            for form, f in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(q, k, v))
                best[form] = min(best[form], time.perf_counter() - t0)
        for form, t in best.items():
            rows.append({"case": name, "shape": f"B={B} T={T} H={H} G={G} K={K}",
                         "pass": "fwd+bwd" if backward else "fwd", "form": form, "ms": round(t * 1e3, 2),
                         "vs zoo": round(t / best["zoo xla"], 2)})
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, minimum of {args.repeats} interleaved runs")
    print_table(rows, ["case", "shape", "pass", "form", "ms", "vs zoo"])
    save_json("attention", rows)


if __name__ == "__main__":
    main()
