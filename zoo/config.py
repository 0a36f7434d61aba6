"""Run configuration: YAML on disk, frozen dataclasses in code.

A run file has three sections, `model`, `data` and `train`. `model.mixer` and `model.ffn` are
picked by their `kind` from the registry (zoo/registry.py; the kinds are in zoo/kinds.py). Overrides
are `dotted.path=value` strings whose value is read as YAML (`model.mixer.window=64`,
`model.mixer.window=null`).

Every mistake is a ValueError that names the dotted path and what was expected, raised before any
array is made: an unknown key, a wrong type, a value outside its choices, an impossible shape.
zoo/run_file.py reads a run file (`load_config`).
"""

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import yaml

from layers.options import NonNegFloat, NonNegInt, PosFloat, PosInt, Range, UnitFloat
from zoo import kinds, tokenizer  # noqa: F401  (kinds: registers every kind)
from zoo.registry import FFNS, LAYER_OF, MIXERS, build_kind
from zoo.schema import build, to_dict  # noqa: F401  (to_dict: part of this module's interface)
from zoo.tasks import TASKS

Beta = Annotated[float, Range(0, 1, hi_open=True)]  # Adam's decay rates
DeviceCount = Annotated[int, Range(lo=-1)]  # a mesh axis: a number of devices, or -1 for the rest


@dataclass(frozen=True)
class ExitsConfig:
    """model.exits: early exits. layers (an exit after each of these many blocks, 1..num_layers-1; the
    final layer is always the last exit); weights (the loss weight of each exit, added to the final
    loss in training); own_head (each exit gets its own LM head instead of sharing the final one);
    layer_dropout (LayerSkip: in training, block i is skipped for a row with probability
    layer_dropout * i / (num_layers - 1), rising with depth); classifier_steps (after the last
    training step, fit the exit classifiers on the frozen model for this many steps; 0 = none)."""
    layers: tuple[PosInt, ...] = ()
    weights: tuple[NonNegFloat, ...] = ()
    own_head: bool = False
    layer_dropout: Annotated[float, Range(0, 1, hi_open=True)] = 0.0
    classifier_steps: NonNegInt = 0


@dataclass(frozen=True)
class ResidualConfig:
    """model.residual: how each sublayer (mixer, FFN) joins the residual stream (layers/residual.py,
    docs/residual.md). kind (standard: x <- x + f(norm(x)); mhc: DeepSeek's manifold-constrained
    hyper-connections, `rate` copies of the stream mixed by a doubly stochastic matrix; attnres: Kimi's
    attention residuals, each sublayer's input a softmax over the embedding and earlier outputs);
    rate (mhc: the expansion rate n, streams of the residual); iterations (mhc: Sinkhorn-Knopp rounds);
    block_size (attnres: sublayers per block, 1 = Full AttnRes, more = Block AttnRes). Both act per
    token, so decoding is unchanged; early exits (model.exits) need kind standard."""
    kind: Literal["standard", "mhc", "attnres"] = "standard"
    rate: PosInt = 4
    iterations: PosInt = 20
    block_size: PosInt = 1


