"""The checks of tests/kernels/test_context_ssm.py, run with 8 simulated CPU devices: the ops whose state decays
elementwise (context.split_diagonal: Mamba-1's selective scan, the RG-LRU, S4D) split over the meshes context=8
and data=2 x context=4 against the same op on one device: outputs, end state and the gradients of a loss of both
with respect to every input and the initial state, at T = 8 * 5 (not a multiple of 8 x the chunk of 4), with
packed documents crossing the devices' boundaries (and starting exactly on two) and a nonzero initial state; S4D
also without documents, where its spans run the FFT form, and the RG-LRU with the second row's first token
beginning a document (its initial state dropped, the first span's M zero). Prints one JSON object:
{op: {mesh: {"y" | "state" | "grad": relative error, "calls": context.over_spans calls while tracing}}}.

python tests/kernels/context_ssm_check.py
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
from kernels.rglru import rglru  # noqa: E402
from kernels.s4d import s4d  # noqa: E402
from kernels.selective_scan import selective_scan  # noqa: E402

B, T, Dm, N, C = 2, 40, 3, 4, 4
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
    """op name -> (call(seq, whole, S0, seg) -> (y, end state), the (B, T, ...) inputs, the inputs held whole, the
    initial state)."""
    out = dict(output_final_state=True)
    complex_rand = lambda *shape: jax.lax.complex(rand(r, *shape), rand(r, *shape))
    A = jax.lax.complex(-0.5 * jnp.exp(rand(r, Dm, N)), np.pi * jnp.arange(N, dtype=jnp.float32) + rand(r, Dm, N))
    s4d_whole = (A, jnp.exp(jnp.asarray(r.uniform(np.log(0.01), np.log(0.5), Dm), jnp.float32)), complex_rand(Dm, N),
                 rand(r, Dm))
    return {
        "selective_scan": (lambda seq, whole, S0, seg: selective_scan(*seq[:2], whole[0], *seq[2:], whole[1],
                                                                      segment_ids=seg, initial_state=S0, mode="chunk",
                                                                      chunk_size=C, **out),
                           (rand(r, B, T, Dm), jax.nn.softplus(rand(r, B, T, Dm)), rand(r, B, T, N), rand(r, B, T, N)),
                           (-jnp.exp(rand(r, Dm, N)), rand(r, Dm)), rand(r, B, Dm, N)),
        "rglru": (lambda seq, whole, S0, seg: rglru(*seq, *whole, segment_ids=seg, initial_state=S0,
                                                    first_starts=jnp.array([False, True]), **out),
                  (rand(r, B, T, Dm), jax.nn.sigmoid(rand(r, B, T, Dm)), jax.nn.sigmoid(rand(r, B, T, Dm))),
                  (jnp.asarray(r.uniform(2.0, 7.0, Dm), jnp.float32),), rand(r, B, Dm)),
        "s4d": (lambda seq, whole, S0, seg: s4d(*seq, *whole, segment_ids=seg, initial_state=S0, **out),
                (rand(r, B, T, Dm),), s4d_whole, complex_rand(B, Dm, N)),
        "s4d fft": (lambda seq, whole, S0, seg: s4d(*seq, *whole, initial_state=S0, mode="fft", **out),
                    (rand(r, B, T, Dm),), s4d_whole, complex_rand(B, Dm, N)),
    }


def loss(call, seq, whole, S0, seg):
    y, S = call(seq, whole, S0, seg)
    return jnp.sum(jnp.sin(y) * y) + sum(jnp.sum(p * jnp.cos(p)) for p in (jnp.real(S), jnp.imag(S))), (y, S)


def error(want, got):
    """max |want - got| over the leaves, relative to max |want|."""
    scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
    return max(float(jnp.max(jnp.abs(w - g))) for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got))) / scale


def main():
    jax.config.update("jax_default_matmul_precision", "highest")
    context.over_spans = counted(context.over_spans)  # context.split_diagonal calls it through the module
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
            out[name][mesh_name] = {"y": error(y_want, y_got), "state": error(S_want, S_got),
                                    "grad": error(g_want, g_got), "calls": CALLS[0]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
