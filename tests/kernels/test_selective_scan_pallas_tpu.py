"""Selective-scan Pallas TPU kernels against the token-by-token reference: outputs, final state and
gradients w.r.t. x, Δ, A, B, C, D and the initial state, with ragged T and Dm, several chunks and
channel blocks, document resets (incl. a one-token document), two state sizes and bfloat16; and
Mosaic TPU lowering of the forward and backward with the default block sizes.

Off a TPU the kernels run in the TPU interpreter with 8-token chunks and 8-channel blocks, so tiny
shapes cross chunks (saved states), ragged tails and channel blocks.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from kernels.selective_scan.pallas_tpu import BlockSizes, selective_scan_pallas_tpu
from tests.kernels.test_selective_scan_pallas import _compare as _compare_kernel
from tests.kernels.test_selective_scan_pallas import _inputs, _packed

BS = BlockSizes(block_t=8, block_d=8)
# Value tests run in the TPU interpreter on every machine (their tiny blocks are below Mosaic's
# tiling); the lowering tests check the compiled path with the default blocks.
_compare = functools.partial(_compare_kernel, block_sizes=BS,
                             kernel=functools.partial(selective_scan_pallas_tpu, interpret=True))


# (B, T, Dm, N, D given, packed): T = 21 gives three 8-token chunks, the last ragged; Dm = 16 two
# channel blocks; N = 5 is padded to 8. T = 1 is one padded chunk, Dm = 12 a padded second channel
# block, N = 16 the other state size.
CASES = {
    "T21-2dblocks-N5-packed": (2, 21, 16, 5, True, True),
    "T1-B1-N16-noD": (1, 1, 12, 16, False, False),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_float32(case):
    Bsz, T, Dm, N, with_D, packed = CASES[case]
    args, wy, wh = _inputs(Bsz, T, Dm, N, with_D, seed=T)
    _compare(args, wy, wh, _packed(Bsz, T) if packed else None, 1e-4)


def test_bfloat16_within_bf16_tolerance():
    Bsz, T, Dm, N, with_D, _ = CASES["T21-2dblocks-N5-packed"]
    args, wy, wh = _inputs(Bsz, T, Dm, N, with_D, seed=1)
    _compare(args, wy, wh, _packed(Bsz, T, 1), 2e-2, jnp.bfloat16)


def test_block_sizes_are_checked():
    with pytest.raises(ValueError, match="block_d"):
        BlockSizes(block_d=12)
    x, A, B = jnp.zeros((1, 300, 200)), jnp.zeros((200, 16)), jnp.zeros((1, 300, 16))
    with pytest.raises(ValueError, match="multiples of 128"):  # 200 channels in blocks of 64
        selective_scan_pallas_tpu(x, x, A, B, B, None, jnp.zeros((1, 300), bool), jnp.zeros((1, 200, 16)),
                                  block_sizes=BlockSizes(block_d=64), interpret=False)


def test_lowers_for_tpu_through_mosaic():
    """Without a TPU: the forward, and the gradient (forward with saved states + backward), lower
    to Mosaic TPU custom calls with the default block sizes, bf16 inputs and documents."""
    Bsz, T, Dm, N = 1, 256, 256, 16
    starts = jnp.zeros((Bsz, T), bool).at[:, 100].set(True)

    def fwd(x, dt, A, B, C, D, h0):
        return selective_scan_pallas_tpu(x, dt, A, B, C, D, starts, h0, interpret=False)

    def loss(*args):
        y, h = fwd(*args)
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(h)

    x, B = jnp.zeros((Bsz, T, Dm), jnp.bfloat16), jnp.zeros((Bsz, T, N), jnp.bfloat16)
    args = (x, x, jnp.zeros((Dm, N)), B, B, jnp.zeros(Dm), jnp.zeros((Bsz, Dm, N)))
    lower = lambda f: jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert lower(fwd).count("tpu_custom_call") == 1
    assert lower(jax.grad(loss, argnums=tuple(range(7)))).count("tpu_custom_call") == 2
