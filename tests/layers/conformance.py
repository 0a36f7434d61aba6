"""The mixer protocol, checked on any layer (layers/__init__.py; the one suite every kind runs through,
tests/layers/test_conformance.py, and a kind's own variants in its test file):

- every mode computes the function of impl="reference" (the token-by-token truth), and the layer's
  training mode its gradients w.r.t. the input and every parameter (every form's gradients are
  compared with the reference's op by op in tests/kernels);
- prefill (with a document start inside it) + token-by-token decode equals the full pass, and so
  does a prefill in chunks of 3 tokens (which do not divide T) and of each short convolution's
  width - 1, each chunk continuing the state the last one left, documents starting inside some,
  + token-by-token decode;
- speculative rollback: decode(steps=True) of a chunk gives decode's outputs, and `rollback` gives
  each row the state of decoding only the tokens it keeps (rows keeping different numbers), from
  which decoding goes on as from that state;
- a packed row equals its documents run alone, a row packed with padding too (segment 0, as
  infer.generate pads: before, between and after documents, some back to back, one starting just
  before the prefill ends, so a convolution's window leaves the prefill holding padding, as zeros);
- gradients are finite and reach every parameter;
- the decode state has fixed shapes: it does not grow with max_len (unless the layer says
  `grows_with_context`, a KV cache), and a jitted decode step traces once for many steps, a state
  saved to the host (numpy, as a checkpoint holds it) and restored included, which continues as the
  state it was saved from;
- bfloat16 compute keeps float32 parameters and returns bfloat16 activations;
- shape annotations are checked (the suite runs under jaxtyping's import hook): a wrong input shape
  fails at the layer's edge; and without the checker (as users run) the layer's own ValueError names
  the expected and the given shape, for x of the wrong rank or width and segment_ids of the wrong
  shape, in __call__ and in decode; and decode(steps=True) refuses segment_ids.

A layer keeps `impl` (and, where it has modes, `mode`) as attributes read at call time, so one set of
parameters runs in every mode. A layer with `carries_v_first` (RWKV-7 after layer 0) gets a v_first
input treated like x. All outputs come from two jitted functions, the full passes (with the gradients,
whose forward passes give those modes' outputs) and decoding: compiles dominate the suite, and XLA
compiles the two halves in less time than the whole (tests/layers/test_conformance.py: 100 CPU-s instead
of 113, the lower of two runs each, 2026-12-07, with the shared forward passes and the batched calls below).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.util import assert_close, assert_tree_close

B, T, P, CUT = 2, 20, 12, 5  # batch, length, prefill length, document start inside row 0's prefill
K, DROP = 5, (0, 3)  # a speculative chunk after the prefill, and the tokens of it each row drops
# (segment id, length) runs of each row. Row 1 is packed with padding (segment 0): a pad token, documents
# A and B back to back, four pad tokens, document C from one token before the prefill ends. No document
# starts at a multiple of 2 or 3, where a chunk of `chunked_prefill` starts (a call continues its state).
ROWS = (((0, CUT), (1, T - CUT)), ((0, 1), (1, 4), (2, 2), (0, 4), (3, 9)))
SEG = jnp.asarray([np.repeat(*np.asarray(runs).T) for runs in ROWS], jnp.int32)
DOCS = ((0, 0, CUT), (0, CUT, T), (1, 1, 5), (1, 5, 7), (1, 11, T))  # (row, start, end) of each document


def randn(seed, shape, scale=1.0):
    """numpy, not jax.random: eager jax ops compile one kernel per shape, slow in a test."""
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def perturbed(module, seed=0, scale=0.2):
    """The module with noise on every parameter that starts at exactly zero (RWKV's W_o and first
    LoRA matrices, biases): zeros there would make outputs or gradients vanish and the checks vacuous."""
    params = nnx.state(module, nnx.Param)
    leaves, tree = jax.tree.flatten(params)
    leaves = [jnp.asarray(x + randn(seed + i, x.shape, scale)) if not np.any(np.asarray(x)) else x
              for i, x in enumerate(leaves)]
    nnx.update(module, jax.tree.unflatten(tree, leaves))
    return module


def _call(m, x, seg, vf):
    if getattr(m, "carries_v_first", False):
        return m(x, segment_ids=seg, v_first=vf)[0]
    return m(x, segment_ids=seg)


def _decode(m, x, state, seg, vf, **steps):
    if getattr(m, "carries_v_first", False):
        y, state, _ = m.decode(x, state, segment_ids=seg, v_first=vf, **steps)
        return y, state
    return m.decode(x, state, segment_ids=seg, **steps)


def rollback_outputs(m, x, vf, state):
    """From the prefill's `state`: a chunk of K tokens decoded plainly and with steps=True, the
    stepped state rolled back by DROP, the state of decoding only each row's kept tokens, and the
    outputs of 3 more tokens from either."""
    part = lambda a, lo, hi: None if a is None else a[:, lo:hi]
    dec = lambda lo, hi, s, **kw: _decode(m, x[:, lo:hi], s, None, part(vf, lo, hi), **kw)
    y, full = dec(P, P + K, state)
    y_steps, stepped = dec(P, P + K, state, steps=True)
    rolled = m.rollback(stepped, jnp.asarray(DROP, jnp.int32))
    _, short = dec(P, P + K - DROP[1], state)
    kept = jax.tree.map(lambda a, b: jnp.concatenate([a[:1], b[1:]]), full, short)  # DROP[0] = 0: row 0 all K
    # 3 more tokens from both states in one call (one decode to compile): the rolled state's rows first
    both = jax.tree.map(lambda *a: jnp.concatenate(a), rolled, kept)
    twice = lambda a: None if a is None else jnp.tile(a[:, P + K:P + K + 3], (2, 1, 1))
    after, _ = _decode(m, twice(x), both, None, twice(vf))
    return dict(plain=y, steps=y_steps, rolled=rolled, kept=kept, after_rolled=after[:B], after_kept=after[B:])


def _alone(a):
    """Each of DOCS first in a row of its own, followed by the rest of its row (causality keeps what
    follows a document out of its outputs)."""
    a = np.asarray(a)
    return np.stack([np.roll(a[row], -start, axis=0) for row, start, _ in DOCS])


def chunked_prefill(m, x, vf, c):
    """The first P tokens of x decoded from a fresh state in chunks of c tokens, each with its segment ids:
    (outputs (B, P, D), state)."""
    chunks = lambda a: None if a is None else jnp.swapaxes(a[:, :P].reshape(B, P // c, c, *a.shape[2:]), 0, 1)

    def piece(state, inputs):
        y, state = _decode(m, inputs[0], state, *inputs[1:])
        return state, y

    state, y = jax.lax.scan(piece, m.init_state(B, 64), (chunks(x), chunks(SEG), chunks(vf)))  # (P / c, B, c, D)
    return jnp.swapaxes(y, 0, 1).reshape(B, P, -1), state


def chunk_sizes(layer) -> tuple:
    """3, and each short convolution's width - 1 (but 1: token-by-token decoding, as after every prefill)."""
    from layers.conv import ShortConvolution

    widths = {m.kernel_size for _, m in nnx.iter_graph(layer) if isinstance(m, ShortConvolution)}
    return tuple(sorted({3} | {w - 1 for w in widths} - {1}))


