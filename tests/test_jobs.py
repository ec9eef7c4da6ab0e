"""The job runtime behind both launch paths (open_r1_ext/launch/jobs.py), without a cluster: fake `squeue` and
`scancel` on PATH record every call. One squeue call per poll for all of a run's jobs, backing off to POLL_S; the
trainer job ends the run (cancels the live servers) unless SLURM is starting it again (the requeue rule)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import pytest

from open_r1_ext.config.recipe import load_recipe
from open_r1_ext.launch import jobs
from open_r1_ext.launch.jobs import (SUBMITIT, JobContext, JobRef, JobWatch, LaunchError, end_run, register_jobs,
                                     run_trainer_job)
from open_r1_ext.launch.slurm_plan import POLL_S, TRAINER, SlurmPlan
from tests.slurm_helpers import RECIPE, REPO


@pytest.fixture()
def plan(tiny_model, tmp_path, monkeypatch):
    """The tiny recipe with a server URL given (no server job), its run directory in tmp_path."""
    monkeypatch.chdir(REPO)
    overrides = [f"model.name_or_path={tiny_model}", f"trainer.output_dir={tmp_path / 'run'}",
                 "servers.generation.url=http://127.0.0.1:9"]
    return SlurmPlan(load_recipe(RECIPE, overrides), overrides)


def test_context_needs_a_slurm_job():
    with pytest.raises(LaunchError, match="submit this job with sbatch"):
        JobContext.from_slurm_env({"PATH": "/bin"})


def test_one_squeue_call_for_all_jobs_backing_off_to_poll_s(fake_slurm):
    calls = fake_slurm("1|RUNNING|0\n2|PENDING|3\n")
    now = [0.0]
    refs = [JobRef("server", "1"), JobRef("ref-server", "2"), JobRef("trainer", "3")]
    watch = JobWatch(refs, clock=lambda: now[0])
    assert [watch.state(ref) for ref in refs] == ["RUNNING", "PENDING", "GONE"]  # 3: squeue no longer knows it
    assert watch.restarts(refs[1]) == 3 and not watch.alive(refs[2])
    assert calls.read_text().splitlines() == ["squeue -h --states=all -j 1,2,3 -O JobID:|,State:|,RestartCnt:"]
    polled_at = [0.0]
    for t in (0.5, 1.0, 1.5, 2.9, 3.0, 6.9, 7.0, 15.0, 24.0, 25.0, 35.0):
        now[0] = t
        before = len(calls.read_text().splitlines())
        for ref in refs:
            watch.state(ref)
        if len(calls.read_text().splitlines()) > before:
            polled_at.append(t)
    assert polled_at == [0.0, 1.0, 3.0, 7.0, 15.0, 25.0, 35.0]  # intervals 1, 2, 4, 8, then POLL_S
    assert POLL_S == 10
    watch.refresh()  # before a decision: ask now
    watch.state(refs[0])
    assert len(calls.read_text().splitlines()) == len(polled_at) + 1


def test_a_busy_controller_counts_as_alive(fake_slurm):
    fake_slurm(squeue_error="slurm_load_jobs error: Socket timed out on send/recv operation")
    server = JobRef("server", "1")
    assert JobWatch([server]).state(server) == "UNKNOWN" and JobWatch([server]).alive(server)


@pytest.mark.parametrize("server_state, cancelled", [("RUNNING", "5 6"), ("CANCELLED", "6")])
def test_the_trainer_job_ends_the_run_and_cancels_every_live_replica(fake_slurm, plan, server_state, cancelled):
    """Replica 6 was added to jobs.env during the run (add-server): the trainer job never watched it, yet cancels it."""
    calls = fake_slurm(f"77|COMPLETING|0\n5|{server_state}|0\n6|RUNNING|0\n")
    ctx = JobContext("77", 0, ("node-1",), restart_count=0)
    me, server = JobRef(TRAINER, "77", log="/logs/trainer-77.err"), JobRef("server", "5")
    register_jobs(plan.files, [server, me], plan, "sbatch")
    register_jobs(plan.files, [JobRef("server", "6"), server])  # 5 again: listed once
    assert plan.files.jobs.read_text().splitlines()[:4] == ["SERVER_JOB=5,6", "TRAINER_JOB=77", "EXECUTOR=slurm",
                                                            "LAUNCHER=sbatch"]
    jobs.record(plan.files, "server job 5: healthy at http://node-2:30000", echo=lambda m: None)  # its URL
    end_run(plan, ctx, me, 1, JobWatch([me, server]), echo=lambda m: None)
    status = (plan.files.status).read_text()
    assert f"trainer job 77: cancelled server job(s) {cancelled}" in status
    assert calls.read_text().splitlines()[-1] == f"scancel {cancelled}"
    if server_state == "RUNNING":
        assert "trainer job 77: failed (exit 1); see /logs/trainer-77.err" in status
    else:
        assert ("trainer job 77: failed (exit 1); server job 5 (http://node-2:30000) is no longer running (CANCELLED)"
                in status)


def test_a_requeued_trainer_stops_training_and_keeps_the_servers(fake_slurm, plan, monkeypatch, signal_handlers):
    """submitit's checkpoint requeues the job through scontrol and exits (SystemExit, here from a SIGUSR2 handler):
    SLURM then counts one restart more than this start's SLURM_RESTART_COUNT; sbatch's requeue does the same."""
    calls = fake_slurm("77|REQUEUED|1\n")
    started: list[subprocess.Popen] = []
    spawn = jobs._spawn
    monkeypatch.setattr(jobs, "node_command", lambda *args: ["sleep", "60"])
    monkeypatch.setattr(jobs, "_spawn", lambda cmd: started.append(spawn(cmd)) or started[-1])

    def exit_like_submitit(signum, frame):
        raise SystemExit(-1)

    signal.signal(signal.SIGUSR2, exit_like_submitit)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR2))
    timer.start()
    ctx = JobContext("77", 0, ("localhost",), restart_count=0, launcher=SUBMITIT)
    with pytest.raises(SystemExit):
        run_trainer_job(plan, ctx, echo=lambda m: None)
    timer.cancel()
    assert started and started[0].returncode == -signal.SIGTERM  # training stopped; it resumes from output_dir
    status = plan.files.status.read_text()
    assert "trainer job 77: requeued; it resumes from the last checkpoint, the servers stay up" in status
    assert "scancel" not in calls.read_text()
