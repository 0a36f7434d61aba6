"""Throughput of the lm-eval backend (train/harness.py) on the local multiple-choice task against a plain loop.

    python -m benchmarks.harness [--source runs/NAME | configs/transformer.yaml] [--batch-size 16] [--repeat 4]

The task's 96 loglikelihood requests (24 questions x 4 choices, repeated --repeat times), scored by the
backend (packed rows, --batch-size rows a call) and by a loop of one request per call (its own row, batch
1), same model and process; each is run once to compile, then timed. Prints requests/s of each and the ratio.
"""

import argparse
import json
import time

from flax import nnx
from lm_eval.api.instance import Instance

from train.harness import TASKS, ZooLM

TASK = TASKS / "shakespeare_mc.jsonl"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", default="configs/transformer.yaml",
                   help="a run folder, a Hugging Face folder or a YAML config (random weights)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=4)
    args = p.parse_args(argv)
    if args.source.endswith(".yaml"):
        import zoo

        cfg = zoo.load_config(args.source)
        packed = ZooLM(model=zoo.LanguageModel(cfg.model, rngs=nnx.Rngs(0)), batch_size=args.batch_size)
    else:
        packed = ZooLM(path=args.source, batch_size=args.batch_size)
    loop = ZooLM(model=packed.model, tokenizer=packed.tok, batch_size=1)
    docs = [json.loads(line) for line in TASK.read_text().splitlines()] * args.repeat
    reqs = [Instance("loglikelihood", {}, (d["context"], c), i, ("bench", i, 1)) for i, d in enumerate(docs)
            for c in d["choices"]]
    rates = {}
    for name, run in (("backend", lambda: packed.loglikelihood(reqs, disable_tqdm=True)),
                      ("loop", lambda: [loop.loglikelihood([r], disable_tqdm=True) for r in reqs])):
        run()  # compile every bucket
        t0 = time.perf_counter()
        run()
        rates[name] = len(reqs) / (time.perf_counter() - t0)
    print(f"{len(reqs)} requests, {args.source}, batch size {args.batch_size}")
    print(f"backend (packed, batched): {rates['backend']:.1f} requests/s")
    print(f"loop (one request a call): {rates['loop']:.1f} requests/s")
    print(f"ratio: {rates['backend'] / rates['loop']:.1f}x")


if __name__ == "__main__":
    main()