def protocol_outputs(layer, modes, x, vf, grad_mode, chunks):
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    weight = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)
    alone = [None if a is None else jnp.asarray(_alone(a)) for a in (x, vf)]

    def model(params, rest, **attrs):
        m = nnx.merge(graphdef, params, rest)
        for k, v in attrs.items():
            setattr(m, k, v)
        return m

    @jax.jit
    def full_passes(params, rest, x, vf, alone):
        def loss(params, x, **attrs):
            y = _call(model(params, rest, **attrs), x, SEG, vf)
            return jnp.sum(y * weight), y

        out, grads = {}, {}
        for name, attrs in [("reference", {"impl": "reference"})] + [(md, {"mode": md}) for md in modes]:
            if name in ("reference", grad_mode):  # the output is the gradient's own forward pass
                grads[name], out[name] = jax.grad(functools.partial(loss, **attrs), argnums=(0, 1),
                                                  has_aux=True)(params, x)
            else:
                out[name] = _call(model(params, rest, **attrs), x, SEG, vf)
        # each document alone (a row of its own) and the rows unpacked, in one batch: rows are independent
        rows = lambda a, b: None if a is None else jnp.concatenate([a, b])
        y = _call(model(params, rest), rows(alone[0], x), None, rows(alone[1], vf))
        out["alone"], out["unpacked"] = y[:len(DOCS)], y[len(DOCS):]
        return out, grads

    @jax.jit
    def decoding(params, rest, x, vf):
        m = model(params, rest)
        y_prefill, state = _decode(m, x[:, :P], m.init_state(B, 64), SEG[:, :P], None if vf is None else vf[:, :P])
        chunked = [chunked_prefill(m, x, vf, c) for c in chunks]
        # token by token on from every prefill's state at once, one batch of rows per prefill
        states = jax.tree.map(lambda *a: jnp.concatenate(a), state, *(s for _, s in chunked))
        n = 1 + len(chunks)

        def step(states, inputs):
            x_t, vf_t = inputs
            y_t, states = _decode(m, x_t[:, None], states, None, None if vf_t is None else vf_t[:, None])
            return states, y_t[:, 0]

        tail = lambda a: None if a is None else jnp.swapaxes(jnp.tile(a[:, P:], (n, 1, 1)), 0, 1)
        _, y_steps = jax.lax.scan(step, states, (tail(x), tail(vf)))
        y_steps = jnp.swapaxes(y_steps, 0, 1).reshape(n, B, T - P, -1)
        return {"decode": jnp.concatenate([y_prefill, y_steps[0]], axis=1),
                "chunked": {c: jnp.concatenate([y, y_steps[1 + i]], axis=1) for i, (c, (y, _)) in
                            enumerate(zip(chunks, chunked))},
                "rollback": rollback_outputs(m, x, vf, state)}

    out, grads = full_passes(params, rest, x, vf, alone)
    return {**out, **decoding(params, rest, x, vf)}, grads


