"""The run protocol, written once for both launch paths: submitting a run, a server job and a trainer job.

`slurm/*.slurm` exec `python -m open_r1_ext.launch.jobs submit|server|trainer RECIPE ...` (a `JobContext` from the
SLURM environment); the submitit tasks (`submitit_launcher.py`) call `run_server_job` / `run_trainer_job` with one
from `submitit.JobEnvironment()`. Jobs meet through the run directory's files (`RunFiles`): jobs.env, <role>.addr.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from open_r1_ext.launch.slurm_plan import (POLL_S, REF_SERVER, SBATCH, SERVER, SUBMITIT, TRAINER, RunFiles, SlurmPlan,
                                           argv, role_var)
from open_r1_ext.launch.local_server import die_with_parent
from open_r1_ext.launch.run_key import write_run_key
from open_r1_ext.sglang_client import SGLangClient

SLURM_DIR = Path(__file__).resolve().parents[2] / "slurm"  # serve.slurm and train.slurm, submitted by `submit`
# SLURM states of a job that may still run (a requeued trainer is PENDING again); UNKNOWN: SLURM did not answer for
# another reason than an unknown job id (a busy controller), so a run is never cut short on a hiccup
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                 "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "UNKNOWN"}
SIGTERM_EXIT = 128 + signal.SIGTERM  # how a job stopped by scancel, a time limit or Ctrl-C exits
# how long a stopped job waits for its trainer to save the checkpoint of the step in flight (SLURM's KillWait, 30 s by
# default, may end it sooner with SIGKILL); a server gets the short default
TRAINER_STOP_GRACE_S = 120.0
Echo = Callable[[str], None]


class LaunchError(RuntimeError):
    """A job of the run failed or never became ready; the message names the job and its log."""


def log(message: str) -> None:
    """What a job says, on its stderr (its `.err` log)."""
    print(f"[{datetime.now():%H:%M:%S}] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------- context
@dataclass(frozen=True)
class JobContext:
    """Who this process is in its job: the job id, this node's rank, the job's nodes, and how many times SLURM had
    started the job before this start (`SLURM_RESTART_COUNT`).

    `launcher` says how the job's nodes run: under `sbatch` this is the batch step, one process on the first node,
    which starts every node's command with srun; under `submitit` the task itself runs on every node.
    """

    job_id: str
    node_rank: int
    nodes: tuple[str, ...]
    restart_count: int = 0
    executor: str = "slurm"  # or "local": submitit's local executor, whose job id is its controller's pid
    launcher: str = SBATCH

    @property
    def head_node(self) -> str:
        """The job's first node: where its server answers, and SGLang's and accelerate's rendezvous."""
        return self.nodes[0]

    @classmethod
    def from_slurm_env(cls, env: Mapping[str, str] = os.environ) -> "JobContext":
        from submitit.slurm.slurm import _parse_node_list  # SLURM_JOB_NODELIST's compressed form, e.g. gpu[1-3,7]

        if "SLURM_JOB_ID" not in env:
            raise LaunchError("no SLURM_JOB_ID in the environment: submit this job with sbatch "
                              "(sbatch slurm/grpo.slurm RECIPE, or bash slurm/grpo.slurm RECIPE), not directly")
        return cls(env["SLURM_JOB_ID"], int(env.get("SLURM_NODEID", "0")),
                   tuple(_parse_node_list(env["SLURM_JOB_NODELIST"])), int(env.get("SLURM_RESTART_COUNT", "0")))

    @classmethod
    def from_submitit(cls) -> "JobContext":
        import submitit
        from submitit.local.local import LocalJobEnvironment

        env = submitit.JobEnvironment()
        executor = "local" if isinstance(env, LocalJobEnvironment) else "slurm"
        return cls(str(env.job_id), env.node, tuple(env.hostnames), int(os.environ.get("SLURM_RESTART_COUNT", "0")),
                   executor, SUBMITIT)


