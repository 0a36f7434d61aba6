"""SSD (Mamba-2) Pallas kernels against the token-by-token reference: outputs, final state and
gradients w.r.t. x, Δ, A, B, C, D and the initial state, with groups shared by several heads,
ragged T, document resets and bfloat16; dispatch; lowering to Triton.

On CPU the kernels run in interpret mode with 16-token chunks and 16-column blocks of P. Tests
marked `gpu` run the compiled kernels.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gla.pallas import BlockSizes, default_block_sizes
from kernels.segments import document_starts
from kernels.ssd import ssd
from kernels.ssd.pallas import ssd_pallas
from kernels.ssd.reference import ssd_recurrent
from tests.util import assert_close

BS = BlockSizes(block_t=16, block_v=16)
ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (compiled kernels)")
NAMES = ("x", "dt", "A", "B", "C", "D", "h0")


def _inputs(Bsz, T, H, P, G, N, with_D=True, seed=0):
    """(x, Δ, A, B, C, D, h0) and the weights of a random projection of (y, h); numpy draws. Δ is
    about 1 and A spans [-16, -e^-1]: a chunk's log-decay passes -88 in the last head."""
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    dt = jnp.asarray(np.log1p(np.exp(rng.standard_normal((Bsz, T, H)) + 0.5)), jnp.float32)
    A = jnp.asarray(-np.exp(np.linspace(-1.0, np.log(16.0), H)), jnp.float32)
    args = (f(Bsz, T, H, P), dt, A, f(Bsz, T, G, N), f(Bsz, T, G, N), f(H) if with_D else None,
            f(Bsz, H, P, N))
    return args, f(Bsz, T, H, P), f(Bsz, H, P, N)


def _packed(Bsz, T, seed=0):
    ids = np.sort(np.random.default_rng(seed).integers(0, 4, (Bsz, T)), axis=1)
    ids[:, T // 2] = 9  # a one-token document
    ids[:, T // 2 + 1:] += 10
    return jnp.asarray(ids, jnp.int32)


@functools.partial(jax.jit, static_argnames=("pallas", "block_sizes"))
def _outputs_and_grads(args, wy, wh, seg, *, pallas, block_sizes=BS):
    """(y, h_T) and the gradients of sum(y wy) + sum(h_T wh) w.r.t. every input; the reference in
    float32 from the same (possibly rounded) inputs."""
    def loss(args):
        x, dt, A, B, C, D, h0 = args
        if pallas:
            y, h = ssd_pallas(x, dt, A, B, C, D, segment_ids=seg, initial_state=h0, block_sizes=block_sizes)
        else:
            f32 = [None if a is None else a.astype(jnp.float32) for a in args]
            starts = jnp.zeros(x.shape[:2], bool) if seg is None else document_starts(seg)
            y, h = ssd_recurrent(*f32[:6], starts, f32[6])
        return jnp.sum(y.astype(jnp.float32) * wy) + jnp.sum(h * wh), (y, h)
    return jax.grad(loss, has_aux=True)(args)


def _compare(args, wy, wh, seg, tol, dtype=jnp.float32, block_sizes=BS):
    args = tuple(None if a is None else a.astype(dtype) if n in ("x", "dt", "B", "C") else a
                 for n, a in zip(NAMES, args))
    grads, (y, h) = _outputs_and_grads(args, wy, wh, seg, pallas=True, block_sizes=block_sizes)
    want_grads, (want_y, want_h) = _outputs_and_grads(args, wy, wh, seg, pallas=False)
    assert y.dtype == dtype and h.dtype == jnp.float32
    assert_close(y, want_y, tol, "y")
    assert_close(h, want_h, tol, "final state")
    for name, a, b, arg in zip(NAMES, grads, want_grads, args):
        if arg is None:
            continue
        assert a.dtype == arg.dtype, name
        assert np.isfinite(np.asarray(a, np.float32)).all(), f"d{name} not finite"
        assert_close(a, b, tol, f"d{name}")


# (B, T, H, P, G, N, D given, packed): T = 37 leaves a ragged last chunk; P = 32 runs two blocks of
# P; G = 2 groups of two heads; N = 8 is padded to 16; T = 1 is a single token.
CASES = {
    "ragged-groups-packed": (2, 37, 4, 32, 2, 8, True, True),
    "T1-noD": (1, 1, 2, 16, 1, 16, False, False),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_float32(case):
    Bsz, T, H, P, G, N, with_D, packed = CASES[case]
    args, wy, wh = _inputs(Bsz, T, H, P, G, N, with_D, seed=T)
    _compare(args, wy, wh, _packed(Bsz, T) if packed else None, 1e-4)


def test_bfloat16_within_bf16_tolerance():
    Bsz, T, H, P, G, N, with_D, _ = CASES["ragged-groups-packed"]
    args, wy, wh = _inputs(Bsz, T, H, P, G, N, with_D, seed=1)
    _compare(args, wy, wh, _packed(Bsz, T, 1), 2e-2, jnp.bfloat16)


def test_dispatch():
    x, dt, A, B = jnp.zeros((1, 32, 2, 16)), jnp.ones((1, 32, 2)), -jnp.ones(2), jnp.zeros((1, 32, 1, 16))
    jaxpr = lambda impl: str(jax.make_jaxpr(functools.partial(ssd, impl=impl))(x, dt, A, B, B))
    assert "pallas_call" in jaxpr("pallas")
    assert ("pallas_call" in jaxpr("auto")) == ON_GPU
    assert "pallas_call" not in jaxpr("xla") and "pallas_call" not in jaxpr("reference")
    with pytest.raises(ValueError, match="impl=.*expected one of"):
        ssd(x, dt, A, B, B, impl="triton")


def test_lowers_for_cuda_through_triton():
    """Without a GPU: the three kernels lower to Triton for CUDA with the GPU block sizes, bf16,
    groups, documents and a ragged T."""
    Bsz, T, H, P, G, N = 2, 100, 4, 64, 1, 128
    seg = jnp.zeros((Bsz, T), jnp.int32)

    def loss(x, dt, A, B, C, D, h0):
        y, h = ssd_pallas(x, dt, A, B, C, D, segment_ids=seg, initial_state=h0, interpret=False,
                          block_sizes=default_block_sizes("gpu", scalar_gate=True))
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(h)

    B = jnp.zeros((Bsz, T, G, N), jnp.bfloat16)
    args = (jnp.zeros((Bsz, T, H, P), jnp.bfloat16), jnp.ones((Bsz, T, H), jnp.bfloat16), -jnp.ones(H), B, B,
            jnp.zeros(H), jnp.zeros((Bsz, H, P, N)))
    hlo = jax.jit(jax.grad(loss, argnums=tuple(range(7)))).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 3


@gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)])
def test_compiled_kernels_on_gpu(dtype, tol):
    """Default GPU block sizes (block_sizes=None), ragged T, groups, documents."""
    Bsz, T, H, P, G, N = 2, 300, 4, 64, 2, 64
    args, wy, wh = _inputs(Bsz, T, H, P, G, N, seed=7)
    with jax.default_matmul_precision("highest"):  # a float32 reference without TF32
        _compare(args, wy, wh, _packed(Bsz, T, 3), tol, dtype, block_sizes=None)