def check_mixer(make, D, modes=(), *, tol=1e-4, grad_tol=1e-4):
    """`make(**kwargs)` builds the layer under test, of width D (kwargs empty, or dtype); `modes` are
    the modes to compare with impl="reference"."""
    layer = perturbed(make())
    x = jnp.asarray(randn(0, (B, T, D)))
    vf = jnp.asarray(randn(1, (B, T, D))) if getattr(layer, "carries_v_first", False) else None
    grad_mode = getattr(layer, "mode", None)
    if grad_mode is not None and grad_mode not in modes:  # e.g. Mamba's "auto"
        modes = (*modes, grad_mode)
    chunks = chunk_sizes(layer)
    starts = np.flatnonzero(np.diff(np.asarray(SEG), axis=1).any(0)) + 1
    assert not any(P % c or s % c == 0 for s in starts for c in chunks), \
        f"chunks of {chunks} tokens must divide the prefill and miss every document start"
    out, grads = protocol_outputs(layer, modes, x, vf, grad_mode, chunks)
    ref = out["reference"]
    assert np.abs(np.asarray(ref)).max() > 1e-3, "the output is ~0: a vacuous check"
    for mode in modes:
        assert_close(out[mode], ref, tol, f"mode={mode} vs reference")
    if grad_mode in grads and grad_mode != "reference":
        assert_tree_close(grads[grad_mode], grads["reference"], grad_tol, f"gradient, mode={grad_mode} vs reference")
    decode_err = np.abs(np.asarray(out["decode"]) - np.asarray(ref)).max()
    assert decode_err <= tol, f"prefill + token-by-token decode vs full pass: max abs diff {decode_err:.3g}"
    for c, y in out["chunked"].items():
        assert_close(y, ref, tol, f"prefill in chunks of {c} + token-by-token decode vs full pass")
    for i, (row, start, end) in enumerate(DOCS):
        assert_close(ref[row, start:end], out["alone"][i, :end - start], tol, f"packed: row {row}, document at {start}")
    assert not np.allclose(ref[0, CUT:], out["unpacked"][0, CUT:], atol=1e-3), "the document reset is not real"
    for path, g in jax.tree_util.tree_leaves_with_path(grads["reference"][0]):
        g = np.asarray(g)
        assert np.isfinite(g).all() and np.abs(g).max() > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"
    check_rollback(out["rollback"], tol)
    check_state(layer, D)
    check_bfloat16(make, D)
    check_annotations(layer, D)
    check_input_errors(layer, D)