@dataclass(frozen=True)
class JobRef:
    """A submitted job as the launchers and the other jobs see it: role, id, executor and error log."""

    role: str
    job_id: str
    executor: str = "slurm"
    log: str = ""

    @classmethod
    def of(cls, files: RunFiles, role: str, job_id: str, executor: str, launcher: str) -> "JobRef":
        return cls(role, str(job_id), executor, str(files.log(role, job_id, launcher, "err")))

    def __str__(self) -> str:
        return f"{self.role} job {self.job_id}"


# ------------------------------------------------------------------------------------ job states
class JobWatch:
    """The states of a run's jobs: one SLURM query for all of its SLURM jobs (local jobs: /proc), made at most
    every `interval` seconds; like submitit's watcher it backs off, the interval doubling from `min_s` to `max_s`."""

    def __init__(self, refs: Sequence[JobRef] = (), min_s: float = 1.0, max_s: float = POLL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.refs, self.interval, self.max_s, self.clock = list(refs), min_s, max_s, clock
        self._states: dict[str, tuple[str, int]] = {}
        self._polled_at: Optional[float] = None

    def add(self, ref: JobRef) -> None:
        self.refs.append(ref)
        self._polled_at = None

    def state(self, ref: JobRef) -> str:
        return self._poll()[ref.job_id][0]

    def restarts(self, ref: JobRef) -> int:
        """How many times SLURM has started the job again (requeue, preemption); 0 for a local job."""
        return self._poll()[ref.job_id][1]

    def alive(self, ref: JobRef) -> bool:
        return self.state(ref) in ACTIVE_STATES

    def refresh(self) -> None:
        """Ask again at the next question, whatever the interval (before a decision: cancel, requeue)."""
        self._polled_at = None

    def _poll(self) -> dict[str, tuple[str, int]]:
        now = self.clock()
        if self._polled_at is None or now - self._polled_at >= self.interval:
            if self._polled_at is not None:
                self.interval = min(2 * self.interval, self.max_s)
            self._polled_at = now
            slurm_ids = [ref.job_id for ref in self.refs if ref.executor == "slurm"]
            self._states = {ref.job_id: (_local_state(ref.job_id), 0) for ref in self.refs if ref.executor == "local"}
            self._states.update(slurm_states(slurm_ids) if slurm_ids else {})
        return self._states


def slurm_states(job_ids: Sequence[str]) -> dict[str, tuple[str, int]]:
    """`{job id: (state, restart count)}` from one call for all the jobs; a job SLURM no longer knows is `GONE`."""
    out = subprocess.run(["squeue", "-h", "--states=all", "-j", ",".join(job_ids), "-O", "JobID:|,State:|,RestartCnt:"],
                         capture_output=True, text=True)
    if out.returncode and "Invalid job id" not in out.stderr:
        return dict.fromkeys(job_ids, ("UNKNOWN", 0))
    states = dict.fromkeys(job_ids, ("GONE", 0))
    for line in out.stdout.splitlines():
        job_id, state, restarts = line.strip().split("|")
        if job_id in states:
            states[job_id] = (state, int(restarts))
    return states


def _local_state(pid: str) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "ENDED"
    return "ENDED" if stat.rsplit(")", 1)[1].split()[0] == "Z" else "RUNNING"


def cancel(refs: Sequence[JobRef]) -> None:
    """scancel the SLURM jobs (one call); a local job's controller gets SIGTERM, which it passes to the task."""
    slurm_ids = [ref.job_id for ref in refs if ref.executor == "slurm"]
    if slurm_ids:
        subprocess.run(["scancel", *slurm_ids], check=False)
    for ref in refs:
        if ref.executor == "local":
            try:
                os.kill(int(ref.job_id), signal.SIGTERM)
            except ProcessLookupError:
                pass


# ------------------------------------------------------------------------------------ run files
def record(files: RunFiles, message: str, echo: Echo = log) -> None:
    """One line in the run's status log (`<time> <message>`), and on the console."""
    files.status.parent.mkdir(parents=True, exist_ok=True)
    with open(files.status, "a") as status:
        status.write(f"{datetime.now().astimezone().isoformat(timespec='seconds')} {message}\n")
    echo(message)


def prepare_run_dir(plan: SlurmPlan, echo: Echo = log) -> None:
    """The run directory with its logs folder (owner-only: SGLang logs its arguments, the key among them), without
    the addresses and job ids of an earlier launch, and with this launch's API key (`run_key.py`)."""
    plan.files.logs.mkdir(parents=True, exist_ok=True)
    plan.files.logs.chmod(0o700)
    write_run_key(plan.recipe, plan.files.run_dir, warn=echo)
    for role in plan.server_roles:
        plan.files.addr(role).unlink(missing_ok=True)
    plan.files.jobs.unlink(missing_ok=True)


def write_jobs_file(files: RunFiles, refs: Sequence[JobRef], launcher: str) -> None:
    """jobs.env: `<ROLE>_JOB=<id>` for each job, `EXECUTOR` and `LAUNCHER`; written with the servers, then again
    with the trainer, so a trainer job always finds its servers there and a server job its trainer."""
    lines = [f"{role_var(ref.role)}_JOB={ref.job_id}" for ref in refs]
    _write_atomic(files.jobs, "\n".join([*lines, f"EXECUTOR={refs[0].executor}", f"LAUNCHER={launcher}"]) + "\n")


def read_jobs_file(plan: SlurmPlan) -> dict[str, JobRef]:
    """The run's jobs by role, from jobs.env (empty before the launcher wrote it)."""
    files = plan.files
    if not files.jobs.is_file():
        return {}
    values = dict(line.split("=", 1) for line in files.jobs.read_text().splitlines() if "=" in line)
    executor, launcher = values.get("EXECUTOR", "slurm"), values.get("LAUNCHER", SBATCH)
    return {role: JobRef.of(files, role, values[f"{role_var(role)}_JOB"], executor, launcher)
            for role in plan.roles if f"{role_var(role)}_JOB" in values}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


# ----------------------------------------------------------------------------------------- waits
def wait_for_server(plan: SlurmPlan, server: JobRef, watch: JobWatch, echo: Echo = log) -> str:
    """The URL of a server job once it has advertised itself and answers /health.

    Raises `LaunchError` when the job ends first, or after the recipe's `trainer.server_wait_timeout`.
    """
    addr_file, timeout = plan.files.addr(server.role), plan.server_wait_s
    start, next_progress = time.monotonic(), POLL_S
    while True:
        url = f"http://{addr_file.read_text().strip()}" if addr_file.is_file() else None
        if url and SGLangClient(url).is_healthy(timeout=5.0):  # /health needs no API key
            return url
        state, elapsed = watch.state(server), time.monotonic() - start
        if state not in ACTIVE_STATES:
            raise LaunchError(f"{server} ended ({state}) before its server became healthy; see {server.log}")
        if elapsed > timeout:
            raise LaunchError(f"{server} ({state}) is not healthy after {timeout:.0f} s (trainer.server_wait_timeout); "
                              f"see {server.log}")
        if elapsed >= next_progress:
            where = f"not healthy at {url}" if url else f"no {addr_file} yet"
            echo(f"waiting for {server} ({state}): {where} ({elapsed:.0f} s / {timeout:.0f} s)")
            next_progress += POLL_S
        time.sleep(1.0)


# ------------------------------------------------------------------------------------- processes
def node_command(plan: SlurmPlan, role: str, ctx: JobContext, urls: Mapping[str, str]) -> list[str]:
    """What one node of the job runs: the server, or `accelerate launch` of the trainer."""
    if role == TRAINER:
        return argv(plan.trainer_command(ctx.node_rank, ctx.head_node, dict(urls)))
    return argv(plan.server_command(role, ctx.node_rank, ctx.head_node))


def job_args(plan: SlurmPlan) -> list[str]:
    """`RECIPE --set=K=V ...`: how a job entry of this module loads the same recipe."""
    return [plan.recipe_path, *(f"--set={item}" for item in plan.overrides)]


def start_on_nodes(plan: SlurmPlan, role: str, ctx: JobContext,
                   urls: Optional[Mapping[str, str]] = None) -> subprocess.Popen:
    """The job's command on its nodes: from sbatch's batch step, one srun task a node (`jobs node`, which computes
    the node's command from its rank); under submitit, which runs the task on every node, this node's command."""
    urls = urls or {}
    if ctx.launcher == SBATCH:
        url_args = [arg for flag, r in (("--server-url", SERVER), ("--ref-url", REF_SERVER)) if r in urls
                    for arg in (flag, urls[r])]
        return _spawn(["srun", *plan.srun_args(role), sys.executable, "-m", "open_r1_ext.launch.jobs", "node", role,
                       *job_args(plan), *url_args])
    return _spawn(node_command(plan, role, ctx, urls))


def _spawn(cmd: list[str]) -> subprocess.Popen:
    """A child that is sent SIGTERM if this job process dies, even by SIGKILL: nothing outlives its job."""
    log("+ " + " ".join(cmd))
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


def raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def stop_on_signals() -> None:
    """SIGTERM (scancel, time limit) and SIGHUP end a job like Ctrl-C, so its clean-up runs (submitit would ignore
    SIGTERM)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, raise_interrupt)


# ------------------------------------------------------------------------------------- the jobs
def run_server_job(plan: SlurmPlan, role: str, ctx: JobContext, echo: Echo = log) -> int:
    """Run a server on the job's nodes; from the first node, advertise `host:port` in `<role>.addr` once /health
    answers, and stop once the run's trainer job is gone. Returns the job's exit status."""
    if role not in plan.server_roles:
        raise LaunchError(f"recipe {plan.recipe_path} starts no {role} (its servers: "
                          f"{', '.join(plan.server_roles) or 'none: every role has a url or runs on the trainer'})")
    files, me, address = plan.files, f"{role} job {ctx.job_id}", f"{ctx.head_node}:{plan.port(role)}"
    stop_on_signals()
    files.logs.mkdir(parents=True, exist_ok=True)
    process = None
    try:
        process = start_on_nodes(plan, role, ctx)
        if ctx.node_rank == 0:
            _advertise_when_healthy(plan, role, process, address, me, echo)
            if _serve_until_trainer_gone(plan, process, me, echo):
                return 0
        process.wait()
        raise LaunchError(f"{me}: the {role} exited on its own (code {process.returncode}); see this job's log")
    except KeyboardInterrupt:
        return SIGTERM_EXIT
    except LaunchError as err:
        echo(str(err))
        return 1
    finally:
        if ctx.node_rank == 0:
            addr_file = files.addr(role)
            if addr_file.is_file() and addr_file.read_text().strip() == address:
                addr_file.unlink()
        _stop(process)
        if ctx.node_rank == 0:
            record(files, f"{me}: stopped", echo)


def _advertise_when_healthy(plan: SlurmPlan, role: str, process: subprocess.Popen, address: str, me: str,
                            echo: Echo) -> None:
    client = SGLangClient(f"http://{address}")  # /health needs no API key
    start, next_progress = time.monotonic(), POLL_S
    while not client.is_healthy(timeout=5.0):
        elapsed = time.monotonic() - start
        if process.poll() is not None:
            raise LaunchError(f"{me}: the {role} exited (code {process.returncode}) before answering "
                              f"http://{address}/health; see this job's log")
        if elapsed > plan.server_wait_s:
            raise LaunchError(f"{me}: the {role} is not healthy after {plan.server_wait_s:.0f} s "
                              f"(trainer.server_wait_timeout; http://{address}/health)")
        if elapsed >= next_progress:
            echo(f"{me}: waiting for http://{address}/health ({elapsed:.0f} s / {plan.server_wait_s:.0f} s)")
            next_progress += POLL_S
        time.sleep(1.0)
    _write_atomic(plan.files.addr(role), address + "\n")
    record(plan.files, f"{me}: healthy at http://{address}", echo)


def _serve_until_trainer_gone(plan: SlurmPlan, process: subprocess.Popen, me: str, echo: Echo) -> bool:
    """The watchdog: True once the trainer job named in jobs.env is gone, False when the server exits first."""
    watch = JobWatch()
    while process.poll() is None:
        trainer = read_jobs_file(plan).get(TRAINER)
        if trainer is not None:
            if trainer not in watch.refs:
                watch.add(trainer)
            if not watch.alive(trainer):
                record(plan.files, f"{me}: {trainer} is gone ({watch.state(trainer)}); stopping the server", echo)
                return True
        try:
            process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
    return False


def run_trainer_job(plan: SlurmPlan, ctx: JobContext, echo: Echo = log) -> int:
    """Wait for the run's servers (named in jobs.env), then `accelerate launch` the training on the job's nodes.
    The first node then ends the run (`end_run`). Returns the job's exit status."""
    files, lead = plan.files, ctx.node_rank == 0
    me = JobRef.of(files, TRAINER, ctx.job_id, ctx.executor, ctx.launcher)
    jobs = read_jobs_file(plan)
    missing = [role for role in plan.server_roles if role not in jobs]
    if missing:
        raise LaunchError(f"{me}: {files.jobs} names no {' or '.join(missing)} job; launch the run with "
                          "slurm/grpo.slurm or open-r1-ext launch")
    servers = [jobs[role] for role in plan.server_roles]
    watch, urls, process, code, ended = JobWatch([me, *servers]), {}, None, 1, False
    stop_on_signals()
    files.logs.mkdir(parents=True, exist_ok=True)
    try:
        if lead:
            record(files, f"{me}: started on {','.join(ctx.nodes)}", echo)
        for server in servers:
            urls[server.role] = wait_for_server(plan, server, watch, echo)
            if lead:
                record(files, f"{me}: {server} is up at {urls[server.role]}", echo)
        process = start_on_nodes(plan, TRAINER, ctx, urls)
        code = process.wait()
    except KeyboardInterrupt:
        code = SIGTERM_EXIT
        if lead:  # said before waiting for the trainer: SLURM may SIGKILL this job (KillWait) before the end below
            watch.refresh()
            ended = being_requeued(ctx, me, watch)
            if ended:  # the servers stay up whatever happens next
                end_run(plan, ctx, me, code, servers, urls, watch, echo)
            else:
                record(files, f"{me}: SIGTERM: the trainer saves a checkpoint of its last finished step and stops "
                              f"(given up to {TRAINER_STOP_GRACE_S:.0f} s, or SLURM's KillWait)", echo)
    except LaunchError as err:
        echo(str(err))
    finally:
        _stop(process, TRAINER_STOP_GRACE_S)
        if lead and not ended:
            end_run(plan, ctx, me, code, servers, urls, watch, echo)
    return code


def end_run(plan: SlurmPlan, ctx: JobContext, me: JobRef, code: int, servers: Sequence[JobRef],
            urls: Mapping[str, str], watch: JobWatch, echo: Echo = log) -> None:
    """The one owner of a run's end, on both launch paths: unless the trainer job is being requeued, say how it
    ended (naming any server job that died under it) and cancel the server jobs still running."""
    watch.refresh()
    if being_requeued(ctx, me, watch):
        record(plan.files, f"{me}: requeued; it resumes from the last checkpoint, the servers stay up", echo)
        return
    lost = "".join(f"; {s} ({urls.get(s.role, 'no URL yet')}) is no longer running ({watch.state(s)})"
                   for s in servers if not watch.alive(s))
    if code == 0:
        record(plan.files, f"{me}: succeeded; model in {plan.files.run_dir}", echo)
    elif code == SIGTERM_EXIT:
        record(plan.files, f"{me}: stopped by SIGTERM (scancel or time limit){lost}", echo)
    else:
        record(plan.files, f"{me}: failed (exit {code}){lost}; see {me.log}", echo)
    alive = [s for s in servers if watch.alive(s)]
    if alive:
        cancel(alive)
        record(plan.files, f"{me}: cancelled server job(s) {' '.join(s.job_id for s in alive)}", echo)


def being_requeued(ctx: JobContext, me: JobRef, watch: JobWatch) -> bool:
    """The requeue rule of both launch paths: SLURM already counts a start of this job after the one running
    (`scontrol requeue`, preemption, and submitit's `checkpoint`, which requeues through scontrol)."""
    return watch.restarts(me) > ctx.restart_count


# ----------------------------------------------------------------------------------- submission
def submit_run(plan: SlurmPlan, echo: Echo = log) -> int:
    """`slurm/grpo.slurm`: sbatch the server job(s), then the trainer job (it starts once they have started), with
    jobs.env written for each; a submission that stops half-way cancels what it submitted."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}  # not the submit job's own
    env["PYTHON"] = sys.executable  # what serve.slurm and train.slurm exec
    stop_on_signals()
    prepare_run_dir(plan)
    submitted: list[JobRef] = []
    try:
        for role in plan.server_roles:
            submitted.append(_sbatch(plan, role, ["--role", role], [], env, echo))
        if submitted:
            write_jobs_file(plan.files, submitted, SBATCH)
        after = [f"--dependency=after:{':'.join(ref.job_id for ref in submitted)}", "--kill-on-invalid-dep=yes"]
        submitted.append(_sbatch(plan, TRAINER, [], after if submitted else [], env, echo))
        write_jobs_file(plan.files, submitted, SBATCH)
    except BaseException:
        if submitted:
            cancel(submitted)
            record(plan.files, f"submission failed: cancelled job(s) {' '.join(ref.job_id for ref in submitted)}", echo)
        raise
    ids = [ref.job_id for ref in submitted]
    print(f"run {plan.files.run_dir}: jobs {' '.join(ids)} (ids in {plan.files.jobs})\n"
          f"  follow: tail -f {plan.files.logs}/*.out; cat {plan.files.status}")
    return 0


def _sbatch(plan: SlurmPlan, role: str, script_args: list[str], options: list[str], env: dict, echo: Echo) -> JobRef:
    script = SLURM_DIR / ("train.slurm" if role == TRAINER else "serve.slurm")
    out = subprocess.run(["sbatch", "--parsable", *plan.sbatch_args(role), *options, str(script), *job_args(plan),
                          *script_args], env=env, capture_output=True, text=True)
    if out.returncode:
        raise LaunchError(f"sbatch of the {role} job failed: {out.stderr.strip()}")
    ref = JobRef.of(plan.files, role, out.stdout.strip().split(";")[0], "slurm", SBATCH)
    record(plan.files, f"submitted {ref} (logs: {plan.files.log(role, ref.job_id, SBATCH, 'out')}, .err)", echo)
    return ref


# ---------------------------------------------------------------------------------- entry point
def main(cli_args: Optional[list[str]] = None) -> int:
    from open_r1_ext.cli import add_recipe_arguments
    from open_r1_ext.launch.recipe import RecipeError, load_recipe
    from open_r1_ext.launch.slurm_plan import PlanError

    parser = argparse.ArgumentParser(prog="python -m open_r1_ext.launch.jobs", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="job", required=True)
    for name, help_ in (("submit", "submit a run's jobs (slurm/grpo.slurm)"),
                        ("server", "a server job (slurm/serve.slurm)"),
                        ("trainer", "the trainer job (slurm/train.slurm)"),
                        ("node", "one node's command, under srun")):
        job = sub.add_parser(name, help=help_)
        if name == "node":
            job.add_argument("role", choices=(SERVER, REF_SERVER, TRAINER))
        job.add_argument("recipe")
        add_recipe_arguments(job, server_urls=name == "node")
        if name == "server":
            job.add_argument("--role", choices=(SERVER, REF_SERVER), default=SERVER)
    args = parser.parse_args(cli_args)
    try:
        plan = SlurmPlan(load_recipe(args.recipe, args.set), args.set)
        if args.job == "submit":
            return submit_run(plan)
        ctx = JobContext.from_slurm_env()
        if args.job == "server":
            return run_server_job(plan, args.role, ctx)
        if args.job == "trainer":
            return run_trainer_job(plan, ctx)
        urls = {SERVER: args.server_url, REF_SERVER: args.ref_url}
        cmd = node_command(plan, args.role, ctx, {role: url for role, url in urls.items() if url})
        os.execv(cmd[0], cmd)  # this node's server or trainer replaces the entry: srun signals it directly
    except RecipeError as err:
        log(f"{err}\nnothing started")
        return 2
    except PlanError as err:
        log(f"{args.recipe}: {err}\nnothing started")
        return 2
    except LaunchError as err:
        log(str(err))
        return 1
    except KeyboardInterrupt:
        return SIGTERM_EXIT


if __name__ == "__main__":
    sys.exit(main())
