"""How a training process ends when it is told to: SIGTERM (SLURM's time limit, scancel) saves a checkpoint of the
last finished step and stops; the same command resumes from it with no step redone, against an embedded built-in
server or real SGLang; the embedded server never outlives its trainer, even one killed with SIGKILL. Real processes,
the real tiny model."""

import json
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml

from open_r1_ext.launch.jobs import SIGTERM_EXIT
from open_r1_ext.launch.run_key import key_file
from tests.helpers import (REPO, children, gone, group_gone, restore_default_weights, start_training, step_lines,
                           tiny_recipe)

def check_embedded_server_wants_the_run_key(pid: int, run: Path, engine: str) -> None:
    """The embedded server holds this run's key (from the owner-only file, not its command line); the built-in one
    reloads only the run's dumps."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    key = yaml.safe_load(key_file(run).read_text())["api-key"]
    assert stat.S_IMODE(key_file(run).stat().st_mode) == 0o600 and key.encode() not in b" ".join(cmdline)
    assert cmdline[cmdline.index(b"--config") + 1] == str(key_file(run)).encode()
    if engine == "builtin":
        assert cmdline[cmdline.index(b"--weight-dirs") + 1] == str(run / "weights").encode()
    url = f"http://127.0.0.1:{cmdline[cmdline.index(b'--port') + 1].decode()}"
    assert requests.post(f"{url}/update_weights_from_disk", json={"model_path": str(run)}, timeout=10).status_code == 401
    assert requests.get(f"{url}/get_model_info", headers={"Authorization": f"Bearer {key}"}, timeout=10).ok


# what `open-r1-ext train` embeds: the recipe's built-in generation server (its /ref slot the reference), or real SGLang
# on the CPU (`device: cpu`, run by the SGLang venv's python) with the reference on the trainer
SERVER_PROCESS = {"builtin": "open_r1_ext.server", "sglang": "sglang.launch_server"}


def engine_overrides(engine: str, request) -> list[str]:
    if engine == "builtin":
        return []
    python = request.getfixturevalue("sglang_python")
    return [f"--set=servers.generation={{engine: sglang, device: cpu, python: {python}, dtype: float32, "
            "resources: {gpus_per_node: 0}}", "--set=servers.reference=local"]


@pytest.mark.parametrize("engine", ["builtin", "sglang"])
def test_sigterm_saves_a_checkpoint_stops_the_server_and_resume_redoes_no_step(tmp_path, tiny_model, engine, request):
    recipe = tiny_recipe(tmp_path, tiny_model, max_steps=40)
    overrides = engine_overrides(engine, request)
    run = tmp_path / "run"
    trainer = start_training(recipe, *overrides)
    try:
        seen = step_lines(trainer, until_step=2)
        assert seen[-1:] == [2], trainer.stderr.read() if trainer.poll() is not None else seen
        servers = children(trainer.pid, SERVER_PROCESS[engine])
        assert len(servers) == 1
        check_embedded_server_wants_the_run_key(servers[0], run, engine)
        trainer.send_signal(signal.SIGTERM)
        seen += step_lines(trainer, until_step=10**6)
        code, err = trainer.wait(timeout=120), trainer.stderr.read()
    finally:
        trainer.kill()
    stopped = seen[-1]
    assert code == SIGTERM_EXIT, err[-3000:]
    assert f"SIGTERM: stopped after step {stopped} with a checkpoint in {run}/checkpoint-{stopped}" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in run.glob("checkpoint-*")) == [f"checkpoint-{stopped}"]
    assert gone(servers[0]), "the embedded server outlived its trainer"
    assert group_gone(servers[0]), "a process of the embedded server outlived it"  # SGLang's scheduler, ...
    assert not (run / "model.safetensors").exists()  # stopped: no final model written as if training had finished

    resumed = start_training(recipe, *overrides, f"--set=trainer.max_steps={stopped + 2}")
    try:
        after = step_lines(resumed, until_step=10**6)
        code, err = resumed.wait(timeout=300), resumed.stderr.read()
    finally:
        resumed.kill()
    assert code == 0, err[-3000:]
    assert f"resuming from {run}/checkpoint-{stopped}" in err
    assert after == [stopped + 1, stopped + 2]  # no step redone, none skipped
    logged = [e["step"] for e in map(json.loads, (run / "weight_sync.jsonl").read_text().splitlines())
              if e["role"] == "generation"]
    assert logged == list(range(1, stopped + 3)), logged  # every step's sync once, across the resume
    assert (run / "model.safetensors").exists()
    if engine == "sglang":  # the resumed run's server (a fresh one) ended on the last step's weights
        versions = re.findall(r"Weight version changed\. old_version='[^']*' new_version='([^']*)'",
                              (run / "generation-server.log").read_text())
        assert versions[-1:] == [str(stopped + 2)], versions


def test_an_embedded_server_dies_with_a_killed_trainer(tmp_path, tiny_model):
    """SIGKILL leaves no chance to clean up: the server still goes, by the kernel's parent-death signal."""
    starter = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from open_r1_ext.launch.local_server import BuiltinServer; "
                               "BuiltinServer(sys.argv[1]).start(); print('up', flush=True); time.sleep(600)",
         str(tiny_model)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert starter.stdout.readline().strip() == "up"
        servers = children(starter.pid, "open_r1_ext.server")
        assert len(servers) == 1
        os.kill(starter.pid, signal.SIGKILL)
        assert gone(servers[0]), "the built-in server outlived the process that started it"
    finally:
        starter.kill()


def test_ranks_agree_to_stop_when_only_one_got_sigterm(tiny_model, server, tmp_path):
    """Two processes (accelerate launch, CPU, gloo); SIGTERM reaches rank 1 only: rank 0 learns it at the end of the
    step, so both save the same checkpoint and stop, neither waits forever at a collective."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    out = tmp_path / "run"
    result = subprocess.run([*launcher, "-m", "tests.stop_ranks_train", str(tiny_model), server.url, str(out)],
                            capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    ranks = [json.loads((out / f"rank-{i}.json").read_text()) for i in range(2)]
    assert [r["stopped_at"] for r in ranks] == [r["global_step"] for r in ranks] == [3, 3]
    assert ranks[1]["received"] == "SIGTERM" and ranks[0]["received"] is not None
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]
    restore_default_weights(server.url, tiny_model)
