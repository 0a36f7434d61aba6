"""The one input check every layer makes at its edge, before any work: a user's wrong shape is a
ValueError naming what was expected and what was given (the shape annotations say the same, but are
only checked in the test suite)."""


def check_input(x, d_model: int, segment_ids=None, where: str = "layer"):
    """x must be (B, T, d_model) and segment_ids, if given, (B, T)."""
    if x.ndim != 3 or x.shape[-1] != d_model:
        raise ValueError(f"{where}: expected x of shape (B, T, D) with D = d_model = {d_model}, "
                         f"got shape {tuple(x.shape)}")
    if segment_ids is not None and tuple(segment_ids.shape) != tuple(x.shape[:2]):
        raise ValueError(f"{where}: expected segment_ids of shape (B, T) = {tuple(x.shape[:2])} (one id per "
                         f"token of x), got shape {tuple(segment_ids.shape)}")
