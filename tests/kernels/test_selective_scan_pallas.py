"""Selective-scan Pallas kernels against the token-by-token reference: outputs, final state and
gradients w.r.t. x, Δ, A, B, C, D and the initial state, with ragged T, several channel blocks,
document resets and bfloat16; dispatch; lowering to Triton.

On CPU the kernels run in interpret mode with 4-token chunks and 16-channel blocks, so tiny shapes
cross chunks (saved states), ragged tails and channel blocks. Tests marked `gpu` run the compiled
kernels.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.segments import document_starts
from kernels.selective_scan import selective_scan
from kernels.selective_scan.pallas import BlockSizes, default_block_sizes, selective_scan_pallas
from kernels.selective_scan.reference import selective_scan_recurrent
from tests.util import assert_close

BS = BlockSizes(block_t=4, block_d=16)
ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (compiled kernels)")
NAMES = ("x", "dt", "A", "B", "C", "D", "h0")


def _inputs(Bsz, T, Dm, N, with_D=True, seed=0):
    """(x, Δ, A, B, C, D, h0) and the weights of a random projection of (y, h); numpy draws. Δ up
    to about 3 and A down to about -20: some decays underflow to 0 within a step."""
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    dt = jnp.asarray(np.log1p(np.exp(rng.standard_normal((Bsz, T, Dm)) - 0.5)), jnp.float32)
    A = jnp.asarray(-np.exp(1.5 * rng.standard_normal((Dm, N))), jnp.float32)
    args = (f(Bsz, T, Dm), dt, A, f(Bsz, T, N), f(Bsz, T, N), f(Dm) if with_D else None, f(Bsz, Dm, N))
    return args, f(Bsz, T, Dm), f(Bsz, Dm, N)


def _packed(Bsz, T, seed=0):
    ids = np.sort(np.random.default_rng(seed).integers(0, 4, (Bsz, T)), axis=1)
    ids[:, T // 2] = 9  # a one-token document
    ids[:, T // 2 + 1:] += 10
    return jnp.asarray(ids, jnp.int32)


@functools.partial(jax.jit, static_argnames=("kernel", "block_sizes"))
def _outputs_and_grads(args, wy, wh, starts, *, kernel, block_sizes):
    """(y, h_T) and the gradients of sum(y wy) + sum(h_T wh) w.r.t. every input; kernel None: the
    reference in float32 from the same (possibly rounded) inputs."""
    def loss(args):
        x, dt, A, B, C, D, h0 = args
        if kernel:
            y, h = kernel(x, dt, A, B, C, D, starts, h0, block_sizes=block_sizes)
        else:
            f32 = [None if a is None else a.astype(jnp.float32) for a in args]
            y, h = selective_scan_recurrent(*f32[:6], starts, f32[6])
        return jnp.sum(y.astype(jnp.float32) * wy) + jnp.sum(h * wh), (y, h)
    return jax.grad(loss, has_aux=True)(args)


def _compare(args, wy, wh, seg, tol, dtype=jnp.float32, block_sizes=BS, kernel=selective_scan_pallas):
    args = tuple(None if a is None else a.astype(dtype) if n in ("x", "dt", "B", "C") else a
                 for n, a in zip(NAMES, args))
    starts = jnp.zeros(args[0].shape[:2], bool) if seg is None else document_starts(seg)
    grads, (y, h) = _outputs_and_grads(args, wy, wh, starts, kernel=kernel, block_sizes=block_sizes)
    want_grads, (want_y, want_h) = _outputs_and_grads(args, wy, wh, starts, kernel=None, block_sizes=None)
    assert y.dtype == dtype and h.dtype == jnp.float32
    assert_close(y, want_y, tol, "y")
    assert_close(h, want_h, tol, "final state")
    for name, a, b, arg in zip(NAMES, grads, want_grads, args):
        if arg is None:
            continue
        assert a.dtype == arg.dtype, name
        assert np.isfinite(np.asarray(a, np.float32)).all(), f"d{name} not finite"
        assert_close(a, b, tol, f"d{name}")


# (B, T, Dm, N, D given, packed): T = 37 leaves a ragged last chunk, Dm = 40 three channel blocks
# (the last one padded), N = 5 is padded to 8; T = 1 is a single step.
CASES = {
    "ragged-3dblocks-packed": (2, 37, 40, 5, True, True),
    "T1-noD": (1, 1, 16, 4, False, False),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_float32(case):
    Bsz, T, Dm, N, with_D, packed = CASES[case]
    args, wy, wh = _inputs(Bsz, T, Dm, N, with_D, seed=T)
    _compare(args, wy, wh, _packed(Bsz, T) if packed else None, 1e-4)


def test_bfloat16_within_bf16_tolerance():
    Bsz, T, Dm, N, with_D, _ = CASES["ragged-3dblocks-packed"]
    args, wy, wh = _inputs(Bsz, T, Dm, N, with_D, seed=1)
    _compare(args, wy, wh, _packed(Bsz, T, 1), 2e-2, jnp.bfloat16)


def test_dispatch():
    x, A, B = jnp.zeros((1, 32, 8)), jnp.zeros((8, 4)), jnp.zeros((1, 32, 4))
    jaxpr = lambda impl: str(jax.make_jaxpr(functools.partial(selective_scan, impl=impl))(x, x, A, B, B))
    assert "pallas_call" in jaxpr("pallas")
    assert ("pallas_call" in jaxpr("auto")) == ON_GPU
    assert "pallas_call" not in jaxpr("xla") and "pallas_call" not in jaxpr("reference")
    with pytest.raises(ValueError, match="impl=.*expected one of"):
        selective_scan(x, x, A, B, B, impl="triton")
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(block_d=24)


def test_lowers_for_cuda_through_triton():
    """Without a GPU: the forward and backward kernels lower to Triton for CUDA with the GPU block
    sizes, bf16 inputs, documents, ragged T and Dm."""
    Bsz, T, Dm, N = 2, 100, 80, 16
    starts = jnp.zeros((Bsz, T), bool)

    def loss(x, dt, A, B, C, D, h0):
        y, h = selective_scan_pallas(x, dt, A, B, C, D, starts, h0, interpret=False,
                                     block_sizes=default_block_sizes("gpu"))
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(h)

    x, B = jnp.zeros((Bsz, T, Dm), jnp.bfloat16), jnp.zeros((Bsz, T, N), jnp.bfloat16)
    args = (x, x, jnp.zeros((Dm, N)), B, B, jnp.zeros(Dm), jnp.zeros((Bsz, Dm, N)))
    hlo = jax.jit(jax.grad(loss, argnums=tuple(range(7)))).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 2


@gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)])
def test_compiled_kernels_on_gpu(dtype, tol):
    """Default GPU block sizes (block_sizes=None), ragged T and Dm, documents."""
    Bsz, T, Dm, N = 2, 300, 200, 16
    args, wy, wh = _inputs(Bsz, T, Dm, N, seed=7)
    _compare(args, wy, wh, _packed(Bsz, T, 3), tol, dtype, block_sizes=None)
