"""`open-r1-ext train` without server URLs: the servers it embeds get GPUs of their own (stand-in GPU ids in
`CUDA_VISIBLE_DEVICES`: no GPU here, so every process runs on the CPU; each logs the GPUs it was given), and under
`accelerate launch` only the first process starts them, the others using their URLs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from open_r1_ext.launch.local_server import free_port
from open_r1_ext.train import split_gpus
from tests.helpers import REPO

RECIPE = "recipes/tiny/grpo.yaml"
BUILTIN_ON_ONE_GPU = "{engine: builtin, dtype: float32, resources: {gpus_per_node: 1, cpus_per_task: 1}}"


def test_servers_take_the_last_gpus_and_the_trainer_keeps_the_first():
    assert split_gpus(list("01234567"), {"generation": 2, "reference": 2}, 4) == (
        list("0123"), {"generation": ["4", "5"], "reference": ["6", "7"]})
    assert split_gpus(["3", "5", "6"], {"generation": 1, "reference": 0}) == (["3", "5"], {"generation": ["6"], "reference": []})
    with pytest.raises(ValueError, match=r"2 GPU\(s\) visible here \(3,5\): 2 for the generation server leave 0 for the "
                                         r"trainer's 1 process\(es\)"):
        split_gpus(["3", "5"], {"generation": 2})


def train(tmp_path, *overrides, gpus: str, launcher=(sys.executable, "-m", "open_r1_ext.cli", "train", RECIPE)):
    sets = [f"trainer.output_dir={tmp_path / 'run'}", "trainer.max_steps=2", *overrides]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus, TOKENIZERS_PARALLELISM="false")
    return subprocess.run([*launcher, *(arg for item in sets for arg in ("--set", item))], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_embedded_servers_get_gpus_of_their_own(tiny_model, tmp_path):
    run = train(tmp_path, f"model.name_or_path={tiny_model}", "servers.generation.resources.gpus_per_node=1",
                f"servers.reference={BUILTIN_ON_ONE_GPU}", gpus="3,5,6,7")
    assert run.returncode == 0, run.stderr[-5000:]
    assert "GPUs: the trainer 3,5, the generation server 6, the reference server 7 (CUDA_VISIBLE_DEVICES)" in run.stderr
    for role, gpu in (("generation", "6"), ("reference", "7")):  # what each server process saw
        assert f"open_r1_ext.server: CUDA_VISIBLE_DEVICES={gpu}, models on cpu" in (tmp_path / "run" / f"{role}-server.log").read_text()


def test_too_few_gpus_for_the_embedded_servers_is_refused(tiny_model, tmp_path):
    """A trainer on the GPUs (`use_cpu: false`) needs one a process; one on the CPU (the tiny recipe's) none: there
    the servers take both."""
    run = train(tmp_path, f"model.name_or_path={tiny_model}", "servers.generation.resources.gpus_per_node=1",
                f"servers.reference={BUILTIN_ON_ONE_GPU}", "trainer.use_cpu=false", gpus="3,5")
    assert run.returncode == 2
    assert (f"{RECIPE}: servers.generation.resources.gpus_per_node / servers.reference.resources.gpus_per_node: "
            "2 GPU(s) visible here (3,5): 1 for the generation server, 1 for the reference server leave 0 for the "
            "trainer's 1 process(es): lower it (0: the server shares the trainer's GPUs)") in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and not (tmp_path / "run" / "generation-server.log").exists()
    on_cpu = train(tmp_path, f"model.name_or_path={tiny_model}", "servers.generation.resources.gpus_per_node=1",
                   f"servers.reference={BUILTIN_ON_ONE_GPU}", gpus="3,5")
    assert on_cpu.returncode == 0, on_cpu.stderr[-5000:]
    assert "GPUs: the trainer , the generation server 3, the reference server 5 (CUDA_VISIBLE_DEVICES)" in on_cpu.stderr


def test_only_the_first_of_two_trainer_processes_starts_the_embedded_servers(tiny_model, tmp_path):
    """Two CPU processes (accelerate launch, gloo): one embedded server, started by the first process; the second
    uses its URL and leaves the run's key alone (a second key would lock the first process out: 401)."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
                "--dynamo_backend", "no", "-m", "open_r1_ext.train", "--config", RECIPE]
    run = train(tmp_path, f"model.name_or_path={tiny_model}", "trainer.per_device_train_batch_size=4", gpus="",
                launcher=launcher)
    assert run.returncode == 0, run.stderr[-5000:]
    assert run.stderr.count("starting an embedded builtin generation server") == 1, run.stderr[-5000:]
    assert "step    2/2" in run.stdout
