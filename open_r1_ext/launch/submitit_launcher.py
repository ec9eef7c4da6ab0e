"""`open-r1-ext launch`: a run's server jobs (every replica) and trainer job through submitit, on SLURM or as local
processes.

The tasks are thin adapters of the job runtime (`jobs.py`, the same as under `slurm/*.slurm`): the trainer job
cancels the servers at its end. The driver submits the servers, waits until `min_replicas` of each role are healthy,
submits the trainer and follows it; it cancels what it submitted only when the launch itself fails or is interrupted.
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import submitit
from submitit.helpers import Checkpointable, DelayedSubmission
from submitit.local.local import LocalJob

from open_r1_ext.config.recipe import Recipe
from open_r1_ext.launch.jobs import (SIGTERM_EXIT, JobContext, JobRef, JobWatch, LaunchError, cancel,
                                     prepare_run_dir, raise_interrupt, read_jobs_file, record, register_jobs,
                                     run_server_job, run_trainer_job, wait_for_replicas)
from open_r1_ext.launch.slurm_plan import POLL_S, SUBMITIT, TRAINER, SlurmPlan

ExecutorFactory = Callable[[Path], submitit.Executor]


def slurm_executor(folder: Path) -> submitit.Executor:
    return submitit.AutoExecutor(folder=folder, cluster="slurm")


def local_executor(folder: Path) -> submitit.Executor:
    return submitit.AutoExecutor(folder=folder, cluster="local")


EXECUTORS: dict[str, ExecutorFactory] = {"slurm": slurm_executor, "local": local_executor}


# ------------------------------------------------------------------------------------------ tasks
class ServerTask:
    """A server job (one replica, of resources entry `index`): `run_server_job` on each of its nodes."""

    def __init__(self, plan: SlurmPlan, role: str, index: int = 0):
        self.plan, self.role, self.index = plan, role, index

    def __call__(self) -> int:
        ctx = JobContext.from_submitit()
        # a server job ends when it is cancelled (by its trainer job): that is no failure
        code = run_server_job(self.plan, self.role, ctx, self.index)
        return _succeeded(code, f"{self.role} job {ctx.job_id}", ok=(0, SIGTERM_EXIT))


class TrainerTask(Checkpointable):
    """The trainer job: `run_trainer_job` on each of its nodes.

    On preemption or timeout submitit calls `checkpoint`, requeues the job (scontrol requeue) and exits; the
    runtime's requeue rule then keeps the servers up, and the fresh task resumes from output_dir's last checkpoint.
    """

    def __init__(self, plan: SlurmPlan):
        self.plan = plan

    def __call__(self) -> int:
        ctx = JobContext.from_submitit()
        return _succeeded(run_trainer_job(self.plan, ctx), f"trainer job {ctx.job_id}")

    def checkpoint(self, *args, **kwargs) -> DelayedSubmission:
        return DelayedSubmission(TrainerTask(self.plan))


def _succeeded(code: int, job: str, ok: Sequence[int] = (0,)) -> int:
    """A job's exit status as submitit reports it: a failure is an error in the job's result."""
    if code not in ok:
        raise LaunchError(f"{job} ended with exit status {code}; see its log")
    return code


# ----------------------------------------------------------------------------------------- launch
def launch(recipe: Recipe, executor_factory: ExecutorFactory, overrides: Sequence[str] = (),
           echo: Callable[[str], None] = print) -> int:
    """Run a validated recipe: every server replica, then the trainer once `min_replicas` of each role are healthy;
    returns 0 when the trainer succeeded, else 1 (130 when interrupted). Once submitted, the trainer job owns the
    run's end; until then a failed or interrupted launch cancels what it submitted."""
    plan = SlurmPlan(recipe, overrides)
    files = plan.files
    prepare_run_dir(plan)
    echo(f"run directory {files.run_dir}: logs in {files.logs}/, events in {files.status}")
    submitted: list[JobRef] = []
    trainer_job = None
    try:
        with _signals_as_interrupt():
            for role in plan.server_roles:
                for _, index in plan.jobs_of(role):
                    task = ServerTask(plan, role, index)
                    submitted.append(_submit(plan, role, index, executor_factory, task, echo)[1])
                    register_jobs(files, submitted[-1:], plan, SUBMITIT)
            urls = wait_for_replicas(plan, JobWatch(submitted), echo)
            echo(f"servers ready: {urls}")
            trainer_job, trainer = _submit(plan, TRAINER, 0, executor_factory, TrainerTask(plan), echo)
            submitted.append(trainer)
            register_jobs(files, [trainer], plan, SUBMITIT)
            return follow_trainer(plan, trainer_job, trainer, echo)
    except LaunchError as err:
        record(files, f"launch failed: {err}", echo)
        if trainer_job is None:
            _cancel_submitted(files, submitted, echo)
        return 1
    except KeyboardInterrupt as err:
        record(files, f"launch interrupted ({err or 'Ctrl-C'})", echo)
        _cancel_submitted(files, submitted, echo)
        return 130


