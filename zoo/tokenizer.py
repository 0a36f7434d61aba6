"""Tokenizers: bytes (the default: vocabulary 256, one token per UTF-8 byte, byte 0 ends a document)
and a Hugging Face `tokenizer.json` (BPE, unigram or WordPiece, through the `tokenizers` library).

Both have `encode(text, special=True) -> ids`, `decode(ids) -> text`, `vocab_size` and `eos_id` (the token that ends
a text, the stop token of generation; None when the vocabulary has none).
"""

import json
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


class HFTokenizer:
    """A tokenizer.json. encode adds the special tokens its post-processor adds (a Llama BOS), as
    transformers' tokenizers do by default; decode drops special tokens. The end-of-text token is
    eos_token_id from the folder's generation_config.json or config.json, else tokenizer_config.json's
    eos_token."""

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


def _eos_from_files(folder: Path, tok) -> int | None:
    for name in ("generation_config.json", "config.json"):
        f = folder / name
        eos = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
        if eos is not None:
            return eos[0] if isinstance(eos, list) else int(eos)
    f = folder / "tokenizer_config.json"
    token = json.loads(f.read_text()).get("eos_token") if f.is_file() else None
    token = token.get("content") if isinstance(token, dict) else token
    return None if token is None else tok.token_to_id(token)