@dataclass(frozen=True)
class ModelConfig:
    """model: vocab_size; d_model (residual width); num_layers; max_seq_len (the context the model
    is trained for, null = train.seq_len: the longest training sequence, and where attention's
    long_context choice starts at inference); mixer (the sequence mixer, picked by `kind`); ffn (the
    FFN, picked by `kind`; none: no FFN); layer_pattern (optional list of mixer configs, repeated over
    the layers; replaces `mixer`); ffn_pattern (optional list of FFN configs, repeated over the layers
    the same way; replaces `ffn`: DeepSeek-V3's first dense layers, Jamba's MoE every other layer, a layer
    without FFN among others); tie_embeddings (LM head shares the embedding matrix); norm (the
    blocks', final and exit norms: rms, or layer: LayerNorm with a bias, as RWKV); embed_norm (a norm of
    the embeddings before block 0, RWKV's ln0); embed_scale (the embeddings times this number before block 0,
    null = none: Gemma's and RecurrentGemma's sqrt(d_model)); logit_softcap (all logits, the final head's and the
    exits', as cap tanh(logits / cap), null = none: Gemma 2's and RecurrentGemma's soft cap); norm_eps; dtype
    (compute dtype; parameters stay float32); exits (optional early exits: the model.exits keys below); residual (the
    residual connection: the model.residual keys below); head (lm: next-
    token logits at every position; pooled_decoder: MAD's compression autoencoder, where the last
    position's hidden state alone, plus each position's sinusoidal embedding, goes through a 2-layer
    GELU MLP to that position's logits, so the model must compress the sequence into one state; it is
    not a language model and cannot decode); init_from (a Hugging Face model folder, zoo/hf: the model
    is config.json's, with this section's keys on top, and a new run starts from its weights)."""
    vocab_size: PosInt = 256
    d_model: PosInt = 128
    num_layers: PosInt = 4
    max_seq_len: PosInt | None = None
    mixer: Any = None
    ffn: Any = None
    layer_pattern: tuple | None = None
    ffn_pattern: tuple | None = None
    tie_embeddings: bool = True
    norm: Literal["rms", "layer"] = "rms"
    embed_norm: bool = False
    embed_scale: PosFloat | None = None
    logit_softcap: PosFloat | None = None
    norm_eps: PosFloat = 1e-6
    dtype: Literal["float32", "bfloat16"] = "float32"
    exits: ExitsConfig | None = None
    residual: ResidualConfig = field(default_factory=ResidualConfig)
    head: Literal["lm", "pooled_decoder"] = "lm"
    init_from: str | None = None

    def mixers(self) -> tuple:
        """The mixer config of each layer."""
        return _repeat(self.layer_pattern or (self.mixer,), self.num_layers)

    def ffns(self) -> tuple:
        """The FFN config of each layer."""
        return _repeat(self.ffn_pattern or (self.ffn,), self.num_layers)


def _repeat(pattern: tuple, n: int) -> tuple:
    return tuple(pattern[i % len(pattern)] for i in range(n))


@dataclass(frozen=True)
class TokenizerConfig:
    """data.tokenizer: kind (bytes: one token per UTF-8 byte, vocabulary 256, byte 0 ends a document;
    bpe: a byte-level BPE vocabulary trained on the training split by the `tokenizers` library; file:
    an existing tokenizer.json); vocab_size (bpe: the vocabulary, special tokens included); special_tokens
    (bpe: extra tokens kept whole, e.g. for fine-tuning formats); end_of_document (bpe, file: the token
    appended after every document, the stop token of generation); path (file: the tokenizer.json).
    The tokenizer a run used is saved in its folder as tokenizer.json (bpe, file)."""
    kind: Literal["bytes", "bpe", "file"] = "bytes"
    vocab_size: Annotated[int, Range(lo=257)] = 4096
    special_tokens: tuple[str, ...] = ()
    end_of_document: str = "<|endoftext|>"
    path: str | None = None


