"""The op checks of tests/kernels/test_context.py, run with 8 simulated CPU devices: every op with a
context-parallel form, on the meshes context=8 and data=2 x context=4, against the same op on one
device: outputs, end state and the gradients of a loss of both with respect to every input and the
initial state, at T = 8 * 5 (not a multiple of 8 x the chunk of 4), with packed documents crossing
the devices' boundaries and an initial state. Prints one JSON object: {op: {mesh: [relative error,
context-parallel forms traced]}} (a form that did not run would compare the op with itself).

python tests/kernels/context_check.py
"""

import json
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from kernels import context  # noqa: E402
from kernels.delta_rule import delta_rule  # noqa: E402
from kernels.delta_rule.product import delta_product  # noqa: E402
from kernels.gla import gla  # noqa: E402
from kernels.linear_attention import linear_attention  # noqa: E402
from kernels.retention import retention  # noqa: E402
from kernels.ssd import ssd  # noqa: E402
from kernels.wkv6 import wkv6  # noqa: E402
from kernels.wkv7 import wkv7  # noqa: E402
from tests.util import count_calls  # noqa: E402

B, T, H, K, V, C = 2, 40, 2, 4, 3, 4
MESHES = {"context=8": (8, 1), "data=2 context=4": (4, 2)}


def rand(r, *shape, low=None):
    x = r.normal(size=shape).astype(np.float32)
    return jnp.asarray(-np.abs(x) * 0.3 if low == "decay" else x)


def cases(r):
    """op name -> (call(seq..., S0, seg) -> (o, S), the (B, T, ...) inputs, initial state)."""
    q, k, v = rand(r, B, T, H, K), rand(r, B, T, H, K), rand(r, B, T, H, V)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    beta = jax.nn.sigmoid(rand(r, B, T, H))
    S0 = rand(r, B, H, K, V)
    kw = lambda S0, seg: dict(initial_state=S0, segment_ids=seg, output_final_state=True, chunk_size=C)
    n = 3  # DeltaProduct's steps per token
    return {
        "linear_attention": (lambda q, k, v, S0, seg: linear_attention(q, k, v, **kw(S0, seg)), (q, k, v), S0),
        "retention": (lambda q, k, v, S0, seg: retention(q, k, v, jnp.array([0.9, 0.6]), **kw(S0, seg)), (q, k, v),
                      S0),
        "gla": (lambda q, k, v, g, S0, seg: gla(q, k, v, g, **kw(S0, seg)), (q, k, v, rand(r, B, T, H, K, low="decay")),
                S0),
        "delta_rule": (lambda q, k, v, b, S0, seg: delta_rule(q, unit(k), v, b, **kw(S0, seg)), (q, k, v, beta), S0),
        "gated_delta_rule": (lambda q, k, v, b, g, S0, seg: delta_rule(q, unit(k), v, b, g, **kw(S0, seg)),
                             (q, k, v, beta, rand(r, B, T, H, low="decay")), S0),
        "kda": (lambda q, k, v, b, g, S0, seg: delta_rule(q, unit(k), v, b, g, **kw(S0, seg)),
                (q, k, v, beta, rand(r, B, T, H, K, low="decay")), S0),
        "delta_product": (lambda q, k, v, b, g, S0, seg: delta_product(q, unit(k), v, b, g, **kw(S0, seg)),
                          (q, rand(r, B, T, n, H, K), rand(r, B, T, n, H, V), jax.nn.sigmoid(rand(r, B, T, n, H)),
                           rand(r, B, T, H, low="decay")), S0),
        "ssd": (lambda x, dt, Bm, Cm, S0, seg: ssd(x, jax.nn.softplus(dt), -jnp.array([0.5, 1.5]), Bm, Cm,
                                                   jnp.array([1.0, -0.5]), **kw(S0, seg)),
                (v, rand(r, B, T, H), rand(r, B, T, 1, K), rand(r, B, T, 1, K)), jnp.swapaxes(S0, 2, 3)),
        "wkv6": (lambda r_, k, v, w, S0, seg: wkv6(r_, k, v, w, jnp.full((H, K), 0.5), **kw(S0, seg)),
                 (q, k, v, rand(r, B, T, H, K, low="decay")), S0),
        "wkv7": (lambda r_, w, k, v, a, b, S0, seg: wkv7(r_, w, unit(k), v, -unit(a), unit(a) * b, **kw(S0, seg)),
                 (q, rand(r, B, T, H, K, low="decay"), k, v, rand(r, B, T, H, K), jax.nn.sigmoid(rand(r, B, T, H, K))),
                 S0),
    }


def loss(call, seq, S0, seg):
    o, S = call(*seq, S0, seg)
    return jnp.sum(jnp.sin(o) * o) + jnp.sum(S * jnp.cos(S)), (o, S)


def main():
    jax.config.update("jax_default_matmul_precision", "highest")
    r = np.random.default_rng(0)
    seg = jnp.asarray(np.cumsum(r.random((B, T)) < 0.06, axis=1), jnp.int32)  # documents across boundaries
    seg = seg.at[:, 15].set(seg[:, 14] + 1).at[:, 16:].add(1)  # and one starting exactly at 16 (context=8: 5 a device)
    out = {}
    for name, (call, seq, S0) in cases(r).items():
        grad = jax.value_and_grad(lambda seq, S0: loss(call, seq, S0, seg), argnums=(0, 1), has_aux=True)
        want = jax.jit(grad)(seq, S0)
        out[name] = {}
        for mesh_name, (n, data) in MESHES.items():
            mesh = jax.make_mesh((data, n), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
            forms = count_calls(context, "over_spans")  # every recurrent form runs through it
            with jax.set_mesh(mesh):
                placed = [jax.device_put(x, NamedSharding(mesh, P("data", "context"))) for x in seq]
                got = jax.jit(grad)(placed, S0)  # a new jit: traced under the mesh
            scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
            out[name][mesh_name] = [max(float(jnp.max(jnp.abs(w - g))) for w, g in
                                        zip(jax.tree.leaves(want), jax.tree.leaves(got))) / scale, forms()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
