"""MesaNet (von Oswald et al. 2025): o_t = G_t^T (H_t + diag(lambda))^{-1} q_t with H_t, G_t the gated sums of
beta k k^T and beta k v^T, the solve `cg_steps` iterations of conjugate gradients (reference.py).

Modes: "recurrent" (reference.py: per token, H_t materialised), "chunk" and "parallel" (chunk.py: the same CG
iterations, each product with H_t a pass of the GLA op in that form); impl: "reference" runs reference.py
whatever the mode, "xla" / "auto" the mode's form, "pallas" the GLA op's Pallas kernels for those passes.
"""

from jaxtyping import Array, Float, Int

from kernels import check_impl, check_mode
from kernels.mesa.chunk import mesa_gla
from kernels.mesa.reference import conjugate_gradients, mesa_reference, mesa_step


def mesa(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
         g: Float[Array, "B T H"], beta: Float[Array, "B T H"], lamb: Float[Array, "H K"], *, cg_steps: int = 10,
         segment_ids: Int[Array, "B T"] | None = None, initial_state: tuple | None = None,
         output_final_state: bool = False, mode: str = "chunk", chunk_size: int = 64, impl: str = "auto"):
    """Returns (o (B, T, H, V) in q's dtype, final (H (B, H, K, K), G (B, H, K, V)) float32 or None).

    g: log gamma <= 0 per head (not checked); beta: the input gate; lamb: lambda > 0 per key channel.
    initial_state: (H_0, G_0) or None; segment_ids as every op (kernels/__init__.py).
    """
    check_mode(mode, chunk_size, "mesa")
    check_impl(impl, "mesa")
    if not isinstance(cg_steps, int) or cg_steps < 1:
        raise ValueError(f"mesa: cg_steps={cg_steps!r}; expected a positive int")
    kwargs = dict(cg_steps=cg_steps, segment_ids=segment_ids, initial_state=initial_state)
    if mode == "recurrent" or impl == "reference":
        o, state = mesa_reference(q, k, v, g, beta, lamb, **kwargs)
    else:
        o, state = mesa_gla(q, k, v, g, beta, lamb, mode=mode, chunk_size=chunk_size, impl=impl, **kwargs)
    return o.astype(q.dtype), (state if output_final_state else None)


__all__ = ["mesa", "mesa_step", "mesa_reference", "mesa_gla", "conjugate_gradients"]
