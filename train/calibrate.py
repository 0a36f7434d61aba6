"""Per-head attention masks chosen for a sparsity budget, from a trained run (SemSA / MoA, Fu et al. 2024).

    python -m train.calibrate RUN_DIR --density 0.25 [--rounds 2] [--batches 4] [--batch-size 8] [--seed 0] [--out FILE]

Every query head of every attention layer picks one mask from a family (FAMILY, relative to the
run's training length L): sliding windows of L/2 down to L/64 tokens, each with and without 4
attention sinks; dilated windows; spans that grow with the query's position (alpha + beta N, N the
query's position in its document + 1, MoA's elastic rule) and no mask at all. A mask's density is the
fraction of the causal (L, L) query-key pairs it keeps (counted with kernels.attention's own mask).

1. Profile: the held-out loss with one head masked and every other head full, for every head and
   every mask of the family: heads x masks forward passes through ONE compiled function (the masks
   are traced arrays, kernels/attention takes them per head). The loss increase of each is its cost.
2. Choose: per head the mask that minimises the summed loss increase subject to the mean density
   over all heads <= the budget: a multiple-choice knapsack, solved by its Lagrangian (per head
   argmin cost + lambda density, the smallest lambda that meets the budget, by bisection), then
   spending what budget is left on the upgrades that buy the most loss per unit of density. The
   result never exceeds the budget and is a pure function of the run, the budget and --seed.
3. Refine (--rounds R): profile again with every other head at its chosen mask (the cost of each
   mask of head n is now the loss change from the current choice when n alone moves to it) and
   choose again; after R rounds (or when the choice stops changing) keep the choice with the lowest
   profiling loss. Step 1 assumes the heads add their costs; heads that stand in for each other
   (masking one is free while the others see everything) are found here, as masking them together
   shows a cost that no single-head profile does.
4. Report the held-out loss (and accuracy, for a task run) of the full model, of one uniform window
   at the same budget (the widest plain window within it) and of the calibrated masks, on batches
   the profile did not see; write the run's config with one attention config per layer
   (`model.layer_pattern`, each with its `head_masks`) to --out (default RUN_DIR/calibrated.yaml),
   which `python -m infer RUN_DIR --config FILE` decodes with (zoo.checkpoint.load_model(config=)).

Departures from MoA: the cost of a mask is measured (the loss with that head masked), where MoA
estimates it from first-order attention-gradient influence over many lengths; the family is fixed
relative to L instead of searched per length; MoA assumes the heads add their costs, which step 3
corrects by re-measuring against the chosen masks.
"""

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx

from kernels.attention.reference import visible
from layers import Attention
from train.prepare import prepare
from train.tasks import TaskBatches
from zoo.checkpoint import load_model
from zoo.config import to_dict

NONE = 2 ** 30  # a window of 2**30 stands for no window (kernels/attention)


@dataclasses.dataclass(frozen=True)
class Mask:
    window: int | None = None
    sinks: int = 0
    dilation: int = 1
    growth: float = 0.0

    def spec(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v != Mask.__dataclass_fields__[k].default}


