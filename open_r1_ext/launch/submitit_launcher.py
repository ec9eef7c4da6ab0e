"""`open-r1-ext launch`: a run's server job(s) and trainer job through submitit, on SLURM or as local processes.

`launch(recipe, executor_factory)` submits each server (`ServerTask`), waits until it is healthy, submits the
trainer (`TrainerTask`, requeued from its last checkpoint on preemption), follows it to the end and cancels the
servers whatever happens. Jobs meet through the run directory's files (`slurm_plan.RunFiles`), as the sbatch path does.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import submitit
from submitit.helpers import Checkpointable, DelayedSubmission
from submitit.local.local import LocalJob

from open_r1_ext.sglang_client import SGLangClient
from open_r1_ext.launch.recipe import Recipe
from open_r1_ext.launch.slurm_plan import POLL_S, TRAINER, RunFiles, SlurmPlan, argv

ExecutorFactory = Callable[[Path], submitit.Executor]
# squeue/scontrol states of a job that may still run (a requeued trainer is PENDING again); UNKNOWN: squeue failed
# for another reason than an unknown job id (a busy controller), so a run is never cut short on a hiccup
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                 "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "UNKNOWN"}


class LaunchError(RuntimeError):
    """A job of the run failed or never became ready; the message names the job and its log."""


def slurm_executor(folder: Path) -> submitit.Executor:
    return submitit.AutoExecutor(folder=folder, cluster="slurm")


def local_executor(folder: Path) -> submitit.Executor:
    return submitit.AutoExecutor(folder=folder, cluster="local")


EXECUTORS: dict[str, ExecutorFactory] = {"slurm": slurm_executor, "local": local_executor}


# ------------------------------------------------------------------------------------------- jobs
@dataclass(frozen=True)
class JobRef:
    """A submitted job as the launcher and the other jobs see it: role, id, executor kind and log files."""

    role: str
    job_id: str
    executor: str  # "slurm" or "local" (a local job id is its controller's pid)
    logs: str = ""

    @classmethod
    def of(cls, role: str, job: submitit.Job) -> "JobRef":
        executor = "local" if isinstance(job, LocalJob) else "slurm"
        return cls(role, str(job.job_id), executor, f"{job.paths.stdout} and {job.paths.stderr}")

    def state(self) -> str:
        if self.executor == "local":
            return _local_state(self.job_id)
        return slurm_job_state(self.job_id)

    def alive(self) -> bool:
        return self.state() in ACTIVE_STATES

    def cancel(self, job: submitit.Job) -> None:
        """scancel; a local job gets SIGTERM, which its controller passes to the task (SIGINT would leave a traceback)."""
        if self.executor == "local":
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(self.job_id), signal.SIGTERM)
        else:
            job.cancel(check=False)

    def __str__(self) -> str:
        return f"{self.role} job {self.job_id}"


def slurm_job_state(job_id: str) -> str:
    """squeue's state while the job is queued or running, then scontrol's (for MinJobAge), then `GONE`."""
    queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    if queued.stdout.strip():
        return queued.stdout.split()[0]
    if queued.returncode and "Invalid job id" not in queued.stderr:
        return "UNKNOWN"
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    for word in shown.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return "GONE"


def _local_state(pid: str) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "ENDED"
    return "ENDED" if stat.rsplit(")", 1)[1].split()[0] == "Z" else "RUNNING"


def record(files: RunFiles, message: str, echo: Callable[[str], None] = print) -> None:
    """One line in the run's status log (`<time> <message>`, as the shell scripts write it), and on the console."""
    files.status.parent.mkdir(parents=True, exist_ok=True)
    with open(files.status, "a") as status:
        status.write(f"{datetime.now().astimezone().isoformat(timespec='seconds')} {message}\n")
    echo(message)


def read_jobs_file(files: RunFiles) -> dict:
    if not files.jobs.is_file():
        return {}
    return dict(line.split("=", 1) for line in files.jobs.read_text().splitlines() if "=" in line)