@dataclass(frozen=True)
class DataConfig:
    """data: corpus (`shakespeare`, or a folder of .txt files (one document each), .jsonl files (one
    document per line, its `text_field`) and .parquet files (one per row, needs pyarrow)); val_docs (the
    documents held out for validation by name: Shakespeare's plays, a .txt file's name without .txt:
    whole documents, never random windows); val_fraction (instead of val_docs: each document goes to
    validation with this probability, by a hash of its name (file, file:line, file:row)); text_field;
    tokenizer (the data.tokenizer keys below); packing (split documents at blank lines, join them with
    the end-of-document token and give each window `segment_ids`, so no token attends or recurs across a
    boundary; off: plain windows of the stream, as nanoGPT); invalid_utf8 (a file that cannot be read or
    is not UTF-8 text, or a JSONL line that is not JSON or lacks text_field: refuse names it and stops;
    skip leaves it out and counts it); workers (processes tokenising the corpus, 0 = one per CPU);
    shard_dtype (auto: the smallest of uint8, uint16, uint32 that holds the vocabulary); shard_mb (corpus
    megabytes per shard); task (a synthetic task instead of the corpus, picked by `kind`: mqar,
    selective_copying, induction_heads, in_context_recall, noisy_recall, fuzzy_recall, memorization,
    compression (with model.head: pooled_decoder), the retrieval tasks needle, needle_multikey,
    needle_multivalue, needle_multiquery, variable_tracking; zoo/tasks.py; its examples have train.seq_len tokens
    and its held-out accuracy is `val_accuracy` in metrics.jsonl). The corpus is tokenised once by
    `python -m train.prepare` (or the first run) into shards under $ZOO_CACHE (train/prepare.py)."""
    corpus: str = "shakespeare"
    val_docs: tuple[str, ...] = ("hamlet", "tempest", "julius_caesar")
    val_fraction: Annotated[float, Range(0, 1, lo_open=True, hi_open=True)] | None = None
    text_field: str = "text"
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    packing: bool = False
    invalid_utf8: Literal["refuse", "skip"] = "refuse"
    workers: NonNegInt = 0
    shard_dtype: Literal["auto", "uint16", "uint32"] = "auto"
    shard_mb: PosFloat = 64.0
    task: Any = None


@dataclass(frozen=True)
class MeshConfig:
    """train.mesh: devices along each axis of the device mesh; their product must be the device
    count, and one axis may be -1 for the devices the others leave. data: batch rows, each device a
    whole model; fsdp: batch rows, and parameters and optimiser state sharded over the model width
    (ZeRO-3); tensor: heads and FFN width (Megatron); expert: MoE experts (and batch rows outside
    them); context: time, each sequence split into spans of seq_len / context tokens, one a device
    (context parallelism, kernels/context.py; the kinds without a form for it are refused by name).
    The default puts every device on data, so one device needs no setting at all."""
    data: DeviceCount = -1
    fsdp: DeviceCount = 1
    tensor: DeviceCount = 1
    expert: DeviceCount = 1
    context: DeviceCount = 1


@dataclass(frozen=True)
class ConvertConfig:
    """train.distill.convert: the model is the teacher's with the mixers of `layers` (indices, null:
    every layer) replaced by `mixer` (a mixer config with its kind), started from the teacher's weights
    (train/convert.py); the config's model section is then derived from the teacher and must be absent."""
    mixer: Any = None
    layers: tuple[NonNegInt, ...] | None = None


@dataclass(frozen=True)
class DistillConfig:
    """train.distill: train the model on a teacher's next-token distributions (train/distill.py).
    teacher (a run folder of this zoo or a Hugging Face model folder, with the model's vocabulary and
    tokenizer; read once, in evaluation mode, and never trained); temperature (both distributions
    softened by it, the KL scaled by its square, as Hinton et al. 2015); lm_weight (the share of the
    next-token cross-entropy in the loss, the KL's is 1 - lm_weight); convert (the student made from the
    teacher, train.distill.convert below; null: the model section's own model, freshly initialised);
    trainable (all: every parameter; converted: only the converted layers' mixers, everything else
    frozen, bitwise, needs convert); stage (logits: the loss above, end to end; layers: attention
    transfer, each converted mixer trained to give its teacher layer's output from the teacher's own
    residual stream, the mean squared error over the width summed over those layers, needs convert and
    trainable: converted; temperature and lm_weight unused); start_from (a run folder of the same
    model, e.g. a layers stage: the new run starts from its latest weights instead of the teacher's or
    a fresh initialisation). The validation loss stays the model's own cross-entropy."""
    teacher: str | None = None
    temperature: PosFloat = 1.0
    lm_weight: UnitFloat = 0.0
    convert: ConvertConfig | None = None
    trainable: Literal["all", "converted"] = "all"
    stage: Literal["logits", "layers"] = "logits"
    start_from: str | None = None


