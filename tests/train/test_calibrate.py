"""Per-head mask calibration (train/calibrate.py): the choice never exceeds its budget, is deterministic,
and the calibrated config decodes the run's checkpoint."""

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from infer import Sampling, generate
from train.calibrate import Evaluator, Mask, calibrate, choose, density, family, main, profile, refine
from train.loop import run
from zoo.checkpoint import load_model
from zoo.config import from_dict

TINY = {"d_model": 16, "num_layers": 2, "mixer": {"kind": "attention", "num_heads": 2}}
TRAIN = {"steps": 3, "batch_size": 8, "seq_len": 16, "eval_every": 3, "eval_batches": 1, "sample_tokens": 0}


def test_density_counts_the_mask():
    L = 16
    assert density(Mask(), L) == 1.0
    assert density(Mask(1), L) == pytest.approx(L / (L * (L + 1) / 2))  # the diagonal
    assert density(Mask(2, sinks=1), L) == pytest.approx((L + (L - 1) + (L - 2)) / (L * (L + 1) / 2))


@pytest.mark.parametrize("seed", range(5))
def test_choice_keeps_to_its_budget(seed):
    rng = np.random.default_rng(seed)
    dens = np.array([density(m, 64) for m in family(64)])
    cost = rng.exponential(size=(12, len(dens))) * (1 - dens)[None]  # sparser masks cost more
    for budget in (0.05, 0.2, 0.5):
        choice = choose(cost, dens, budget)
        assert dens[choice].mean() <= budget
        np.testing.assert_array_equal(choice, choose(cost, dens, budget))
        # no better single move fits: the greedy fill spent what was left
        used = dens[choice].mean()
        better = (cost < cost[np.arange(12), choice][:, None]) & (used + (dens[None] - dens[choice][:, None]) / 12
                                                                  <= budget)
        assert not better.any()


def test_a_costly_head_keeps_its_context():
    dens = np.array([1.0, 0.5, 0.1])
    cost = np.array([[0, 0.01, 0.02]] * 3 + [[0, 5.0, 9.0]])  # head 3 needs the whole context
    choice = choose(cost, dens, 0.4)
    assert choice[3] == 0 and dens[choice].mean() <= 0.4
    with pytest.raises(ValueError, match="below the sparsest mask"):
        choose(cost, dens, 0.05)


class Redundant(Evaluator):
    """A stand-in for a model's Evaluator, 2 layers x 2 heads: heads 0 and 1 stand in for each other (masking one
    is free, masking both costs 5), heads 2 and 3 each cost 0.1 to mask."""

    H, num_layers = 2, 2

    def __init__(self):
        pass

    def __call__(self, masks):
        sparse = [m != Mask() for layer in masks for m in layer]
        return 5.0 * (sparse[0] and sparse[1]) + 0.1 * (sparse[2] + sparse[3]), 0.0


def test_refinement_finds_heads_that_stand_in_for_each_other():
    """The single-head profile sees heads 0 and 1 as free to mask and masks both (loss 5); a round
    against the chosen masks sees what that costs and keeps both full, masking heads 2 and 3 (0.2);
    the next round swings back (each head alone again looks free) and is not kept. (The best choice
    within the budget, one of heads 0 and 1 full and head 2 or 3 full, 0.1, is a trade that no
    re-solve from single-head costs proposes.)"""
    evaluate, candidates, dens = Redundant(), [Mask(), Mask(4)], np.array([1.0, 0.25])
    first = choose(profile(evaluate, candidates, log=lambda *a: None), dens, 0.625)
    loss = lambda choice: evaluate([[candidates[c] for c in choice[:2]], [candidates[c] for c in choice[2:]]])[0]
    assert loss(first) == 5.0
    best = refine(evaluate, candidates, dens, 0.625, first, rounds=2, log=lambda *a: None)
    assert loss(best) == pytest.approx(0.2) and dens[best].mean() <= 0.625
    unrefined = refine(evaluate, candidates, dens, 0.625, first, rounds=0, log=lambda *a: None)
    np.testing.assert_array_equal(unrefined, first)


def test_calibrated_run_decodes(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "cache"))
    run(from_dict({"model": TINY, "train": TRAIN}), tmp_path / "run", log=lambda *a: None)
    result = calibrate(tmp_path / "run", 0.3, batches=1, log=lambda *a: None)
    assert result["density"] <= 0.3 and result["uniform_density"] <= 0.3
    assert result["masks"] == calibrate(tmp_path / "run", 0.3, batches=1, log=lambda *a: None)["masks"]
    heads = result["config"]["model"]["layer_pattern"]
    assert [len(m["head_masks"]) for m in heads] == [2, 2]

    main([str(tmp_path / "run"), "--density", "0.3", "--batches", "1"])
    out = tmp_path / "run" / "calibrated.yaml"
    assert yaml.safe_load(out.read_text())["model"]["layer_pattern"] == heads
    cfg, model, _ = load_model(tmp_path / "run", config=out)
    assert model.blocks[0].mixer.band.window is not None  # the masks are in force
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    new = generate(model, [prompt], max_new_tokens=7, sampling=Sampling(0.0))[0]
    logits = model(jnp.asarray([prompt + new]))  # the full pass agrees with every decoded token
    np.testing.assert_array_equal(np.argmax(logits[0, len(prompt) - 1:-1], -1), new)

    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"model": {**TINY, "d_model": 32}, "train": TRAIN}))
    with pytest.raises(ValueError, match="must build the saved parameters"):
        load_model(tmp_path / "run", config=other)
    with pytest.raises(SystemExit, match="expected a fraction"):
        main([str(tmp_path / "run"), "--density", "1.5"])
    with pytest.raises(SystemExit, match="expected a count"):
        main([str(tmp_path / "run"), "--density", "0.3", "--rounds", "-1"])
