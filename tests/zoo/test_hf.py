"""zoo.hf against transformers, through the fixtures of tests/fixtures/hf/make_fixtures.py (no torch here).

Each fixture is a tiny random model at unit-scale logits, saved by transformers, with the logits and
greedy continuations transformers gave. Checked: load -> the same logits (max |diff| < 1e-4) and the
same greedy tokens; save(load(folder)) -> the folder's tensors bit for bit (the fixture script checks
transformers reads save's folders with the same logits); every kind of broken folder -> an error naming
the file and the tensor or field.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import infer
import zoo.hf
from tests.util import HF_FIXTURES as FIXTURES
from tests.util import HF_PROMPTS as PROMPTS
from tests.util import decode_in_pieces, forward, hf_fixture, hf_greedy
from zoo import safetensors

CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file())


def test_every_architecture_has_a_fixture():
    archs = {json.loads((FIXTURES / c / "config.json").read_text())["architectures"][0] for c in CASES}
    # qwen3_5_moe's folder in the multimodal layout (tests/zoo/test_hf_qwen3_next.py), its text model a fixture's
    assert archs | {"Qwen3_5MoeForConditionalGeneration"} == set(zoo.hf.ARCHITECTURES)
    checks = json.loads((FIXTURES / "save_check.json").read_text())["max_abs_diff"]
    assert set(checks) == set(CASES)  # transformers on save's folders: the same tensors, or multipliers folded
    assert all(d < (1e-4 if c.startswith("falcon_h1") else 1e-5) for c, d in checks.items())  # into the weights


@pytest.mark.parametrize("case", CASES)
def test_logits_and_greedy_tokens_match_transformers(case):
    expected = np.load(FIXTURES / case / "expected.npz")
    model, tok = zoo.hf.load(FIXTURES / case)
    logits = np.asarray(forward(model, jnp.asarray(expected["ids"], jnp.int32)))
    assert logits.std() > 0.5  # unit scale: a 1e-4 tolerance means something
    np.testing.assert_allclose(logits, expected["logits"], atol=1e-4, rtol=0)
    prompts, greedy = hf_greedy(case, tok)
    rows = infer.generate(model, prompts, max_new_tokens=10, stop_token=tok.eos_id)
    assert rows == greedy
    texts = infer.generate_text(model, PROMPTS, max_new_tokens=10, sampling=infer.Sampling(0.0), tokenizer=tok)
    assert texts == [tok.decode(r) for r in rows]


def test_dynamic_rope_is_loaded_within_its_context_and_refused_past_it():
    """Dynamic NTK scaling is the plain rotary up to max_position_embeddings (the fixture's logits and
    greedy tokens match transformers there); a longer pass or cache is an error, never a silent
    departure from transformers' running-length frequencies."""
    model, _ = zoo.hf.load(FIXTURES / "mistral")
    assert model.blocks[0].mixer.rope_scaling.type == "dynamic" and model.blocks[0].mixer.exact_up_to == 256
    model(jnp.zeros((1, 256), jnp.int32))
    with pytest.raises(ValueError, match="a sequence of 257 tokens exceeds 256.*dynamic rope"):
        model(jnp.zeros((1, 257), jnp.int32))
    with pytest.raises(ValueError, match="a KV cache of 300 tokens exceeds 256"):
        infer.generate(model, [[1, 2, 3]], max_new_tokens=297)


# case: the config.json fields save writes where they differ from the fixture's (or which the case is about); not
# the zero-centred norms' Qwen3-Next and Qwen3.5 (w back within 2^-24) nor qwen3_5_vl, whose save is its text model
# alone (Qwen3_5ForCausalLM), other tensor names: test_hf_qwen3_next.py checks those
IDENTITY = {
    "llama": {}, "qwen2": {}, "qwen2_moe": {}, "qwen3_moe": {}, "mamba2": {}, "fla_gla": {}, "fla_rwkv7": {},
    "jamba": {},  # the layer and FFN patterns written back as attn/expert layer periods
    "nemotron_h": {"hybrid_override_pattern": "M-*-MM-*"},  # the zoo blocks written back as the pattern's layers
    "nemotron_h_moe": {"hybrid_override_pattern": "M-*EME"},  # from layers_block_type; the experts, the bias
    "lfm2": {"intermediate_size": 96, "block_auto_adjust_ff_dim": False},  # the MLP width as it is, not re-derived
    "deepseek_v3": {},  # MLA with a query latent, the dense-then-MoE FFNs, the correction bias
    "deepseek_v3_q_proj": {},  # MLA with q_proj (no query latent)
    "kimi_linear": {},  # KDA and MLA layers, the correction bias
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},  # the pattern's period, the centred norms
}


