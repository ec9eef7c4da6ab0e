"""`open-r1-ext launch`: the run through submitit, on the real local SLURM cluster and as local processes.

One `launch(recipe, executor_factory)` for both executors: the server comes up, the trainer does its steps, and
the server is cancelled afterwards, so nothing of the run is left. An interrupted launch (SIGTERM) cancels its
jobs; `--dry-run` and an invalid recipe submit nothing; a preempted trainer requeues a fresh task.
"""

from __future__ import annotations

import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from open_r1_ext.launch.submitit_launcher import EXECUTORS, JobRef, TrainerTask, launch
from open_r1_ext.launch.recipe import load_recipe
from open_r1_ext.launch.slurm_plan import SlurmPlan
from test_slurm import (  # noqa: F401 - slurm_cluster and tiny_run are fixtures
    JOB_WAIT_S,
    RECIPE,
    REPO,
    assert_trained,
    job_env,
    run_script,
    slurm_cluster,
    tiny_run,
    wait_until,
)


def processes_of(run) -> list[str]:
    """Command lines of the processes still serving or training on this run's server ports (server, ref-server)."""
    port = int(next(o for o in run.overrides if o.startswith("servers.generation.port=")).split("=", 1)[1])
    ports = {str(port), str(port + 1)}
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(a == "--port" and b in ports for a, b in zip(words, words[1:])) or f"--set=servers.generation.port={port}" in words:
            found.append(" ".join(words))
    return found


@pytest.mark.parametrize("executor, layout", [("slurm", "shared"), ("local", "separate")])
def test_launch_runs_the_servers_then_the_trainer_and_cancels_the_servers(executor, layout, request, tiny_run, monkeypatch):
    if executor == "slurm":
        request.getfixturevalue("slurm_cluster")
    monkeypatch.chdir(REPO)  # recipe paths are relative to the repository root, as for sbatch
    reference = {"shared": "generation", "separate": "{dtype: float32, resources: {gpus_per_node: 0, cpus_per_task: 1}}"}
    tiny_run.overrides.append(f"servers.reference={reference[layout]}")
    lines: list[str] = []
    code = launch(load_recipe(RECIPE, tiny_run.overrides), EXECUTORS[executor], tiny_run.overrides, echo=lines.append)
    output, status = "\n".join(lines), tiny_run.status()
    assert code == 0, f"{output}\n{status}"
    roles = ["server", "ref-server"] if layout == "separate" else ["server"]
    ready = next(line for line in lines if line.startswith("servers ready: "))
    assert all(f"'{role}': 'http://" in ready for role in roles), ready
    logs = tiny_run.run_dir / "logs"
    assert_trained(tiny_run, *logs.glob("trainer/*_0_log.out"), *(p for role in roles for p in logs.glob(f"{role}/*_0_log.out")))
    assert "trainer job" in status and ": succeeded" in status
    assert all(f"cancelled {role} job" in status for role in roles), status
    tiny_run.wait_for_no_jobs()
    wait_until(lambda: not processes_of(tiny_run), 30, "the run's processes to exit")


def test_interrupted_launch_cancels_its_jobs(slurm_cluster, tiny_run):
    tiny_run.overrides.append("trainer.max_steps=500")
    launcher = subprocess.Popen([sys.executable, "-m", "open_r1_ext.cli", "launch", RECIPE, *tiny_run.set_args],
                                cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: "submitted trainer job" in tiny_run.status() or launcher.poll() is not None, JOB_WAIT_S,
                   "the launcher to submit the trainer")
        launcher.send_signal(signal.SIGTERM)
        output = launcher.communicate(timeout=60)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, output
    status = tiny_run.status()
    assert "launch interrupted (SIGTERM)" in status
    assert "cancelled server job" in status and "cancelled trainer job" in status, status
    tiny_run.wait_for_no_jobs()


def test_dry_run_prints_both_jobs_and_submits_nothing(slurm_cluster, tiny_run):
    result = run_script(sys.executable, "-m", "open_r1_ext.cli", "launch", RECIPE, *tiny_run.set_args,
                        "--set", "servers.reference={resources: {gpus_per_node: 0}}", "--dry-run")
    assert result.returncode == 0, result.stderr
    out, name = result.stdout, tiny_run.job_name
    for role in ("server", "ref-server", "trainer"):
        assert f"{role} job: 1 node(s)" in out and f"sbatch --job-name={name}-{role} --time=00:30:00" in out
        assert f"submitit parameters of the {role} job: {{'name': '{name}-{role}'" in out
    assert "-m open_r1_ext.server --model-path" in out
    assert "accelerate.commands.launch --cpu --dynamo_backend no --num_machines 1 --num_processes 1" in out
    assert '--server-url "$SERVER_URL" --ref-url "$REF_SERVER_URL"' in out
    assert not tiny_run.jobs() and not tiny_run.run_dir.exists()


def test_invalid_recipe_launches_nothing(slurm_cluster, tiny_run):
    result = run_script(sys.executable, "-m", "open_r1_ext.cli", "launch", RECIPE, *tiny_run.set_args,
                        "--set", "servers.reference=sideways")
    assert result.returncode == 2
    assert "servers.reference: 'sideways' is not one of generation, local, none" in result.stderr
    assert "nothing submitted" in result.stderr
    assert not tiny_run.jobs() and not tiny_run.run_dir.exists()


def test_preempted_trainer_stops_training_and_requeues_a_fresh_task(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    overrides = [f"model.name_or_path={tiny_model}", f"trainer.output_dir={tmp_path}"]
    servers = [JobRef("server", "12", "slurm")]
    task = TrainerTask(SlurmPlan(load_recipe(RECIPE, overrides), overrides), servers)
    task._process, task._job_id = subprocess.Popen(["sleep", "60"]), "34"
    delayed = task.checkpoint()
    assert task._process.wait(timeout=10) == -signal.SIGTERM  # training stops; it resumes from output_dir's last checkpoint
    requeued = pickle.loads(pickle.dumps(delayed.function))
    assert isinstance(requeued, TrainerTask) and requeued._process is None
    assert requeued.servers == servers and requeued.plan.recipe_args() == task.plan.recipe_args()
    assert "trainer job 34: preempted or out of time; requeued" in (tmp_path / "status.log").read_text()
