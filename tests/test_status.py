"""`open-r1-ext status` on a tiny run launched with `sbatch slurm/grpo.slurm` on the real local SLURM cluster, from a
shell with no environment activated (no venv on PATH, no PYTHON: slurm/python.sh finds the repository's .venv).

While the run trains, `status --json` shows its jobs running, the server healthy with its weight version, and
steps advancing; once the server is killed it shows it unhealthy; once the run has ended, its jobs' final states.
Without a Python environment slurm/python.sh says what it tried and how to fix it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.slurm_helpers import JOB_WAIT_S, RECIPE, REPO, fake_slurm_commands, wait_until


def bare_env() -> dict:
    """A login shell's environment with nothing activated: no venv on PATH, no PYTHON, no VIRTUAL_ENV."""
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != venv_bin)
    return env


def status(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "open_r1_ext.cli", "status", str(run_dir), *args],
                          capture_output=True, text=True, timeout=120)


def status_json(run_dir: Path) -> dict:
    result = status(run_dir, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_status_of_a_run_under_sbatch_with_nothing_activated(slurm_cluster, tiny_run, tmp_path):
    # trainer.server_wait_timeout: how long the trainer waits for the lost server to return, and also the bound of
    # the server's start (the server job's and the trainer's): 20 s ran out on a busy machine (CI, 2026-12-07)
    tiny_run.overrides += ["trainer.max_steps=500", "trainer.max_retries=2", "trainer.request_timeout=10",
                           "trainer.server_wait_timeout=60"]
    submitted = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/submit-%j.out", "slurm/grpo.slurm", RECIPE,
                                *tiny_run.set_args], cwd=REPO, env=bare_env(), capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    submit_out = tmp_path / f"submit-{submitted.stdout.strip().split(';')[0]}.out"
    run_dir = tiny_run.run_dir
    wait_until(lambda: (run_dir / "jobs.env").exists() and "TRAINER_JOB" in (run_dir / "jobs.env").read_text(), 120,
               f"grpo.slurm to submit the jobs ({submit_out})", tiny_run.log_tails)
    ids = tiny_run.job_ids()
    server, trainer = ids["SERVER_JOB"], ids["TRAINER_JOB"]

    # while it trains: jobs running, the server healthy at the address it advertised, steps advancing
    # polled every 3 s: a `status` call costs ~2 s of CPU, which a server starting beside it on 2 cores would lose
    first = wait_until(lambda: (s := status_json(run_dir))["trainer"] and s["trainer"]["step"] >= 2 and s, JOB_WAIT_S,
                       "the trainer's second step in status --json", tiny_run.log_tails, interval=3)
    assert first["schema"] == 1 and first["run_dir"] == str(run_dir)
    assert [(j["role"], j["job_id"], j["state"]) for j in first["jobs"]] == [("server", server, "RUNNING"),
                                                                         ("trainer", trainer, "RUNNING")]
    (srv,) = first["servers"]
    assert srv["role"] == "server" and srv["job_id"] == server and srv["healthy"]
    assert srv["url"] == f"http://{(run_dir / 'replicas' / 'server' / f'{server}.addr').read_text().strip()}"
    assert re.fullmatch(r"\d+", srv["weight_version"]) and int(srv["weight_version"]) >= 1
    progress = first["trainer"]
    assert progress["max_steps"] == 500 and not progress["finished"] and progress["steps_per_s"] > 0
    assert progress["eta_s"] > 0 and progress["age_s"] >= 0 and isinstance(progress["reward"], float)
    assert {"kl", "loss", "reward_std"} <= set(progress)
    assert first["last_sync"]["generation"]["step"] >= 1 and first["staleness"]["last"] == 0
    assert any(f"server job {server}: healthy at {srv['url']}" in e["message"] for e in first["events"])
    later = wait_until(lambda: (s := status_json(run_dir))["trainer"]["step"] > progress["step"] and s, 60,
                       "a later step in status --json", tiny_run.log_tails, interval=3)
    assert later["trainer"]["step"] > progress["step"]

    # the server killed outright (no clean-up: its address file stays): unhealthy, the URL still named
    subprocess.run(["scancel", "--signal=KILL", "--full", server], check=True)
    text = wait_until(lambda: "NOT HEALTHY" in (out := status(run_dir).stdout) and out, 60, "the server to show unhealthy",
                      tiny_run.log_tails, interval=3)
    assert f"server    server {server} {srv['url']}: NOT HEALTHY" in text and f"trainer {trainer}" in text
    down = status_json(run_dir)["servers"][0]
    assert not down["healthy"] and down["url"] == srv["url"] and down["weight_version"] is None and "/health" in down["error"]

    # after the run: the trainer failed on the lost server; status says so and --watch returns at once
    tiny_run.wait_for_no_jobs()
    final = status_json(run_dir)
    states = {j["role"]: j["state"] for j in final["jobs"]}
    assert states["trainer"] == "FAILED" and states["server"] != "RUNNING", states
    assert not final["servers"][0]["healthy"] and not final["trainer"]["finished"]
    assert any(f"trainer job {trainer}: failed" in e["message"] for e in final["events"])
    logs = "".join((run_dir / "logs" / f"trainer-{trainer}.{stream}").read_text() for stream in ("out", "err"))
    assert not re.search(r"(Future|Deprecation)Warning", logs), logs[-3000:]  # quiet under SLURM too
    watched = subprocess.run([sys.executable, "-m", "open_r1_ext.cli", "status", str(run_dir), "--watch", "1", "--json"],
                             capture_output=True, text=True, timeout=60)
    assert watched.returncode == 0 and len(watched.stdout.splitlines()) == 1, watched.stdout + watched.stderr


