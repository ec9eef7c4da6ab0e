"""Helpers of the launch tests (tests/test_slurm.py, test_launcher.py, test_jobs.py): a tiny run with its own output
dir, port and job names, the submit shell's environment, waits, and fake `squeue`/`scancel` commands."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import REPO

RECIPE = "recipes/tiny/grpo.yaml"
JOB_WAIT_S = 240  # bound of every wait for a run's jobs to finish
NOT_ENDED = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")  # a job in one of these may still run


@dataclass
class TinyRun:
    """A run of the tiny recipe with its own output dir, server port and job-name prefix."""

    run_dir: Path
    job_name: str
    overrides: list

    @property
    def set_args(self) -> list:
        return [arg for item in self.overrides for arg in ("--set", item)]

    def jobs(self) -> list[tuple[str, str, str]]:
        """`(id, name, state)` of this run's jobs that squeue still lists."""
        if not shutil.which("squeue"):
            return []
        out = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], capture_output=True, text=True, check=True).stdout
        return [tuple(line.split()) for line in out.splitlines() if line.split()[1].startswith(self.job_name)]

    def job_ids(self) -> dict:
        return dict(line.split("=", 1) for line in (self.run_dir / "jobs.env").read_text().splitlines())

    def status(self) -> str:
        path = self.run_dir / "status.log"
        return path.read_text() if path.exists() else ""

    def wait_for_no_jobs(self) -> None:
        wait_until(lambda: not self.jobs(), JOB_WAIT_S, f"the jobs of {self.job_name} to leave squeue", self.log_tails)

    def log_tails(self, lines: int = 15) -> str:
        """The run's status.log and the last `lines` lines of each job's log, for a wait's failure message."""
        paths = [self.run_dir / "status.log", *sorted((self.run_dir / "logs").glob("*"))]
        return "".join(f"\n--- {path}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
                       for path in paths if path.is_file())


def job_env() -> dict:
    """The submit shell's environment: this venv first on PATH (jobs inherit it), and its python for the scripts."""
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHON=sys.executable)


def run_script(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(map(str, args)), cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=timeout)


def wait_until(predicate, timeout: float, what: str, explain=lambda: "", interval: float = 1.0):
    """The first true value of `predicate`, polled every `interval` s; after `timeout` s an AssertionError naming
    `what`, with what `explain()` says (e.g. `TinyRun.log_tails`: the logs that tell why)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{explain()}")
        time.sleep(interval)


def slurm_state(job_id: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    match = re.search(r"JobState=(\w+)", shown)
    return match.group(1) if match else "GONE"


def assert_trained(run: TinyRun, trainer_log: Path, *server_logs: Path) -> None:
    """The trainer did its steps and saved the model; each server answered its requests; weights were synced."""
    assert re.search(r"step\s+4\b", trainer_log.read_text()), trainer_log.read_text()[-3000:]
    assert (run.run_dir / "model.safetensors").exists()
    assert server_logs
    for server_log in server_logs:
        served = server_log.read_text()
        assert re.search(r"POST (/ref)?/generate HTTP/1.1\" 200", served), served[-2000:]
    sync_log = run.run_dir / "weight_sync.jsonl"
    assert sync_log.exists(), f"no {sync_log}: the trainer confirmed no weight sync"
    entries = [json.loads(line) for line in sync_log.read_text().splitlines() if line.strip()]
    assert entries and all("weight_version" in e for e in entries)


def sglang_on_cpu(python: str, **settings) -> str:
    """A server spec (YAML, for `--set servers.<role>=...`) of real SGLang on the CPU, run by `python` (the SGLang
    venv's interpreter), with `settings` added (e.g. `replicas=2`)."""
    extra = "".join(f", {key}: {value}" for key, value in settings.items())
    return (f"{{engine: sglang, device: cpu, python: {python}, dtype: float32, "
            f"resources: {{gpus_per_node: 0, cpus_per_task: 1}}{extra}}}")


def job_processes(job_id: str) -> dict[int, str]:
    """`{pid: command line}` of the processes still alive that run for SLURM job `job_id` (its environment says so):
    a server job's srun step, the node's task, SGLang's launcher, scheduler and detokenizer."""
    found, marker = {}, f"SLURM_JOB_ID={job_id}\0".encode()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes() and (environ.parent / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                command = (environ.parent / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
                found[int(environ.parent.name)] = command
        except OSError:
            continue
    return found


def fake_slurm_commands(bin_dir: Path, squeue_lines: str = "", squeue_error: str = "", sbatch_ok: int = 99) -> Path:
    """`squeue` that prints `squeue_lines` (`ID|STATE|RESTARTS`, one a job), or fails with `squeue_error`, `scancel`
    that does nothing, and `sbatch` that answers job ids 100, 101, ... for its first `sbatch_ok` calls and then fails;
    each appends its arguments to the returned file. Put `bin_dir` first on PATH."""
    calls = bin_dir / "calls.log"
    bin_dir.mkdir(parents=True, exist_ok=True)
    squeue = f"echo {squeue_error!r} >&2; exit 1" if squeue_error else f"printf '%b' {squeue_lines!r}"
    counter = bin_dir / "next_id"
    sbatch = (f'n=$(cat {counter} 2>/dev/null || echo 100); echo $((n + 1)) > {counter}\n'
              f'if [ "$n" -ge {100 + sbatch_ok} ]; then echo "sbatch: error: job submit limit reached" >&2; exit 1; fi\n'
              'echo "$n"')
    for name, body in (("squeue", squeue), ("scancel", "true"), ("sbatch", sbatch)):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n{body}\n')
        script.chmod(0o755)
    return calls

