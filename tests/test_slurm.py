"""slurm/*.slurm on a real SLURM cluster (tools/local_slurm.sh), and the plan their jobs read (slurm_plan.py).

End to end: `sbatch slurm/grpo.slurm` runs server replicas and a trainer job on the tiny model, and nothing of the run
is left in squeue afterwards (real SGLang on the CPU under sbatch: every shipped recipe in test_rehearsal.py); scancel
of the servers, or a server that never comes up, stops the trainer with an error naming the server job; an invalid
recipe submits nothing. The plan tests need no cluster.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from open_r1_ext.config.recipe import load_recipe
from open_r1_ext.launch.jobs import JobContext, node_command, rendezvous_port
from open_r1_ext.launch.local_server import SharedMemoryFiles
from open_r1_ext.launch.run_key import write_run_key
from open_r1_ext.launch.slurm_plan import SUBMITIT, PlanError, ShellVar, SlurmPlan, shell_join, time_minutes
from tests.slurm_helpers import (JOB_WAIT_S, NOT_ENDED, RECIPE, REPO, assert_trained, job_processes, run_script,
                                 sglang_on_cpu, slurm_state, wait_until)


# --------------------------------------------------------------------------------- plan (no SLURM)
def tiny_plan(tiny_model, *overrides) -> SlurmPlan:
    items = [f"model.name_or_path={tiny_model}", *overrides]
    return SlurmPlan(load_recipe(REPO / RECIPE, items), items)


def test_sbatch_options_come_from_the_recipe(tiny_model):
    plan = tiny_plan(tiny_model, "slurm.account=proj", "slurm.qos=high", "slurm.constraint=h100", "slurm.exclusive=true",
                     "slurm.trainer={nodes: 1, gpus_per_node: 4, processes_per_node: 1, cpus_per_task: 8, mem: 64G}",
                     "slurm.extra_sbatch=['#SBATCH --reservation=r1', --requeue]", "trainer.output_dir=/runs/x")
    assert plan.sbatch_args("trainer") == [
        "--job-name=grpo-tiny-trainer", "--time=00:30:00", "--nodes=1", "--ntasks-per-node=1", "--partition=debug",
        "--account=proj", "--qos=high", "--constraint=h100", "--cpus-per-task=8", "--mem=64G", "--gres=gpu:4",
        "--exclusive", "--reservation=r1", "--requeue",
        "--output=/runs/x/logs/trainer-%j.out", "--error=/runs/x/logs/trainer-%j.err", "--open-mode=append"]
    assert not any(a.startswith("--gres") for a in plan.sbatch_args("server"))  # gpus_per_node: 0
    assert plan.srun_args("trainer") == ["--nodes=1", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                                         "--cpus-per-task=8", "--gres=gpu:4"]
    params = plan.submitit_parameters("trainer")
    assert params["slurm_gres"] == "gpu:4" and params["timeout_min"] == 30 and params["slurm_exclusive"] is True
    assert params["slurm_additional_parameters"] == {"reservation": "r1", "requeue": True}


def test_submitits_own_srun_gives_the_task_the_jobs_cpus(tiny_model, tmp_path):
    """The sbatch script submitit writes for a job: its srun asks for the job's CPUs again (Slurm 22.05-23.02's srun
    does not inherit --cpus-per-task from sbatch: the task would get one CPU)."""
    import submitit

    plan = tiny_plan(tiny_model, "slurm.trainer={gpus_per_node: 4, processes_per_node: 1, cpus_per_task: 8}")
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="slurm")
    executor.update_parameters(**plan.submitit_parameters("trainer"))
    script = executor._executor._make_submission_file_text("python -m task", "uid")  # what submitit sbatches
    assert "#SBATCH --cpus-per-task=8" in script and "#SBATCH --gres=gpu:4" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert " --cpus-per-task=8 " in srun, script


def test_sglang_servers_span_nodes_and_the_trainer_gets_both_address_dirs(tiny_model):
    sglang = "engine: sglang, tp_size: 16, mem_fraction_static: 0.8, dtype: float32, resources: {nodes: 2, gpus_per_node: 8}"
    plan = tiny_plan(tiny_model, f"servers.generation={{{sglang}}}", f"servers.reference={{{sglang}, extra_args: [--enable-metrics]}}",
                     "slurm.trainer={nodes: 2, gpus_per_node: 8}", "trainer.per_device_train_batch_size=4",
                     "model.trust_remote_code=true")
    assert plan.server_roles == ["server", "ref-server"]
    node, head = ShellVar("SLURM_NODEID"), ShellVar("HEAD_NODE")
    serve = shell_join(plan.server_command("ref-server", node, head))
    assert serve.endswith("-m sglang.launch_server --model-path " + str(tiny_model) + " --host 0.0.0.0 --port 30001 "
                          "--tp-size 16 --dp-size 1 --dtype float32 --mem-fraction-static 0.8 --trust-remote-code --nnodes 2 --node-rank \"$SLURM_NODEID\" "
                          f"--dist-init-addr \"$HEAD_NODE\":30101 --config {plan.files.run_dir}/api_key.yaml --enable-metrics")
    train = plan.trainer_command(1, "node-7", 41234)
    assert train[3:16] == ["--multi_gpu", "--dynamo_backend", "no", "--num_machines", 2, "--num_processes", 16,
                           "--machine_rank", 1, "--main_process_ip", "node-7", "--main_process_port", 41234]
    run_dir = plan.files.run_dir
    assert train[-4:] == ["--server-dir", f"{run_dir}/replicas/server", "--ref-dir", f"{run_dir}/replicas/ref-server"]


def test_sglang_on_the_cpu_runs_under_its_own_python(tiny_model, tmp_path, monkeypatch):
    """`device: cpu`: SGLang's launcher run by the spec's interpreter (a path relative to the launch directory, made
    absolute) with the CPU engine's environment and flags, LoRA through its torch-native kernels; the built-in server
    takes `--device` too."""
    monkeypatch.chdir(REPO)
    venv = tmp_path / "venv-sglang" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)  # a venv's python is a link: kept as named, not resolved
    spec = (f"{{engine: sglang, device: cpu, python: {os.path.relpath(venv / 'python', REPO)}, "
            "resources: {gpus_per_node: 0}}")
    plan = tiny_plan(tiny_model, f"servers.generation={spec}", f"servers.reference={spec}", "model.use_peft=true",
                     "trainer.output_dir=/runs/x")
    serve = shell_join(plan.server_command("server", 0, "node-1"))
    assert serve == (f"env SGLANG_USE_CPU_ENGINE=1 SGLANG_PYSPY_DUMP_BEFORE_CRASH=0 SGLANG_CUDA_COREDUMP_BEFORE_CRASH=0 "
                     f"{venv}/python -m sglang.launch_server --model-path {tiny_model} "
                     "--host 0.0.0.0 --port 30000 --tp-size 1 --dp-size 1 --device cpu --attention-backend torch_native "
                     "--max-total-tokens 8192 --sleep-on-idle --lora-backend torch_native --enable-lora --max-lora-rank 16 "
                     "--lora-target-modules all --config /runs/x/api_key.yaml")
    assert "--lora-backend" not in shell_join(plan.server_command("ref-server", 0, "node-1"))  # no adapters there
    builtin = tiny_plan(tiny_model, "servers.generation.device=cpu", "servers.generation.python=python3")
    assert shell_join(builtin.server_command("server", 0, "node-1")).startswith(
        f"python3 -m open_r1_ext.server --model-path {tiny_model} --host 0.0.0.0 --port 30000 --dtype float32 --device cpu")


def test_each_node_runs_its_own_command_from_the_slurm_environment(tiny_model):
    """What `jobs node` (srun'd on every node) runs: exact words, no shell in between, rank and head from SLURM."""
    sglang = "{engine: sglang, tp_size: 16, resources: {nodes: 2, gpus_per_node: 8}}"
    plan = tiny_plan(tiny_model, "servers.api_key=it's $ecret", "trainer.output_dir=/runs/with space",
                     f"servers.generation={sglang}", f"servers.reference={sglang}")
    env = {"SLURM_JOB_ID": "42", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[3-4,7]", "SLURM_RESTART_COUNT": "2"}
    ctx = JobContext.from_slurm_env(env)
    assert (ctx.job_id, ctx.node_rank, ctx.nodes, ctx.head_node, ctx.restart_count) == ("42", 1, ("gpu3", "gpu4", "gpu7"), "gpu3", 2)
    serve = node_command(plan, "ref-server", ctx)
    assert serve[serve.index("--node-rank") + 1] == "1" and serve[serve.index("--dist-init-addr") + 1] == "gpu3:30101"
    assert serve[serve.index("--config") + 1] == "/runs/with space/api_key.yaml" and "it's $ecret" not in serve
    train = node_command(plan, "trainer", ctx, port=41234)
    assert train[train.index("--machine_rank") + 1] == "1" and train[train.index("--main_process_ip") + 1] == "gpu3"
    assert train[train.index("--main_process_port") + 1] == "41234"  # the port the job took on its first node
    assert train[-4:] == ["--server-dir", "/runs/with space/replicas/server", "--ref-dir", "/runs/with space/replicas/ref-server"]
    assert plan.sbatch_args("server")[-2] == "--error=/runs/with space/logs/server-%j.err"


def test_the_trainer_jobs_nodes_meet_on_a_port_its_first_node_took(tiny_model, tmp_path):
    """accelerate's rendezvous port: a free one on the first node, not a fixed one (two runs on a node collided on
    29500). Under submitit every node runs its own task: the first node's writes it to the run directory, where the
    others wait for it; under sbatch the batch step, on the first node, passes it to each node's srun task."""
    plan = tiny_plan(tiny_model, f"trainer.output_dir={tmp_path}")
    nodes = ("gpu3", "gpu4")
    port = rendezvous_port(plan, JobContext("42", 0, nodes, launcher=SUBMITIT))
    assert port != 29500 and rendezvous_port(plan, JobContext("42", 1, nodes, launcher=SUBMITIT)) == port
    assert rendezvous_port(plan, JobContext("43", 0, nodes)) != 29500  # sbatch: passed on srun's line, no file
    assert [path.name for path in tmp_path.glob(".rendezvous-*")] == [".rendezvous-42.0.port"]


@pytest.mark.parametrize("override, key", [
    ("slurm.time=soon", "slurm.time"),
    ("slurm.extra_sbatch=[reservation=r1]", "slurm.extra_sbatch[0]"),
    ("slurm.trainer={nodes: 2, gpus_per_node: 0}", "slurm.trainer"),
])
def test_plan_errors_name_the_key(tiny_model, override, key):
    with pytest.raises(PlanError, match=re.escape(key)):
        tiny_plan(tiny_model, override)


def test_time_limits_in_minutes():
    assert [time_minutes(t) for t in ("90", "90:30", "04:00:00", "1-00:00:00", "2-3", "1-2:30")] == [90, 91, 240, 1440, 3060, 1590]


# ---------------------------------------------------------------------------------- real SLURM
def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def generation_syncs(run_dir: Path) -> list[dict]:
    """The confirmed syncs of the generation servers (weight_sync.jsonl), each naming the replicas that confirmed it."""
    return [e for e in jsonl(run_dir / "weight_sync.jsonl") if e["role"] == "generation"]


def test_grpo_slurm_runs_two_replicas_one_replaced_mid_run_and_leaves_no_job(slurm_cluster, tiny_run, tmp_path):
    """`replicas: 2, min_replicas: 2` under sbatch: three jobs; both replicas serve batches and confirm every sync.
    Once both have served, the first is scancelled: the trainer waits (below min_replicas) until a replacement from
    `open-r1-ext add-server` joins with the current weights (it confirms every sync from its first on) and serves;
    the run finishes, every step once; the trainer job cancels the replicas left, and nothing of the run is left in
    squeue or the address directory."""
    tiny_run.overrides += ["servers.generation.replicas=2", "servers.generation.min_replicas=2", "trainer.max_steps=12"]
    submitted = run_script("sbatch", "--parsable", f"--output={tmp_path}/submit-%j.out", "slurm/grpo.slurm", RECIPE,
                           *tiny_run.set_args)
    assert submitted.returncode == 0, submitted.stderr
    submit_job = submitted.stdout.strip().split(";")[0]
    run_dir, rollouts = tiny_run.run_dir, tiny_run.run_dir / "rollouts.jsonl"
    try:
        wait_until(lambda: (run_dir / "jobs.env").exists() and "TRAINER_JOB" in (run_dir / "jobs.env").read_text()
                   or slurm_state(submit_job) not in ("PENDING", "CONFIGURING", "RUNNING"), 120, "grpo.slurm to submit",
                   tiny_run.log_tails)
        ids = tiny_run.job_ids()
        first, second = ids["SERVER_JOB"].split(",")
        trainer = ids["TRAINER_JOB"]
        wait_until(lambda: {first, second} <= {r for e in jsonl(rollouts) for r in e.get("replicas", [])}
                   and any({first, second} <= set(e["replicas"]) for e in generation_syncs(run_dir)), JOB_WAIT_S,
                   "both replicas to serve a batch and confirm a sync", tiny_run.log_tails)
        subprocess.run(["scancel", first], check=True)
        added = run_script(sys.executable, "-m", "open_r1_ext.cli", "add-server", run_dir)
        assert added.returncode == 0, added.stderr
        third = tiny_run.job_ids()["SERVER_JOB"].split(",")[2]
        tiny_run.wait_for_no_jobs()
    finally:
        subprocess.run(["scancel", submit_job], check=False)
    logs = run_dir / "logs"
    assert_trained(tiny_run, logs / f"trainer-{trainer}.out", *(logs / f"server-{job}.out" for job in (first, second, third)))
    assert slurm_state(trainer) == "COMPLETED"
    status = tiny_run.status()
    assert f"server job {third}: healthy at http://" in status and f"trainer job {trainer}: succeeded" in status
    assert f"trainer job {trainer}: cancelled server job(s) {second} {third}" in status
    syncs = generation_syncs(run_dir)
    assert [e["step"] for e in syncs] == list(range(1, len(syncs) + 1)) and len(syncs) >= 11  # each step once
    assert all(second in e["replicas"] for e in syncs)  # the replica that stayed confirmed every sync
    left = max(i for i, e in enumerate(syncs) if first in e["replicas"])
    assert all(first in e["replicas"] for e in syncs[:left + 1])  # until it was cancelled
    joined = next(i for i, e in enumerate(syncs) if third in e["replicas"])
    assert joined > left and all(third in e["replicas"] for e in syncs[joined:])
    assert any(third in e.get("replicas", []) for e in jsonl(rollouts))  # the newcomer served batches
    assert not list((run_dir / "replicas" / "server").glob("*.addr"))  # every replica withdrew its address


def start_long_run(run) -> tuple[str, str]:
    """`bash slurm/grpo.slurm` of a 500-step run; `(server job, trainer job)` once the trainer has done a step."""
    run.overrides.append("trainer.max_steps=500")
    submitted = run_script("bash", "slurm/grpo.slurm", RECIPE, *run.set_args)
    assert submitted.returncode == 0, submitted.stderr
    ids = run.job_ids()
    trainer_out = run.run_dir / "logs" / f"trainer-{ids['TRAINER_JOB']}.out"
    wait_until(lambda: trainer_out.exists() and re.search(r"step\s+1\b", trainer_out.read_text()), JOB_WAIT_S,
               "the trainer's first step", run.log_tails)
    return ids["SERVER_JOB"], ids["TRAINER_JOB"]


def test_scancel_of_every_replica_stops_the_trainer_with_an_error_naming_them(slurm_cluster, tiny_run):
    """Both replicas scancelled: the trainer waits for replicas (up to trainer.server_wait_timeout), then stops with a
    checkpoint to resume from; the trainer job's end names both server jobs and their URLs."""
    tiny_run.overrides += ["servers.generation.replicas=2", "trainer.max_retries=2", "trainer.request_timeout=10",
                           "trainer.server_wait_timeout=60"]  # also each server job's bound for its server's start:
    # 20 s was too short for a built-in server under sbatch on a fresh clone's busy machine
    servers, trainer = start_long_run(tiny_run)
    subprocess.run(["scancel", *servers.split(",")], check=True)
    tiny_run.wait_for_no_jobs()
    assert slurm_state(trainer) == "FAILED"
    status = tiny_run.status()
    urls = {job: re.search(rf"server job {job}: healthy at (http://\S+)", status).group(1) for job in servers.split(",")}
    failure = f"trainer job {trainer}: failed (exit 1)" + "".join(
        f"; server job {job} ({url}) is no longer running (CANCELLED)" for job, url in urls.items())
    assert failure in status
    trainer_err = (tiny_run.run_dir / "logs" / f"trainer-{trainer}.err").read_text()
    assert failure in trainer_err
    stopped = re.search(r"Training stopped at step \d+\. A checkpoint to resume from is in (\S+):", trainer_err)
    assert stopped and (Path(stopped.group(1)) / "trainer_state.json").is_file(), trainer_err[-3000:]


def test_a_requeued_trainer_keeps_its_servers_which_stop_once_it_is_gone(slurm_cluster, tiny_run):
    """The requeue rule under sbatch (scontrol's restart count above the job's SLURM_RESTART_COUNT), then the
    server's watchdog: the trainer, cancelled while pending again, never runs its end; the server stops by itself."""
    server, trainer = start_long_run(tiny_run)
    subprocess.run(["scontrol", "requeue", trainer], check=True)
    wait_until(lambda: f"trainer job {trainer}: requeued; it resumes from the last checkpoint" in tiny_run.status(), 60,
               "the trainer job to record its requeue", tiny_run.log_tails)
    assert slurm_state(server) == "RUNNING" and "cancelled server job" not in tiny_run.status()
    subprocess.run(["scancel", trainer], check=True)
    tiny_run.wait_for_no_jobs()
    assert f"server job {server}: trainer job {trainer} is gone (CANCELLED); stopping the server" in tiny_run.status()


def test_a_server_that_never_comes_up_fails_the_trainer_naming_the_server_job(slurm_cluster, tiny_run):
    tiny_run.overrides.append("servers.generation.extra_args=[--no-such-flag]")
    submitted = run_script("bash", "slurm/grpo.slurm", RECIPE, *tiny_run.set_args)
    assert submitted.returncode == 0, submitted.stderr
    ids = tiny_run.job_ids()
    server, trainer = ids["SERVER_JOB"], ids["TRAINER_JOB"]
    tiny_run.wait_for_no_jobs()
    logs = tiny_run.run_dir / "logs"
    assert "unrecognized arguments: --no-such-flag" in (logs / f"server-{server}.err").read_text()
    assert slurm_state(server) == "FAILED" and slurm_state(trainer) == "FAILED"
    assert (f"server job {server} ended (FAILED) before its server became healthy; see {logs}/server-{server}.err"
            in (logs / f"trainer-{trainer}.err").read_text())
    assert f"trainer job {trainer}: failed (exit 1); server job {server} (no URL yet) is no longer running" in tiny_run.status()


def test_invalid_recipe_submits_nothing(slurm_cluster, tiny_run):
    result = run_script("bash", "slurm/grpo.slurm", RECIPE, *tiny_run.set_args, "--set", "trainer.max_stepz=4")
    assert result.returncode != 0
    assert "trainer.max_stepz: unknown key (did you mean 'max_steps'?)" in result.stderr
    assert "nothing started" in result.stderr
    assert not tiny_run.jobs()  # (the queue as a whole may hold other users' jobs meanwhile)
    assert not tiny_run.run_dir.exists()


def test_scancel_of_the_trainer_saves_a_checkpoint_and_cancels_the_servers(slurm_cluster, tiny_run):
    """SIGTERM from SLURM (scancel; a time limit sends the same) reaches the trainer, which saves the step it has
    finished and stops within the cluster's KillWait; the trainer job then ends the run."""
    tiny_run.overrides.append("trainer.save_strategy='no'")  # the only checkpoint: the one SIGTERM asks for
    server, trainer = start_long_run(tiny_run)
    subprocess.run(["scancel", trainer], check=True)
    tiny_run.wait_for_no_jobs()
    trainer_err = (tiny_run.run_dir / "logs" / f"trainer-{trainer}.err").read_text()
    stopped = re.search(r"SIGTERM: stopped after step (\d+) with a checkpoint in (\S+);", trainer_err)
    assert stopped, trainer_err[-3000:]
    assert (Path(stopped.group(2)) / "trainer_state.json").is_file()
    status = tiny_run.status()
    assert f"trainer job {trainer}: SIGTERM: the trainer saves a checkpoint of its last finished step" in status
    # the trainer job cancels its servers, or (SIGKILLed after the cluster's KillWait, 5 s here) their watchdog stops them
    assert (f"cancelled server job(s) {server}" in status
            or f"server job {server}: trainer job {trainer} is gone (CANCELLED); stopping the server" in status)


def test_a_sglang_server_killed_under_sbatch_leaves_no_shared_memory_file(slurm_cluster, tiny_run, sglang_python,
                                                                          tmp_path):
    """`sbatch slurm/serve.slurm` with real SGLang on the CPU; SIGKILL to every process of the server (its launcher,
    scheduler, detokenizer and their resource tracker), as the OOM killer would: SGLang's own unlinks never run. The
    node's task under srun (`jobs.run_node_server`) removes what they left in /dev/shm, and the job fails."""
    tiny_run.overrides[:0] = [f"servers.generation={sglang_on_cpu(sglang_python)}", "servers.reference=local"]
    write_run_key(load_recipe(REPO / RECIPE, tiny_run.overrides), tiny_run.run_dir)  # what grpo.slurm writes first
    submitted = run_script("sbatch", "--parsable", f"--job-name={tiny_run.job_name}-server",
                           f"--output={tmp_path}/server-%j.out", "slurm/serve.slurm", RECIPE, *tiny_run.set_args)
    assert submitted.returncode == 0, submitted.stderr
    job, addresses = submitted.stdout.strip(), tiny_run.run_dir / "replicas" / "server"
    wait_until(lambda: list(addresses.glob("*.addr")) or slurm_state(job) not in NOT_ENDED, JOB_WAIT_S,
               "the SGLang server job to answer /health")
    assert list(addresses.glob("*.addr")), next(tmp_path.glob("server-*.out")).read_text()[-3000:]
    task = next(pid for pid, command in job_processes(job).items()  # the node's task, not srun's line that runs it
                if "-m open_r1_ext.launch.jobs node " in command and Path(command.split()[0]).name != "srun")
    server = psutil.Process(task).children(recursive=True)
    held = SharedMemoryFiles()
    held.note(task)
    assert sorted(Path(path).name[:7] for path in held.files) == ["sem.mp-", "sglang_"], held.files
    log = next(tmp_path.glob("server-*.out"))

    def noted() -> bool:  # the node's task says what it noted: it looks every jobs.NOTE_SHARED_MEMORY_S
        said = re.findall(r"in /dev/shm, removed once it is gone: (.*)", log.read_text())
        return bool(said) and set(held.files) <= set(said[-1].split())

    wait_until(noted, 60, "the node's task to note the server's files")
    for process in server:
        process.kill()
    wait_until(lambda: slurm_state(job) not in NOT_ENDED, JOB_WAIT_S, "the server job to end")
    assert slurm_state(job) == "FAILED"
    assert not [path for path in held.files if os.path.exists(path)], log.read_text()[-3000:]