@dataclass(frozen=True)
class LoraConfig:
    """train.lora: fine-tune low-rank adapters instead of the weights (LoRA, Hu et al. 2022;
    train/lora.py): each projection whose dotted path matches `targets` (a regular expression searched
    in paths such as blocks.0.mixer.wq or blocks.1.ffn.w_up; null: every projection that can carry one)
    is read as W + (alpha / rank) A B with W frozen, A and B trained, B starting at zero; every other
    parameter is frozen. alpha null: rank. Checkpoints keep W, A and B apart (exact resume);
    zoo.checkpoint.load_model folds them into W, so decoding and export see an ordinary model."""
    rank: PosInt = 8
    alpha: PosFloat | None = None
    targets: str | None = None

    @property
    def scale(self) -> float:
        """alpha / rank, the adapters' factor."""
        return (self.rank if self.alpha is None else self.alpha) / self.rank


@dataclass(frozen=True)
class QatConfig:
    """train.qat: quantization-aware training (infer/quantize.fake_quantize): every weight that
    `python -m infer RUN --quantize <bits>` quantizes is read in the forward pass as that rounding
    reads it (int8 per channel, int4 in groups of group_size input rows; with activations int8 each
    projection's input rounded per token, as the W8A8 product does), gradients passing straight
    through to the float weights, which the checkpoints keep. `python -m infer` decodes the run
    quantized this way unless told otherwise."""
    bits: Literal["int8", "int4"] = "int4"
    group_size: PosInt = 32
    activations: Literal["int8", "float"] = "int8"


@dataclass(frozen=True)
class TrainConfig:
    """train: steps; batch_size; seq_len; seed (weights, data order and sampling); lr (peak),
    min_lr_ratio, warmup_steps, schedule (cosine|linear|constant after warmup); weight_decay (not
    on norms, biases, embeddings); b1, b2; grad_clip (global norm, 0 = off); grad_accum
    (micro-batches per step); eval_every, eval_batches; log_every; checkpoint_every,
    keep_checkpoints; sample_tokens (bytes sampled at each evaluation, 0 = none);
    redraw_features_every (Performer: new random features every N steps, 0 = fixed); run_dir (default
    runs/<config stem>); on_nonfinite (stop: end the run naming the step, keeping the last good
    checkpoint; skip: drop the update and count it); stop_at_accuracy (a task run ends after the first
    evaluation whose held-out accuracy reaches it, as Zoology's early_stopping_threshold; null =
    never); mesh (devices per mesh axis, see train.mesh); distill (a teacher to distil, see
    train.distill; null = plain next-token training); lora (train low-rank adapters only, see
    train.lora; null = train the weights); qat (train into a quantized form, see train.qat; null =
    float)."""
    steps: PosInt = 1000
    batch_size: PosInt = 32
    seq_len: PosInt = 128
    seed: NonNegInt = 0
    lr: PosFloat = 3e-3
    min_lr_ratio: UnitFloat = 0.1
    warmup_steps: NonNegInt = 100
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: NonNegFloat = 0.1
    b1: Beta = 0.9
    b2: Beta = 0.99
    grad_clip: NonNegFloat = 1.0
    grad_accum: PosInt = 1
    eval_every: PosInt = 250
    eval_batches: PosInt = 8
    log_every: PosInt = 10
    checkpoint_every: PosInt = 250
    keep_checkpoints: PosInt = 2
    sample_tokens: NonNegInt = 200
    redraw_features_every: NonNegInt = 0
    run_dir: str | None = None
    on_nonfinite: Literal["stop", "skip"] = "stop"
    stop_at_accuracy: UnitFloat | None = None
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distill: DistillConfig | None = None
    lora: LoraConfig | None = None
    qat: QatConfig | None = None


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def build_model(data, path: str) -> ModelConfig:
    """The checked ModelConfig of a `model` section (a dict), with `path` naming it in errors."""
    data = dict(data or {})
    mixer, ffn, exits = data.pop("mixer", None), data.pop("ffn", None), data.pop("exits", None)
    pattern = _pattern(data.pop("layer_pattern", None), mixer, MIXERS, f"{path}.layer_pattern", f"{path}.mixer",
                       "mixer")
    ffn_pattern = _pattern(data.pop("ffn_pattern", None), ffn, FFNS, f"{path}.ffn_pattern", f"{path}.ffn", "FFN")
    cfg = build(ModelConfig, data, path)
    cfg = dataclasses.replace(
        cfg, layer_pattern=pattern, ffn_pattern=ffn_pattern,
        mixer=None if pattern else build_kind(MIXERS, mixer or {"kind": "attention"}, f"{path}.mixer"),
        ffn=None if ffn_pattern else build_kind(FFNS, ffn or {"kind": "mlp"}, f"{path}.ffn"),
        exits=None if exits is None else build(ExitsConfig, exits, f"{path}.exits"))
    check_model(cfg, path)
    return cfg


