"""The checks every layer makes at its edge, before any work: a user's wrong shape is a ValueError
naming what was expected and what was given (the shape annotations say the same, but are only checked
in the test suite); `head_shape` checks an attention layer's heads."""


def check_input(x, d_model: int, segment_ids=None, where: str = "layer"):
    """x must be (B, T, d_model) and segment_ids, if given, (B, T)."""
    if x.ndim != 3 or x.shape[-1] != d_model:
        raise ValueError(f"{where}: expected x of shape (B, T, D) with D = d_model = {d_model}, "
                         f"got shape {tuple(x.shape)}")
    if segment_ids is not None and tuple(segment_ids.shape) != tuple(x.shape[:2]):
        raise ValueError(f"{where}: expected segment_ids of shape (B, T) = {tuple(x.shape[:2])} (one id per "
                         f"token of x), got shape {tuple(segment_ids.shape)}")


def head_shape(d_model: int, num_heads: int, num_kv_heads: int | None, head_dim: int | None) -> tuple[int, int, int]:
    """(H, G, K) of an attention layer: G = num_kv_heads (None = H) must divide H, K = head_dim (None = D / H)."""
    G = num_heads if num_kv_heads is None else num_kv_heads
    if head_dim is None and d_model % num_heads:
        raise ValueError(f"num_heads={num_heads} does not divide d_model={d_model}")
    if num_heads % G:
        raise ValueError(f"num_kv_heads={G} does not divide num_heads={num_heads}")
    return num_heads, G, head_dim or d_model // num_heads
