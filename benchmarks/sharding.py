"""Training on 8 simulated CPU devices, one mesh per row, next to one device: tokens/s and the bytes
of parameters and optimiser state that each device holds.

    python -m benchmarks.sharding [--steps 5] [--d-model 64] [--seq-len 64] [--batch 16]

The 8 "devices" are XLA's host-platform devices sharing this machine's cores, so the tokens/s show
the cost of partitioning (collectives, smaller per-device matmuls), not a speedup: on real devices
each would bring its own compute. Each row builds the model with the loop's own pieces
(zoo.sharding.init_state and batch_placer, train.step.make_train_step), compiles the step, then
times `--steps` steps (median). Bytes: the largest per-device total of the parameters' and the optimiser state's
shards; "one" holds everything.
"""

import argparse
import time

import jax

from benchmarks.common import print_table, save_json
from train import optim
from train.prepare import prepare
from train.step import make_train_step
from zoo.config import MeshConfig, from_dict
from zoo.sharding import as_numpy, batch_placer, bytes_per_device, describe, init_state, make_mesh

MESHES = {
    "transformer": ["one", "data=8", "fsdp=8", "fsdp=4 data=2", "tensor=2 fsdp=2 data=2", "tensor=4 data=2"],
    "moe": ["one", "data=8", "expert=4 data=2", "expert=8"],
}
MIXER = {"kind": "attention", "num_heads": 4}


def parse(mesh: str) -> MeshConfig:
    return MeshConfig(**{"data": 1, **{k: int(v) for k, v in (part.split("=") for part in mesh.split())}})


def measure(arch: str, mesh_name: str, args, corpus) -> dict:
    ffn = {"kind": "moe", "num_experts": 8, "top_k": 2} if arch == "moe" else {"kind": "mlp"}
    cfg = from_dict({"model": {"d_model": args.d_model, "num_layers": 2, "max_seq_len": args.seq_len, "mixer": MIXER,
                               "ffn": ffn},
                     "train": {"batch_size": args.batch, "seq_len": args.seq_len, "steps": args.steps + 1}})
    one = mesh_name == "one"
    mesh = make_mesh(MeshConfig(data=1), devices=jax.devices()[:1]) if one else make_mesh(parse(mesh_name))
    with jax.set_mesh(mesh):
        tx = optim.optimizer(cfg.train)
        graphdef, params, rest, opt_state, shardings = init_state(cfg, tx, mesh)
        step = make_train_step(graphdef, tx, (*shardings, jax.sharding.NamedSharding(mesh, jax.P())))
        train_batch, _ = batch_placer(cfg, mesh)
        batches = corpus.batches(seq_len=args.seq_len, seed=0, packing=False)
        held = {"params": max(bytes_per_device(params).values()), "opt": max(bytes_per_device(opt_state).values())}
        times = []
        for i in range(args.steps + 1):  # the first call compiles
            batch = train_batch(batches, i)
            t0 = time.perf_counter()
            params, rest, opt_state, m = step(params, rest, opt_state, batch)
            as_numpy(m["loss"])
            times.append(time.perf_counter() - t0)
    seconds = sorted(times[1:])[len(times[1:]) // 2]
    return {"model": arch, "mesh": mesh_name if one else describe(mesh), "devices": mesh.size,
            "tokens/s": int(args.batch * args.seq_len / seconds), "compile s": round(times[0], 1),
            "param KiB/device": round(held["params"] / 1024, 1), "opt KiB/device": round(held["opt"] / 1024, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)
    corpus = prepare(from_dict({}).data)
    rows = [measure(arch, mesh, args, corpus) for arch, meshes in MESHES.items() for mesh in meshes]
    print_table(rows, list(rows[0]))
    save_json("sharding", rows)


if __name__ == "__main__":
    main()