def test_without_an_environment_the_scripts_say_what_to_do(tmp_path):
    """A repository copy without .venv, on a PATH whose python lacks TRL: slurm/python.sh names what it tried."""
    shutil.copytree(REPO / "slurm", tmp_path / "slurm")
    result = subprocess.run(["bash", "slurm/grpo.slurm", RECIPE], cwd=tmp_path, env=bare_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert "no Python interpreter with open_r1_ext and its dependencies (trl) was found" in result.stderr
    assert f"{tmp_path}/.venv/bin/python (not found)" in result.stderr
    assert "make venv" in result.stderr and "PYTHON=/path/to/python sbatch slurm/grpo.slurm RECIPE" in result.stderr
    chosen = subprocess.run(["bash", "slurm/python.sh", "-c", "import sys; print(sys.executable)"], cwd=REPO,
                            env=bare_env(), capture_output=True, text=True, timeout=60)
    assert chosen.stdout.strip() == str(REPO / ".venv" / "bin" / "python"), chosen.stderr


def test_jobs_squeue_has_forgotten_get_their_state_from_sacct(tmp_path, monkeypatch):
    """After SLURM's MinJobAge squeue no longer lists a job; sacct (accounting, which the local test cluster does not
    keep: a fake sacct here) still knows how it ended. Without accounting the state stays GONE."""
    from open_r1_ext.launch.run_status import run_status

    bin_dir = tmp_path / "bin"
    calls = fake_slurm_commands(bin_dir, squeue_lines="11|RUNNING|0\n")
    (bin_dir / "sacct").write_text(f'#!/bin/sh\necho "sacct $*" >> {calls}\nprintf "12|CANCELLED by 0\\n13|COMPLETED\\n"\n')
    (bin_dir / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "jobs.env").write_text("SERVER_JOB=11\nREF_SERVER_JOB=12\nTRAINER_JOB=13\nEXECUTOR=slurm\nLAUNCHER=sbatch\n")
    jobs = run_status(run_dir)["jobs"]
    assert [(j["role"], j["job_id"], j["state"]) for j in jobs] == [
        ("server", "11", "RUNNING"), ("ref-server", "12", "CANCELLED"), ("trainer", "13", "COMPLETED")]
    assert calls.read_text().splitlines() == ["squeue -h --states=all -j 11,12,13 -O JobID:|,State:|,RestartCnt:",
                                              "sacct -n -X -P -o JobID,State -j 12,13"]  # one call each
    (bin_dir / "sacct").write_text("#!/bin/sh\necho 'Slurm accounting storage is disabled' >&2\nexit 1\n")
    assert [j["state"] for j in run_status(run_dir)["jobs"]] == ["RUNNING", "GONE", "GONE"]