def _pattern(pattern, single, table, path: str, single_path: str, what: str) -> tuple | None:
    """The built configs of model.layer_pattern or model.ffn_pattern (`path`), None when not given; `single`
    is the one config it replaces (model.mixer or model.ffn, at `single_path`)."""
    if pattern is None:
        return None
    if single is not None:
        raise ValueError(f"{path}: give either {single_path} or {path}, not both")
    if not isinstance(pattern, (list, tuple)) or not pattern:
        raise ValueError(f"{path}: expected a non-empty list of {what} configs")
    return tuple(build_kind(table, c, f"{path}[{i}]") for i, c in enumerate(pattern))


def check_model(cfg: ModelConfig, path: str = "model"):
    where = [f"{path}.layer_pattern[{i}]" for i in range(len(cfg.layer_pattern))] if cfg.layer_pattern \
        else [f"{path}.mixer"]
    for p, m in zip(where, cfg.layer_pattern or (cfg.mixer,)):
        m.check(cfg.d_model, p)
    carries = [getattr(LAYER_OF[type(m)], "carries_v_first", False) for m in cfg.mixers()]
    if any(carries) and not carries[0]:
        raise ValueError(f"{where[0]}: RWKV-7's value residual takes its values from layer 0, so layer 0 "
                         "must be an rwkv7 layer")
    ffn_where = [f"{path}.ffn_pattern[{i}]" for i in range(len(cfg.ffn_pattern))] if cfg.ffn_pattern \
        else [f"{path}.ffn"]
    for p, f in zip(ffn_where, cfg.ffn_pattern or (cfg.ffn,)):
        f.check(cfg.d_model, p)
    if cfg.exits is not None:
        _check_exits(cfg.exits, cfg.num_layers, f"{path}.exits")
        if cfg.head != "lm":
            raise ValueError(f"{path}.exits: early exits need model.head=lm, got {cfg.head!r}")
    _check_residual(cfg, path)


