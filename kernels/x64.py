"""Indices and constants for the Pallas kernels whose dtypes do not depend on `jax_enable_x64`.

Researchers turn x64 on to check numerics. JAX then makes a Python number alone into a 64-bit
value: `lax.div(h, R)` with an int32 grid index h and a Python int R raises (lax does not promote),
`lax.fori_loop(0, n, ...)` counts in int64 whatever the bounds' dtype (so does every index computed
from its counter), and `jnp.where(mask, 1.0, 0.0)` is a float64 tile. Mosaic TPU has no 64-bit
types and refuses to lower such kernels, Triton computes their indices in 64 bits, and the
interpreter runs them in float64 where the compiled kernel would not. So the kernels make every
loop counter, index quotient, iota and 0/1 tile through these helpers, which give int32 and float32
under x64 and the same values and dtypes as the plain calls without it.
"""

import jax.numpy as jnp
import numpy as np
from jax import lax


def i32(x):
    """x as int32: a Python or NumPy int becomes an np.int32 (a literal in the jaxpr), an array is cast."""
    return np.int32(x) if isinstance(x, (int, np.integer)) else lax.convert_element_type(x, jnp.int32)


def div(a, b):
    """lax.div (quotient rounded towards zero) of two ints or int arrays, in int32."""
    return lax.div(i32(a), i32(b))


def iota(shape, axis):
    """int32 indices along `axis` of a tile of `shape`."""
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def indicator(mask):
    """1.0 where `mask`, 0.0 elsewhere, float32 (jnp.where(mask, 1.0, 0.0) is float64 under x64)."""
    return jnp.where(mask, np.float32(1), np.float32(0))


def fori_loop(lower, upper, body_fun, init_val):
    """lax.fori_loop with an int32 counter. With static bounds lax.fori_loop scans with a Python int
    counter (int64 under x64); here the scan carries an np.int32 one. Traced bounds (int32, as every
    index in the kernels) run a while loop counting in their dtype, as in lax.fori_loop."""
    if not (isinstance(lower, (int, np.integer)) and isinstance(upper, (int, np.integer))):
        return lax.fori_loop(i32(lower), i32(upper), body_fun, init_val)

    def step(carry, _):
        i, x = carry
        return (i + 1, body_fun(i, x)), None

    (_, out), _ = lax.scan(step, (i32(lower), init_val), None, length=max(int(upper) - int(lower), 0))
    return out
