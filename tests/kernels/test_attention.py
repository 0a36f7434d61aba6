import jax.numpy as jnp
import numpy as np
import pytest

from kernels.attention import Band, attention
from tests.util import assert_close, randn


def brute_force(q, k, v, seg, window):
    """Loop over queries and keys with numpy: the mask rules written out one by one."""
    B, T, H, K = q.shape
    G = k.shape[2]
    out = np.zeros(q.shape, np.float64)
    for b in range(B):
        for h in range(H):
            g = h // (H // G)
            for i in range(T):
                js = [j for j in range(i + 1) if (window is None or j > i - window)
                      and (seg is None or seg[b, j] == seg[b, i])]
                s = np.array([q[b, i, h] @ k[b, j, g] / np.sqrt(K) for j in js])
                p = np.exp(s - s.max())
                out[b, i, h] = (p / p.sum()) @ np.asarray(v)[b, js, g]
    return out


@pytest.mark.parametrize("G,window,packed", [(4, None, False), (2, 3, False), (1, None, True), (2, 4, True)])
def test_reference_matches_brute_force(G, window, packed):
    B, T, H, K = 2, 9, 4, 8
    q, k, v = randn(0, (B, T, H, K)), randn(1, (B, T, G, K)), randn(2, (B, T, G, K))
    seg = jnp.array([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 3, 3, 3]]) if packed else None
    o = attention(q, k, v, segment_ids=seg, band=Band(window))
    assert_close(o, brute_force(np.asarray(q, np.float64), np.asarray(k, np.float64), v, seg, window), 1e-5)


def test_gqa_equals_mha_with_repeated_kv_heads():
    B, T, H, G, K = 2, 7, 6, 2, 8
    q, k, v = randn(0, (B, T, H, K)), randn(1, (B, T, G, K)), randn(2, (B, T, G, K))
    full = attention(q, jnp.repeat(k, H // G, axis=2), jnp.repeat(v, H // G, axis=2))
    assert_close(attention(q, k, v), full, 1e-6)


def test_bad_impl_and_heads():
    q = randn(0, (1, 2, 4, 8))
    with pytest.raises(ValueError, match="impl"):
        attention(q, q, q, impl="cuda")
    with pytest.raises(ValueError, match="kv heads"):
        attention(q, q[:, :, :3], q[:, :, :3])


def brute_force_band(q, k, v, seg, window, sinks, dilation, growth):
    """The sparse masks from their definition, one (query, key, head) at a time: key j is seen from
    query i of head h when j <= i, both are in one document, and either i - j is a multiple of
    dilation[h] below window[h] * dilation[h] + growth[h] * (c_i + 1), c_i the query's position in
    its document, or j is among the first sinks[h] tokens of that document."""
    B, T, H, K = q.shape
    G = k.shape[2]
    seg = np.zeros((B, T), int) if seg is None else np.asarray(seg)
    out = np.zeros(q.shape, np.float64)
    for b in range(B):
        for h in range(H):
            g = h // (H // G)
            for i in range(T):
                start = min(t for t in range(i + 1) if all(seg[b, u] == seg[b, i] for u in range(t, i + 1)))
                c = i - start
                js = [j for j in range(start, i + 1)
                      if (i - j) % dilation[h] == 0 and i - j < window[h] * dilation[h] + growth[h] * (c + 1)
                      or j - start < sinks[h]]
                s = np.array([q[b, i, h] @ k[b, j, g] / np.sqrt(K) for j in js])
                p = np.exp(s - s.max())
                out[b, i, h] = (p / p.sum()) @ np.asarray(v)[b, js, g]
    return out


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("band", ["sinks", "dilation", "per-head", "growth"])
def test_sparse_masks_match_brute_force(band, packed):
    """Sinks (of each document), dilated windows, per-head windows / sinks / dilations and a span
    growing with the query's position, in every impl on CPU, against the definition."""
    B, T, H, G, K = 2, 13, 4, 2, 8
    q, k, v = randn(0, (B, T, H, K)), randn(1, (B, T, G, K)), randn(2, (B, T, G, K))
    seg = jnp.array([[0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3]]) if packed \
        else None
    kw = {"sinks": dict(window=3, sinks=2), "dilation": dict(window=3, dilation=2),
          "per-head": dict(window=(2, 3, 2 ** 30, 4), sinks=(1, 0, 2, 3), dilation=(1, 2, 1, 3)),
          "growth": dict(window=(1, 2, 1, 2), growth=(0.0, 0.5, 0.25, 1.0), sinks=(0, 1, 1, 0))}[band]
    per = lambda name, none: [kw.get(name, none)] * H if not isinstance(kw.get(name), tuple) else kw[name]
    want = brute_force_band(np.asarray(q, np.float64), np.asarray(k, np.float64), v, seg, per("window", 2 ** 30),
                            per("sinks", 0), per("dilation", 1), per("growth", 0.0))
    for impl in ("reference", "xla"):
        assert_close(attention(q, k, v, segment_ids=seg, band=Band(**kw), impl=impl), want, 1e-5, impl)


def test_sparse_mask_parameters_may_be_traced():
    """Per-head arrays as arguments of one jitted function: new values, no new trace, the same outputs
    as static tuples."""
    import jax

    q, k, v = randn(0, (1, 11, 4, 8)), randn(1, (1, 11, 2, 8)), randn(2, (1, 11, 2, 8))
    traces = []

    @jax.jit
    def run(window, sinks, dilation, growth):
        traces.append(1)
        return attention(q, k, v, band=Band(window, sinks, dilation, growth))

    for masks in [((2, 3, 4, 5), (0, 1, 2, 3), (1, 2, 1, 2), (0.0, 0.5, 0.0, 0.25)),
                  ((5, 1, 2, 2 ** 30), (2, 0, 0, 1), (2, 1, 3, 1), (0.5, 0.0, 1.0, 0.0))]:
        arrays = [jnp.asarray(m) for m in masks]
        assert_close(run(*arrays), attention(q, k, v, band=Band(*masks)), 1e-6)
    assert len(traces) == 1


def test_masks_the_flash_kernels_cannot_express_run_the_xla_forms():
    """impl="pallas" with sinks, dilation or per-head windows: the XLA forms, never a wrong result."""
    q, k, v = randn(0, (1, 20, 4, 16)), randn(1, (1, 20, 2, 16)), randn(2, (1, 20, 2, 16))
    for kw in (dict(window=3, sinks=2), dict(window=3, dilation=2), dict(window=(2, 3, 4, 5))):
        band = Band(**kw)
        assert_close(attention(q, k, v, impl="pallas", band=band), attention(q, k, v, impl="reference", band=band),
                     1e-5)
