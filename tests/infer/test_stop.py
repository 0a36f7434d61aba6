"""Stop strings (infer/stops.py): of any length, matched on the generated text, per row, inside the
decode loop and the speculative loop alike. The models here are scripted: the greedy next token is a
fixed function of the current token, so a test writes the text a model generates."""

import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import infer
from infer import Speculation, stops
from infer.generate import TRACES
from tests.util import tiny_config, unchecked
from zoo import LanguageModel
from zoo.tokenizer import Bytes, HFTokenizer

FIXTURES = "tests/fixtures/hf"
# Rows of one batch: the bytes model continues each along "abé:Qu" then "\n" forever, and "x" forever.
PROMPTS = ["a", "é", "Q", "x", "u\n"]


def scripted(successor: dict[int, int], vocab_size: int = 256) -> LanguageModel:
    """A 1-layer model whose greedy next token after t is successor.get(t, t): a one-hot embedding
    (d_model = vocab), blocks that add 0, and a head that maps each token to its successor."""
    cfg = tiny_config({"kind": "attention", "num_heads": 4}, num_layers=1, d_model=vocab_size, tie_embeddings=False)
    model = LanguageModel(dataclasses.replace(cfg, vocab_size=vocab_size), rngs=nnx.Rngs(0))
    nnx.update(model.blocks, jax.tree.map(jnp.zeros_like, nnx.state(model.blocks, nnx.Param)))
    model.embed.embedding[...] = jnp.eye(vocab_size)
    nxt = np.arange(vocab_size)
    nxt[list(successor)] = list(successor.values())
    model.head[...] = jax.nn.one_hot(nxt, vocab_size)
    return model


def chain(ids) -> dict[int, int]:
    return dict(zip(ids, ids[1:]))


@pytest.fixture(scope="module")
def model():
    return scripted(chain(list("abé:Qu\n".encode())))


def test_the_table_finds_the_first_match_a_search_of_the_bytes_finds():
    """Overlapping strings (failure links), a match inside one token, across three, and at a token's end."""
    rng = random.Random(0)
    vocab = [bytes([i]) for i in range(256)] + [bytes(rng.choices(b"ab\n", k=rng.randint(0, 4))) for _ in range(60)]
    for _ in range(300):
        strings = [bytes(rng.choices(b"ab\n", k=rng.randint(1, 4))).decode() for _ in range(rng.randint(1, 3))]
        table = stops.build(strings, vocab)
        ids = rng.choices([97, 98, 10, *range(256, 316)], k=20)
        text = b""
        want = len(ids)
        for n, t in enumerate(ids):
            text += vocab[t]
            if any(s.encode() in text for s in strings):
                want = n + 1
                break
        assert table.end(ids) == want, (strings, ids)
    assert stops.build(["ab", "b\n"], vocab).table.shape == (8, 316)  # 5 states padded to a power of two
    assert stops.build(["ab", "b\n"], vocab).table.dtype == np.int16


def test_strings_of_several_bytes_and_several_strings_on_bytes(model):
    """Rows stop at different steps, each at its own match; the prompt is not matched ("u\\n" then "\\n"
    would stop at the first new token); "x" never matches and runs to max_new_tokens."""
    texts = lambda stop: infer.generate_text(model, PROMPTS, max_new_tokens=10, stop=stop)
    assert texts("é") == ["b", ":Qu" + "\n" * 7, "u" + "\n" * 9, "x" * 10, "\n" * 10]
    assert texts("\n\n") == ["bé:Qu", ":Qu", "u", "x" * 10, ""]
    assert texts(["Qu", "é:"]) == ["b", ":", "u" + "\n" * 9, "x" * 10, "\n" * 10]
    assert texts([":Q", "u\n"]) == ["bé", "", "", "x" * 10, "\n" * 10]
    ids = infer.generate(model, [list(p.encode()) for p in PROMPTS], max_new_tokens=10,
                         stop_strings=stops.build("\n\n", Bytes.token_bytes()))
    assert ids == [list("bé:Qu\n\n".encode()), list(":Qu\n\n".encode()), list(b"u\n\n"), list(b"x" * 10), [10, 10]]


