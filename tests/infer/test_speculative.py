"""Speculative decoding (infer/speculative.py): greedy speculation is plain greedy decoding, token for
token, for every drafter and a tree; a round's rollback leaves the state plain decoding reaches;
sampled speculation draws from the target's own distribution (a chi-square test)."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import infer
from infer import Exits, Sampling, Speculation, speculative
from tests.util import forward, tiny_config
from zoo import LanguageModel

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]
MHA = {"kind": "attention", "num_heads": 4}
# One kind per kind of state (every kind's own rollback is in tests/layers/conformance.py): a grouped
# KV cache, a short convolution beside a recurrence, a matrix state, RWKV-7's value residual across layers.
KINDS = {
    "gqa": {"kind": "attention", "num_heads": 4, "num_kv_heads": 2},
    "mamba": {"kind": "mamba"},
    "gated_deltanet": {"kind": "gated_deltanet", "num_heads": 2},
    "rwkv7": {"kind": "rwkv7", "head_dim": 16},
}


def target(mixer, vocab_size=256, scale_last=0.7):
    """A 2-layer model with an exit after layer 1. The last block's parameters are scaled so that the
    exit (or a copy scaled otherwise) agrees with the full model often but not always: both the accept
    and the reject paths run."""
    cfg = tiny_config(mixer, num_layers=2, exits={"layers": [1], "weights": [1.0]})
    model = LanguageModel(dataclasses.replace(cfg, vocab_size=vocab_size), rngs=nnx.Rngs(0))  # any vocabulary
    last = nnx.state(model.blocks[1], nnx.Param)
    nnx.update(model.blocks[1], jax.tree.map(lambda p: p * scale_last, last))
    return model


def drafter(model=None, vocab_size=256):
    """A 1-layer Mamba; given the target `model`, with its embedding and small block weights, so that it
    often predicts what a random target predicts (both lean on the tied embedding)."""
    cfg = dataclasses.replace(tiny_config({"kind": "mamba"}, num_layers=1), vocab_size=vocab_size)
    draft = LanguageModel(cfg, rngs=nnx.Rngs(1))
    if model is not None:
        nnx.update(draft.blocks[0], jax.tree.map(lambda p: p * 0.1, nnx.state(draft.blocks[0], nnx.Param)))
        draft.embed.embedding[...] = model.embed.embedding[...]
    return draft


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculation_is_greedy(kind):
    """Self-speculation with a tree, and a draft model of the same kind (its own rollback then runs too)."""
    model = target(KINDS[kind])
    greedy = infer.generate(model, PROMPTS, max_new_tokens=10)
    draft = target(KINDS[kind], scale_last=0.3)
    for speculation in (Speculation(3, tree=(2,)), Speculation(2, draft_model=draft)):
        out, info = infer.generate(model, PROMPTS, max_new_tokens=10, speculation=speculation, return_info=True)
        assert out == greedy, speculation
        assert 0 < info["acceptance"] < 1, (speculation, info)  # both the accept and the reject path ran


def test_a_mamba_drafts_for_a_transformer_whose_rows_accept_differently():
    model = target(MHA)
    draft = drafter(model)
    # Two prompt lengths (the short rows left-padded by 4 in the batch, one token each alone): each row alone
    # compiles once per length, not once per row.
    prompts = [[5, 6, 7, 8, 9], [9, 10, 11, 12, 13], [40], [7]]
    greedy = infer.generate(model, prompts, max_new_tokens=16)
    for k, tree in ((4, None), (2, (2, 2))):
        out, info = infer.generate(model, prompts, max_new_tokens=16,
                                   speculation=Speculation(k, draft_model=draft, tree=tree), return_info=True)
        assert out == greedy and 0 < info["acceptance"] < 1, (tree, info)
    rounds = []
    for p, row in zip(prompts, greedy):  # each row alone: rows advance independently
        out, info = infer.generate(model, [p], max_new_tokens=16, speculation=Speculation(4, draft_model=draft),
                                   return_info=True)
        assert out == [row]
        rounds.append(info["rounds"])
    assert len(set(rounds)) > 1, rounds  # the rows accept differently: in the batch, they advance apart


def test_a_round_rolls_back_to_the_state_of_plain_decoding():
    """After one round, each row's state is the state of decoding its kept tokens (hybrid model: a KV
    cache and recurrent states, rows keeping different counts)."""
    model = LanguageModel(tiny_config(layer_pattern=[{"kind": "attention", "num_heads": 4}, {"kind": "gla"}],
                                      num_layers=2), rngs=nnx.Rngs(0))
    for block in model.blocks:  # blocks scaled down, so that a drafter with its embedding is accepted at times
        nnx.update(block, jax.tree.map(lambda p: p * 0.4, nnx.state(block, nnx.Param)))
    draft = drafter(model)
    B, k = 2, 4
    prompt = jnp.asarray([[5, 6, 7], [9, 10, 11]])
    plain = nnx.jit(lambda m, fed: m.decode(fed, m.init_state(fed.shape[0], 16))[1])  # the state after `fed`
    state, draft_state = plain(model, prompt), plain(draft, prompt)
    last = jnp.asarray([4, 5])
    round_ = nnx.jit(lambda m, d, *args: speculative.speculative_round(  # one compile, not one per op
        m, speculative.model_drafter(d, k), *args, k=k, tree=(), warp_fn=lambda x: x, greedy=True))
    kept, n, state, draft_state = round_(model, draft, last, state, draft_state, jax.random.key(0))
    assert n[0] != n[1] and 0 < n.min() < k, n  # rows keep different counts (here 2 and 4 of 4)
    for b in range(B):
        fed = jnp.concatenate([prompt[b], last[b:b + 1], kept[b, :n[b]]])[None]
        for m, got in ((model, state), (draft, draft_state)):
            want = plain(m, fed)
            row = jax.tree.map(lambda a: a[b:b + 1], got)
            for (path, a), w in zip(jax.tree_util.tree_leaves_with_path(row), jax.tree.leaves(want), strict=True):
                a, w = np.asarray(a), np.asarray(w)
                if a.ndim >= 2 and a.shape[-1 if a.ndim == 2 else 2] == 16:  # KV cache slots: those written
                    a, w = (x[..., :fed.shape[1]] if a.ndim == 2 else x[:, :, :fed.shape[1]] for x in (a, w))
                np.testing.assert_allclose(a, w, atol=1e-5, err_msg=jax.tree_util.keystr(path))


def chi2_critical(df: int, alpha_z: float = 3.09) -> float:
    """The chi-square quantile at significance 0.001 (z = 3.09), by Wilson and Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + alpha_z * (2 / (9 * df)) ** 0.5) ** 3


