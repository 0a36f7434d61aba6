"""Students made from a teacher (train/convert.py): restoring the converted layers to the teacher's
attention gives the teacher exactly; every shared tensor is copied and attention's projections land
in the new mixer where the docs say; a converted hybrid decodes like its full pass; bad input is
refused naming it."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.util import assert_close, decode_in_pieces, forward, tiny_model
from train.convert import convert
from zoo.config import to_dict

GQA = {"kind": "attention", "num_heads": 4, "num_kv_heads": 2}


def _tokens():
    return jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 11)), jnp.int32)


def test_converting_back_to_the_teachers_attention_is_the_teacher():
    teacher = tiny_model(GQA, num_layers=2)
    student, mapped = convert(teacher, to_dict(teacher.cfg.mixer), layers=[1])
    every = {".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(teacher, nnx.Param))}
    assert mapped == {name: name for name in every}
    np.testing.assert_array_equal(forward(student, _tokens()), forward(teacher, _tokens()))


def test_shared_tensors_are_copied_and_projections_mapped():
    teacher = tiny_model(GQA, num_layers=2)
    student, mapped = convert(teacher, {"kind": "deltanet", "num_heads": 4}, layers=[0])
    t, s = teacher.blocks[0].mixer, student.blocks[0].mixer
    D = teacher.cfg.d_model
    np.testing.assert_array_equal(s.q_proj.kernel.get_value(), t.wq.get_value().reshape(D, -1))
    k = np.asarray(t.wk.get_value())  # (D, 2 groups, K): each group's head serves 2 query heads
    np.testing.assert_array_equal(s.k_proj.kernel.get_value(), np.repeat(k, 2, axis=1).reshape(D, -1))
    np.testing.assert_array_equal(s.o_proj.kernel.get_value(), t.wo.get_value().reshape(-1, D))
    assert mapped["blocks.0.mixer.v_proj.kernel"] == "blocks.0.mixer.wv"
    assert "blocks.0.mixer.b_proj.kernel" not in mapped  # the delta rule's beta: fresh
    for name in ("embed.embedding", "blocks.0.ffn.w_up", "blocks.0.mixer_norm.weight", "blocks.1.mixer.wq"):
        assert mapped[name] == name
    np.testing.assert_array_equal(student.blocks[1].mixer.wq.get_value(), teacher.blocks[1].mixer.wq.get_value())
    np.testing.assert_array_equal(student.embed.embedding.get_value(), teacher.embed.embedding.get_value())

    logits = forward(student, _tokens())  # a hybrid: DeltaNet, then the teacher's attention
    pieces, _ = decode_in_pieces(student, _tokens(), cuts=[6, 9, 10])
    assert_close(pieces, logits, 1e-4, "converted hybrid: prefill + decode vs full pass")


def test_mamba2_takes_x_b_c_from_v_k_q_as_mamba_in_the_llama():
    """An MHA teacher (4 heads of 8) into a Mamba-2 of expand 1, heads of 8, 4 groups of state 8: in_proj's
    x, B and C columns are wv, wk and wq, z and dt stay fresh, out_proj is wo."""
    teacher = tiny_model({"kind": "attention", "num_heads": 4}, num_layers=1)
    mixer = {"kind": "mamba2", "expand": 1, "head_dim": 8, "num_groups": 4, "state_size": 8}
    fresh = tiny_model(mixer, num_layers=1).blocks[0].mixer.in_proj.kernel.get_value()
    student, mapped = convert(teacher, mixer)
    t, m = teacher.blocks[0].mixer, student.blocks[0].mixer
    w = np.asarray(m.in_proj.kernel.get_value())  # (32, [z 32, x 32, B 32, C 32, dt 4])
    as2d = lambda p: np.asarray(p.get_value()).reshape(32, -1)
    np.testing.assert_array_equal(w[:, 32:64], as2d(t.wv))
    np.testing.assert_array_equal(w[:, 64:96], as2d(t.wk))
    np.testing.assert_array_equal(w[:, 96:128], as2d(t.wq))
    np.testing.assert_array_equal(w[:, :32], np.asarray(fresh)[:, :32])  # z: the student's own init
    np.testing.assert_array_equal(m.out_proj.kernel.get_value(), t.wo.get_value().reshape(-1, 32))
    assert mapped["blocks.0.mixer.in_proj.kernel"] == "blocks.0.mixer.wv+wk+wq"
    assert mapped["blocks.0.mixer.out_proj.kernel"] == "blocks.0.mixer.wo"


def test_bad_input_names_it():
    teacher = tiny_model(GQA, num_layers=2)
    for layers in ([2], [-1], []):
        with pytest.raises(ValueError, match=r"convert\.layers: .*expected indices of the teacher.s layers, 0 to 1"):
            convert(teacher, {"kind": "gla"}, layers=layers)
    with pytest.raises(ValueError, match=r"convert\.mixer\.layer_pattern\[0\]\.kind: unknown kind .linear."):
        convert(teacher, {"kind": "linear"}, layers=[0])
