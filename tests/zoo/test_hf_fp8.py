"""zoo.hf.load on FP8 folders (config.json's quantization_config of quant_method fp8, as DeepSeek-V3's releases):
FP8 copies of the deepseek_v3 fixture, each linear weight quantized here per block with numpy, load as the float
folder of exactly the dequantized weights, bit for bit, and close to the fixture's logits; what they get wrong is
refused naming the field, or the file and the tensor."""

import json
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import zoo.hf
from tests.util import HF_FIXTURES, forward, hf_fixture
from zoo import safetensors

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"  # (16, 32): two 16 x 16 blocks


def quantize(w: np.ndarray, blocks, dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(float8 values, float32 scale_inv per block of `blocks` (the last ones ragged), the values dequantized) of
    a torch Linear weight (out, in), each block's max |w| at the float8 type's largest value: transformers'
    FP8Linear layout, a (ceil(out / r), ceil(in / c)) grid of scales."""
    (R, C), (r, c) = w.shape, blocks
    padded = np.zeros((-(-R // r) * r, -(-C // c) * c), np.float32)
    padded[:R, :C] = w
    amax = np.abs(padded.reshape(padded.shape[0] // r, r, padded.shape[1] // c, c)).max((1, 3))
    scale_inv = (np.maximum(amax, 1e-12) / float(ml_dtypes.finfo(dtype).max)).astype(np.float32)
    s = np.repeat(np.repeat(scale_inv, r, 0), c, 1)[:R, :C]
    q = (w / s).astype(dtype)
    return q, scale_inv, q.astype(np.float32) * s


def fp8_folders(tmp_path, blocks, dtype=ml_dtypes.float8_e4m3fn):
    """(an FP8 copy of the deepseek_v3 fixture whose linear weights are float8 in `blocks`, the float copy holding
    exactly their dequantized values), in tmp_path; the head, embeddings, norms and routers stay float32, as
    transformers leaves them. The FP8 copy also holds tensors of the multi-token-prediction layer config.json's
    num_nextn_predict_layers 1 announces (model.layers.3.*), as the released folders do."""
    fp8 = hf_fixture(tmp_path / "fp8", "deepseek_v3", quantization_config={**FP8, "weight_block_size": list(blocks)})
    dequantized = hf_fixture(tmp_path / "float", "deepseek_v3")
    source = safetensors.SafetensorsFile(HF_FIXTURES / "deepseek_v3" / "model.safetensors")
    quantized, floats = {}, {}
    for name in source.keys():
        w = np.array(source.get(name))
        if "_proj" in name:  # q_a_proj, kv_a_proj_with_mqa, ..., o_proj; the MLPs' and experts' gate, up, down
            q, scale_inv, w = quantize(w, blocks, dtype)
            quantized.update({name: q, name + "_scale_inv": scale_inv})
        else:
            quantized[name] = w
        floats[name] = w
    q, scale_inv, _ = quantize(np.ones((32, 64), np.float32), blocks, dtype)  # a multi-token-prediction layer's,
    quantized.update({"model.layers.3.eh_proj.weight": q, "model.layers.3.eh_proj.weight_scale_inv": scale_inv,
                      "model.layers.3.enorm.weight": np.ones(32, np.float32)})  # as the releases hold: not read
    safetensors.write(fp8 / "model.safetensors", quantized, {"format": "pt"})
    safetensors.write(dequantized / "model.safetensors", floats, {"format": "pt"})
    return fp8, dequantized


@pytest.mark.parametrize("blocks, dtype, load_as", [
    ((128, 128), ml_dtypes.float8_e4m3fn, "float32"), ((16, 16), ml_dtypes.float8_e4m3fn, "float32"),
    ((16, 8), ml_dtypes.float8_e5m2, "bfloat16")], ids=["128", "16 ragged", "e5m2 as bfloat16"])
def test_an_fp8_folder_loads_as_its_dequantized_weights(tmp_path, blocks, dtype, load_as):
    fp8, dequantized = fp8_folders(tmp_path, blocks, dtype)
    model, _ = zoo.hf.load(fp8, dtype=load_as)
    want = dict(nnx.to_flat_state(nnx.state(zoo.hf.load(dequantized, dtype=load_as)[0])))
    for path, v in nnx.to_flat_state(nnx.state(model)):
        np.testing.assert_array_equal(v[...], want[path][...], err_msg=str(path))
    if blocks == (16, 16):  # float8's rounding of every linear weight, against the float32 fixture's logits
        expected = np.load(HF_FIXTURES / "deepseek_v3" / "expected.npz")
        logits = np.asarray(forward(model, jnp.asarray(expected["ids"], jnp.int32)))
        worst = np.abs(logits - expected["logits"]).max(-1)  # per position: 0.1 to 0.4, and 1.3 where the
        assert np.median(worst) < 0.5 and np.mean(worst > 0.5) < 0.1  # rounding flips an expert choice


@pytest.fixture(scope="module")
def ragged(tmp_path_factory):
    return fp8_folders(tmp_path_factory.mktemp("ragged"), (16, 16))[0]


def _edit(folder, tensors):
    """Rewrite folder's model.safetensors with `tensors(dict of its arrays)` applied."""
    f = folder / "model.safetensors"
    stored = safetensors.SafetensorsFile(f)
    arrays = {n: np.array(stored.get(n)) for n in stored.keys()}
    tensors(arrays)
    safetensors.write(f, arrays)


@pytest.mark.parametrize("config, tensors, message", [
    ({"quant_method": "gptq"}, None, "quantization_config: quant_method='gptq' is not supported"),
    ({"weight_block_size": [128]}, None, r"quantization_config: weight_block_size=\[128\] is not supported"),
    ({"weight_block_size": None}, None, "quantization_config: weight_block_size=None is not supported"),
    ({"activation_scheme": "static"}, None, "quantization_config: activation_scheme='static' is not supported"),
    (None, None, "model.safetensors: tensor model.layers.0.self_attn.kv_a_proj_with_mqa.weight is F8_E4M3, but "
     "config.json has no quantization_config"),
    ({}, lambda t: t.pop(EXPERT + "_scale_inv"),
     f"model.safetensors: tensor {EXPERT} is F8_E4M3, but the checkpoint has no {EXPERT}_scale_inv"),
    ({}, lambda t: t.update({EXPERT + "_scale_inv": t[EXPERT + "_scale_inv"][:, :1]}),
     rf"model.safetensors: tensor {EXPERT}_scale_inv is F32 \[1, 1\], but {EXPERT}'s \[16, 32\] in blocks of "
     r"\[16, 16\] needs float scales of shape \[1, 2\]"),
    ({}, lambda t: t.update({EXPERT + "_scale_inv": t[EXPERT + "_scale_inv"].view(np.uint8)[:, ::4]}),
     rf"tensor {EXPERT}_scale_inv is U8 \[1, 2\]"),
    ({}, lambda t: t.update({"lm_head.weight_scale_inv": np.ones((1, 1), np.float32)}),
     "holds tensors .* has no place for: lm_head.weight_scale_inv"),
], ids=["quant_method", "block pair", "per-tensor", "static", "no config", "no scale", "scale shape", "scale dtype",
        "stray scale"])
def test_what_an_fp8_folder_gets_wrong_is_refused_by_name(ragged, tmp_path, config, tensors, message):
    folder = tmp_path / "edited"
    shutil.copytree(ragged, folder)
    hf = json.loads((folder / "config.json").read_text())
    hf["quantization_config"] = None if config is None else {**hf["quantization_config"], **config}
    (folder / "config.json").write_text(json.dumps(hf))
    if tensors is not None:
        _edit(folder, tensors)
    with pytest.raises(ValueError, match=message):
        zoo.hf.load(folder)
