"""python -m infer RUN_DIR_OR_CONFIG_OR_HF_FOLDER --prompt "ROMEO:" --max-new-tokens 200

A Hugging Face model folder (config.json + safetensors, zoo/hf) is read with its tokenizer.json,
and generation stops at its end-of-text token; --dtype bfloat16 loads it in bfloat16.

--stop "Question:" (repeatable; any length; $'\n\n' in bash for a blank line) also stops a row at that text
and cuts the output before it.

Early exit (a model trained with model.exits): --exit-threshold 0.9 --exit-measure margin [--show-exits].
Speculative decoding: --speculative 4 with --draft RUN2 (another model of the same vocabulary) or
[--draft-layers 2] (the model's own first layers and their exit); --tree 2,2 checks a tree of drafts
(greedy). Greedy speculation gives greedy's tokens; with --temperature > 0 it samples exactly as plain
sampling does.

Quantized decoding (infer/quantize.py): --quantize int8 (or int4) for the weights, --kv-cache int8;
--method gptq (or awq, smoothquant) --calibration FILE corrects or scales them on the text of FILE (up to
32 windows of 128 tokens), quantizing once before decoding. A run folder that python -m train.compress
quantized decodes as written (its codes and scales). A run trained with train.qat decodes in the quantized
form it trained (its bits, groups and activations) unless --quantize says otherwise.
"""

import argparse
import sys
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer", description="Generate text from a run's latest "
                                "checkpoint, or from a config with random weights.")
    p.add_argument("source", help="a run folder (runs/NAME), a Hugging Face model folder (config.json, "
                   "*.safetensors, tokenizer.json) or a YAML config (random init)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="a Hugging Face folder's parameter and compute dtype (default: %(default)s)")
    p.add_argument("overrides", nargs="*", help="config overrides (dotted.key=value), only with a YAML config")
    p.add_argument("--config", default=None, help="a run folder's model built from this YAML config instead of its "
                   "own, with the same parameters (per-head attention masks from python -m train.calibrate)")
    p.add_argument("--prompt", action="append", help="prompt text; repeat for a batch (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=200,
                   help="tokens to generate per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature; 0 is greedy decoding (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens only")
    p.add_argument("--top-p", type=float, default=None, help="sample from the smallest set with this much mass")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives the same text (default: %(default)s)")
    p.add_argument("--stop", action="append", help="stop a row at this text, of any length, and cut it there; "
                   "repeat for several")
    p.add_argument("--exit-threshold", type=float, default=None, help="early exit: confidence in [0, 1] to stop at")
    p.add_argument("--exit-measure", default="softmax",
                   help="softmax, margin, saturation or classifier (default: %(default)s)")
    p.add_argument("--exit-decay", type=float, default=0.0,
                   help="CALM's threshold decay along the output (default: %(default)s)")
    p.add_argument("--exit-level", default="token",
                   help="token (per token and row) or sequence (one depth) (default: %(default)s)")
    p.add_argument("--speculative", type=int, default=None, help="speculative decoding: draft length k")
    p.add_argument("--draft", default=None,
                   help="the draft model: a run folder, Hugging Face folder or YAML config of the same vocabulary")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="self-speculation: the exit layer that drafts (default: the first)")
    p.add_argument("--tree", default=None, help="a tree of drafts, branching factors per depth, e.g. 2,2 (greedy)")
    p.add_argument("--show-exits", action="store_true", help="print the layer each generated token used")
    p.add_argument("--quantize", default=None, choices=("int8", "int4", "int3"),
                   help="decode with int8 (per channel) or int4 (groups of 32) weights; int3 with --method gptq")
    p.add_argument("--method", default=None, choices=("rtn", "gptq", "awq", "smoothquant"),
                   help="how --quantize rounds: to nearest (the default), or on --calibration's text")
    p.add_argument("--calibration", default=None, help="a text file the quantizer reads (--method other than rtn)")
    p.add_argument("--kv-cache", default=None, choices=("int8",), help="keep the attention KV cache in int8")
    return p


def load(source: str, overrides, dtype: str, config=None):
    """(model, tokenizer or None, the run's train.qat or None) from a Hugging Face folder, a run folder or a
    YAML config (random weights, with `overrides`)."""
    from flax import nnx

    import zoo
    from zoo.checkpoint import load_model

    if Path(source).is_dir() and overrides:
        raise ValueError(f"overrides {' '.join(overrides)}: a run folder is loaded with the config it was trained "
                         "with; overrides apply to a YAML config (random weights)")
    if (Path(source) / "config.json").is_file():
        import zoo.hf

        print(f"# {source}: Hugging Face {zoo.hf.read_config(source)['architectures'][0]}", file=sys.stderr)
        return *zoo.hf.load(source, dtype=dtype), None
    if Path(source).is_dir():
        cfg, model, step = load_model(source, config=config)
        print(f"# {source}, checkpoint step {step}" + (f", config {config}" if config else ""), file=sys.stderr)
        return model, zoo.tokenizer.for_run(source, cfg.data.tokenizer), cfg.train.qat  # bytes, or tokenizer.json
    cfg = zoo.load_config(source, overrides)
    print(f"# {source}: random weights", file=sys.stderr)
    return zoo.LanguageModel(cfg.model, rngs=nnx.Rngs(cfg.train.seed)), None, None