def test_one_compile_serves_every_stop_set_of_a_table_shape(model):
    prompts = [list(p.encode()) for p in PROMPTS]
    infer.generate(model, prompts, max_new_tokens=10, stop_strings=stops.build("\n\n", Bytes.token_bytes()))
    before = TRACES["generate"]
    out = infer.generate(model, prompts, max_new_tokens=10, stop_strings=stops.build(["é"], Bytes.token_bytes()))
    assert TRACES["generate"] == before and out[0] == list("bé".encode())


def test_speculation_stops_as_greedy_decoding(model):
    """A draft that is sometimes wrong (both the accept and the reject path), and one always right: a round
    then keeps k + 1 = 5 tokens, and the match ends inside the round."""
    prompts = [list(p.encode()) for p in PROMPTS]
    wrong = scripted({**chain(list("abé:Qu\n".encode())), ord("b"): ord("z"), ord(":"): ord("x")})
    for stop in (["\n\n"], ["é", "Q"]):  # tables of one shape: one program per draft length
        stop_strings = stops.build(stop, Bytes.token_bytes())
        greedy = infer.generate(model, prompts, max_new_tokens=10, stop_strings=stop_strings)
        for draft, k in ((wrong, 2), (model, 4)):
            out, info = infer.generate(model, prompts, max_new_tokens=10, stop_strings=stop_strings,
                                       speculation=Speculation(k, draft_model=draft), return_info=True)
            assert out == greedy, (stop, k)
            assert (0 < info["acceptance"] < 1) == (draft is wrong), info


@pytest.fixture(scope="module")
def bpe():
    """The Hugging Face fixtures' byte-level BPE (320 ids, </s> ends a text) and a model that writes
    "Question: the world" after "Q" in its tokens (… "es" "t" "i" "on" ":" " the" " world"), then </s>."""
    tok = HFTokenizer(f"{FIXTURES}/qwen2/tokenizer.json")
    ids = tok.encode("Question: the world", special=False)
    return tok, scripted(chain(ids + [tok.eos_id]), tok.vocab_size)


def test_bpe_words_and_strings_that_straddle_tokens(bpe):
    tok, model = bpe
    run = lambda stop: infer.generate_text(model, ["Q"], max_new_tokens=12, stop=stop, tokenizer=tok,
                                           return_info=True)
    for stop, text, kept in (("tion", "ues", 5),  # "t" "i" "on": three tokens
                             ("e wor", "uestion: th", 8),  # ends inside " world", starts inside " the"
                             (["world", "n:"], "uestio", 6),  # the earliest of two, across "on" ":"
                             ("zzzz", "uestion: the world", 8)):  # no match: </s> still ends the row, dropped
        texts, info = run(stop)
        assert texts == [text] and len(info["exit_layers"][0]) == kept, (stop, texts, info)


def test_sentencepiece_token_bytes_are_its_decoded_text(tmp_path):
    """A Llama-2-style tokenizer (no byte-level decoder: "▁" for a space, byte-fallback tokens, the first
    space stripped): each token's bytes joined are the decoded text, a match ends at the right token."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "a", "b", "Q", "u", ":", "▁a",
              "▁b", "ab", "▁ab", "Qu", "▁Qu"]
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b"), ("Q", "u"), ("▁", "Qu")]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path / "tokenizer.json")
    token_bytes = tok.token_bytes()
    assert token_bytes[:3] == [b""] * 3 and token_bytes[pieces.index("▁ab")] == b" ab"
    for text in ("ab a b", "Qué: ab", "é", "b aé"):
        ids = tok.encode(text, special=False)
        assert tok.decode(ids) == text and b"".join(token_bytes[i] for i in ids) == b" " + text.encode(), ids
    ids = tok.encode("ab Qué: b", special=False)  # "▁ab" "▁Qu" <0xC3> <0xA9> ":" "▁b"
    assert stops.build("é", token_bytes).end(ids) == 4 and stops.build(": b", token_bytes).end(ids) == 6
    assert stops.build(["b Q", "a"], token_bytes).end(ids) == 1


def test_bad_stop_strings_are_refused(model):
    for stop in ("", [""], [], ["a", 3], b"\n"):  # the last three as users run, unchecked by the annotations
        with unchecked(), pytest.raises(ValueError, match="expected a non-empty string or a list of them"):
            infer.generate_text(model, ["a"], max_new_tokens=2, stop=stop)
    with pytest.raises(ValueError, match="built for 320 token ids, the model has 256"):
        infer.generate(model, [[1]], max_new_tokens=2, stop_strings=stops.build("a", [b"a"] * 320))

