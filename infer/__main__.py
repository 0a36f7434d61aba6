"""python -m infer RUN_DIR_OR_CONFIG --prompt "ROMEO:" --max-new-tokens 200"""

import argparse
import sys
from pathlib import Path


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m infer", description="Generate text from a run's latest "
                                "checkpoint, or from a config with random weights.")
    p.add_argument("source", help="a run folder (runs/NAME) or a YAML config (random init)")
    p.add_argument("overrides", nargs="*", help="config overrides, only with a YAML config")
    p.add_argument("--prompt", action="append", help="prompt text; repeat for a batch (default: newline)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", default=None, help="stop at this character (one byte)")
    args = p.parse_args(argv)
    try:
        from flax import nnx

        import infer
        import zoo
        from zoo.checkpoint import load_model

        if Path(args.source).is_dir():
            _, model, step = load_model(args.source)
            print(f"# {args.source}, checkpoint step {step}", file=sys.stderr)
        else:
            cfg = zoo.load_config(args.source, args.overrides)
            model = zoo.LanguageModel(cfg.model, rngs=nnx.Rngs(cfg.train.seed))
            print(f"# {args.source}: random weights", file=sys.stderr)
        prompts = args.prompt or ["\n"]
        outs = infer.generate_text(model, prompts, max_new_tokens=args.max_new_tokens, stop=args.stop,
                                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as e:
        sys.exit(f"error: {e}")
    for prompt, out in zip(prompts, outs):
        print(prompt + out)


if __name__ == "__main__":
    main()
