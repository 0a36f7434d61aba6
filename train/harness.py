"""An lm-evaluation-harness (lm-eval 0.4) backend for zoo models: `ZooLM`, registered as model "zoo".

    python -m train.harness --model zoo --model_args path=runs/NAME --tasks zoo_shakespeare_mc \\
        --include_path train/lm_eval_tasks
    lm_eval.simple_evaluate(model=ZooLM(path="runs/NAME"), tasks=[...])

lm-eval 0.4.13 finds models in its registry only (no entry-point plugins): importing this module registers
"zoo", and `python -m train.harness ARGS` is lm-eval's own command line (`lm_eval ARGS`) run after that
import. `path` is a run folder (its latest checkpoint, train/ and zoo/checkpoint.py) or a Hugging Face
folder (zoo.hf.load); the tokenizer is the model's own (bytes, the run's trained BPE, tokenizer.json).

The three request types:
- loglikelihood: each request's context + continuation, less its last token, is one document of a packed row
  (segment_ids: documents never see each other, as levanter packs its evaluation); rows are filled
  longest-first, hold model.max_seq_len tokens (the power of two above a longer request, where the model
  takes one) and are padded to a power-of-two length (a bucket), `batch_size` rows a call, so each bucket
  compiles one function. The continuation's log-probability is read from one float32 log-softmax; is_greedy
  when every continuation token is the argmax.
- loglikelihood_rolling: the disjoint-window perplexity of lm-eval's Hugging Face backend: the document in
  windows of max_seq_len predicted tokens, stride max_seq_len, each conditioned on the one token before it
  (the first on the prefix token), summed; the windows go through loglikelihood's packing.
- generate_until: infer.generate_text, `batch_size` prompts a call, greedy unless the task asks to sample,
  stopping at the task's `until` strings and after `max_gen_toks` (default 256) tokens.

A sequence longer than max_seq_len is refused, naming its task, unless every layer can take it: a mixer
whose state stays fixed (recurrent) or whose attention is windowed past the trained context
(long_context: window); a Hyena cache or attention with long_context: full cannot. With a `mesh`, a
folder's parameters are read into their shards and each batch's rows are split over the batch axes, as in
training.
"""

import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import lm_eval.models  # noqa: F401  (its models first: get_model loads them only into an empty registry)
import numpy as np
from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from infer.generate import Sampling, generate_text
from layers.sharding import LOGICAL_TO_MESH
from zoo import tokenizer as tokenizer_lib
from zoo.sharding import batch_sharding

TASKS = Path(__file__).parent / "lm_eval_tasks"  # the local tasks: lm-eval's include_path
MIN_ROW = 32  # the shortest bucket: rows are MIN_ROW * 2**k tokens
MODEL_ARGS = ("path", "batch_size", "dtype")
IGNORED = ("max_batch_size", "device")  # lm-eval's command line passes them to every model


@jax.jit
def _scores(graphdef, params, tokens, segment_ids, targets):
    """Each position's log-probability of its target and whether the target is the argmax, (B, T) each."""
    model = nnx.merge(graphdef, params)
    logits = model(tokens, segment_ids=segment_ids).astype(jnp.float32)  # (B, T, V)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
    return logp, jnp.argmax(logits, axis=-1) == targets


