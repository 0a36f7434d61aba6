import numpy as np
import pytest

import infer
from infer import Sampling
from infer.generate import TRACES
from tests.util import forward, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model({"kind": "attention", "num_heads": 4, "num_kv_heads": 2})


def test_batched_greedy_equals_each_prompt_alone(model):
    prompts = [[5, 6, 7, 8, 9, 10], [42], [100, 101, 102]]
    batched = infer.generate(model, prompts, max_new_tokens=8)
    assert batched == [infer.generate(model, [p], max_new_tokens=8)[0] for p in prompts]
    assert all(len(r) == 8 for r in batched)


def test_left_padding_stays_out_of_a_recurrent_state():
    """The 2-token prompt is shorter than the short convolutions' window: decoding starts with its
    padding (segment 0) in the window, where it must count as zeros (every shipped config decodes in
    this layout in tests/zoo/test_kinds.py)."""
    recurrent = tiny_model({"kind": "gated_deltanet", "num_heads": 2, "conv_size": 4}, num_layers=1)
    prompts = [[5, 6, 7, 8, 9, 10], [42, 43]]
    batched = infer.generate(recurrent, prompts, max_new_tokens=6)
    assert batched == [infer.generate(recurrent, [p], max_new_tokens=6)[0] for p in prompts]


def test_greedy_is_the_argmax_of_the_full_pass(model):
    prompt = [3, 1, 4, 1, 5]
    new = infer.generate(model, [prompt], max_new_tokens=5)[0]
    seq = list(prompt)
    for _ in range(5):  # right-padded to one length: one compile; causality ignores the padding
        logits = forward(model, np.asarray([seq + [0] * (10 - len(seq))]))
        seq.append(int(np.argmax(logits[0, len(seq) - 1])))
    assert new == seq[len(prompt):]


def test_decode_loop_compiles_once_per_shape(model):
    infer.generate(model, [[1, 2, 3]], max_new_tokens=6)
    before = TRACES["generate"]
    for seed in range(3):  # new seeds, temperatures and prompts of the same shape: no new trace
        infer.generate(model, [[seed, 2, 3]], max_new_tokens=6, sampling=Sampling(0.5 + seed), seed=seed)
    infer.generate(model, [[4, 5, 6]], max_new_tokens=6, sampling=Sampling(0.7))
    assert TRACES["generate"] - before == 1  # greedy and sampling are two programs, each traced once


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    a = infer.generate(model, [[1, 2]], max_new_tokens=10, sampling=Sampling(1.0, top_k=50, top_p=0.9), seed=3)
    assert a == infer.generate(model, [[1, 2]], max_new_tokens=10, sampling=Sampling(1.0, top_k=50, top_p=0.9), seed=3)
    assert a != infer.generate(model, [[1, 2]], max_new_tokens=10, sampling=Sampling(1.0, top_k=50, top_p=0.9), seed=4)
    greedy = infer.generate(model, [[1, 2]], max_new_tokens=10)
    assert infer.generate(model, [[1, 2]], max_new_tokens=10, sampling=Sampling(2.0, top_k=1), seed=9) == greedy


def test_stop_token_ends_a_row(model):
    greedy = infer.generate(model, [[7, 7, 7]], max_new_tokens=10)[0]
    stop = greedy[3]
    out = infer.generate(model, [[7, 7, 7]], max_new_tokens=10, stop_token=stop)[0]
    assert out == greedy[:greedy.index(stop)]


def test_text_helper_and_errors(model):
    (text,) = infer.generate_text(model, ["ROMEO:"], max_new_tokens=4)
    assert isinstance(text, str)
    with pytest.raises(ValueError, match="at least one token"):
        infer.generate(model, [[1], []], max_new_tokens=3)
    with pytest.raises(ValueError, match="top_p"):
        infer.generate(model, [[1]], max_new_tokens=3, sampling=Sampling(1.0, top_p=1.5))