def test_sampled_speculation_follows_the_target_distribution():
    """2,000 two-token continuations of one prompt, drawn with speculation (a random 1-layer Mamba
    drafting, so most drafts are rejected and the residual distribution is exercised), against the
    target's exact two-token distribution: chi-square at significance 0.001 over the cells expected at
    least 5 times. The drafter's own distribution fails the same test, so the test can fail."""
    V, N, T = 8, 2000, 1.0
    model, draft = target(MHA, vocab_size=V, scale_last=1.0), drafter(vocab_size=V)
    prompt = [1, 2, 3]

    def exact(m):  # one jitted forward pass of the V continuations: the first token's logits are at position -2
        logits = forward(m, jnp.asarray([prompt + [t] for t in range(V)]))
        first, seconds = jax.nn.softmax(logits[0, -2] / T), jax.nn.softmax(logits[:, -1] / T, -1)
        return np.asarray(first[:, None] * seconds).ravel()  # (V * V,): p(t1, t2)

    p = exact(model)
    out = infer.generate(model, [prompt] * N, max_new_tokens=2, sampling=Sampling(T),
                         speculation=Speculation(3, draft_model=draft), seed=0)
    counts = np.bincount([a * V + b for a, b in out], minlength=V * V)

    def chi2(probs):
        e = probs * N
        big = e >= 5
        return np.sum((counts[big] - e[big]) ** 2 / e[big]) + (counts[~big].sum() - e[~big].sum()) ** 2 / max(
            e[~big].sum(), 1e-9), int(big.sum())

    stat, cells = chi2(p)
    assert stat < chi2_critical(cells), (stat, chi2_critical(cells))
    wrong, _ = chi2(exact(draft))
    assert wrong > chi2_critical(cells), wrong


@pytest.mark.parametrize("kwargs, message", [
    ({"speculation": Speculation(0)}, "k >= 1"),
    ({"speculation": Speculation(2, draft_layers=2)}, "not an exit"),
    ({"speculation": Speculation(2, tree=(2,)), "sampling": Sampling(0.7)}, "greedy"),
    ({"speculation": Speculation(2, tree=(2, 2, 2))}, "at most k"),
    ({"speculation": Speculation(2), "draft": 128}, "vocabulary"),  # a draft model of another vocabulary
    ({"speculation": Speculation(2, draft_layers=1), "draft": 256}, "not both"),
    ({"speculation": Speculation(2), "exits": Exits(0.5)}, "not both"),
])
def test_bad_speculation_arguments_are_refused(kwargs, message):
    model, kwargs = target(MHA), dict(kwargs)
    if "draft" in kwargs:
        draft = drafter(vocab_size=kwargs.pop("draft"))
        kwargs["speculation"] = dataclasses.replace(kwargs["speculation"], draft_model=draft)
    with pytest.raises(ValueError, match=message):
        infer.generate(model, PROMPTS, max_new_tokens=2, **kwargs)
    plain = LanguageModel(tiny_config(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs a draft_model"):
        infer.generate(plain, PROMPTS, max_new_tokens=2, speculation=Speculation(2))


def test_command_line_drafts_with_another_model(tmp_path, capsys):
    from infer.__main__ import main

    target_yaml, draft_yaml = tmp_path / "target.yaml", tmp_path / "draft.yaml"
    target_yaml.write_text("model: {d_model: 32, num_layers: 2, mixer: {kind: attention, num_heads: 4}}\n")
    draft_yaml.write_text("model: {d_model: 32, num_layers: 1, mixer: {kind: mamba}}\n")
    main([str(target_yaml), "--prompt", "ab", "--max-new-tokens", "6", "--temperature", "0"])
    greedy = capsys.readouterr().out
    main([str(target_yaml), "--prompt", "ab", "--max-new-tokens", "6", "--temperature", "0", "--speculative", "3",
          "--draft", str(draft_yaml), "--tree", "2"])
    captured = capsys.readouterr()
    assert captured.out == greedy and "accepted in" in captured.err
    with pytest.raises(SystemExit, match="need --speculative"):  # a draft without a draft length
        main([str(target_yaml), "--prompt", "ab", "--draft", str(draft_yaml)])


def test_tree_digits_enumerate_every_path():
    digits = np.asarray(speculative.tree_digits((2, 3), 4))
    assert digits.shape == (6, 4) and {tuple(r[:2]) for r in digits} == set(itertools.product(range(2), range(3)))
    assert not digits[:, 2:].any()