@pytest.mark.parametrize("case, written", IDENTITY.items(), ids=list(IDENTITY))
def test_save_then_load_is_the_identity(case, written, tmp_path):
    """save(load(folder)) writes the folder's tensors bit for bit, and loading that gives the same config,
    tokenizer and whole state: the parameters and any other variable, such as an MoE's RouterBias (DeepSeek-V3's
    and Kimi Linear's correction bias)."""
    model, tok = zoo.hf.load(FIXTURES / case)
    zoo.hf.save(model, tmp_path, tok)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert {k: saved.get(k) for k in written} == written
    ours, theirs = (safetensors.SafetensorsFile(d / "model.safetensors") for d in (tmp_path, FIXTURES / case))
    assert sorted(ours.keys()) == sorted(theirs.keys())
    for name in theirs.keys():
        np.testing.assert_array_equal(ours.get(name), theirs.get(name), err_msg=name)
    again, tok2 = zoo.hf.load(tmp_path)
    assert again.cfg == model.cfg and tok2.eos_id == tok.eos_id
    state = lambda m: nnx.to_flat_state(nnx.state(m))
    for (path, a), (path2, b) in zip(state(model), state(again), strict=True):
        assert path == path2 and type(a) is type(b) and np.array_equal(a[...], b[...]), path


def test_bfloat16_load_stays_close():
    expected = np.load(FIXTURES / "llama" / "expected.npz")
    model, _ = zoo.hf.load(FIXTURES / "llama", dtype="bfloat16")
    assert model.embed.embedding[...].dtype.name == "bfloat16"
    logits = np.asarray(forward(model, jnp.asarray(expected["ids"], jnp.int32)), np.float32)
    assert np.abs(logits - expected["logits"]).max() < 0.25


def test_broken_folders_name_what_is_wrong(tmp_path):
    folder = hf_fixture(tmp_path, "llama")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])  # truncated
    with pytest.raises(ValueError, match=r"model.safetensors: tensor \S+ .*truncated"):
        zoo.hf.load(folder)
    f = safetensors.SafetensorsFile(FIXTURES / "llama" / "model.safetensors")
    tensors = {k: np.asarray(f.get(k)) for k in f.keys()}
    safetensors.write(weights, {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(ValueError, match="no tensor model.layers.1.mlp.up_proj.weight"):
        zoo.hf.load(folder)
    safetensors.write(weights, {**tensors, "model.layers.0.self_attn.k_proj.weight": np.zeros((8, 32), np.float32)})
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \(8, 32\), but config.json implies \(16, 32\)"):
        zoo.hf.load(folder)
    safetensors.write(weights, {**tensors, "model.layers.0.mlp.extra.weight": np.zeros((2,), np.float32)})
    with pytest.raises(ValueError, match="no place for: model.layers.0.mlp.extra.weight"):
        zoo.hf.load(folder)
    safetensors.write(weights, tensors)
    assert zoo.hf.load(folder)[0].cfg.num_layers == 2


@pytest.mark.parametrize("case, changes, message", [
    ("llama", dict(architectures=["GPT2LMHeadModel"]),
     r"architectures=\['GPT2LMHeadModel'\] is not supported; expected one of LlamaForCausalLM"),
    ("llama", dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    ("llama", dict(num_attention_heads=None), "no field num_attention_heads"),
    ("llama", dict(attention_bias=True), "attention_bias=True is not supported"),
    ("llama", dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}, rope_parameters=None),
     "rope_scaling type 'longrope' is not supported"),
    ("fla_gla", dict(feature_map="relu"), "feature_map='relu' is not supported"),
    ("fla_gla", dict(num_kv_heads=1), "num_kv_heads=1 is not supported"),
])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, case, changes, message):
    with pytest.raises(ValueError, match=message):
        zoo.hf.load(hf_fixture(tmp_path, case, **changes))