def write_jobs_file(files: RunFiles, refs: Sequence[JobRef]) -> None:
    lines = [f"{ref.role.upper().replace('-', '_')}_JOB={ref.job_id}" for ref in refs]
    _write_atomic(files.jobs, "\n".join([*lines, f"EXECUTOR={refs[0].executor}"]) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


# ------------------------------------------------------------------------------------------ waits
def wait_for_server(plan: SlurmPlan, server: JobRef, echo: Callable[[str], None] = print) -> str:
    """The URL of a server job once it has advertised itself and answers /health.

    Raises `LaunchError` when the job ends first, or after the recipe's `trainer.server_wait_timeout`.
    """
    addr_file, timeout = plan.files.addr(server.role), plan.server_wait_s
    start = time.monotonic()
    next_progress = POLL_S
    while True:
        url = f"http://{addr_file.read_text().strip()}" if addr_file.is_file() else None
        if url and SGLangClient(url, api_key=plan.recipe.servers.api_key).is_healthy(timeout=5.0):
            return url
        state, elapsed = server.state(), time.monotonic() - start
        if state not in ACTIVE_STATES:
            raise LaunchError(f"{server} ended ({state}) before its server became healthy; see {server.logs}")
        if elapsed > timeout:
            raise LaunchError(f"{server} ({state}) not healthy after {timeout:.0f} s (trainer.server_wait_timeout); "
                              f"see {server.logs}")
        if elapsed >= next_progress:
            where = f"not healthy at {url}" if url else f"no {addr_file.name} yet"
            echo(f"waiting for {server} ({state}): {where} ({elapsed:.0f} s / {timeout:.0f} s)")
            next_progress += POLL_S
        time.sleep(1.0)


def _spawn(cmd: list[str]) -> subprocess.Popen:
    """A child that is sent SIGTERM if this task dies, even by SIGKILL: no server or trainer outlives its job."""

    def die_with_parent() -> None:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    print("+ " + " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=die_with_parent)


def _stop(process: Optional[subprocess.Popen], grace_s: float = 15.0) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# ------------------------------------------------------------------------------------------ tasks
class ServerTask:
    """A server job, on each of its nodes: run the server; on the first node, advertise it once healthy and stop
    it when the run's trainer job is gone (the launcher may have died)."""

    def __init__(self, plan: SlurmPlan, role: str):
        self.plan, self.role = plan, role

    def __call__(self) -> int:
        env = submitit.JobEnvironment()
        head, port, files = env.hostnames[0], self.plan.port(self.role), self.plan.files
        me = f"{self.role} job {env.job_id}"
        signal.signal(signal.SIGTERM, _raise_interrupt)  # cancelled: stop the server and withdraw its address
        process = _spawn(argv(self.plan.server_command(self.role, env.node, head)))
        try:
            if env.node == 0:
                self._advertise(process, f"{head}:{port}", me)
            while process.poll() is None and not (env.node == 0 and self._trainer_gone(me)):
                time.sleep(POLL_S)
        finally:
            if env.node == 0:
                files.addr(self.role).unlink(missing_ok=True)
            _stop(process)
        if process.returncode not in (0, -signal.SIGTERM):
            raise LaunchError(f"{me}: the server exited with code {process.returncode}")
        return 0

    def _advertise(self, process: subprocess.Popen, address: str, me: str) -> None:
        client, files = SGLangClient(f"http://{address}", api_key=self.plan.recipe.servers.api_key), self.plan.files
        start = time.monotonic()
        while not client.is_healthy(timeout=5.0):
            elapsed = time.monotonic() - start
            if process.poll() is not None:
                raise LaunchError(f"{me}: the server exited with code {process.returncode} while starting")
            if elapsed > self.plan.server_wait_s:
                raise LaunchError(f"{me}: the server is not healthy after {elapsed:.0f} s")
            time.sleep(1.0)
        _write_atomic(files.addr(self.role), address + "\n")
        record(files, f"{me}: healthy at http://{address}")

    def _trainer_gone(self, me: str) -> bool:
        jobs = read_jobs_file(self.plan.files)
        if "TRAINER_JOB" not in jobs:
            return False
        trainer = JobRef(TRAINER, jobs["TRAINER_JOB"], jobs.get("EXECUTOR", "slurm"))
        if trainer.alive():
            return False
        record(self.plan.files, f"{me}: {trainer} is gone ({trainer.state()}); stopping the server")
        return True


class TrainerTask(Checkpointable):
    """The trainer job, on each of its nodes: find the servers, then `accelerate launch` the training.

    On preemption or timeout submitit calls `checkpoint`, which requeues a fresh task; training resumes from the
    last checkpoint in output_dir (`open_r1_ext.train` does that by itself).
    """

    def __init__(self, plan: SlurmPlan, servers: Sequence[JobRef]):
        self.plan, self.servers = plan, list(servers)
        self._process: Optional[subprocess.Popen] = None
        self._job_id: Optional[str] = None

    def __call__(self) -> int:
        env = submitit.JobEnvironment()
        self._job_id = env.job_id
        signal.signal(signal.SIGTERM, _raise_interrupt)  # cancelled: stop training (preemption comes as USR2)
        urls = {server.role: wait_for_server(self.plan, server) for server in self.servers}
        self._process = _spawn(argv(self.plan.trainer_command(env.node, env.hostnames[0], urls)))
        try:
            code = self._process.wait()
        finally:
            _stop(self._process)
        if code:
            raise LaunchError(f"trainer job {env.job_id}: the trainer exited with code {code} (servers: {urls})")
        return code

    def checkpoint(self, *args, **kwargs) -> DelayedSubmission:
        # Runs in a signal handler while __call__ waits on the process: signal it, never wait here (that would
        # deadlock on Popen's lock); __call__'s `finally` reaps it once submitit exits.
        if self._process is not None:
            self._process.terminate()
        record(self.plan.files, f"trainer job {self._job_id}: preempted or out of time; requeued, it resumes from "
                                "the last checkpoint")
        return DelayedSubmission(TrainerTask(self.plan, self.servers))


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


# ----------------------------------------------------------------------------------------- launch
def launch(recipe: Recipe, executor_factory: ExecutorFactory, overrides: Sequence[str] = (),
           echo: Callable[[str], None] = print) -> int:
    """Run a validated recipe: servers, then the trainer; returns 0 when the trainer succeeded, else 1.

    Whatever the outcome (success, failure, Ctrl-C, SIGTERM), every job still queued or running is cancelled.
    """
    plan = SlurmPlan(recipe, overrides)
    files = plan.files
    prepare_run_dir(plan)
    echo(f"run directory {files.run_dir}: logs in {files.logs}/, events in {files.status}")
    jobs: dict[str, tuple[submitit.Job, JobRef]] = {}
    try:
        with _signals_as_interrupt():
            for role in plan.server_roles:
                jobs[role] = _submit(plan, role, executor_factory, ServerTask(plan, role), echo)
            servers = [ref for _, ref in jobs.values()]
            urls = {ref.role: wait_for_server(plan, ref, echo) for ref in servers}
            echo(f"servers ready: {urls}")
            jobs[TRAINER] = _submit(plan, TRAINER, executor_factory, TrainerTask(plan, servers), echo)
            write_jobs_file(files, [ref for _, ref in jobs.values()])
            return follow_trainer(plan, *jobs[TRAINER], servers, echo)
    except LaunchError as err:
        record(files, f"launch failed: {err}", echo)
        return 1
    except KeyboardInterrupt as err:
        record(files, f"launch interrupted ({err or 'Ctrl-C'})", echo)
        return 130
    finally:
        for job, ref in jobs.values():
            if ref.alive() and not job.paths.result_pickle.exists():
                ref.cancel(job)
                record(files, f"cancelled {ref}", echo)


def prepare_run_dir(plan: SlurmPlan) -> None:
    """The run directory with its logs folder, without the addresses and job ids of an earlier launch."""
    plan.files.logs.mkdir(parents=True, exist_ok=True)
    for role in plan.server_roles:
        plan.files.addr(role).unlink(missing_ok=True)
    plan.files.jobs.unlink(missing_ok=True)


def _submit(plan: SlurmPlan, role: str, executor_factory: ExecutorFactory, task, echo) -> tuple[submitit.Job, JobRef]:
    executor = executor_factory(plan.files.logs / role)
    try:
        executor.update_parameters(**plan.submitit_parameters(role))
    except ValueError as err:
        raise LaunchError(f"{role} job: {err}") from err
    job = executor.submit(task)
    ref = JobRef.of(role, job)
    record(plan.files, f"submitted {ref} (logs: {ref.logs})", echo)
    return job, ref


def follow_trainer(plan: SlurmPlan, job: submitit.Job, trainer: JobRef, servers: Sequence[JobRef], echo) -> int:
    """Wait for the trainer job with a progress line every POLL_S seconds; record how it ended."""
    start, next_progress = time.monotonic(), POLL_S
    while not job.paths.result_pickle.exists() and trainer.alive():
        elapsed = time.monotonic() - start
        if elapsed >= next_progress:
            echo(f"{trainer}: {trainer.state()} for {elapsed:.0f} s; last log line: {_last_line(job.paths.stdout)}")
            next_progress += POLL_S
        time.sleep(1.0)
    if not job.paths.result_pickle.exists():
        raise LaunchError(f"{trainer} ended ({trainer.state()}) without a result: killed or cancelled; see {trainer.logs}")
    try:
        job.result()
    except Exception as err:  # noqa: BLE001 - submitit re-raises the job's error with its traceback
        lost = [f"{s} is no longer running ({s.state()})" for s in servers if not s.alive()]
        raise LaunchError(f"{trainer} failed: {_last_line_of(str(err))}{'; ' if lost else ''}{'; '.join(lost)}; "
                          f"see {trainer.logs}") from None
    record(plan.files, f"{trainer}: succeeded; model in {plan.files.run_dir}", echo)
    return 0


def _last_line(path: Path) -> str:
    try:
        return _last_line_of(path.read_text(errors="replace"))
    except OSError:
        return "(no log yet)"


def _last_line_of(text: str, width: int = 160) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else "(empty)"
    return line if len(line) <= width else line[: width - 3] + "..."


@contextlib.contextmanager
def _signals_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP end the launch like Ctrl-C does, so its clean-up runs."""
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def describe_launch(plan: SlurmPlan) -> str:
    """`--dry-run`: each job's sbatch options and commands, and the submitit parameters the launcher would use."""
    lines = [plan.describe()]
    lines += [f"submitit parameters of the {role} job: {plan.submitit_parameters(role)}" for role in plan.roles]
    return "\n".join(lines)