@register_model("zoo")
class ZooLM(TemplateLM):
    """A zoo model for lm-eval: from `path` (a run folder or a Hugging Face folder, read in `dtype`) or a
    `model` and its `tokenizer` (default bytes); `batch_size` rows or prompts a call. With a `mesh`, a folder's
    parameters are read into their shards there (a `model` given must be placed already) and each batch's rows
    are split over its batch axes."""

    def __init__(self, path=None, *, model=None, tokenizer=None, batch_size=8, dtype="float32", mesh=None,
                 **unknown):
        super().__init__()
        unknown = sorted(k for k in unknown if k not in IGNORED)
        if unknown:
            raise ValueError(f"zoo lm-eval backend: unknown model_args {unknown}; expected {', '.join(MODEL_ARGS)}")
        if (path is None) == (model is None):
            raise ValueError("zoo lm-eval backend: give path= (a run folder or a Hugging Face folder) or model=")
        if path is not None:
            model, tokenizer = _load(str(path), dtype, mesh)
        self.model, self.tok = model, tokenizer or tokenizer_lib.Bytes
        self.model.eval()
        self.batch_size = 8 if str(batch_size).startswith("auto") else int(batch_size)  # lm-eval's "auto": ours
        self.mesh, self.max_length = mesh, model.cfg.max_seq_len
        split = 1 if mesh is None else math.prod(mesh.shape[a] for a in LOGICAL_TO_MESH["batch"])
        if self.batch_size % split:
            raise ValueError(f"zoo lm-eval backend: batch_size={self.batch_size} rows do not split over the mesh's "
                             f"batch axes (data x fsdp x expert = {split} devices); use a multiple of {split}")
        self.longer_ok = _takes_longer(model.cfg)
        self.graphdef, self.params = nnx.split(model)

    @property
    def eot_token_id(self) -> int:
        return tokenizer_lib.END_OF_DOCUMENT if self.tok.eos_id is None else self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The token before a text with no context: the tokenizer's BOS if it adds one, else the end of text."""
        return (self.tok.encode("", special=True) or [self.eot_token_id])[0]

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string, special=add_special_tokens is not False)

    def tok_decode(self, ids) -> str:
        return self.tok.decode(ids)

    def _check_length(self, n: int, request, what: str):
        if n > self.max_length and not self.longer_ok:
            raise ValueError(f"zoo lm-eval backend: task {request.task_name!r} (doc {request.doc_id}) needs {n} "
                             f"tokens of {what}, longer than the model can take: model.max_seq_len="
                             f"{self.max_length}, and a layer's context is not bounded past it (a Hyena cache, "
                             "attention with long_context: full)")

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        try:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        except _TooLong as e:  # score() knows the length, the request knows its task
            self._check_length(e.n, requests[e.index], "context and continuation")

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        return self.score([(ctx, cont) for _, ctx, cont in requests])

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log-probability, is_greedy) of each continuation after its context, token ids: packed rows,
        `batch_size` of them a call, one compiled function per row length."""
        docs = [ctx + cont for ctx, cont in pairs]  # ctx holds one token at least (lm-eval's prefix token)
        lengths = [len(d) - 1 for d in docs]
        too_long = [i for i, n in enumerate(lengths) if n > self.max_length]
        if too_long and not self.longer_ok:
            raise _TooLong(too_long[0], lengths[too_long[0]])
        by_length = {}
        for row in _pack(lengths, lambda n: max(self.max_length, self._bucket(n))):
            by_length.setdefault(self._bucket(sum(lengths[i] for i in row)), []).append(row)
        out = [None] * len(pairs)
        for T, group in sorted(by_length.items()):
            for b in range(0, len(group), self.batch_size):
                batch = group[b:b + self.batch_size]
                tokens, segments, targets = (np.zeros((self.batch_size, T), np.int32) for _ in range(3))
                spans = []
                for j, row in enumerate(batch):
                    t = 0
                    for s, i in enumerate(row):
                        d = docs[i]
                        tokens[j, t:t + len(d) - 1], targets[j, t:t + len(d) - 1] = d[:-1], d[1:]
                        segments[j, t:t + len(d) - 1] = s + 1
                        t += len(d) - 1
                        spans.append((i, j, t - len(pairs[i][1]), t))
                logp, greedy = (np.asarray(a) for a in _scores(self.graphdef, self.params,
                                                               *(self._place(a) for a in (tokens, segments, targets))))
                for i, j, start, end in spans:
                    out[i] = (float(logp[j, start:end].sum()), bool(greedy[j, start:end].all()))
        return out

    def _bucket(self, n: int) -> int:
        """A row's length for n tokens: a power of two from MIN_ROW on, at most max_seq_len unless n is longer."""
        T = max(MIN_ROW, 1 << (n - 1).bit_length())
        return T if n > self.max_length else min(T, self.max_length)

    def _place(self, a: np.ndarray):
        return jnp.asarray(a) if self.mesh is None else jax.device_put(a, batch_sharding(self.mesh, 2))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for k, r in enumerate(requests):
            ids = self.tok_encode(r.args[0])  # with its BOS, scored after the prefix token, as lm-eval's HF backend
            for w in get_rolling_token_windows(ids, self.prefix_token_id, self.max_length, context_len=1):
                windows.append(make_disjoint_window(w))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (logp, _) in zip(owner, self.score(windows)):
            totals[k] += logp
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups = {}  # one generate call per batch of requests with the same generation arguments
        for k, r in enumerate(requests):
            context, kwargs = r.args
            until = kwargs.get("until") or []
            max_gen = int(kwargs.get("max_gen_toks", 256))
            sampling = Sampling(float(kwargs.get("temperature", 1.0)), kwargs.get("top_k"), kwargs.get("top_p")) \
                if kwargs.get("do_sample") else Sampling()  # transformers' defaults, as lm-eval's HF backend
            self._check_length(len(self.tok_encode(context)) + max_gen, r, "prompt and max_gen_toks")
            key = (tuple([until] if isinstance(until, str) else until), max_gen, sampling)
            groups.setdefault(key, []).append(k)
        out = [None] * len(requests)
        for (until, max_gen, sampling), ks in groups.items():
            ks.sort(key=lambda k: len(requests[k].args[0]))  # similar lengths share a batch
            for b in range(0, len(ks), self.batch_size):
                chunk = ks[b:b + self.batch_size]
                texts = generate_text(self.model, [requests[k].args[0] for k in chunk], max_new_tokens=max_gen,
                                      stop=list(until) or None, tokenizer=self.tok, sampling=sampling)
                for k, text in zip(chunk, texts):
                    out[k] = text
        return out


class _TooLong(Exception):
    def __init__(self, index: int, n: int):
        self.index, self.n = index, n


def _load(path: str, dtype: str, mesh):
    """(model, tokenizer) from a Hugging Face folder (config.json) or a run folder."""
    from zoo.checkpoint import load_any

    model, tok = load_any(path, dtype=dtype, mesh=mesh)
    if tok is None:
        raise ValueError(f"zoo lm-eval backend: {path} has no tokenizer.json; lm-eval needs the model's tokenizer")
    return model, tok


def _takes_longer(cfg) -> bool:
    """Whether every layer of model config `cfg` runs past max_seq_len: a fixed state or a bounded window."""
    from zoo.registry import LAYER_OF

    return all(not getattr(LAYER_OF[type(m)], "grows_with_context", False)
               or getattr(m, "long_context", None) == "window" for m in cfg.mixers())


def _pack(lengths: list[int], capacity) -> list[list[int]]:
    """Indices of `lengths` in rows, longest first, each into the first row with room for it (first-fit
    decreasing); a row holds capacity(n) tokens for n those of its first (longest) request."""
    rows, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = next((j for j, r in enumerate(room) if lengths[i] <= r), None)
        if j is None:
            rows.append([i])
            room.append(capacity(lengths[i]) - lengths[i])
        else:
            rows[j].append(i)
            room[j] -= lengths[i]
    return rows


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    sys.exit(cli_evaluate())