@pytest.mark.parametrize("config,overrides,message", [
    ("deltanet", [], r"have a Hugging Face architecture; this model has mixers \['deltanet'\]"),
    ("gla", ["model.mixer.gate_low_rank_dim=8"], "fla's GLA has gate_low_rank_dim 16"),
    ("transformer", ["model.norm=layer"], "LayerNorm blocks .* only in fla's RWKV-7 layout"),
    ("diff_attention", [], "output_gate, differential and rope_fraction have no architecture"),
    ("mhc", [], "model.residual other than standard"),
    ("transformer", ["model.logit_softcap=30.0"], "have a Hugging Face form only in RecurrentGemma"),
    ("moe", ["model.ffn.scoring=sigmoid"], "an MoE saves as Mixtral .* only with .* softmax scoring"),
])
def test_save_refuses_what_has_no_hugging_face_form(tmp_path, config, overrides, message):
    cfg = zoo.load_config(f"configs/{config}.yaml", ["model.num_layers=1", "model.d_model=32", *overrides])
    model = zoo.LanguageModel(cfg.model, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=message):
        zoo.hf.save(model, tmp_path)


def test_the_cli_generates_from_a_folder(capsys):
    from infer.__main__ import main
    model, tok = zoo.hf.load(FIXTURES / "llama")
    want = infer.generate_text(model, PROMPTS[:1], max_new_tokens=10, sampling=infer.Sampling(0.0), tokenizer=tok)[0]
    main([str(FIXTURES / "llama"), "--prompt", PROMPTS[0], "--max-new-tokens", "10", "--temperature", "0"])
    assert capsys.readouterr().out == PROMPTS[0] + want + "\n"


def test_a_run_starts_from_the_folders_weights(tmp_path):
    from train.loop import run
    from zoo.checkpoint import load_model
    overrides = ["train.steps=1", "train.lr=1e-9", "train.warmup_steps=0", "train.batch_size=2", "train.seq_len=16",
                 "train.eval_every=1", "train.checkpoint_every=1", "model.mixer.window=7"]
    cfg = zoo.load_config("configs/finetune.yaml", overrides)
    hf_cfg = zoo.hf.model_config(zoo.hf.read_config(FIXTURES / "llama"))
    assert cfg.model.mixer.window == 7 and cfg.model.d_model == hf_cfg.d_model and cfg.model.init_from
    run(cfg, tmp_path, log=lambda *_: None)
    _, trained, _ = load_model(tmp_path)
    loaded, _ = zoo.hf.load(FIXTURES / "llama")
    leaves = lambda m: jax.tree.leaves(nnx.state(m, nnx.Param))
    for a, b in zip(leaves(trained), leaves(loaded), strict=True):  # one step at lr 1e-9 moves nothing visible
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_a_loaded_model_fine_tuned_with_exits_decodes_with_them(tmp_path):
    """A folder has no exit heads: model.exits in the fine-tuning config adds them (fresh, the rest read
    from the folder) and trains them; the run then decodes with self-speculation exactly as greedy,
    and with token-level exit at threshold 0 every token leaves at the exit."""
    from train.loop import run
    from zoo.checkpoint import load_model
    overrides = ["train.steps=3", "train.batch_size=2", "train.seq_len=16", "train.eval_every=3",
                 "train.checkpoint_every=3", "model.exits.layers=[1]", "model.exits.weights=[1.0]"]
    run(zoo.load_config("configs/finetune.yaml", overrides), tmp_path, log=lambda *_: None)
    _, model, _ = load_model(tmp_path)
    assert model.exit_layers == (1,)
    prompts = [[1, 40, 41, 42], [1, 50]]
    greedy = infer.generate(model, prompts, max_new_tokens=10)
    spec, info = infer.generate(model, prompts, max_new_tokens=10, speculation=infer.Speculation(3), return_info=True)
    assert spec == greedy and 0 <= info["acceptance"] <= 1
    _, info = infer.generate(model, prompts, max_new_tokens=10, exits=infer.Exits(0.0), return_info=True)
    assert all(layer == 1 for row in info["exit_layers"] for layer in row[1:])  # the prompt's token: full depth


