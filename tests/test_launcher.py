"""`open-r1-ext launch`: the run through submitit, on the real local SLURM cluster and as local processes.

One `launch(recipe, executor_factory)` for both executors: the server comes up, the trainer does its steps, and
the trainer job cancels the server afterwards, so nothing of the run is left. An interrupted launch (SIGTERM)
cancels its jobs; `--dry-run` and an invalid recipe submit nothing; a preempted trainer requeues a fresh task.
"""

from __future__ import annotations

import json
import pickle
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from open_r1_ext.config.recipe import load_recipe
from open_r1_ext.launch.slurm_plan import SlurmPlan
from open_r1_ext.launch.submitit_launcher import EXECUTORS, TrainerTask, launch
from tests.slurm_helpers import (JOB_WAIT_S, RECIPE, REPO, assert_trained, job_env, job_processes, run_script,
                                 sglang_on_cpu, wait_until)


def processes_of(run) -> list[str]:
    """Command lines of the processes still serving or training for this run: every one names its run directory (the
    servers' --config and --weight-dirs, the jobs' and the trainer's --set=trainer.output_dir), whatever port a
    replica took."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = cmdline.read_bytes().decode(errors="replace").replace("\0", " ")
        except OSError:
            continue
        if str(run.run_dir) in command:
            found.append(command)
    return found


@pytest.mark.parametrize("executor, layout", [("slurm", "sglang"), ("local", "separate")])
def test_launch_runs_the_servers_then_the_trainer_and_cancels_the_servers(executor, layout, request, tiny_run, monkeypatch):
    """On SLURM with two generation replicas of real SGLang on the CPU (`device: cpu`, the SGLang venv's python; the
    reference on the trainer): both serve and confirm every sync (`min_replicas=2`, so the trainer starts with both:
    with the default 1 it may start with one and the other joins later), and every process of theirs is gone at the
    end; locally with built-in servers, the reference on a server of its own. (The built-in server's replicas on
    SLURM: tests/test_slurm.py.)"""
    if executor == "slurm":
        request.getfixturevalue("slurm_cluster")
        # first: tiny_run's own port then applies to this spec
        tiny_run.overrides[:0] = [f"servers.generation={sglang_on_cpu(request.getfixturevalue('sglang_python'))}"]
        tiny_run.overrides += ["servers.generation.replicas=2", "servers.generation.min_replicas=2"]
    monkeypatch.chdir(REPO)  # recipe paths are relative to the repository root, as for sbatch
    reference = {"sglang": "local", "separate": "{dtype: float32, resources: {gpus_per_node: 0, cpus_per_task: 1}}"}
    tiny_run.overrides.append(f"servers.reference={reference[layout]}")
    lines: list[str] = []
    code = launch(load_recipe(RECIPE, tiny_run.overrides), EXECUTORS[executor], tiny_run.overrides, echo=lines.append)
    output, status = "\n".join(lines), tiny_run.status()
    assert code == 0, f"{output}\n{status}"
    roles = ["server", "ref-server"] if layout == "separate" else ["server"]
    ids = tiny_run.job_ids()
    replicas = {role: ids[f"{role.upper().replace('-', '_')}_JOB"].split(",") for role in roles}
    assert len(replicas["server"]) == (2 if executor == "slurm" else 1)
    ready = next(line for line in lines if line.startswith("servers ready: "))
    assert all(f"'{job}': 'http://" in ready for jobs in replicas.values() for job in jobs), ready
    logs = tiny_run.run_dir / "logs"
    server_logs = [logs / role / f"{job}_0_log.out" for role, jobs in replicas.items() for job in jobs]
    assert_trained(tiny_run, *logs.glob("trainer/*_0_log.out"), *server_logs)  # every replica served
    if executor == "slurm":
        syncs = [e for e in map(json.loads, (tiny_run.run_dir / "weight_sync.jsonl").read_text().splitlines())
                 if e["role"] == "generation"]
        assert syncs and all(sorted(e["replicas"]) == sorted(replicas["server"]) for e in syncs)  # both confirmed each
        for role, job in [*(("server", job) for job in replicas["server"]), ("trainer", ids["TRAINER_JOB"])]:
            task_log = (logs / role / f"{job}_0_log.err").read_text()  # what submitit's srun gave each task
            resources = rf"\] {role} on \S+: resources: CUDA_VISIBLE_DEVICES=\(unset\) cpus=1 "
            assert re.search(resources, task_log), task_log[-2000:]
    assert f"trainer job {ids['TRAINER_JOB']}: succeeded" in status
    server_ids = " ".join(job for jobs in replicas.values() for job in jobs)
    assert f"trainer job {ids['TRAINER_JOB']}: cancelled server job(s) {server_ids}" in status, status
    tiny_run.wait_for_no_jobs()
    wait_until(lambda: not processes_of(tiny_run), 30, "the run's processes to exit")
    if executor == "slurm":  # SGLang's scheduler and detokenizer name no run directory: their job's environment does
        wait_until(lambda: not any(job_processes(job) for job in replicas["server"]), 30, "the servers' processes to exit")


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


def test_dry_run_prints_every_job_and_submits_nothing(slurm_cluster, tiny_run):
    """Two generation replicas on two partitions (a resources list), a reference server, the trainer."""
    replicas = ["--set", "servers.generation.replicas=2", "--set", "servers.generation.resources=[{gpus_per_node: 0}, "
                "{gpus_per_node: 0, cpus_per_task: 2, partition: cpu-big}]"]
    result = run_script(sys.executable, "-m", "open_r1_ext.cli", "launch", RECIPE, *tiny_run.set_args, *replicas,
                        "--set", "servers.reference={resources: {gpus_per_node: 0}}", "--dry-run")
    assert result.returncode == 0, result.stderr
    out, name, run_dir = result.stdout, tiny_run.job_name, tiny_run.run_dir
    for title, role, partition in (("server job 1/2", "server", "debug"), ("server job 2/2", "server", "cpu-big"),
                                   ("ref-server job", "ref-server", "debug"), ("trainer job", "trainer", "debug")):
        assert f"\n{title}: 1 node(s)" in out and f"sbatch --job-name={name}-{role} --time=00:30:00 " in out
        assert f"submitit parameters of the {title}: {{'name': '{name}-{role}'" in out
        assert re.search(rf"{title}: .*\n  sbatch [^\n]* --partition={partition} ", out), out
    assert f"advertised in {run_dir}/replicas/server/<job id>.addr once healthy; the trainer starts once 1 of 2 are" in out
    assert "'slurm_partition': 'cpu-big', 'cpus_per_task': 2" in out
    assert "-m open_r1_ext.server --model-path" in out
    assert "accelerate.commands.launch --cpu --dynamo_backend no --num_machines 1 --num_processes 1" in out
    assert f"--server-dir {run_dir}/replicas/server --ref-dir {run_dir}/replicas/ref-server" in out
    assert not tiny_run.jobs() and not tiny_run.run_dir.exists()


def test_invalid_recipe_launches_nothing(slurm_cluster, tiny_run):
    result = run_script(sys.executable, "-m", "open_r1_ext.cli", "launch", RECIPE, *tiny_run.set_args,
                        "--set", "servers.reference=sideways")
    assert result.returncode == 2
    assert "servers.reference: 'sideways' is not one of generation, local, none" in result.stderr
    assert "nothing submitted" in result.stderr
    assert not tiny_run.jobs() and not tiny_run.run_dir.exists()


def test_preempted_trainer_requeues_a_fresh_task(tiny_model, tmp_path, monkeypatch):
    """submitit's `checkpoint` hands back a fresh task of the same run (the requeue rule and the stop of the training
    process are the job runtime's: tests/test_jobs.py)."""
    monkeypatch.chdir(REPO)
    overrides = [f"model.name_or_path={tiny_model}", f"trainer.output_dir={tmp_path}"]
    task = TrainerTask(SlurmPlan(load_recipe(RECIPE, overrides), overrides))
    requeued = pickle.loads(pickle.dumps(task.checkpoint().function))
    assert isinstance(requeued, TrainerTask) and requeued is not task
    assert requeued.plan.recipe_args() == task.plan.recipe_args()
