"""The checks of tests/kernels/test_context_mamba3.py, run with 8 simulated CPU devices: Mamba-3's op,
SISO (`mamba3`) and MIMO (`mamba3_mimo`), split over the meshes context=8 and data=2 x context=4 against
the same op on one device: outputs, end carry and the gradients of a loss of both with respect to every
input and the initial carry, at T = 8 * 5 (not a multiple of 8 x the chunk of 4), with packed documents
crossing the devices' boundaries (and starting exactly on two) and an initial carry with nonzero h,
angles, B̄ and x. Prints one JSON object: {op: {mesh: {"y" | "carry" | "grad": relative error,
"calls": context.over_spans calls while tracing}}}.

python tests/kernels/context_mamba3_check.py
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
from kernels.mamba3 import Mamba3Carry, mamba3, mamba3_mimo  # noqa: E402

B, T, H, Pd, N, R, C = 2, 40, 2, 3, 4, 2, 4
MESHES = {"context=8": (8, 1), "data=2 context=4": (4, 2)}
CALLS = [0]


def counted(f):
    def g(*a, **kw):
        CALLS[0] += 1
        return f(*a, **kw)
    return g


def rand(r, *shape):
    return jnp.asarray(r.normal(size=shape).astype(np.float32))


def cases(r):
    """op name -> (call(seq, whole, carry, seg) -> (y, end carry), the (B, T, ...) inputs, the inputs held
    whole, the initial carry)."""
    seq = lambda *rank: (rand(r, B, T, H, Pd), jax.nn.softplus(rand(r, B, T, H)), -0.5 - jnp.abs(rand(r, B, T, H)),
                         jax.nn.sigmoid(rand(r, B, T, H)), rand(r, B, T, H, *rank, N), rand(r, B, T, H, *rank, N),
                         np.pi * jnp.tanh(rand(r, B, T, H, N // 2)))
    carry = lambda *rank: Mamba3Carry(rand(r, B, H, Pd, N), jnp.asarray(r.uniform(0, 2 * np.pi, (B, H, N // 2)),
                                                                       jnp.float32),
                                      rand(r, B, H, *rank, N), rand(r, B, H, Pd))
    kw = lambda S0, seg: dict(initial_state=S0, segment_ids=seg, output_final_state=True, chunk_size=C)
    return {
        "mamba3": (lambda seq, whole, S0, seg: mamba3(*seq, *whole, **kw(S0, seg)), seq(), (rand(r, H),), carry()),
        "mamba3_mimo": (lambda seq, whole, S0, seg: mamba3_mimo(*seq, *whole, **kw(S0, seg)), seq(R),
                        (rand(r, H, R, Pd), rand(r, H)), carry(R)),
    }


def loss(call, seq, whole, S0, seg):
    y, S = call(seq, whole, S0, seg)
    return jnp.sum(jnp.sin(y) * y) + sum(jnp.sum(s * jnp.cos(s)) for s in S), (y, S)


def error(want, got):
    """max |want - got| over the leaves, relative to max |want|."""
    scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
    return max(float(jnp.max(jnp.abs(w - g))) for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got))) / scale


def main():
    jax.config.update("jax_default_matmul_precision", "highest")
    context.over_spans = counted(context.over_spans)  # kernels/mamba3/split.py calls it through the module
    r = np.random.default_rng(0)
    seg = jnp.asarray(np.cumsum(r.random((B, T)) < 0.06, axis=1), jnp.int32)  # documents across boundaries
    seg = seg.at[:, 15].set(seg[:, 14] + 1).at[:, 16:].add(1)  # one token at 15 (a boundary of context=8), one at 16
    seg = seg.at[:, 20:].add(1)  # and a start at 20, a boundary of both meshes
    out = {}
    for name, (call, seq, whole, S0) in cases(r).items():
        grad = jax.value_and_grad(lambda *a: loss(call, *a, seg), argnums=(0, 1, 2), has_aux=True)
        CALLS[0] = 0
        want = jax.jit(grad)(seq, whole, S0)
        out[name] = {"one device": {"calls": CALLS[0]}}
        for mesh_name, (ctx, data) in MESHES.items():
            mesh = jax.make_mesh((data, ctx), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
            CALLS[0] = 0
            with jax.set_mesh(mesh):
                placed = [jax.device_put(x, NamedSharding(mesh, P("data", "context"))) for x in seq]
                got = jax.jit(grad)(placed, whole, S0)  # a new jit: traced under the mesh
            (_, (y_want, S_want)), g_want = want
            (_, (y_got, S_got)), g_got = got
            out[name][mesh_name] = {"y": error(y_want, y_got), "carry": error(S_want, S_got),
                                    "grad": error(g_want, g_got), "calls": CALLS[0]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
