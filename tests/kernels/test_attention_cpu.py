"""The fused CPU kernels (kernels/attention/cpu.cc through cpu.py) against the reference: outputs and the
gradients of q, k and v on ragged T (a partial last block), several 64-token blocks, GQA ratios 1, 2 and 4,
one kv head, head dims that are padded (8, 24) and not, windows inside a block and across blocks, packed
documents; that `attention` takes them on CPU for the layers' calls and leaves them for what they do not
express; and that a machine without a working compiler gets the XLA forms, with a warning."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import layers
from kernels import native
from kernels.attention import Band, attention, cpu
from tests.kernels.test_attention_pallas import _compare, _inputs, _packed
from tests.util import NEEDS_CXX

# (B, T, H, G, K, V, window, packed)
CASES = {
    "ragged-G1": (2, 37, 4, 1, 16, 16, None, False),
    "blocks-mha-packed": (1, 192, 2, 2, 32, 32, None, True),
    "tail-gqa4-window-K8": (2, 130, 8, 2, 8, 16, 9, True),
    "gqa2-window-across-blocks-K24-V48": (1, 200, 4, 2, 24, 48, 70, False),
    "window-of-two": (1, 70, 2, 1, 16, 16, 2, True),
}


@NEEDS_CXX
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case):
    B, T, H, G, K, V, window, packed = CASES[case]
    q, k, v, ct = _inputs(B, T, T, H, G, K, V, seed=3)
    kw = dict(band=Band(window), segment_ids=_packed(B, T, 5) if packed else None)
    _compare(q, k, v, ct, kw, 1e-5, block_sizes=None,
             kernel=lambda q, k, v, block_sizes, band, segment_ids: cpu.attention_cpu(q, k, v, segment_ids, band))


def _custom_calls(f, *args) -> int:
    return jax.jit(f).lower(*args).as_text().count("zoo_attention_cpu_forward")


@NEEDS_CXX
def test_auto_takes_the_layers_calls_and_leaves_the_rest():
    x = jnp.ones((2, 40, 64))
    layer = layers.Attention(64, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(0))  # band: the trained context
    assert _custom_calls(lambda x: layer(x), x) == 1
    q, k, v, _ = _inputs(1, 40, 40, 2, 2, 16, 16)
    assert _custom_calls(lambda q: attention(q, k, v), q) == 1
    for other in (dict(band=Band(window=8, sinks=2)), dict(causal=False), dict(impl="xla"),
                  dict(decay=jnp.zeros((1, 40, 2)))):
        assert _custom_calls(lambda q: attention(q, k, v, **other), q) == 0, other
    with pytest.raises(ValueError, match="one static window"):
        cpu.attention_cpu(q, k, v, band=Band(window=8, sinks=2))


def test_without_a_compiler_attention_runs_the_xla_forms(monkeypatch, tmp_path):
    build = lambda: native._build.__wrapped__(cpu.SOURCE, (("ZooAttentionForward", "unregistered"),))
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    with pytest.warns(UserWarning, match="did not compile"):
        assert build() is False
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert build() is False
    monkeypatch.setenv("ZOO_CPU_KERNELS", "0")
    assert cpu.KERNELS.available() is False
    assert not any((tmp_path / "ffi").iterdir())  # nothing half-written
