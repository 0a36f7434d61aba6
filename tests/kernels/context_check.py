"""The checks of tests/kernels/test_context.py, run with 8 simulated CPU devices: every case, an op with a
context-parallel form (kernels/context.py), an attention layer or a short window (convolution, token shift), on the
meshes context=8 and data=2 x context=4 (softmax attention with each split, contiguous and zigzag) against the same
call on one device: outputs, end state and the gradients of a loss of both with respect to every float input and the
initial state, each array against its own scale; and the calls of the form's function (context.over_spans or
split_queries), counted while tracing, under each mesh and on one device. B = 2, T = 40: spans of 5 and 10 tokens,
not a multiple of 8 x the chunk of 4, the zigzag's halves unequal on context=8. Packed documents cross the spans:
one of a single token at 15 (a boundary of context=8), starts at 16 and at 20 (a boundary of both meshes). Prints
one JSON object: {case: {"form", "one device": calls, "runs": [{"split", "mesh", "calls": {function: [the split of
each call]}, "errors": {"outputs" | "end state" | "gradients": {array: relative error}}}]}}.

python tests/kernels/context_check.py
"""

import contextlib
import json
import os
from typing import Any, Callable, NamedTuple

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
from kernels.delta_rule import delta_rule  # noqa: E402
from kernels.delta_rule.product import delta_product  # noqa: E402
from kernels.gla import gla  # noqa: E402
from kernels.linear_attention import linear_attention  # noqa: E402
from kernels.mamba3 import Mamba3Carry, mamba3, mamba3_mimo  # noqa: E402
from kernels.retention import retention  # noqa: E402
from kernels.rglru import rglru  # noqa: E402
from kernels.s4d import s4d  # noqa: E402
from kernels.selective_scan import selective_scan  # noqa: E402
from kernels.ssd import ssd  # noqa: E402
from kernels.wkv6 import wkv6  # noqa: E402
from kernels.wkv7 import wkv7  # noqa: E402
from layers.conv import ShortConvolution  # noqa: E402
from layers.token_shift import token_shift  # noqa: E402
from tests.util import record_calls, rel_err  # noqa: E402

B, T, H, K, V, C, R, D = 2, 40, 2, 4, 3, 4, 2, 16  # R: Mamba-3 MIMO's rank, D: the attention layers' width
MESHES = {"context=8": (8, 1), "data=2 context=4": (4, 2)}
FORMS = ("over_spans", "split_queries")  # every context-parallel form runs through one of them
CASES = ("linear_attention", "retention", "gla", "delta_rule", "gated_delta_rule", "kda", "delta_product", "ssd",
         "wkv6", "wkv7", "mamba3", "mamba3_mimo", "selective_scan", "rglru", "s4d", "s4d_fft", "attention_gqa",
         "attention_documents", "attention_band", "attention_band_traced", "attention_fox", "attention_blocked",
         "layer_attention", "layer_fox", "layer_mla", "short_convolution", "token_shift")


class Case(NamedTuple):
    """One check: the call, its inputs and the form it must run under a mesh."""

    call: Callable  # (seq, whole, state, split) -> (outputs, end state or None)
    seq: tuple  # (B, T, ...) arrays, split over the data and context axes
    whole: Any = ()  # arrays every device holds whole
    state: Any = None  # the initial state
    form: str = "over_spans"  # the function of kernels/context.py a run under a mesh calls, once
    patch: Callable = contextlib.nullcontext  # the context manager every trace of the case runs in


@contextlib.contextmanager
def blocked():
    """The XLA form of attention blocked at any length, in blocks of 4: the block pairs that no query sees are
    skipped."""
    saved = xla.DENSE_MAX, xla.BLOCK
    xla.DENSE_MAX, xla.BLOCK = 0, 4
    try:
        yield
    finally:
        xla.DENSE_MAX, xla.BLOCK = saved


