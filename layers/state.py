"""Decode states: frozen dataclasses that are JAX pytrees, one annotated array (or None) per field.

    @state
    class GLAState:
        S: Float[Array, "B H K V"]  # (B, H, K, V) float32 recurrent state

Like `flax.struct.dataclass`, except that JAX rebuilds a state without calling its __init__ (as
equinox does). The suite checks every annotation at run time (jaxtyping's import hook), and that
check belongs on the states a layer builds, not on the ShapeDtypeStructs, tracers, shapes or
shardings that `jax.eval_shape`, `jit` and `jax.tree.map` put in the fields of the copies they make.
"""

import dataclasses

import jax


def state(cls):
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = tuple(f.name for f in dataclasses.fields(cls))

    def flatten(s):
        return [(jax.tree_util.GetAttrKey(n), getattr(s, n)) for n in names], None

    def unflatten(_, children):
        s = object.__new__(cls)
        for name, child in zip(names, children, strict=True):
            object.__setattr__(s, name, child)
        return s

    jax.tree_util.register_pytree_with_keys(cls, flatten, unflatten)
    return cls