MESH_SCRIPT = """
import jax, numpy as np, jax.numpy as jnp
import zoo.hf
from zoo.config import MeshConfig
from zoo.sharding import make_mesh
mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2))
model, _ = zoo.hf.load("{folder}", mesh=mesh)
wq = model.blocks[0].mixer.wq[...]
assert wq.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None), wq.sharding.spec
expected = np.load("{folder}/expected.npz")
with jax.set_mesh(mesh):
    logits = np.asarray(model(jnp.asarray(expected["ids"], jnp.int32)))
assert np.abs(logits - expected["logits"]).max() < 1e-4
print("ok")
"""


def test_load_places_each_tensor_on_the_mesh(tmp_path):
    import os
    import subprocess
    import sys
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"}
    out = subprocess.run([sys.executable, "-c", MESH_SCRIPT.format(folder=FIXTURES / "mixtral")], env=env,
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_a_sharded_checkpoint_loads_like_one_file(tmp_path):
    folder = hf_fixture(tmp_path, "llama")
    f = safetensors.SafetensorsFile(folder / "model.safetensors")
    names = sorted(f.keys())
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        safetensors.write(folder / file, {n: np.asarray(f.get(n)) for n in part})
    (folder / "model.safetensors").unlink()
    index = {"weight_map": {n: file for file, part in shards.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    expected = np.load(folder / "expected.npz")
    model, _ = zoo.hf.load(folder)
    logits = forward(model, jnp.asarray(expected["ids"], jnp.int32))
    np.testing.assert_allclose(np.asarray(logits), expected["logits"], atol=1e-4)
    first, second = shards
    index["weight_map"]["model.norm.weight"] = first if "model.norm.weight" in shards[second] else second
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="holds no tensor model.norm.weight, which model.safetensors.index.json"):
        zoo.hf.load(folder)


# case: where decoding cuts the fixture's ids (None: a prefill of 10, then one token at a time)
DECODE = {
    "mamba": None,  # ffn: none (Mamba's blocks)
    "qwen3": None,  # qk_norm
    "jamba": None,  # Mamba's state and convolution window beside attention's cache, the MoE
    "nemotron_h": None,  # Mamba-2's state and convolution window beside attention's cache
    "nemotron_h_moe": [12],  # the same beside the relu2 MoE (one shape: one compile; greedy covers single steps)
    "falcon_h1": None,  # the same in one block: the parallel mixer's state, a tuple of its parts' states
    "lfm2": [5, 6, 7, 12, 13],  # both mixers: the conv window and the KV cache with qk_norm and rotary
    "deepseek_v3": None,  # the absorbed latent-cache decode with yarn and the MoE's routing
    "kimi_linear": None,  # KDA's recurrent state and convolution windows and MLA's latent cache
    # the DeltaNet states and convolution windows, and the gated attention's cache, from a prefill of 12 to the
    # next 12 (one shape: one compile; the greedy tokens above, equal to transformers', come from single steps)
    "qwen3_next": [12],
    "recurrent_gemma": None,  # the RG-LRU state and conv window, and the window's ring buffer wrapping at 5 + 16
}


@pytest.mark.parametrize("case, cuts", DECODE.items(), ids=list(DECODE))
def test_prefill_then_decode_equals_the_full_pass(case, cuts):
    ids = jnp.asarray(np.load(FIXTURES / case / "expected.npz")["ids"], jnp.int32)
    model, _ = zoo.hf.load(FIXTURES / case)
    steps, _ = decode_in_pieces(model, ids, cuts=cuts or list(range(10, ids.shape[1])))
    np.testing.assert_allclose(steps, forward(model, ids), atol=2e-4)
