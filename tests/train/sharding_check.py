"""The multi-device checks of tests/train/test_sharding.py (parts a and b, which it starts side by
side) and tests/train/test_sharding_context.py (part c), run with 8 simulated CPU devices (compiles
dominate; each part shares one start-up). Each prints one JSON object:

  losses[arch][mesh]   10 training losses; mesh "one" is one device (a 1-device mesh); (a) the
                       Transformer, (b) GLA, Mamba, MoE and a new kind that names no sharding axes
                       (tests/zoo/toy_kind.py: registered here, with no other edit)
  resume[where]        (a) losses of steps 6-10 after restoring the step-5 checkpoint written on
                       fsdp=4 data=2, on tensor=2 data=4 and on one device, and whether the run
                       did resume (kept the written lines of steps 1-5)
  bytes[what]          (a) bytes of parameters / optimiser state on each device under fsdp=8, and total
  tokens[where]        (a) sampled tokens of the checkpointed model, one device and tensor=4 data=2
  techniques[where]    (a) a tiny model with an exit: early-exit tokens and layers and self-speculative
                       tokens, one device and tensor=4 data=2 (its sharding hints in force)
  errors[what]         (a) the messages of a mesh of the wrong size and of an axis that does not divide;
                       (c) of a kind without a context-parallel form and a seq_len the context axis does not divide
  context[mesh]        (c) a model with one layer of every kind that has a context-parallel form, on packed
                       documents crossing the devices' spans (T = 40: 10 tokens a device, chunks of 4): relative
                       error of logits, loss and gradients against one device on data=2 context=4, and how many
                       context-parallel forms ran
  losses["context"]    (c) its 10 training losses on one device and on data=2 context=4 (the whole loop);
  resume["context"]    the losses of steps 6-10 resumed from the step-5 checkpoint on data=2 context=4

python tests/train/sharding_check.py RUN_DIR a|b|c
"""

import contextlib
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infer import Exits, Sampling, Speculation, generate
from kernels import context
from tests.util import count_calls, rel_err
from tests.zoo import toy_kind
from train import optim
from train.loop import run
from train.prepare import prepare
from train.step import make_train_step
from zoo.checkpoint import load_model
from zoo.config import MeshConfig, from_dict, to_dict
from zoo.model import LanguageModel
from zoo.registry import LAYER_OF
from zoo.registry import MIXERS as MIXERS_REGISTRY
from zoo.sharding import as_numpy, batch_placer, bytes_per_device, init_on_mesh, init_state, make_mesh

MIXERS = {"transformer": {"kind": "attention", "num_heads": 4}, "gla": {"kind": "gla", "num_heads": 4},
          "mamba": {"kind": "mamba", "state_size": 4}, "moe": {"kind": "attention", "num_heads": 4},
          "toy": {"kind": "shift"}}
MESHES = {"data=8": MeshConfig(data=8), "fsdp=4 data=2": MeshConfig(fsdp=4, data=2),
          "tensor=2 fsdp=2 data=2": MeshConfig(tensor=2, fsdp=2, data=2),
          "expert=4 data=2": MeshConfig(expert=4, data=2)}
THREE = ["data=8", "fsdp=4 data=2", "tensor=2 fsdp=2 data=2"]  # the Transformer's meshes; the other kinds
# take the last, whose axes apply every partition rule of theirs (data=8 and fsdp=4 only split more ways)


def config(arch: str, mesh: MeshConfig, **train):
    """The tiny run of every check (also the test's two-process run): 10 steps of 8 x 16 bytes; the
    Transformer's steps are two micro-batches of 8 (train.grad_accum), each split over the mesh."""
    ffn = {"kind": "moe", "num_experts": 8, "top_k": 2} if arch == "moe" else {"kind": "mlp"}
    batch = {"batch_size": 16, "grad_accum": 2} if arch == "transformer" else {"batch_size": 8}
    return from_dict({
        "model": {"d_model": 32, "num_layers": 1, "max_seq_len": train.get("seq_len", 16), "mixer": MIXERS[arch],
                  "ffn": ffn},
        "train": {**batch, "seq_len": 16, "lr": 3e-3, "warmup_steps": 2, "schedule": "constant", "steps": 10,
                  "log_every": 1, "eval_every": 100, "eval_batches": 1, "sample_tokens": 0,
                  "mesh": dataclasses.asdict(mesh),
                  **train}})


