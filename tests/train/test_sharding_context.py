"""Context parallelism in a whole model: a layer of every kind with a context-parallel form on 8 simulated CPU
devices (data=2 context=4) gives one device's logits, loss and gradients; a run on the context axis trains like
one device and resumes bitwise; the context axis refuses a kind without a form and a length it does not split.

Part c of tests/train/sharding_check.py, in a subprocess (this process keeps one device). Apart from
tests/train/test_sharding.py (parts a and b) so that the two xdist workers of `make test` run them side by side:
part c took 95 CPU-s, parts a and b with the two-process run 59 (2026-12-07), and in one file the
worker held them all.
"""

import pytest

from tests.train.test_sharding import TOL, collect, start
from tests.util import rel_err


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    collect(out, "c", start("c", tmp_path_factory.mktemp("part_c")))
    return out


def test_every_kind_with_a_context_parallel_form_gives_one_devices_logits_loss_and_gradients(results):
    context = results["context"]
    assert {"attention", "mla", "gla", "mamba", "mamba2", "mamba3", "rwkv7", "gated_deltanet"} <= set(context["kinds"])
    got = context["data=2 context=4"]
    with_form = set(context["kinds"]) - {"base_conv", "gated_conv"}  # only short convolutions: XLA's halo exchange
    assert got["forms"] >= len(with_form), got  # every other layer ran its context-parallel form
    # float32 rounding through 20 layers: two exact single-device forms of this model (chunks of 4 and of 8) differ
    # by 2e-5 in the gradients and 1e-6 in the logits
    assert got["loss"] < 1e-6 and got["logits"] < 1e-5 and got["grads"] < 1e-4, got


def test_a_run_on_the_context_axis_trains_like_one_device_and_resumes_bitwise(results):
    losses = results["losses"]["context"]
    assert rel_err(losses["data=2 context=4"], losses["one"]) < TOL and losses["one"][-1] < losses["one"][0] - 0.1
    assert results["resume"]["context"]["resumed"]
    assert results["resume"]["context"]["losses"] == losses["data=2 context=4"][5:]  # bitwise


def test_the_context_axis_refuses_a_kind_without_a_form_and_a_length_it_does_not_split(results):
    assert "mixer kind hyena has no context-parallel form" in results["errors"]["kind"]
    assert "train.seq_len: 20 tokens do not split over train.mesh.context=8" in results["errors"]["length"]
