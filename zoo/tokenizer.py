"""Tokenizers: bytes (the default: vocabulary 256, one token per UTF-8 byte, byte 0 ends a document)
and a Hugging Face `tokenizer.json` (BPE, unigram or WordPiece, through the `tokenizers` library),
either an existing file or a byte-level BPE vocabulary trained on a corpus' training split
(`train_bpe`, as GPT-2's: bytes mapped to printable characters, the GPT-2 pre-tokenising regex, no
normaliser, so decoding gives back every text exactly). A run config picks one in `data.tokenizer`.

Both have `encode(text, special=True) -> ids`, `decode(ids) -> text`, `vocab_size`, `eos_id` (the token that ends
a text, the stop token of generation; None when the vocabulary has none) and `token_bytes()` (each id's bytes in
decoded text, on which generation matches stop strings: infer/stops.py).
"""

import json
import re
from collections.abc import Iterable
from pathlib import Path

END_OF_DOCUMENT = 0
VOCAB_SIZE = 256


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class Bytes:
    """The byte tokenizer as an object. Its eos_id is None: byte-level runs generate to their length."""
    vocab_size, eos_id = VOCAB_SIZE, None
    decode = staticmethod(decode)

    @staticmethod
    def encode(text: str, special: bool = True) -> list[int]:
        return encode(text)

    @staticmethod
    def token_bytes() -> list[bytes]:
        return [bytes([i]) for i in range(VOCAB_SIZE)]


class HFTokenizer:
    """A tokenizer.json. encode adds the special tokens its post-processor adds (a Llama BOS), as
    transformers' tokenizers do by default; decode drops special tokens. The end-of-text token is
    eos_token_id from the folder's generation_config.json or config.json (or its text_config: a multimodal
    model's), else tokenizer_config.json's eos_token."""

    def __init__(self, path, eos_id: int | None = None):
        from tokenizers import Tokenizer

        path = Path(path)
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own Exception type
            raise ValueError(f"{path}: not a readable tokenizer.json ({e})") from None
        self.path, self.vocab_size = path, self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = eos_id if eos_id is not None else _eos_from_files(path.parent, self.tokenizer)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """special=False: the text's own tokens, without the special tokens the post-processor adds."""
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes in decoded text: b"" for a special token (decode drops it) or an unused id; an added
        token's content; a byte-level BPE's token (GPT-2, Llama 3, Qwen) through GPT-2's byte-to-character
        table; else a byte-fallback token <0xNN> its byte and any other token its text after a plain token
        (decode([a, t]) minus decode([a]): SentencePiece's leading "▁" stays a space)."""
        from tokenizers import decoders

        tok, out = self.tokenizer, [b""] * self.vocab_size
        added = tok.get_added_tokens_decoder()
        for i, t in added.items():
            out[i] = b"" if t.special else t.content.encode("utf-8")
        pieces = {i: p for i in range(self.vocab_size) if i not in added and (p := tok.id_to_token(i)) is not None}
        if isinstance(tok.decoder, decoders.ByteLevel):
            byte_of = {c: b for b, c in enumerate(_gpt2_byte_chars())}
            for i, p in pieces.items():
                out[i] = bytes(byte_of[c] for c in p)
            return out
        anchor = self.encode("a", special=False)[-1]
        skip = len(self.decode([anchor]))
        texts = tok.decode_batch([[anchor, i] for i in pieces], skip_special_tokens=True)
        for (i, p), text in zip(pieces.items(), texts):
            byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", p)
            out[i] = bytes([int(byte[1], 16)]) if byte else text[skip:].encode("utf-8")
        return out


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet, the character byte b stands for at index b (its `bytes_to_unicode`): the
    printable bytes are themselves, the others the characters from 256 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _eos_from_files(folder: Path, tok) -> int | None:
    for name in ("generation_config.json", "config.json"):
        f = folder / name
        config = json.loads(f.read_text()) if f.is_file() else {}
        eos = config.get("eos_token_id")
        eos = (config.get("text_config") or {}).get("eos_token_id") if eos is None else eos
        if eos is not None:
            return eos[0] if isinstance(eos, list) else int(eos)
    f = folder / "tokenizer_config.json"
    token = json.loads(f.read_text()).get("eos_token") if f.is_file() else None
    token = token.get("content") if isinstance(token, dict) else token
    return None if token is None else tok.token_to_id(token)


def special_tokens(cfg) -> list[str]:
    """data.tokenizer's special tokens of a trained BPE, the end-of-document token first (id 0)."""
    return [cfg.end_of_document] + [t for t in cfg.special_tokens if t != cfg.end_of_document]


def vocab_size_of(cfg, path: str = "data.tokenizer") -> int:
    """The vocabulary of data.tokenizer `cfg`, known before the corpus is read: 256 for bytes, vocab_size
    for bpe (a corpus too small for that many merges trains fewer, all below it), the file's for file."""
    if cfg.kind != "file" and cfg.path is not None:
        raise ValueError(f"{path}.path: {cfg.path!r} is read only with {path}.kind=file, not {cfg.kind}")
    if cfg.kind == "bytes":
        return VOCAB_SIZE
    if cfg.kind == "bpe":
        need = VOCAB_SIZE + len(special_tokens(cfg))
        if cfg.vocab_size < need:
            raise ValueError(f"{path}.vocab_size: {cfg.vocab_size} is below the {VOCAB_SIZE} bytes and "
                             f"{need - VOCAB_SIZE} special tokens a byte-level BPE starts from ({need})")
        return cfg.vocab_size
    if cfg.path is None:
        raise ValueError(f"{path}.path: kind file needs the path of a tokenizer.json")
    try:
        tok = HFTokenizer(cfg.path)
    except ValueError as e:
        raise ValueError(f"{path}.path: {e}") from None
    if tok.tokenizer.token_to_id(cfg.end_of_document) is None:
        raise ValueError(f"{path}.end_of_document: {cfg.end_of_document!r} is not a token of {cfg.path}; name the "
                         "token that ends a document in that vocabulary (e.g. '</s>')")
    return tok.vocab_size


def train_bpe(texts: Iterable[str], cfg):
    """A byte-level BPE `tokenizers.Tokenizer` of cfg.vocab_size ids trained on `texts`: the 256 bytes,
    then the special tokens (the end-of-document token first, id 0), then merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=special_tokens(cfg), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def document_encoder(path):
    """The tokenizer.json at `path` without its added (special) tokens: a document is encoded as text,
    so a literal '<|endoftext|>' inside it stays text and never becomes a control token."""
    from tokenizers import Tokenizer

    data = json.loads(Path(path).read_text())
    data["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(data))


def for_run(folder, cfg) -> "type[Bytes] | HFTokenizer":
    """The tokenizer of a run (data.tokenizer `cfg`): bytes, or the folder's tokenizer.json, whose
    end-of-document token ends generation."""
    if cfg.kind == "bytes":
        return Bytes
    f = Path(folder) / "tokenizer.json"
    if not f.is_file():
        raise ValueError(f"{folder}: data.tokenizer.kind={cfg.kind} but the folder has no tokenizer.json; copy the "
                         "one the run was prepared with (train/prepare.py's cache folder) there")
    tok = HFTokenizer(f)
    tok.eos_id = tok.tokenizer.token_to_id(cfg.end_of_document)
    return tok