def cases(r, seg):
    """name -> Case, in the order of CASES; seg (B, T) the documents."""
    rand = lambda *shape: jnp.asarray(r.normal(size=shape), jnp.float32)
    decay = lambda *shape: -0.3 * jnp.abs(rand(*shape))  # a log decay
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    complex_rand = lambda *shape: jax.lax.complex(rand(*shape), rand(*shape))
    q, k, v, S0 = rand(B, T, H, K), rand(B, T, H, K), rand(B, T, H, V), rand(B, H, K, V)
    beta = jax.nn.sigmoid(rand(B, T, H))
    kw = lambda S0, seq, **more: dict(initial_state=S0, segment_ids=seq[-1], output_final_state=True, **more)
    chunked = lambda S0, seq: kw(S0, seq, chunk_size=C)
    n = 3  # DeltaProduct's steps per token
    # Mamba-3 (head dim V, state K) from a carry with nonzero h, angles, B̄ and x
    mamba = lambda *rank: (rand(B, T, H, V), jax.nn.softplus(rand(B, T, H)), -0.5 - jnp.abs(rand(B, T, H)),
                           jax.nn.sigmoid(rand(B, T, H)), rand(B, T, H, *rank, K), rand(B, T, H, *rank, K),
                           np.pi * jnp.tanh(rand(B, T, H, K // 2)), seg)
    carry = lambda *rank: Mamba3Carry(rand(B, H, V, K), jnp.asarray(r.uniform(0, 2 * np.pi, (B, H, K // 2)),
                                                                    jnp.float32), rand(B, H, *rank, K), rand(B, H, V))
    # the elementwise decays of context.split_diagonal, over V channels of K states
    A = jax.lax.complex(-0.5 * jnp.exp(rand(V, K)), np.pi * jnp.arange(K, dtype=jnp.float32) + rand(V, K))
    s4d_whole = (A, jnp.exp(jnp.asarray(r.uniform(np.log(0.01), np.log(0.5), V), jnp.float32)), complex_rand(V, K),
                 rand(V))
    # softmax attention: 2H query heads on H kv heads, FoX's cumulative log decay c
    qa, c = rand(B, T, 2 * H, K), jnp.cumsum(jax.nn.log_sigmoid(rand(B, T, 2 * H) + 2.0), axis=1)
    band = Band(window=7, sinks=2)
    traced = (jnp.array([3, 5, 7, 2 ** 30]), jnp.array([0, 1, 2, 3]), jnp.array([0.0, 0.5, 0.0, 0.25]))  # per head
    stateless = lambda call: lambda seq, whole, S0, split: (call(seq, whole, split), None)
    x = rand(B, T, D)
    conv = nnx.split(ShortConvolution(D, 4, use_bias=True, rngs=nnx.Rngs(0)))  # (graph, parameters)
    return {
        "linear_attention": Case(lambda s, w, S0, _: linear_attention(*s[:3], **chunked(S0, s)), (q, k, v, seg),
                                 state=S0),
        "retention": Case(lambda s, w, S0, _: retention(*s[:3], jnp.array([0.9, 0.6]), **chunked(S0, s)),
                          (q, k, v, seg), state=S0),
        "gla": Case(lambda s, w, S0, _: gla(*s[:4], **chunked(S0, s)), (q, k, v, decay(B, T, H, K), seg), state=S0),
        "delta_rule": Case(lambda s, w, S0, _: delta_rule(s[0], unit(s[1]), *s[2:4], **chunked(S0, s)),
                           (q, k, v, beta, seg), state=S0),
        "gated_delta_rule": Case(lambda s, w, S0, _: delta_rule(s[0], unit(s[1]), *s[2:5], **chunked(S0, s)),
                                 (q, k, v, beta, decay(B, T, H), seg), state=S0),
        "kda": Case(lambda s, w, S0, _: delta_rule(s[0], unit(s[1]), *s[2:5], **chunked(S0, s)),
                    (q, k, v, beta, decay(B, T, H, K), seg), state=S0),
        "delta_product": Case(lambda s, w, S0, _: delta_product(s[0], unit(s[1]), *s[2:5], **chunked(S0, s)),
                              (q, rand(B, T, n, H, K), rand(B, T, n, H, V), jax.nn.sigmoid(rand(B, T, n, H)),
                               decay(B, T, H), seg), state=S0),
        "ssd": Case(lambda s, w, S0, _: ssd(s[0], jax.nn.softplus(s[1]), -jnp.array([0.5, 1.5]), *s[2:4],
                                            jnp.array([1.0, -0.5]), **chunked(S0, s)),
                    (v, rand(B, T, H), rand(B, T, 1, K), rand(B, T, 1, K), seg), state=jnp.swapaxes(S0, 2, 3)),
        "wkv6": Case(lambda s, w, S0, _: wkv6(*s[:4], jnp.full((H, K), 0.5), **chunked(S0, s)),
                     (q, k, v, decay(B, T, H, K), seg), state=S0),
        "wkv7": Case(lambda s, w, S0, _: wkv7(*s[:2], unit(s[2]), s[3], -unit(s[4]), unit(s[4]) * s[5],
                                              **chunked(S0, s)),
                     (q, decay(B, T, H, K), k, v, rand(B, T, H, K), jax.nn.sigmoid(rand(B, T, H, K)), seg), state=S0),
        "mamba3": Case(lambda s, w, S0, _: mamba3(*s[:-1], *w, **chunked(S0, s)), mamba(), (rand(H),), carry()),
        "mamba3_mimo": Case(lambda s, w, S0, _: mamba3_mimo(*s[:-1], *w, **chunked(S0, s)), mamba(R),
                            (rand(H, R, V), rand(H)), carry(R)),
        "selective_scan": Case(lambda s, w, S0, _: selective_scan(*s[:2], w[0], *s[2:4], w[1], mode="chunk",
                                                                  **chunked(S0, s)),
                               (rand(B, T, V), jax.nn.softplus(rand(B, T, V)), rand(B, T, K), rand(B, T, K), seg),
                               (-jnp.exp(rand(V, K)), rand(V)), rand(B, V, K)),
        # the second row's first token begins a document: its initial state dropped, the first span's M zero
        "rglru": Case(lambda s, w, S0, _: rglru(*s[:3], *w, first_starts=jnp.array([False, True]), **kw(S0, s)),
                      (rand(B, T, V), jax.nn.sigmoid(rand(B, T, V)), jax.nn.sigmoid(rand(B, T, V)), seg),
                      (jnp.asarray(r.uniform(2.0, 7.0, V), jnp.float32),), rand(B, V)),
        "s4d": Case(lambda s, w, S0, _: s4d(s[0], *w, **kw(S0, s)), (rand(B, T, V), seg), s4d_whole,
                    complex_rand(B, V, K)),
        # without documents the spans run the FFT form
        "s4d_fft": Case(lambda s, w, S0, _: s4d(*s, *w, initial_state=S0, mode="fft", output_final_state=True),
                        (rand(B, T, V),), s4d_whole, complex_rand(B, V, K)),
        "attention_gqa": Case(stateless(lambda s, w, split: attention(*s, context_split=split)), (qa, k, v),
                              form="split_queries"),
        "attention_documents": Case(stateless(lambda s, w, split: attention(*s[:3], segment_ids=s[3],
                                                                        context_split=split)),
                                    (qa, k, v, seg), form="split_queries"),
        "attention_band": Case(stateless(lambda s, w, split: attention(*s[:3], segment_ids=s[3], band=band,
                                                                   context_split=split)),
                               (qa, k, v, seg), form="split_queries"),
        # window, sinks and growth traced per head
        "attention_band_traced": Case(stateless(lambda s, w, split: attention(*s[:3], segment_ids=s[3],
                                                                          band=Band(w[0], w[1], 1, w[2]),
                                                                          context_split=split)),
                                      (qa, k, v, seg), traced, form="split_queries"),
        "attention_fox": Case(stateless(lambda s, w, split: attention(*s[:3], segment_ids=s[4], decay=s[3],
                                                                  context_split=split)),
                              (qa, k, v, c, seg), form="split_queries"),
        "attention_blocked": Case(stateless(lambda s, w, split: attention(*s[:3], segment_ids=s[3], band=band,
                                                                          context_split=split)),
                                  (qa, k, v, seg), form="split_queries", patch=blocked),
        **{name: layer_case(make, x, seg) for name, make in layer_makers().items()},
        # the windows of layers/conv.py and layers/token_shift.py, continuing a given one
        "short_convolution": Case(lambda s, p, S0, _: nnx.merge(conv[0], p).decode(s[0], S0, segment_ids=s[1]),
                                  (x, seg), conv[1], rand(B, 3, D)),
        "token_shift": Case(lambda s, w, S0, _: token_shift(s[0], S0, s[1]), (x, seg), state=rand(B, D)),
    }


def layer_makers():
    """name -> the layer built with a split; its gradients: with respect to x and the parameters."""
    from layers.attention import Attention
    from layers.fox import ForgettingAttention
    from layers.mla import MultiHeadLatentAttention

    return {
        "layer_attention": lambda s: Attention(D, num_heads=4, num_kv_heads=2, window=9, sinks=1, context_split=s,
                                               rngs=nnx.Rngs(0)),
        "layer_fox": lambda s: ForgettingAttention(D, num_heads=4, num_kv_heads=2, context_split=s, rngs=nnx.Rngs(0)),
        "layer_mla": lambda s: MultiHeadLatentAttention(D, num_heads=2, window=11, context_split=s, rngs=nnx.Rngs(0)),
    }


def layer_case(make, x, seg):
    """The Case of the layer make(split) on x (B, T, D): its parameters held whole, the same for every split."""
    graphs = {split: nnx.split(make(split)) for split in context.SPLITS}  # (graph, parameters)
    return Case(lambda s, p, _, split: (nnx.merge(graphs[split][0], p)(s[0], segment_ids=s[1]), None), (x, seg),
                graphs[context.SPLITS[0]][1], form="split_queries")


def value_and_grad(case: Case, split):
    """A new jit (traced where it is called) of (seq, whole, state) -> ((loss, (outputs, end state)), the gradients
    with respect to the three). The loss: sum_i cos(i) a_i over every output and end state array a (real and
    imaginary parts), i the element's index: weights that tell the tokens apart (a plain sum would not see them
    swapped) and, fixed, pass the op's rounding to the gradients unamplified (sum a sin(a) would multiply it by |a|).
    Its value, a sum of both signs, is not compared; the arrays it sums are."""

    def loss(seq, whole, state):
        out = case.call(seq, whole, state, split)
        parts = [p for a in jax.tree.leaves(out) for p in ((a.real, a.imag) if jnp.iscomplexobj(a) else (a,))]
        return sum(jnp.sum(jnp.cos(jnp.arange(p.size).reshape(p.shape)) * p) for p in parts), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True, allow_int=True))


def errors(want, got) -> dict:
    """{"outputs" | "end state" | "gradients": {array: relative error}} of got against want, value_and_grad's
    results, every array against its own scale (the integer inputs' empty gradients left out, no end state no
    entry)."""
    (_, (o_w, S_w)), g_w = want
    (_, (o_g, S_g)), g_g = got
    named = lambda g: dict(zip(("seq", "whole", "state"), g, strict=True))
    out = {}
    for what, w, g in (("outputs", o_w, o_g), ("end state", S_w, S_g), ("gradients", named(g_w), named(g_g))):
        pairs = zip(jax.tree_util.tree_leaves_with_path(w), jax.tree.leaves(g), strict=True)
        if e := {jax.tree_util.keystr(path): rel_err(b, a) for (path, a), b in pairs if a.dtype != jax.dtypes.float0}:
            out[what] = e
    return out


def main():
    jax.config.update("jax_default_matmul_precision", "highest")
    recorded = {f: record_calls(context, f) for f in FORMS}  # the ops call them through the module

    def calls():
        """{function: the split of each call} since the last time, the records cleared."""
        out = {f: [c.get("split") for c in rec] for f, rec in recorded.items()}
        for rec in recorded.values():
            rec.clear()
        return out

    r = np.random.default_rng(0)
    seg = np.cumsum(r.random((B, T)) < 0.06, axis=1)  # documents across boundaries
    for t in (15, 16, 20):  # starts at 15 (a boundary of context=8: a document of one token), 16 and 20 (of both)
        seg[:, t:] += 1
    meshes = {name: jax.make_mesh((data, n), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
              for name, (n, data) in MESHES.items()}
    report = {}
    all_cases = cases(r, jnp.asarray(seg, jnp.int32))
    assert tuple(all_cases) == CASES
    for name, case in all_cases.items():
        splits = context.SPLITS if case.form == "split_queries" else (None,)
        with case.patch():
            want = value_and_grad(case, splits[0])(case.seq, case.whole, case.state)
            report[name] = {"form": case.form, "one device": calls(), "runs": []}
            for split in splits:
                for mesh_name, mesh in meshes.items():
                    with jax.set_mesh(mesh):
                        seq = jax.device_put(case.seq, NamedSharding(mesh, P("data", "context")))
                        got = value_and_grad(case, split)(seq, case.whole, case.state)
                    report[name]["runs"].append({"split": split, "mesh": mesh_name, "calls": calls(),
                                                 "errors": errors(want, got)})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
