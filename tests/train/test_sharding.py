"""Training on a mesh of 8 simulated CPU devices gives the losses of one device; checkpoints move
between meshes; FSDP splits the state; a tensor-parallel model decodes the same tokens, with early
exit and self-speculation too; two processes of 4 devices each, launched as docs/devices.md says,
train like one device.

The checks run in subprocesses (tests/train/sharding_check.py parts a and b, and `python -m train`
twice) so that this process keeps one device; they all start at once, since their compiles are
single-threaded. Part c, context parallelism: tests/train/test_sharding_context.py.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.train.sharding_check import config
from tests.util import rel_err
from zoo.config import MeshConfig, to_dict

ROOT = Path(__file__).parents[2]
TOL = 1e-5  # max |difference| / max |loss| of float32 losses (tests.util.rel_err): against the run's own
# scale, since a distillation loss falls 10x in 10 steps and float32 noise does not fall with it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start(part: str, folder: Path) -> subprocess.Popen:
    """tests/train/sharding_check.py's part a, b or c in a process of its own, writing under `folder`. Its one-device
    runs use XLA's forms, as the meshes of several devices do (where the C++ CPU kernels are never taken,
    kernels/native.py): the checks compare sharding with one device, not the kernels with XLA's forms
    (tests/kernels/test_attention_cpu.py does; the kernel's different summation order moved the 22-layer
    model's logits by 1.2e-5 against the mesh's)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ZOO_CPU_KERNELS": "0"}  # with conftest.py's fast-compile XLA_FLAGS
    return subprocess.Popen([sys.executable, str(ROOT / "tests/train/sharding_check.py"), str(folder), part], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def collect(out: dict, name: str, proc: subprocess.Popen):
    """Merge a part's JSON object into `out`: losses, resume and errors by key, the rest as it is."""
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, (name, stderr[-3000:])
    got = json.loads(stdout.splitlines()[-1])
    assert got["devices"] == 8
    out.setdefault("losses", {}).update(got.pop("losses"))
    for key in ("resume", "errors"):
        out.setdefault(key, {}).update(got.pop(key, {}))
    out.update(got)


@pytest.fixture(scope="module")  # `make test` distributes by file: one worker, one run of the subprocesses
def results(tmp_path_factory):
    procs = {part: start(part, tmp_path_factory.mktemp(f"part_{part}")) for part in ("a", "b")}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # with conftest.py's fast-compile XLA_FLAGS
    hosts = tmp_path_factory.mktemp("hosts")
    cfg = config("transformer", MeshConfig(fsdp=4, data=2), sample_tokens=4, run_dir=str(hosts / "run"))
    (hosts / "run.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    port = _free_port()
    for pid in (0, 1):  # the multi-host launch of docs/devices.md, with two local processes as hosts
        host_env = {**env, "JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2",
                    "JAX_PROCESS_ID": str(pid), "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
                    "XLA_FLAGS": f"{env['XLA_FLAGS']} --xla_force_host_platform_device_count=4"}
        procs[f"host{pid}"] = subprocess.Popen([sys.executable, "-m", "train", str(hosts / "run.yaml")],
                                               cwd=ROOT, env=host_env, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True)
    out = {"hosts": {}}
    for name, proc in procs.items():
        if name.startswith("host"):
            stdout, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, (name, stdout[-3000:])
            out["hosts"][name] = stdout
        else:
            collect(out, name, proc)
    out["hosts"]["metrics"] = [json.loads(line) for line in (hosts / "run" / "metrics.jsonl").read_text().splitlines()]
    out["hosts"]["checkpoints"] = sorted(p.name for p in (hosts / "run" / "checkpoints").iterdir())
    return out


@pytest.mark.parametrize("arch, meshes", [
    ("transformer", ["data=8", "fsdp=4 data=2", "tensor=2 fsdp=2 data=2"]),
    ("gla", ["tensor=2 fsdp=2 data=2"]), ("mamba", ["tensor=2 fsdp=2 data=2"]),
    ("moe", ["expert=4 data=2"]), ("toy", ["tensor=2 fsdp=2 data=2"]),
    ("distilled", ["tensor=2 fsdp=2 data=2"])])  # a GLA student of a Transformer run (train.distill)
def test_meshes_train_like_one_device(results, arch, meshes):
    losses = results["losses"][arch]
    one = losses["one"]
    falls = one[0] / 2 if arch == "distilled" else one[0] - 0.1  # the KL to a 10-step teacher starts small
    assert len(one) == 10 and one[-1] < falls  # it trains
    for mesh in meshes:
        assert rel_err(losses[mesh], one) < TOL, (arch, mesh, losses[mesh], one)


def test_checkpoint_moves_between_meshes_and_onto_one_device(results):
    reference = results["losses"]["transformer"]["one"][5:]  # steps 6-10 of the run never stopped
    for where in ("tensor=2 data=4", "one"):
        assert results["resume"][where]["resumed"], where
        assert rel_err(results["resume"][where]["losses"], reference) < TOL, where


def test_fsdp_holds_an_eighth_of_the_state_per_device(results):
    for what in ("params", "opt_state"):
        per_device, total = results["bytes"][what]["per_device"], results["bytes"][what]["total"]
        assert len(per_device) == 8
        # About 1/8: only the norms' weights and the optimiser's step counters are replicated.
        assert total / 8 <= min(per_device) and max(per_device) < 1.05 * total / 8, (what, per_device, total)


def test_tensor_parallel_decoding_gives_the_tokens_of_one_device(results):
    assert results["tp_wq_spec"] == "P(None, 'tensor', None)"  # the heads really are split
    assert results["tokens"]["tensor=4 data=2"] == results["tokens"]["one"]
    assert all(len(row) == 12 for row in results["tokens"]["one"])


def test_early_exit_and_self_speculation_on_a_mesh_give_the_tokens_of_one_device(results):
    one, mesh = results["techniques"]["one"], results["techniques"]["tensor=4 data=2"]
    assert mesh == one
    layers = [x for row in one["exit_layers"] for x in row]
    assert {2, 3} <= set(layers)  # rows exit at different layers: both the lean and the full branches ran
    assert all(len(row) == 6 for row in one["exits"] + one["speculation"])


def test_mesh_errors_name_what_does_not_fit(results):
    size, indivisible = results["errors"]["mesh size"], results["errors"]["indivisible"]
    assert "data=4" in size and "8 (cpu)" in size
    # 4 heads over 8 tensor ranks: the message names the axis, its size, the parameter and its shape.
    assert all(s in indivisible for s in ("train.mesh.tensor=8", "(heads, size 4)", "parameter blocks/0/mixer/w",
                                          "(shape ("))


def test_two_processes_train_like_one_device(results):
    rows = results["hosts"]["metrics"]  # written by process 0 alone: one line per step
    assert [r["step"] for r in rows] == list(range(1, 11)) and "sample" in rows[-1]
    assert rel_err([r["loss"] for r in rows], results["losses"]["transformer"]["one"]) < TOL
    assert results["hosts"]["checkpoints"] == ["10"]
    assert "step     10/10  loss" in results["hosts"]["host0"] and "/10  loss" not in results["hosts"]["host1"]
