"""WKV7 Pallas kernels against the token-by-token reference: outputs, final state and gradients
w.r.t. r, w_log, k, v, a, b and initial_state, with ragged T, T = 1, packed documents, fast and slow
decays, two value blocks, two head dims and bfloat16; dispatch; lowering to Triton.

On CPU the kernels run in interpret mode with 16-token chunks and 16-column value blocks, so tiny
shapes cross chunks, ragged tails and value blocks. The test marked `gpu` runs the compiled kernels.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import AUTO_PALLAS
from kernels.gla.pallas import BlockSizes
from kernels.wkv7 import wkv7
from kernels.wkv7.pallas import default_block_sizes, wkv7_pallas
from kernels.wkv7.reference import wkv7_recurrent
from tests.kernels.test_wkv7 import NAMES, make_inputs, randn
from tests.util import assert_close, unchecked

BS = BlockSizes(block_t=16, block_v=16)
ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (compiled kernels)")


def _packed(B, T):
    """Segment ids: row 0 has documents starting at t = 5, 6 (a one-token document) and 16 (a chunk
    boundary); row 1 one starting at t = 11."""
    rows = [np.repeat([4, 5, 6, 7], [5, 1, 10, T - 16]), np.repeat([2, 3], [11, T - 11])]
    return jnp.asarray(np.stack(rows)[:B], jnp.int32)


@functools.partial(jax.jit, static_argnames=("pallas", "block_sizes"))
def _outputs_and_grads(x, seg, wo, ws, *, pallas, block_sizes=BS):
    """(o, S) and the gradients of sum(o wo) + sum(S ws) w.r.t. every input; the reference in
    float32 from the same (possibly rounded) inputs."""
    def loss(x):
        if pallas:
            o, S = wkv7_pallas(**x, segment_ids=seg, block_sizes=block_sizes)
        else:
            o, S = wkv7_recurrent(**{n: v.astype(jnp.float32) for n, v in x.items()}, segment_ids=seg)
        return jnp.sum(o.astype(jnp.float32) * wo) + jnp.sum(S * ws), (o, S)
    return jax.grad(loss, has_aux=True)(x)


def _compare(x, seg, tol, dtype=jnp.float32, block_sizes=BS):
    B, T, H, K = x["r"].shape
    V = x["v"].shape[-1]
    wo, ws = jnp.asarray(randn(100, (B, T, H, V))), jnp.asarray(randn(101, (B, H, K, V)))
    x = {n: v if n == "initial_state" else v.astype(dtype) for n, v in x.items()}
    grads, (o, S) = _outputs_and_grads(x, seg, wo, ws, pallas=True, block_sizes=block_sizes)
    want_grads, (want_o, want_S) = _outputs_and_grads(x, seg, wo, ws, pallas=False)
    assert o.dtype == dtype and S.dtype == jnp.float32
    assert_close(o, want_o, tol, "o")
    assert_close(S, want_S, tol, "final state")
    for name in NAMES:
        a, b = grads[name], want_grads[name]
        assert a.dtype == x[name].dtype, name
        assert np.isfinite(np.asarray(a, np.float32)).all(), f"d{name} not finite"
        assert float(jnp.abs(b).max()) > 0, f"d{name}: the reference gradient is zero"
        assert_close(a, b, tol, f"d{name}")


# (B, T, H, K, V, packed, decay_scale): T = 21 leaves a ragged second chunk; V = 32 runs two value
# blocks (dr, dw, dk, da, db summed over them); K = 8 is padded to 16; decay_scale 1.5 mixes log
# decays from about -0.01 to -20 (products of decays underflow inside a chunk).
CASES = {
    "ragged-packed-2vblocks-fast-decay": (2, 21, 2, 16, 32, True, 1.5),
    "ragged-packed-K8": (2, 21, 1, 8, 16, True, 0.0),
    "T1-B1": (1, 1, 2, 8, 16, False, 0.0),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_float32(case):
    B, T, H, K, V, packed, decay = CASES[case]
    _compare(make_inputs(T + K, B, T, H, K, V, decay), _packed(B, T) if packed else None, 1e-4)


def test_bfloat16_within_bf16_tolerance():
    B, T, H, K, V, _, _ = CASES["ragged-packed-K8"]
    _compare(make_inputs(3, B, T, H, K, V), _packed(B, T), 2e-2, jnp.bfloat16)


def test_dispatch():
    x = jnp.zeros((1, 32, 2, 16))  # T > 16: "auto" would take the kernel on GPU
    jaxpr = lambda impl: str(jax.make_jaxpr(functools.partial(wkv7, impl=impl))(x, x, x, x, x, x))
    assert "pallas_call" in jaxpr("pallas")
    if not (AUTO_PALLAS and ON_GPU):  # ZOO_AUTO_PALLAS=1 on a GPU: "auto" takes the kernel
        assert "pallas_call" not in jaxpr("auto")
    assert "pallas_call" not in jaxpr("xla") and "pallas_call" not in jaxpr("reference")
    with pytest.raises(ValueError, match="expected one of"):
        wkv7(x, x, x, x, x, x, impl="triton")
    with pytest.raises(ValueError, match="expected r, w_log, k, a, b"), unchecked():  # the kernel's own check
        wkv7_pallas(x, x, x[..., :8], x, x, x)


def test_lowers_for_cuda_through_triton():
    """Without a GPU: the forward, state-recomputing and backward kernels lower to Triton for CUDA
    with the GPU block sizes, documents and a ragged T, in float32 and bfloat16."""
    B, T, H, K = 2, 40, 2, 64
    seg = jnp.zeros((B, T), jnp.int32)

    def loss(r, w_log, k, v, a, b, S0):
        o, S = wkv7_pallas(r, w_log, k, v, a, b, segment_ids=seg, initial_state=S0, interpret=False,
                           block_sizes=default_block_sizes("gpu"))
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)

    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.zeros((B, T, H, K), dtype)
        hlo = jax.jit(jax.grad(loss, argnums=tuple(range(7)))).trace(
            x, x, x, x, x, x, jnp.zeros((B, H, K, K))).lower(lowering_platforms=("cuda",)).as_text()
        assert hlo.count("__gpu$xla.gpu.triton") == 3, dtype


@gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)])
def test_compiled_kernels_on_gpu(dtype, tol):
    """Default GPU block sizes (block_sizes=None), ragged T, documents, fast decays."""
    B, T, H, K = 2, 300, 4, 64
    with jax.default_matmul_precision("highest"):  # a float32 reference without TF32
        _compare(make_inputs(7, B, T, H, K, K, 1.5), _packed(B, T), tol, dtype, block_sizes=None)