def _cancel_submitted(files, submitted: Sequence[JobRef], echo) -> None:
    """Cancel what the launch submitted, and any replica added to jobs.env meanwhile (`add-server`)."""
    added = [ref for ref in read_jobs_file(files) if ref.job_id not in {s.job_id for s in submitted}]
    watch = JobWatch([*submitted, *added])
    for ref in watch.refs:
        if watch.alive(ref):
            cancel([ref])
            record(files, f"cancelled {ref}", echo)


def _submit(plan: SlurmPlan, role: str, index: int, executor_factory: ExecutorFactory, task,
            echo) -> tuple[submitit.Job, JobRef]:
    executor = executor_factory(plan.files.logs / role)
    try:
        executor.update_parameters(**plan.submitit_parameters(role, index))
    except ValueError as err:
        raise LaunchError(f"{role} job: {err}") from err
    job = executor.submit(task)
    ref = JobRef.of(plan.files, role, job.job_id, "local" if isinstance(job, LocalJob) else "slurm", SUBMITIT)
    record(plan.files, f"submitted {ref} (logs: {job.paths.stdout} and {job.paths.stderr})", echo)
    return job, ref


def follow_trainer(plan: SlurmPlan, job: submitit.Job, trainer: JobRef, echo) -> int:
    """Wait for the trainer job with a progress line every POLL_S seconds; say how it ended."""
    watch = JobWatch([trainer])
    start, next_progress = time.monotonic(), POLL_S
    while not job.paths.result_pickle.exists() and watch.alive(trainer):
        elapsed = time.monotonic() - start
        if elapsed >= next_progress:
            echo(f"{trainer}: {watch.state(trainer)} for {elapsed:.0f} s; "
                 f"last log line: {_last_line(job.paths.stdout)}")
            next_progress += POLL_S
        time.sleep(1.0)
    if not job.paths.result_pickle.exists():
        raise LaunchError(f"{trainer} ended ({watch.state(trainer)}) without a result: killed or cancelled; "
                          f"see {trainer.log}")
    try:
        job.result()
    except Exception as err:  # noqa: BLE001 - submitit re-raises the job's error with its traceback
        raise LaunchError(f"{trainer} failed: {_last_line_of(str(err))}; "
                          f"see {trainer.log} and {plan.files.status}") from None
    echo(f"{trainer}: succeeded; model in {plan.files.run_dir}")
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
    previous = {sig: signal.signal(sig, raise_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def describe_launch(plan: SlurmPlan) -> str:
    """`--dry-run`: each job's sbatch options and commands, and the submitit parameters the launcher would use."""
    lines = [plan.describe()]
    lines += [f"submitit parameters of the {title}: {plan.submitit_parameters(role, index)}"
              for role in plan.roles for title, index in plan.jobs_of(role)]
    return "\n".join(lines)