def student_model(teacher: ModelConfig, mixer, layers=None, path: str = "train.distill.convert") -> ModelConfig:
    """The teacher's model config with the mixers of `layers` (indices; None: every layer) replaced by
    `mixer` (a mixer config as in YAML, with its kind); a ValueError naming a bad index or key."""
    n = teacher.num_layers
    chosen = range(n) if layers is None else layers
    bad = [i for i in chosen if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
    if bad or not chosen:
        raise ValueError(f"{path}.layers: {list(chosen)!r}; expected indices of the teacher's layers, 0 to {n - 1}")
    mixers = [to_dict(m) for m in teacher.mixers()]
    for i in chosen:
        mixers[i] = mixer
    return build_model({**to_dict(teacher), "mixer": None, "layer_pattern": mixers, "init_from": None},
                       f"{path}.mixer")


def _check_exits(e: ExitsConfig, num_layers: int, path: str):
    if not e.layers:
        raise ValueError(f"{path}.layers: expected at least one exit layer (1..{num_layers - 1})")
    if list(e.layers) != sorted(set(e.layers)) or not 1 <= e.layers[0] <= e.layers[-1] < num_layers:
        raise ValueError(f"{path}.layers: expected increasing layer counts in 1..{num_layers - 1} "
                         f"(model.num_layers={num_layers}; the last layer is always an exit), got {list(e.layers)}")
    if len(e.weights) != len(e.layers):
        raise ValueError(f"{path}.weights: expected one loss weight per exit layer ({len(e.layers)}), "
                         f"got {list(e.weights)}")


def _check_residual(cfg: ModelConfig, path: str):
    r = cfg.residual
    for key, owner in (("rate", "mhc"), ("iterations", "mhc"), ("block_size", "attnres")):
        if r.kind != owner and getattr(r, key) != getattr(ResidualConfig, key):
            raise ValueError(f"{path}.residual.{key}: an option of model.residual.kind={owner}, given with "
                             f"kind={r.kind!r}; remove it or set model.residual.kind={owner}")
    if r.kind != "standard" and cfg.exits is not None:
        raise ValueError(f"{path}.residual.kind: {r.kind!r} with {path}.exits: early exits and self-speculative "
                         "drafting read the hidden state of one residual stream; use model.residual.kind=standard "
                         "or remove model.exits")


def _check_train(cfg: Config):
    t = cfg.train
    if t.seq_len > cfg.model.max_seq_len:
        raise ValueError(f"train.seq_len: {t.seq_len} is longer than the model allows "
                         f"(model.max_seq_len={cfg.model.max_seq_len})")
    if t.batch_size % t.grad_accum:
        raise ValueError(f"train.grad_accum: {t.grad_accum} does not divide train.batch_size={t.batch_size}")
    sizes = dataclasses.asdict(t.mesh)
    for axis, n in sizes.items():
        if n == 0:
            raise ValueError(f"train.mesh.{axis}: expected a positive number of devices or -1 (the rest), got {n}")
    if list(sizes.values()).count(-1) > 1:
        raise ValueError(f"train.mesh: at most one axis may be -1 (the devices the others leave), got "
                         f"{', '.join(f'{a}={n}' for a, n in sizes.items())}")


def from_dict(data: dict) -> Config:
    if not isinstance(data, dict):
        raise ValueError(f"config: expected a mapping with sections model, data, train; got {data!r}")
    for key, section in data.items():
        if key not in ("model", "data", "train"):
            raise ValueError(f"{key}: unknown section; expected model, data or train")
        if section is not None and not isinstance(section, dict):
            raise ValueError(f"{key}: expected a mapping of {key} keys, got {section!r}")
    train = build(TrainConfig, data.get("train") or {}, "train")
    model = data.get("model") or {}
    if isinstance(model, dict) and model.get("max_seq_len") is None:  # null: the trained length
        model = {**model, "max_seq_len": train.seq_len}
    data_cfg = dict(data.get("data") or {})
    task = data_cfg.pop("task", None)
    data_cfg = build(DataConfig, data_cfg, "data")
    if task is not None:
        task = build_kind(TASKS, task, "data.task")
        task.check(train.seq_len, "data.task")
        data_cfg = dataclasses.replace(data_cfg, task=task)
        if isinstance(model, dict) and model.get("vocab_size") is None:  # unset: the task's vocabulary
            model = {**model, "vocab_size": task.vocab_size}
    if task is None:
        model = _check_vocab(model, data_cfg)
    cfg = Config(model=build_model(model, "model"), data=data_cfg, train=train)
    _check_train(cfg)
    compression = task is not None and task.KIND == "compression"
    if compression != (cfg.model.head == "pooled_decoder"):
        raise ValueError(f"model.head: {cfg.model.head!r} with data.task.kind="
                         f"{task.KIND if task else None!r}; MAD's compression task and model.head=pooled_decoder "
                         "go together (every other source is next-token prediction, for model.head=lm)")
    if train.distill is not None and not train.distill.teacher:
        raise ValueError("train.distill.teacher: expected a run folder or a Hugging Face model folder, got "
                         f"{train.distill.teacher!r}")
    if train.distill is not None and train.distill.trainable == "converted" and train.distill.convert is None:
        raise ValueError("train.distill.trainable: 'converted' trains the layers train.distill.convert replaces; "
                         "there is no convert section")
    if train.distill is not None and train.distill.stage == "layers" and cfg.model.residual.kind != "standard":
        raise ValueError("train.distill.stage: 'layers' matches each converted mixer on the (B, T, D) residual "
                         f"stream; model.residual.kind={cfg.model.residual.kind!r} carries another: use stage 'logits'")
    if train.distill is not None and train.distill.stage == "layers" and train.distill.trainable != "converted":
        raise ValueError("train.distill.stage: 'layers' trains the converted mixers alone; set train.distill.trainable"
                         ": converted (and a convert section)")
    if train.lora is not None and train.distill is not None and train.distill.trainable != "all":
        raise ValueError(f"train.lora: adapters train in place of the weights; train.distill.trainable="
                         f"{train.distill.trainable!r} picks weights to train as well: leave it at 'all'")
    if train.lora is not None and train.lora.targets is not None:
        try:
            re.compile(train.lora.targets)
        except re.error as e:
            raise ValueError(f"train.lora.targets: {train.lora.targets!r} is not a regular expression ({e})") from None
    if train.qat is not None and train.lora is not None:
        raise ValueError("train.qat: with train.lora the adapters train and the weights stay frozen; quantization-"
                         "aware training moves the weights: use one of them")
    if task is None and train.stop_at_accuracy is not None:
        raise ValueError(f"train.stop_at_accuracy: {train.stop_at_accuracy} needs data.task (a text run reports no "
                         "accuracy); remove it or train on a task")
    if task is not None and cfg.model.vocab_size < task.vocab_size:
        raise ValueError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than data.task.vocab_size="
                         f"{task.vocab_size} (the task's token ids)")
    return cfg