def train_losses(cfg, mesh, corpus) -> list[float]:
    """The loop's own pieces (init_state, batch_placer, make_train_step) without evaluation."""
    with jax.set_mesh(mesh):
        tx = optim.optimizer(cfg.train)
        graphdef, params, rest, opt_state, shardings = init_state(cfg, tx, mesh)
        step = make_train_step(graphdef, tx, (*shardings, jax.sharding.NamedSharding(mesh, jax.P())))
        train_batch, _ = batch_placer(cfg, mesh)
        batches = corpus.batches(cfg.train.seq_len, cfg.train.seed, packing=False)
        out = []
        for i in range(1, cfg.train.steps + 1):
            params, rest, opt_state, m = step(params, rest, opt_state, train_batch(batches, i))
            out.append(float(as_numpy(m["loss"])))
    return out


def logged(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def techniques(mesh) -> dict:
    """Early exit and self-speculation (greedy, 6 tokens) of a tiny 3-layer model with exits after layers 1
    and 2, on one device or with its parameters sharded over `mesh` and decoded under it."""
    model_cfg = from_dict({"model": {"d_model": 32, "num_layers": 3, "max_seq_len": 16, "mixer": MIXERS["transformer"],
                                     "exits": {"layers": [1, 2], "weights": [0.5, 0.5]}},
                           "train": {"seq_len": 16}}).model
    build = lambda: LanguageModel(model_cfg, rngs=nnx.Rngs(0))
    if mesh is None:
        model, context = build(), contextlib.nullcontext()
    else:
        graphdef, params, rest, _ = init_on_mesh(build, mesh)
        model, context = nnx.merge(graphdef, params, rest), jax.set_mesh(mesh)
    prompts = [[10, 84, 104], [101, 32, 20, 30]]
    with context:
        exits = generate(model, prompts, max_new_tokens=6, exits=Exits(0.6, measure="saturation"), return_info=True)
        drafted = generate(model, prompts, max_new_tokens=6, speculation=Speculation(2))
    return {"exits": exits[0], "exit_layers": exits[1]["exit_layers"], "speculation": drafted}


def part_a(root: Path, one, corpus) -> dict:
    """Transformer losses, checkpoints moving between meshes, FSDP bytes, sharded decoding."""
    out = {"losses": {}, "resume": {}, "bytes": {}, "tokens": {}, "errors": {}}
    quiet = lambda *_: None  # noqa: E731
    out["losses"]["transformer"] = {name: train_losses(config("transformer", MESHES[name]), make_mesh(MESHES[name]),
                                                       corpus) for name in ("data=8", "tensor=2 fsdp=2 data=2")}
    out["losses"]["transformer"]["one"] = train_losses(config("transformer", MeshConfig()), one, corpus)
    # The fsdp=4 data=2 run goes through the whole loop and leaves checkpoints at steps 5 and 10;
    # without step 10, a run started on its folder resumes from step 5.
    run(config("transformer", MESHES["fsdp=4 data=2"], checkpoint_every=5), root / "written", log=quiet)
    written = logged(root / "written")
    out["losses"]["transformer"]["fsdp=4 data=2"] = [r["loss"] for r in written]
    shutil.rmtree(root / "written" / "checkpoints" / "10")
    for where, mesh_cfg, mesh in (("tensor=2 data=4", MeshConfig(tensor=2, data=4), None), ("one", MeshConfig(), one)):
        shutil.copytree(root / "written", root / where)
        run(config("transformer", mesh_cfg), root / where, log=quiet, mesh=mesh)
        rows = logged(root / where)  # a resumed run keeps the metrics lines of steps 1-5 as written
        out["resume"][where] = {"losses": [r["loss"] for r in rows[5:]], "resumed": rows[:5] == written[:5]}

    fsdp = make_mesh(MeshConfig(fsdp=8))
    cfg = config("transformer", MeshConfig(fsdp=8))
    with jax.set_mesh(fsdp):
        _, params, _, opt_state, _ = init_state(cfg, optim.optimizer(cfg.train), fsdp)
    for what, tree in (("params", params), ("opt_state", opt_state)):
        out["bytes"][what] = {"per_device": sorted(bytes_per_device(tree).values()),
                              "total": sum(x.nbytes for x in jax.tree.leaves(tree))}

    prompts = [[10], [84, 104, 101, 32]]
    for where, mesh in (("one", None), ("tensor=4 data=2", make_mesh(MeshConfig(tensor=4, data=2)))):
        _, model, _ = load_model(root / "one", mesh=mesh)
        out["tokens"][where] = generate(model, prompts, max_new_tokens=12, sampling=Sampling(1.0), seed=3)
    out["tp_wq_spec"] = str(model.blocks[0].mixer.wq[...].sharding.spec)
    # distillation: a GLA student of the run in root/one (its teacher placed on the mesh by its own shardings)
    distill = {"teacher": str(root / "one"), "temperature": 2.0}
    out["losses"]["distilled"] = {}
    for where, mesh_cfg, mesh in (("one", MeshConfig(), one),
                                  ("tensor=2 fsdp=2 data=2", MESHES["tensor=2 fsdp=2 data=2"], None)):
        run(config("gla", mesh_cfg, distill=distill), root / f"distilled {where}", log=quiet, mesh=mesh)
        out["losses"]["distilled"][where] = [r["loss"] for r in logged(root / f"distilled {where}")]
    out["techniques"] = {where: techniques(mesh) for where, mesh in (
        ("one", None), ("tensor=4 data=2", make_mesh(MeshConfig(tensor=4, data=2))))}

    tx = optim.optimizer(config("transformer", MeshConfig()).train)
    for what, make in (("mesh size", lambda: make_mesh(MeshConfig(data=4, fsdp=1))),
                       ("indivisible", lambda: init_state(config("transformer", MeshConfig(tensor=8)), tx,
                                                          make_mesh(MeshConfig(tensor=8))))):
        try:
            make()
            out["errors"][what] = None
        except ValueError as e:
            out["errors"][what] = str(e)
    return out


def part_b(root: Path, one, corpus) -> dict:
    """GLA's, Mamba's and the new kind's losses on tensor=2 fsdp=2 data=2, MoE's on expert=4 data=2."""
    out = {"losses": {}}
    with toy_kind.registered():
        for arch, meshes in (("gla", THREE[-1:]), ("mamba", THREE[-1:]), ("moe", ["expert=4 data=2"]),
                             ("toy", ["tensor=2 fsdp=2 data=2"])):
            out["losses"][arch] = {"one": train_losses(config(arch, MeshConfig()), one, corpus)}
            for name in meshes:
                out["losses"][arch][name] = train_losses(config(arch, MESHES[name]), make_mesh(MESHES[name]),
                                                         corpus)
    return out


CONTEXT_MESH = MeshConfig(data=2, context=4)


def context_model():
    """A model config with one layer of every registered kind whose layer has a context-parallel form, small."""
    small = {"num_heads": 2, "chunk_size": 4, "state_size": 8}
    layers = []
    for kind, cfg in MIXERS_REGISTRY.items():
        if LAYER_OF[cfg].context_parallel:
            names = {f.name: f.default for f in dataclasses.fields(cfg)}
            mixer = {k: v for k, v in small.items() if k in names}
            if names.get("head_dim"):  # RWKV and Mamba give a head width rather than a number of heads
                mixer["head_dim"] = 8
            layers.append({"kind": kind, **mixer})
    return sorted(layers, key=lambda m: m["kind"] != "rwkv7")  # RWKV-7's value residual reads layer 0's values


def part_c(root: Path, one, corpus) -> dict:
    """Context parallelism: every kind with a form, in one model, against one device; a training run on it and
    its resumption; the refusals."""
    layers = context_model()
    out = {"context": {"kinds": [m["kind"] for m in layers]}, "losses": {}, "resume": {}, "errors": {}}
    T = 40
    cfg = from_dict({"model": {"d_model": 32, "num_layers": len(layers), "max_seq_len": T, "layer_pattern": layers},
                     "train": {"seq_len": T}})
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 256, (2, T)), jnp.int32)
    seg = jnp.asarray(np.cumsum(rng.random((2, T)) < 0.08, axis=1), jnp.int32).at[:, 15:].add(1)  # one start at 15

    def loss(model):
        logits = model(tokens, segment_ids=seg)  # (B, T, V)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1)
        return jnp.mean(nll), logits

    def grads(mesh):
        graphdef, params, rest, _ = init_on_mesh(lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(0)), mesh)
        f = jax.jit(lambda p: nnx.value_and_grad(lambda m: loss(m), has_aux=True)(nnx.merge(graphdef, p, rest)))
        with jax.set_mesh(mesh):
            (value, logits), g = f(params)
        return [np.asarray(x) for x in (value, logits, *jax.tree.leaves(nnx.state(g)))]

    want = grads(one)  # against data=2 context=4 only; context=8 too for every op (tests/kernels/test_context.py)
    calls = [count_calls(context, name) for name in ("over_spans", "split_queries")]  # every form: one of them
    got = grads(make_mesh(CONTEXT_MESH))
    out["context"]["data=2 context=4"] = {
        "forms": sum(c() for c in calls), "loss": rel_err(got[0], want[0]), "logits": rel_err(got[1], want[1]),
        "grads": max(rel_err(a, b) for a, b in zip(got[2:], want[2:]))}

    train = dict(checkpoint_every=5)
    pattern = [m for m in layers if m["kind"] in ("attention", "gated_deltanet")]  # with a short convolution
    model = {"layer_pattern": pattern, "num_layers": len(pattern), "max_seq_len": T, "mixer": None}
    quiet = lambda *_: None  # noqa: E731
    for where, mesh_cfg, mesh in (("one", MeshConfig(), one),
                                  ("data=2 context=4", CONTEXT_MESH, None)):
        run_cfg = _with_model(config("gla", mesh_cfg, seq_len=T, **train), model)
        run(run_cfg, root / f"context {where}", log=quiet, mesh=mesh)
        out["losses"].setdefault("context", {})[where] = [r["loss"] for r in logged(root / f"context {where}")]
    resumed = root / "context resumed"
    shutil.copytree(root / "context data=2 context=4", resumed)
    shutil.rmtree(resumed / "checkpoints" / "10")
    written = logged(resumed)
    run(_with_model(config("gla", CONTEXT_MESH, seq_len=T, **train), model), resumed, log=quiet)
    rows = logged(resumed)
    out["resume"]["context"] = {"losses": [r["loss"] for r in rows[5:]], "resumed": rows[:5] == written[:5]}

    hyena = _with_model(config("gla", MeshConfig(context=8), seq_len=T), {"mixer": {"kind": "hyena"}})
    for what, run_cfg in (("kind", hyena),
                          ("length", config("gla", MeshConfig(context=8), seq_len=20))):
        try:
            batch_placer(run_cfg, make_mesh(run_cfg.train.mesh))
            out["errors"][what] = None
        except ValueError as e:
            out["errors"][what] = str(e)
    return out


def _with_model(cfg, model: dict):
    return from_dict({**to_dict(cfg), "model": {**to_dict(cfg)["model"], **model}})


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    one_device = make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    corpus = prepare(config("transformer", MeshConfig()).data)
    part = {"a": part_a, "b": part_b, "c": part_c}[sys.argv[2]]
    print(json.dumps({"devices": jax.device_count(), **part(Path(sys.argv[1]), one_device, corpus)}))