def family(L: int) -> list[Mask]:
    """The masks a head may take at training length L, full attention first."""
    windows = sorted({max(1, L >> i) for i in range(1, 7)}, reverse=True)
    out = [Mask()]
    out += [Mask(w, s) for w in windows for s in (0, 4)]
    out += [Mask(max(1, L // 16), dilation=2), Mask(max(1, L // 32), dilation=4)]
    out += [Mask(max(1, L // 32), growth=g) for g in (0.125, 0.25, 0.5)]
    return out


def density(m: Mask, L: int) -> float:
    """The fraction of the causal (L, L) pairs mask m keeps."""
    p = jnp.arange(L, dtype=jnp.int32)[None]
    seen = visible(p, p, None, None, True, m.window, m.sinks or None, m.dilation if m.dilation > 1 else None,
                   m.growth or None, p)
    return float(np.asarray(seen).sum()) / (L * (L + 1) / 2)


def mask_arrays(masks) -> dict:
    """masks[layer][head] -> the four (layers, heads) arrays the kernels take."""
    field = lambda f, dtype: np.array([[f(m) for m in layer] for layer in masks], dtype)
    return dict(window=field(lambda m: NONE if m.window is None else m.window, np.int32),
                sinks=field(lambda m: m.sinks, np.int32), dilation=field(lambda m: m.dilation, np.int32),
                growth=field(lambda m: m.growth, np.float32))


def attention_layers(model) -> list[Attention]:
    layers = [b.mixer for b in model.blocks if isinstance(b.mixer, Attention)]
    if not layers:
        raise ValueError("the run has no attention layer: nothing to calibrate")
    return layers


@functools.partial(jax.jit, static_argnums=0)
def _losses(graphdef, state, masks: dict, x, y, weight):
    """(loss, correct) summed over the weighted positions, with masks[name][l] set on attention layer l."""
    model = nnx.merge(graphdef, state)
    for i, layer in enumerate(attention_layers(model)):
        for name, a in masks.items():
            setattr(layer, name, a[i])
    logits = model(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
    return jnp.sum(loss * weight), jnp.sum((jnp.argmax(logits, -1) == y) * weight)


class Evaluator:
    """Held-out loss (and accuracy) of a trained model under given per-head masks; batches [start, start + n)."""

    def __init__(self, cfg, model, start: int, n: int, batch_size: int, seed: int):
        L, task = cfg.train.seq_len, cfg.data.task
        model.eval()
        source = TaskBatches(dataclasses.replace(task, num_test_examples=(start + n) * batch_size), L, seed) \
            if task else prepare(cfg.data).batches(L, seed, packing=False)
        self.batches = [source.val_batch(i, batch_size) for i in range(start, start + n)]
        self.graphdef, self.state = nnx.split(model)
        self.H = attention_layers(model)[0].num_heads
        self.num_layers = len(attention_layers(model))

    def __call__(self, masks) -> tuple[float, float]:
        arrays = mask_arrays(masks)
        total = correct = weight = 0.0
        for b in self.batches:
            s, c = _losses(self.graphdef, self.state, arrays, b["x"], b["y"], b["mask"])
            total, correct, weight = total + float(s), correct + float(c), weight + float(b["mask"].sum())
        return total / weight, correct / weight


def _masks(choice, candidates, H: int) -> list[list[Mask]]:
    """One candidate index per head (layers * heads) -> masks[layer][head]."""
    return [[candidates[c] for c in choice[i:i + H]] for i in range(0, len(choice), H)]


def profile(evaluate: Evaluator, candidates: list[Mask], choice=None, log=print, base=None) -> np.ndarray:
    """(layers * heads, candidates) held-out loss change when one head moves to a candidate, the
    others at `choice` (indices into candidates; None: every head full), whose loss is `base` (None:
    evaluated here)."""
    N = evaluate.num_layers * evaluate.H
    choice = np.full(N, candidates.index(Mask())) if choice is None else choice
    current = _masks(choice, candidates, evaluate.H)
    base = evaluate(current)[0] if base is None else base
    cost = np.zeros((N, len(candidates)))
    for n in range(N):
        for c, m in enumerate(candidates):
            masks = [list(layer) for layer in current]
            masks[n // evaluate.H][n % evaluate.H] = m
            cost[n, c] = evaluate(masks)[0] - base if c != choice[n] else 0.0
        log(f"# layer {n // evaluate.H} head {n % evaluate.H}: " +
            " ".join(f"{x:+.3f}" for x in cost[n]))
    return cost


def refine(evaluate: Evaluator, candidates: list[Mask], dens: np.ndarray, budget: float, choice: np.ndarray,
           rounds: int, log=print) -> np.ndarray:
    """Step 3 of the module docstring: re-profile against the current choice and choose again, up to
    `rounds` times; the choice with the lowest loss on the profiling batches."""
    loss = lambda ch: evaluate(_masks(ch, candidates, evaluate.H))[0]
    best, best_loss = choice, loss(choice)
    current_loss = best_loss
    for r in range(rounds):
        new = choose(profile(evaluate, candidates, choice, log, base=current_loss), dens, budget)
        if np.array_equal(new, choice):
            break
        choice, current_loss = new, loss(new)
        log(f"# refinement round {r + 1}: profiling loss {current_loss:.4f} (was {best_loss:.4f})")
        if current_loss < best_loss:
            best, best_loss = new, current_loss
    return best


def choose(cost: np.ndarray, dens: np.ndarray, budget: float) -> np.ndarray:
    """Per row of cost (heads, candidates) one candidate, the summed cost minimal (Lagrangian, then
    greedy fill) with mean density <= budget. Ties go to the lower index: deterministic."""
    N = cost.shape[0]
    if dens.min() > budget:
        raise ValueError(f"--density {budget}: below the sparsest mask of the family ({dens.min():.4f})")
    pick = lambda lam: np.argmin(cost + lam * dens[None], axis=1)
    fits = lambda choice: dens[choice].mean() <= budget
    hi = 1.0
    while not fits(pick(hi)):
        hi *= 2
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(pick(mid)) else (mid, hi)
    choice = pick(hi)
    while True:  # spend what is left on the best loss per density that still fits
        gain = cost[np.arange(N), choice][:, None] - cost  # (N, C): loss saved by moving head n to c
        extra = (dens[None] - dens[choice][:, None]) / N  # mean density it costs
        ok = (gain > 0) & (extra > 0) & (dens[choice].mean() + extra <= budget + 1e-12)
        if not ok.any():
            return choice
        n, c = np.unravel_index(np.argmax(np.where(ok, gain / np.where(extra > 0, extra, 1), -np.inf)), gain.shape)
        choice[n] = c


def uniform(candidates_L: int, budget: float) -> Mask:
    """The widest plain window whose density is within the budget."""
    lo, hi = 1, candidates_L
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if density(Mask(mid), candidates_L) <= budget else (lo, mid - 1)
    return Mask(lo)


def calibrated_config(cfg, masks) -> dict:
    """The run's config with one attention config per layer carrying its head masks."""
    data = to_dict(cfg)
    model = data["model"]
    pattern = model.pop("layer_pattern", None) or [model.pop("mixer")]
    model.pop("mixer", None)
    layers, it = [], iter(masks)
    for i in range(cfg.model.num_layers):
        mixer = dict(pattern[i % len(pattern)])
        if mixer["kind"] == "attention":
            for k in ("window", "sinks", "dilation"):
                mixer.pop(k, None)
            mixer["head_masks"] = [m.spec() for m in next(it)]
        layers.append(mixer)
    model["layer_pattern"] = layers
    return data


@functools.lru_cache(maxsize=4)
def _profiled(run_dir: str, batches: int, batch_size: int, seed: int, log):
    """The run, its mask family with densities, the evaluators and the profiled costs (kept for other budgets)."""
    cfg, model, step = load_model(run_dir)
    L = cfg.train.seq_len
    candidates = family(L)
    dens = np.array([density(m, L) for m in candidates])
    tune = Evaluator(cfg, model, 0, batches, batch_size, seed)
    held = Evaluator(cfg, model, batches, batches, batch_size, seed)
    return cfg, step, candidates, dens, tune, held, profile(tune, candidates, log=log)


def calibrate(run_dir, budget: float, batches: int = 4, batch_size: int = 8, seed: int = 0, rounds: int = 2,
              log=print) -> dict:
    if not 0 < budget <= 1:
        raise ValueError(f"--density: expected a fraction in (0, 1], got {budget}")
    if rounds < 0:
        raise ValueError(f"--rounds: expected a count >= 0, got {rounds}")
    cfg, step, candidates, dens, tune, held, cost = _profiled(str(run_dir), batches, batch_size, seed, log)
    L, H, n = cfg.train.seq_len, held.H, held.num_layers
    choice = refine(tune, candidates, dens, budget, choose(cost, dens, budget), rounds, log)
    masks = _masks(choice, candidates, H)
    wide = uniform(L, budget)
    result = {"run": str(run_dir), "step": step, "seq_len": L, "budget": budget, "rounds": rounds,
              "density": round(float(dens[choice].mean()), 4), "uniform_window": wide.window,
              "uniform_density": round(density(wide, L), 4),
              "masks": [[m.spec() for m in layer] for layer in masks]}
    for name, m in (("full", [[Mask()] * H] * n), ("uniform", [[wide] * H] * n), ("calibrated", masks)):
        loss, acc = held(m)
        result[f"{name}_loss"] = round(loss, 4)
        if cfg.data.task:
            result[f"{name}_accuracy"] = round(acc, 4)
    return result | {"config": calibrated_config(cfg, masks)}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m train.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--density", type=float, required=True, help="the mean fraction of causal pairs kept, in (0, 1]")
    p.add_argument("--batches", type=int, default=4, help="held-out batches to profile on (and as many to report on)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="refinement rounds against the chosen masks (0: none)")
    p.add_argument("--out", help="the calibrated config (default: RUN_DIR/calibrated.yaml)")
    args = p.parse_args(argv)
    try:
        if not Path(args.run_dir).is_dir():
            raise ValueError(f"{args.run_dir}: not a run folder")
        result = calibrate(args.run_dir, args.density, args.batches, args.batch_size, args.seed, args.rounds)
    except ValueError as e:
        sys.exit(f"error: {e}")
    config = result.pop("config")
    out = Path(args.out or Path(args.run_dir) / "calibrated.yaml")
    out.write_text(f"# python -m train.calibrate {args.run_dir} --density {args.density} --rounds {args.rounds} "
                   f"--seed {args.seed}\n"
                   + yaml.safe_dump(config, sort_keys=False))
    print(json.dumps(result))
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
