"""Byte-level tokenizer: vocabulary 256, one token per UTF-8 byte, byte 0 ends a document."""

END_OF_DOCUMENT = 0
VOCAB_SIZE = 256


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
