"""Dense SwiGLU MLP vs Mixture-of-Experts with the same active parameters: forward+backward speed and
memory, one table.

    python -m benchmarks.moe [--tokens 4096] [--seq-len 512] [--d-model 256] [--experts 8] [--top-k 2]

The dense MLP has width F = default_hidden_dim(d_model); each MoE expert has width F / top_k, so a
token meets the same number of FFN weights (router aside). fwd+bwd is the gradient with respect to
every parameter of mean(y^2) (+ the sown aux loss for the MoE, in training mode), jitted, float32,
median of 5 after a compile. Memory: parameter bytes and XLA's temp bytes of the compiled step
(`compiled.memory_analysis()`); GFLOP from `compiled.cost_analysis()`. Ratios divide by the dense row.
"""

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import print_table, save_json, timeit, tree_bytes
from layers.mlp import MLP, default_hidden_dim
from layers.moe import MoE, total_aux_loss


def step_fn(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, x):
        m = nnx.merge(graphdef, params, rest, copy=True)
        y = m(x)
        return jnp.mean(y.astype(jnp.float32) ** 2) + total_aux_loss(nnx.pop(m, nnx.Intermediate))

    return jax.jit(jax.grad(loss)), params


def measure(name, model, x):
    fn, params = step_fn(model)
    compiled = fn.lower(params, x).compile()
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    seconds = timeit(compiled, params, x)
    return {"model": name, "params": sum(p.size for p in jax.tree.leaves(params)),
            "ms": round(1e3 * seconds, 1), "tokens/s": int(x.shape[0] * x.shape[1] / seconds),
            "GFLOP": round(cost.get("flops", float("nan")) / 1e9, 2),
            "param MB": round(tree_bytes(params) / 2**20, 2), "temp MB": round(mem.temp_size_in_bytes / 2**20, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    a = ap.parse_args()
    D, F = a.d_model, default_hidden_dim(a.d_model)
    x = jax.random.normal(jax.random.key(0), (a.tokens // a.seq_len, a.seq_len, D), jnp.float32)
    moe = dict(num_experts=a.experts, top_k=a.top_k, hidden_dim=F // a.top_k, rngs=nnx.Rngs(0))
    rows = [measure(f"dense MLP (F={F})", MLP(D, hidden_dim=F, rngs=nnx.Rngs(0)), x)]
    for dispatch in ("capacity", "dropless"):
        rows.append(measure(f"MoE E={a.experts} k={a.top_k} F={F // a.top_k} {dispatch} (cf 1.25)",
                            MoE(D, dispatch=dispatch, **moe), x))
    rows.append(measure(f"MoE E={a.experts} expert_choice (cf 1.0)",
                        MoE(D, router="expert_choice", capacity_factor=1.0, **moe), x))
    dense = rows[0]
    for r in rows:
        r["time x dense"] = round(r["ms"] / dense["ms"], 2)
        r["temp x dense"] = round(r["temp MB"] / dense["temp MB"], 2)
    print(f"fwd+bwd, {a.tokens} tokens, d_model {D}, float32, {jax.devices()[0].platform}")
    print_table(rows, ["model", "params", "ms", "tokens/s", "time x dense", "GFLOP", "param MB", "temp MB",
                       "temp x dense"])
    save_json("moe", rows)


if __name__ == "__main__":
    main()