def _check_vocab(model: dict, data: DataConfig) -> dict:
    """model with vocab_size set to the tokenizer's where it is null or absent; an explicit one that
    differs is refused (a model from init_from may have more ids than its tokenizer, never fewer)."""
    n = tokenizer.vocab_size_of(data.tokenizer, "data.tokenizer")
    t = data.tokenizer
    where = {"bytes": "data.tokenizer.kind=bytes", "bpe": f"data.tokenizer.vocab_size={t.vocab_size}",
             "file": f"data.tokenizer.path={t.path}"}[t.kind]
    limit = {"uint16": 2 ** 16, "uint32": 2 ** 32}.get(data.shard_dtype)
    if limit is not None and n > limit:
        raise ValueError(f"data.shard_dtype: {data.shard_dtype} holds ids below {limit} but the tokenizer has {n} "
                         f"({where}); use uint32 or auto")
    if isinstance(model, dict) and model.get("vocab_size") is None:
        return {**model, "vocab_size": n}
    given = model.get("vocab_size") if isinstance(model, dict) else None
    if isinstance(given, int) and given < n:
        raise ValueError(f"model.vocab_size: {given} is smaller than the tokenizer's {n} ids ({where}); pass "
                         f"model.vocab_size=null to follow the tokenizer, or at least {n}")
    if isinstance(given, int) and given != n and model.get("init_from") is None:
        raise ValueError(f"model.vocab_size: {given} does not match the tokenizer's {n} ids ({where}); remove "
                         f"model.vocab_size (it then follows the tokenizer) or set it to {n}")
    return model


def apply_overrides(data: dict, overrides) -> dict:
    """Set each `dotted.path=value` (value parsed as YAML) in a nested dict; list items by index."""
    for item in overrides or ():
        key, eq, raw = item.partition("=")
        parts = key.strip().split(".")
        if not eq or not all(parts):
            raise ValueError(f"override {item!r}: expected dotted.path=value, e.g. model.d_model=256")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise ValueError(f"override {item!r}: the value {raw!r} is not valid YAML "
                             f"({str(e).splitlines()[0]})") from None
        node = data
        for i, part in enumerate(parts):
            here, last = ".".join(parts[:i + 1]), i == len(parts) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ValueError(f"override {key}: {here}: expected an index 0..{len(node) - 1} of "
                                     f"{'.'.join(parts[:i])} (a list of {len(node)}), got {part!r}")
                part = int(part)
            elif not isinstance(node, dict):
                raise ValueError(f"override {key}: {'.'.join(parts[:i])} is a value, not a section")
            if last:
                node[part] = value
            elif isinstance(node, dict) and node.get(part) is None:
                node[part] = {}
            node = node[part]
    return data
