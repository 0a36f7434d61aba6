import jax
from flax import nnx

from tests.util import tiny_model
from train.utilisation import flops_per_token, products_rate


def count(model, keep=lambda path: True):
    return sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)) if keep(path))


def test_flops_per_token_counts_the_products_a_token_runs():
    """6 N with the untied input embedding left out and the routed experts at top_k / num_experts, plus
    6 H (K + K) T_seen per softmax attention layer (a window caps T_seen); a Mamba-2 layer adds only its weights."""
    T = 64
    model = tiny_model(layer_pattern=[{"kind": "attention", "num_heads": 4, "window": 16},
                                      {"kind": "attention", "num_heads": 4}, {"kind": "mamba2", "head_dim": 8}],
                       num_layers=3, tie_embeddings=False,
                       ffn={"kind": "moe", "num_experts": 4, "top_k": 1, "router": "switch"})
    routed = count(model, lambda p: any(getattr(k, "key", None) in ("w_gate", "w_up", "w_down") for k in p)
                   and "ffn" in jax.tree_util.keystr(p))
    n = count(model) - 256 * 32 - routed * 3 / 4
    attention = 6 * 4 * (8 + 8) * (16 + 64)  # the windowed layer sees 16 keys, the other all 64
    assert flops_per_token(model, T) == 6 * n + attention
    tied = tiny_model(num_layers=1)  # the embedding is the LM head's weight: counted once
    assert flops_per_token(tied, T) == 6 * count(tied) + 6 * 4 * 16 * T


def test_products_rate_is_measured_on_cpu():
    rate = products_rate(n=128, repeats=2)
    assert 1e8 < rate < 1e14