def techniques(args, draft, qat=None) -> dict:
    """generate's sampling, exits, speculation and quantization from the command line's flags; a run
    trained quantization-aware (`qat`, its train.qat) decodes in that form unless --quantize says otherwise."""
    import infer

    tree = tuple(int(w) for w in args.tree.split(",")) if args.tree else None
    exits = None if args.exit_threshold is None else infer.Exits(
        args.exit_threshold, measure=args.exit_measure, decay=args.exit_decay, level=args.exit_level)
    if args.speculative is None and (draft is not None or tree is not None or args.draft_layers is not None):
        raise ValueError("--draft, --draft-layers and --tree need --speculative K (the draft length)")
    speculation = None if args.speculative is None else infer.Speculation(
        args.speculative, draft_layers=args.draft_layers, draft_model=draft, tree=tree)
    plain = not calibrated(args) and (args.quantize is not None or args.kv_cache is not None)
    quantization = infer.Quantization(weights=args.quantize, kv_cache=args.kv_cache) if plain else None
    if qat is not None and args.quantize is None and not calibrated(args):
        print(f"# decoding as trained (train.qat): {qat.bits} weights" + (f" in groups of {qat.group_size}" if
              qat.bits == "int4" else "") + f", {qat.activations} activations", file=sys.stderr)
        quantization = infer.Quantization(weights=qat.bits, kv_cache=args.kv_cache, group_size=qat.group_size,
                                          activations=qat.activations)
    return dict(sampling=infer.Sampling(args.temperature, top_k=args.top_k, top_p=args.top_p), exits=exits,
                speculation=speculation, quantization=quantization)


def calibrated(args) -> bool:
    """Whether --method quantizes on --calibration's text (once, before decoding) rather than to nearest."""
    return args.method not in (None, "rtn")


def calibration(args, tokenizer, length: int = 128, rows: int = 32):
    """Token ids (rows, length) of --calibration's text, for --method; errors name what is missing."""
    import numpy as np

    from zoo.tokenizer import Bytes

    if args.quantize is None or args.calibration is None:
        raise ValueError(f"--method {args.method} needs --quantize BITS and --calibration FILE (a text to read)")
    if not Path(args.calibration).is_file():
        raise ValueError(f"--calibration {args.calibration}: no such file")
    ids = (tokenizer or Bytes).encode(Path(args.calibration).read_text(encoding="utf-8"))
    n = min(rows, len(ids) // length)
    if n < 1:
        raise ValueError(f"--calibration {args.calibration}: {len(ids)} tokens; expected at least {length}")
    return np.asarray(ids[:n * length], np.int32).reshape(n, length)


def main(argv=None):
    args = parser().parse_args(argv)
    try:

        import infer
        from infer.quantize import is_quantized

        if args.config and not Path(args.source).is_dir():
            raise ValueError(f"--config {args.config}: builds a run folder's model; {args.source} is not one")
        model, tokenizer, qat = load(args.source, args.overrides, args.dtype, args.config)
        if args.quantize and is_quantized(model):
            raise ValueError(f"--quantize {args.quantize}: {args.source} holds quantized weights already "
                             "(python -m train.compress); decode it without --quantize")
        draft = load(args.draft, [], args.dtype)[0] if args.draft else None
        if calibrated(args):  # quantized once here (generate's `quantization` is round-to-nearest)
            model = infer.quantize(model, args.quantize, args.kv_cache, method=args.method,
                                   calibration=calibration(args, tokenizer))
        prompts = args.prompt or ["\n"]
        outs, info = infer.generate_text(
            model, prompts, max_new_tokens=args.max_new_tokens, stop=args.stop, tokenizer=tokenizer, seed=args.seed,
            return_info=True, **techniques(args, draft, qat))
    except ValueError as e:
        sys.exit(f"error: {e}")
    for prompt, out, layers in zip(prompts, outs, info["exit_layers"]):
        print(prompt + out)
        if args.show_exits:
            print(f"# layers used per token (mean {sum(layers) / max(len(layers), 1):.2f} of "
                  f"{model.cfg.num_layers}): {' '.join(map(str, layers))}")
    if "acceptance" in info:
        print(f"# speculative: {info['acceptance']:.1%} of drafted tokens accepted in {info['rounds']} rounds",
              file=sys.stderr)


if __name__ == "__main__":
    main()
