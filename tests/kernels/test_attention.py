import jax.numpy as jnp
import numpy as np
import pytest

from kernels.attention import attention
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
    o = attention(q, k, v, segment_ids=seg, window=window)
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