def check_rollback(r, tol):
    """Field by field: a KV cache's slots only below each row's index (the ones it reads)."""
    from layers.state import is_state

    assert_close(r["steps"], r["plain"], tol, "decode: steps=True vs steps=False")
    for got, want in zip(*(jax.tree.leaves(r[k], is_leaf=is_state) for k in ("rolled", "kept")), strict=True):
        for f in dataclasses.fields(got):
            a, b = getattr(got, f.name), getattr(want, f.name)
            what = f"rollback {type(got).__name__}.{f.name}"
            if a is None:
                assert b is None, what
                continue
            a, b = np.asarray(a), np.asarray(b)
            if f.name in got.final_fields and hasattr(got, "index"):  # a cache's slots: KVCache, LatentCache
                ring = getattr(got, "token_index", None)
                at = np.arange(got.doc.shape[1])[None] if ring is None else np.asarray(ring)
                seen = (at >= 0) & (at < np.asarray(got.index)[:, None])  # (B, S): a ring's slots hold any index
                # (B, S, ...) as they are; heads first, (B, G, S, K) or (B, H, S), swapped: slots second
                S = seen.shape[1]
                a, b = ((c if c.ndim == 2 or c.shape[1] == S else np.swapaxes(c, 1, 2))[seen] for c in (a, b))
            if np.issubdtype(a.dtype, np.integer):
                np.testing.assert_array_equal(a, b, what)
            else:
                assert_close(a, b, tol, what)
    assert_close(r["after_rolled"], r["after_kept"], tol, "decoding on from the rolled-back state")


def check_state(layer, D):
    nbytes = lambda s: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(s))
    small, large = (jax.eval_shape(lambda n=n: layer.init_state(B, n)) for n in (128, 16384))
    if not getattr(layer, "grows_with_context", False):
        assert nbytes(small) == nbytes(large), "the state grows with max_len"
    graphdef, params = nnx.split(layer)
    traces = []

    @jax.jit
    def step(params, x, state):
        traces.append(1)
        return _decode(nnx.merge(graphdef, params), x, state, None, x if getattr(layer, "carries_v_first", False)
                       else None)

    state = layer.init_state(B, 8)
    for t in range(3):  # a state of fixed shapes: one trace for every step
        _, state = step(params, jnp.asarray(randn(t, (B, 1, D))), state)
    saved = jax.device_get(state)  # numpy on the host, as a checkpoint holds it
    x = jnp.asarray(randn(3, (B, 1, D)))
    assert_tree_close(step(params, x, jax.tree.map(jnp.asarray, saved)), step(params, x, state), 1e-6,
                      "decoding on from a state saved and restored")
    assert len(traces) == 1, f"the decode step traced {len(traces)} times for 3 steps and a restored state"


def check_bfloat16(make, D):
    low = make(dtype=jnp.bfloat16)
    assert {p.dtype for p in jax.tree.leaves(nnx.state(low, nnx.Param))} == {jnp.dtype(jnp.float32)}
    x = jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16)
    vf = x if getattr(low, "carries_v_first", False) else None
    assert jax.eval_shape(lambda x, vf: _call(low, x, SEG, vf), x, vf).dtype == jnp.bfloat16
    y, _ = jax.eval_shape(lambda x, vf: _decode(low, x, low.init_state(B, 64), SEG, vf), x, vf)
    assert y.dtype == jnp.bfloat16


def check_annotations(layer, D):
    """The annotations are live: an input of the wrong width or rank fails at the layer's edge."""
    import jaxtyping

    for shape in ((B, T), (B, T, D, 1)):
        with pytest.raises(jaxtyping.TypeCheckError):
            jax.eval_shape(lambda x: _call(layer, x, None, None), jax.ShapeDtypeStruct(shape, jnp.float32))


def check_input_errors(layer, D):
    from tests.util import unchecked

    seg = jnp.zeros((B, T + 1), jnp.int32)
    calls = [(lambda x, s: _call(layer, x, s, None)),
             (lambda x, s: _decode(layer, x, layer.init_state(B, 64), s, None))]
    for call in calls:
        for x, s, message in (((B, T), None, "expected x of shape"), ((B, T, D + 1), None, f"d_model = {D}"),
                              ((B, T, D), seg, "expected segment_ids of shape")):
            with unchecked(), pytest.raises(ValueError, match=message):
                jax.eval_shape(call, jax.ShapeDtypeStruct(x, jnp.float32), s)
    with pytest.raises(ValueError, match="steps=True needs segment_ids=None"):  # a verify pass has no packing
        jax.eval_shape(lambda x: _decode(layer, x, layer.init_state(B, 64), SEG, x, steps=True),
                       jax.ShapeDtypeStruct((B, T, D), jnp.float32))
