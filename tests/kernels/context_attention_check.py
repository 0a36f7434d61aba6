"""The checks of tests/kernels/test_context_attention.py, run with 8 simulated CPU devices: softmax attention
split over the context axis (kernels.context.split_queries, both splits) on the meshes context=8 and
data=2 x context=4, against the same call on one device: outputs and the gradients of a loss of them with
respect to q, k, v (and the decay), at T = 40 (spans of 5 and 10 tokens: the zigzag's halves unequal on
context=8), GQA (4 query heads on 2 kv heads), with packed documents crossing the devices' boundaries, a
band with a window and sinks (static, or traced per head with growth), FoX's decay, and the blocked XLA
form (its block pairs skipped by the queries' positions). Then the layers whose training path runs it
(Attention, ForgettingAttention, MultiHeadLatentAttention): outputs and the gradients with respect to x
and the parameters. Every call under a mesh must go through split_queries with its split (counted), and
none on one device. Prints one JSON object: {case: {split: {mesh: relative error}}}.

python tests/kernels/context_attention_check.py
"""

import contextlib
import json
import os

if __name__ == "__main__":  # (not when the test imports CASES: its process keeps its one device)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from kernels import context  # noqa: E402
from kernels.attention import Band, attention, xla  # noqa: E402

B, T, H, G, K, V, D = 2, 40, 4, 2, 4, 3, 16
MESHES = {"context=8": (8, 1), "data=2 context=4": (4, 2)}
CASES = ("gqa", "documents", "band", "band_traced", "fox", "blocked", "layer_attention", "layer_fox", "layer_mla")


@contextlib.contextmanager
def blocked():
    """The XLA form blocked at any length, in blocks of 4: the block pairs that no query sees are skipped."""
    saved = xla.DENSE_MAX, xla.BLOCK
    xla.DENSE_MAX, xla.BLOCK = 0, 4
    try:
        yield
    finally:
        xla.DENSE_MAX, xla.BLOCK = saved


def kernel_cases(r, seg):
    """name -> (call(inputs, split) -> o, inputs: (B, T, ...) arrays, the n differentiated ones first, then
    the arrays every device holds whole; n; a context manager the case runs in)."""
    q, k, v = (jnp.asarray(r.normal(size=s), jnp.float32) for s in ((B, T, H, K), (B, T, G, K), (B, T, G, V)))
    c = jnp.cumsum(jax.nn.log_sigmoid(jnp.asarray(r.normal(size=(B, T, H)) + 2.0, jnp.float32)), axis=1)
    band = Band(window=7, sinks=2)
    traced = (jnp.array([3, 5, 7, 2 ** 30]), jnp.array([0, 1, 2, 3]), jnp.array([0.0, 0.5, 0.0, 0.25]))
    nothing = contextlib.nullcontext
    return {
        "gqa": (lambda a, s: attention(*a, context_split=s), (q, k, v), 3, nothing),
        "documents": (lambda a, s: attention(*a[:3], segment_ids=a[3], context_split=s), (q, k, v, seg), 3, nothing),
        "band": (lambda a, s: attention(*a[:3], segment_ids=a[3], band=band, context_split=s), (q, k, v, seg), 3,
                 nothing),
        "band_traced": (lambda a, s: attention(*a[:3], segment_ids=a[3], band=Band(a[4], a[5], 1, a[6]),
                                               context_split=s), (q, k, v, seg, *traced), 3, nothing),
        "fox": (lambda a, s: attention(*a[:3], segment_ids=a[4], decay=a[3], context_split=s), (q, k, v, c, seg), 4,
                nothing),
        "blocked": (lambda a, s: attention(*a[:3], segment_ids=a[3], band=band, context_split=s), (q, k, v, seg), 3,
                    blocked),
    }


def layer_cases():
    """name -> a layer built for each split."""
    from layers.attention import Attention
    from layers.fox import ForgettingAttention
    from layers.mla import MultiHeadLatentAttention
    return {
        "layer_attention": lambda s: Attention(D, num_heads=4, num_kv_heads=2, window=9, sinks=1, context_split=s,
                                               rngs=nnx.Rngs(0)),
        "layer_fox": lambda s: ForgettingAttention(D, num_heads=4, num_kv_heads=2, context_split=s, rngs=nnx.Rngs(0)),
        "layer_mla": lambda s: MultiHeadLatentAttention(D, num_heads=2, window=11, context_split=s, rngs=nnx.Rngs(0)),
    }


def loss(o):
    """A loss of every output, and the outputs (compared too: a sum over the tokens would not see them swapped)."""
    return jnp.sum(jnp.sin(o) * o), o


def rel(want, got):
    """The largest relative error over the arrays (loss, outputs, each gradient), each against its own scale."""
    return max(float(jnp.max(jnp.abs(w - g)) / jnp.max(jnp.abs(w))) for w, g in
               zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True))


def main():
    jax.config.update("jax_default_matmul_precision", "highest")
    splits = []  # the split of every split_queries call traced
    split_queries = context.split_queries

    def counted(*args, split, **kwargs):
        splits.append(split)
        return split_queries(*args, split=split, **kwargs)

    context.split_queries = counted
    r = np.random.default_rng(0)
    seg = jnp.asarray(np.cumsum(r.random((B, T)) < 0.08, axis=1), jnp.int32)  # documents across boundaries
    seg = seg.at[:, 15].set(seg[:, 14] + 1).at[:, 16:].add(1)  # and one starting exactly at 16 (context=8: 5 a device)
    x = jnp.asarray(r.normal(size=(B, T, D)), jnp.float32)

    def compare(name, value_and_grad, seq, whole):
        """{split: {mesh: error}} of value_and_grad(split)(seq, whole) under each mesh against one device."""
        want = jax.jit(value_and_grad("contiguous"))(seq, whole)
        assert not splits, f"{name}: split_queries ran on one device"
        out = {}
        for split in context.SPLITS:
            out[split] = {}
            for mesh_name, (n, data) in MESHES.items():
                mesh = jax.make_mesh((data, n), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
                with jax.set_mesh(mesh):
                    placed = [jax.device_put(a, NamedSharding(mesh, P("data", "context"))) for a in seq]
                    got = jax.jit(value_and_grad(split))(placed, whole)  # a new jit: traced under the mesh
                assert splits and set(splits) == {split}, f"{name} {split} {mesh_name}: split_queries ran {splits}"
                splits.clear()
                out[split][mesh_name] = rel(want, got)
        return out

    results = {}
    for name, (call, inputs, n, patch) in kernel_cases(r, seg).items():
        def value_and_grad(split):
            run = lambda d, rest, whole: loss(call((*d, *rest, *whole), split))
            return lambda seq, whole: jax.value_and_grad(run, has_aux=True)(seq[:n], seq[n:], whole)

        seq = [a for a in inputs if a.ndim >= 2]  # q, k, v (and the decay), then the documents
        whole = tuple(a for a in inputs if a.ndim < 2)  # a traced band's (H,) fields
        with patch():
            results[name] = compare(name, value_and_grad, seq, whole)
    for name, make in layer_cases().items():
        def value_and_grad(split):
            graph, params = nnx.split(make(split))
            run = lambda p, x, seg: loss(nnx.merge(graph, p)(x, segment_ids=seg))
            return lambda seq, whole: jax.value_and_grad(run, argnums=(0, 1), has_aux=True)(params, *seq)

        results[name] = compare(name, value_and_grad, [x, seg], ())
    assert tuple(results) == CASES
    print(json.dumps(results))


if __name__ == "__main__":
    main()
