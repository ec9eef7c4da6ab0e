"""The run protocol, written once for both launch paths: submitting a run, a server job and a trainer job.

`slurm/*.slurm` exec `python -m open_r1_ext.launch.jobs submit|server|trainer RECIPE ...` (a `JobContext` from the
SLURM environment); the submitit tasks (`submitit_launcher.py`) call `run_server_job` / `run_trainer_job` with one
from `submitit.JobEnvironment()`. Jobs meet through the run directory's files (`RunFiles`): jobs.env, and each
server replica's `replicas/<role>/<job id>.addr`; `add_server` adds a replica to a running run.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Sequence

from open_r1_ext.config.arguments import add_recipe_arguments
from open_r1_ext.launch.slurm_plan import (POLL_S, REF_SERVER, SBATCH, SERVER, SERVER_ROLES, SUBMITIT, TRAINER,
                                           RunFiles, SlurmPlan, argv, role_var)
from open_r1_ext.launch.local_server import (SharedMemoryFiles, die_with_parent, free_port,
                                             remove_orphaned_shared_memory)
from open_r1_ext.launch.preflight import launch_refused
from open_r1_ext.launch.run_key import write_run_key
from open_r1_ext.server_pool import read_addresses
from open_r1_ext.sglang_client import SGLangClient

SLURM_DIR = Path(__file__).resolve().parents[2] / "slurm"  # serve.slurm and train.slurm, submitted by `submit`
# SLURM states of a job that may still run (a requeued trainer is PENDING again); UNKNOWN: SLURM did not answer for
# another reason than an unknown job id (a busy controller), so a run is never cut short on a hiccup
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                 "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "UNKNOWN"}
SIGTERM_EXIT = 128 + signal.SIGTERM  # how a job stopped by scancel, a time limit or Ctrl-C exits
NOTE_SHARED_MEMORY_S = 5.0  # how often a node's server task notes the /dev/shm files of its server's processes
# how long a stopped job waits for its trainer to save the checkpoint of the step in flight (SLURM's KillWait, 30 s by
# default, may end it sooner with SIGKILL); a server gets the short default
TRAINER_STOP_GRACE_S = 120.0
PORT_CLAIMS = Path(tempfile.gettempdir()) / f"open_r1_ext-ports-{os.getuid()}"  # node-local: ports server jobs took
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
        for addr in plan.files.replica_dir(role).glob("*.addr"):
            addr.unlink(missing_ok=True)
    plan.files.jobs.unlink(missing_ok=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock (flock) on `path` while the block runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def read_jobs_env(files: RunFiles) -> dict[str, str]:
    """jobs.env's `KEY=VALUE` lines as a dict (empty before a launcher wrote it)."""
    if not files.jobs.is_file():
        return {}
    return dict(line.split("=", 1) for line in files.jobs.read_text().splitlines() if "=" in line)


def register_jobs(files: RunFiles, refs: Sequence[JobRef], plan: Optional[SlurmPlan] = None,
                  launcher: Optional[str] = None) -> None:
    """Add jobs to jobs.env (`<ROLE>_JOB`, a role's replicas comma-separated in submission order), with
    `EXECUTOR`; a launcher also writes `LAUNCHER` and how to load the recipe again (`RECIPE_ARGS`, `LAUNCH_DIR`, what
    `add-server` reads). Read, changed and written (atomically) under a lock: the launcher, `add-server` and a server
    job that joins by itself may add jobs at once. A job already listed is not added twice."""
    with _locked(files.run_dir / ".jobs.lock"):
        values = read_jobs_env(files)
        for ref in refs:
            key = f"{role_var(ref.role)}_JOB"
            ids = [job_id for job_id in values.get(key, "").split(",") if job_id]
            values[key] = ",".join(ids if ref.job_id in ids else [*ids, ref.job_id])
        values.setdefault("EXECUTOR", refs[0].executor)
        if launcher:
            values["LAUNCHER"] = launcher
        if plan is not None:
            values.update(RECIPE_ARGS=shlex.join(job_args(plan)), LAUNCH_DIR=os.getcwd())
        order = [f"{role_var(role)}_JOB" for role in (SERVER, REF_SERVER, TRAINER)]
        keys = [key for key in order if key in values] + [key for key in values if key not in order]
        write_atomic(files.jobs, "".join(f"{key}={values[key]}\n" for key in keys))


def read_jobs_file(files: RunFiles) -> list[JobRef]:
    """The run's jobs from jobs.env, servers first (every replica), each with its error log; [] before a launcher
    wrote it."""
    values = read_jobs_env(files)
    executor, launcher = values.get("EXECUTOR", "slurm"), values.get("LAUNCHER", SBATCH)
    return [JobRef.of(files, role, job_id, executor, launcher) for role in (SERVER, REF_SERVER, TRAINER)
            for job_id in values.get(f"{role_var(role)}_JOB", "").split(",") if job_id]


def write_atomic(path: Path, text: str) -> None:
    """Write `path` in one rename: a reader sees the old file or the new one, never half (its directory made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


HEALTHY_EVENT = re.compile(r" (?:server|ref-server) job (\S+): healthy at (http://\S+)$")  # `_advertise_when_healthy`


def replica_urls(files: RunFiles) -> dict[str, str]:
    """`{job id: URL}` of every server replica of the run that became healthy: its address file, or once that is
    withdrawn, the job's last `healthy at URL` line in status.log."""
    lines = files.status.read_text().splitlines() if files.status.is_file() else []
    urls = {match.group(1): match.group(2) for line in lines if (match := HEALTHY_EVENT.search(line))}
    for role in (SERVER, REF_SERVER):
        urls.update(advertised(files, role))
    return urls


def advertised(files: RunFiles, role: str) -> dict[str, str]:
    """`{name: URL}` of the replicas of a role in its address directory (`<name>.addr`, `name` the job id)."""
    return read_addresses(files.replica_dir(role))


# ----------------------------------------------------------------------------------------- waits
def wait_for_replicas(plan: SlurmPlan, watch: JobWatch, echo: Echo = log) -> dict[str, dict[str, str]]:
    """`{role: {job id: URL}}` of the healthy replicas of each server role, once every role has its spec's
    `min_replicas` healthy. Replica jobs added to jobs.env meanwhile (`add-server`) are watched too.

    Raises `LaunchError` once a role cannot get there any more (too few of its jobs may still run), or after the
    recipe's `trainer.server_wait_timeout`, naming the jobs that do not serve and their logs.
    """
    timeout, start, next_progress = plan.server_wait_s, time.monotonic(), POLL_S
    while True:
        for ref in read_jobs_file(plan.files):
            if ref.role in plan.server_roles and ref.job_id not in {r.job_id for r in watch.refs}:
                watch.add(ref)
        healthy, waiting, short_of = {}, [], []
        for role in plan.server_roles:
            jobs, need = [r for r in watch.refs if r.role == role], plan.spec(role).min_replicas
            addresses = advertised(plan.files, role)  # /health needs no API key
            healthy[role] = {name: url for name, url in addresses.items() if SGLangClient(url).is_healthy(timeout=5.0)}
            if len(healthy[role]) >= need:
                continue
            ended = [r for r in jobs if not watch.alive(r)]
            if len(jobs) - len(ended) < need:
                short = (f"{len(jobs) - len(ended)} of the {len(jobs)} {role} jobs may still serve, and the trainer "
                         f"needs {need} (servers.{SERVER_ROLES[role]}.min_replicas): " if len(jobs) > 1 else "")
                raise LaunchError(short + "; ".join(f"{r} ended ({watch.state(r)}) before its server became healthy; "
                                                    f"see {r.log}" for r in ended))
            waiting += [(r, addresses.get(r.job_id)) for r in jobs if r.job_id not in healthy[role] and watch.alive(r)]
            short_of.append(f"{len(healthy[role])} of {need} {role} replica(s) healthy")
        if not short_of:
            return healthy
        elapsed = time.monotonic() - start
        not_serving = "; ".join(f"{r} ({watch.state(r)}): {f'not healthy at {url}' if url else 'no address yet'}"
                                for r, url in waiting)
        if elapsed > timeout:
            raise LaunchError(f"{', '.join(short_of)} after {timeout:.0f} s (trainer.server_wait_timeout): "
                              f"{not_serving}; see {', '.join(r.log for r, _ in waiting)}")
        if elapsed >= next_progress:
            echo(f"waiting for servers, {', '.join(short_of)}: {not_serving} ({elapsed:.0f} s / {timeout:.0f} s)")
            next_progress += POLL_S
        time.sleep(1.0)


# ------------------------------------------------------------------------------------- processes
def node_command(plan: SlurmPlan, role: str, ctx: JobContext, index: int = 0,
                 port: Optional[int] = None) -> list[str]:
    """What one node of the job runs: the server (of resources entry `index`, on `port`), or `accelerate launch`
    of the trainer (`port`: its rendezvous port on the first node)."""
    if role == TRAINER:
        if port is None:
            raise LaunchError("the trainer's node command needs the rendezvous port the job took (--port)")
        return argv(plan.trainer_command(ctx.node_rank, ctx.head_node, port))
    return argv(plan.server_command(role, ctx.node_rank, ctx.head_node, index, port))


def log_resources(role: str) -> None:
    """One line, at the start of each node's task of a job, of what SLURM gave it: the GPUs (`CUDA_VISIBLE_DEVICES`,
    set by SLURM for `--gres=gpu:N`) and the CPUs (`SLURM_CPUS_PER_TASK`; else, and in brackets, how many this
    process may run on). What to check first when a server does not fit its GPUs or a trainer runs slowly."""
    runnable = len(os.sched_getaffinity(0))
    log(f"{role} on {os.environ.get('SLURMD_NODENAME', socket.gethostname())}: resources: CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')} cpus={os.environ.get('SLURM_CPUS_PER_TASK', runnable)} "
        f"(runnable on {runnable})")


def rendezvous_port(plan: SlurmPlan, ctx: JobContext, echo: Echo = log) -> int:
    """accelerate's rendezvous port of the trainer job: one free on its first node, chosen there (a fixed port would
    collide with another run's trainer on that node). Under sbatch the batch step, on the first node, passes it to
    each node's task (`jobs node --port`); under submitit the first node's task writes it to the run directory, where
    the tasks of the other nodes wait for it."""
    path = plan.files.run_dir / f".rendezvous-{ctx.job_id}.{ctx.restart_count}.port"
    if ctx.node_rank == 0:
        port = free_port("0.0.0.0")
        if ctx.launcher == SUBMITIT and len(ctx.nodes) > 1:
            write_atomic(path, f"{port}\n")
        return port
    me = f"trainer job {ctx.job_id}, node {ctx.node_rank}"
    wait_for(path.is_file, f"{me}: waiting for the rendezvous port of the first node ({ctx.head_node}) in {path}",
             plan.server_wait_s, f"{me}: no rendezvous port from the first node ({ctx.head_node}) in {path} after "
                                 f"{plan.server_wait_s:.0f} s (trainer.server_wait_timeout)", echo)
    return int(path.read_text())


def wait_for(ready: Callable[[], bool], waiting: str, timeout: float, timed_out: str, echo: Echo,
             failed: Callable[[], Optional[str]] = lambda: None) -> None:
    """Poll `ready` every second until it holds, saying `waiting (N s / T s)` every POLL_S seconds; `LaunchError`
    with `timed_out` after `timeout` seconds, or with what `failed` says once the wait is pointless."""
    start, next_progress = time.monotonic(), POLL_S
    while not ready():
        elapsed, failure = time.monotonic() - start, failed()
        if failure:
            raise LaunchError(failure)
        if elapsed > timeout:
            raise LaunchError(timed_out)
        if elapsed >= next_progress:
            echo(f"{waiting} ({elapsed:.0f} s / {timeout:.0f} s)")
            next_progress += POLL_S
        time.sleep(1.0)


def job_args(plan: SlurmPlan) -> list[str]:
    """`RECIPE --set=K=V ...`: how a job entry of this module loads the same recipe."""
    return [plan.recipe_path, *(f"--set={item}" for item in plan.overrides)]


def start_on_nodes(plan: SlurmPlan, role: str, ctx: JobContext, index: int = 0,
                   port: Optional[int] = None) -> subprocess.Popen:
    """The job's command on its nodes: from sbatch's batch step, one srun task a node (`jobs node`, which computes
    the node's command from its rank); under submitit, which runs the task on every node, this node's command."""
    if ctx.launcher == SBATCH:
        port_args = ["--port", str(port)] if role == TRAINER else ["--resources-index", str(index),
                                                                   "--port", str(port or plan.port(role))]
        return _spawn(["srun", *plan.srun_args(role, index), sys.executable, "-m", "open_r1_ext.launch.jobs", "node",
                       role, *job_args(plan), *port_args])
    log_resources(role)
    return _spawn(node_command(plan, role, ctx, index, port))


def run_node_server(cmd: list[str]) -> int:
    """One node's server under sbatch's srun, as a child of this task: once it is gone, killed or not, the files it
    left in this node's /dev/shm are removed (`SharedMemoryFiles`, noted every `NOTE_SHARED_MEMORY_S` while it runs,
    as SGLang makes some after its start); SIGTERM (scancel, the job's end) stops it. Its exit status."""
    stop_on_signals()
    if orphans := remove_orphaned_shared_memory():
        log(f"removed what killed servers left in /dev/shm: {' '.join(orphans)}")
    process, shared_memory, said = _spawn(cmd), SharedMemoryFiles(), set()
    try:
        while True:
            shared_memory.note(process.pid)
            if said != shared_memory.files.keys():
                said = set(shared_memory.files)
                log(f"the server's files in /dev/shm, removed once it is gone: {' '.join(sorted(said))}")
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = process.wait(timeout=NOTE_SHARED_MEMORY_S)
                return code if code >= 0 else 128 - code  # killed by a signal: as a shell says it
    except KeyboardInterrupt:
        return SIGTERM_EXIT
    finally:
        _stop(process)
        removed = shared_memory.remove()
        if removed:
            log(f"removed what the server left in /dev/shm: {' '.join(removed)}")


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


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: a TIME_WAIT socket is no owner
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def node_port(preferred: int, job_id: str) -> Iterator[int]:
    """The port of a one-node server job: `preferred` when nothing on this node listens on it and no other server
    job (of this user) starting here has claimed it, else one the OS picks. Replicas SLURM places on one node so
    each get their own. The claim is a file in a node-local folder, held while the block runs."""
    with _locked(PORT_CLAIMS / ".lock"):
        claimed = {path.stem for path in PORT_CLAIMS.glob("*.port")}
        port = preferred
        while str(port) in claimed or not _bindable(port):
            port = free_port("0.0.0.0")
        claim = PORT_CLAIMS / f"{port}.port"
        claim.write_text(job_id)
    try:
        yield port
    finally:
        claim.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------- the jobs
def run_server_job(plan: SlurmPlan, role: str, ctx: JobContext, index: int = 0, echo: Echo = log) -> int:
    """Run one replica of a role's server (resources entry `index`) on the job's nodes; from the first node, join
    the run (jobs.env), advertise `host:port` in the role's address directory once /health answers, and stop once
    the run's trainer job is gone. Returns the job's exit status."""
    if role not in plan.server_roles:
        raise LaunchError(f"recipe {plan.recipe_path} starts no {role} (its servers: "
                          f"{', '.join(plan.server_roles) or 'none: every role has a url or runs on the trainer'})")
    plan.check_index(role, index)
    files, me = plan.files, JobRef.of(plan.files, role, ctx.job_id, ctx.executor, ctx.launcher)
    stop_on_signals()
    files.logs.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        try:
            one_node = plan.resources(role, index).nodes == 1
            port = stack.enter_context(node_port(plan.port(role), ctx.job_id)) if one_node else plan.port(role)
        except KeyboardInterrupt:
            return SIGTERM_EXIT
        return _serve(plan, role, ctx, index, port, me, echo)


def _serve(plan: SlurmPlan, role: str, ctx: JobContext, index: int, port: int, me: JobRef, echo: Echo) -> int:
    files, address, lead = plan.files, f"{ctx.head_node}:{port}", ctx.node_rank == 0
    addr_file, process, shared_memory = files.replica_addr(role, ctx.job_id), None, SharedMemoryFiles()
    try:
        if lead:
            _join(files, me, echo)
        if ctx.launcher != SBATCH and (orphans := remove_orphaned_shared_memory()):  # (under sbatch: srun's task)
            echo(f"{me}: removed what killed servers left in /dev/shm: {' '.join(orphans)}")
        process = start_on_nodes(plan, role, ctx, index, port)
        if lead:
            _advertise_when_healthy(plan, process, address, addr_file, me, echo)
            shared_memory.note(process.pid)  # the server's own processes under submitit (under sbatch: srun's task)
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
        if lead and addr_file.is_file() and addr_file.read_text().strip() == address:
            addr_file.unlink()  # withdrawn first: the trainer's pool stops sending to it
        _stop(process)
        shared_memory.remove()  # what it left in /dev/shm, killed or not
        if lead:
            record(files, f"{me}: stopped", echo)


def _join(files: RunFiles, me: JobRef, echo: Echo) -> None:
    """A server job started by hand (`sbatch slurm/serve.slurm RECIPE`) adds itself to its run's jobs.env, so the
    run's end cancels it like the others (`add-server` and the launchers list theirs when they submit them)."""
    values = read_jobs_env(files)
    if not values or me.job_id in values.get(f"{role_var(me.role)}_JOB", "").split(","):
        return
    if values.get("EXECUTOR", "slurm") != me.executor:
        echo(f"{me}: not added to {files.jobs}: the run's jobs are {values.get('EXECUTOR')} jobs, this one is not")
        return
    register_jobs(files, [me])
    record(files, f"{me}: joined the run (added to {files.jobs})", echo)


def _advertise_when_healthy(plan: SlurmPlan, process: subprocess.Popen, address: str, addr_file: Path, me: JobRef,
                            echo: Echo) -> None:
    client = SGLangClient(f"http://{address}")  # /health needs no API key
    def exited() -> Optional[str]:
        if process.poll() is None:
            return None
        return (f"{me}: the {me.role} exited (code {process.returncode}) before answering http://{address}/health; "
                "see this job's log")

    wait_for(lambda: client.is_healthy(timeout=5.0), f"{me}: waiting for http://{address}/health", plan.server_wait_s,
             f"{me}: the {me.role} is not healthy after {plan.server_wait_s:.0f} s (trainer.server_wait_timeout; "
             f"http://{address}/health)", echo, exited)
    write_atomic(addr_file, address + "\n")
    record(plan.files, f"{me}: healthy at http://{address}", echo)


def _serve_until_trainer_gone(plan: SlurmPlan, process: subprocess.Popen, me: JobRef, echo: Echo) -> bool:
    """The watchdog: True once the trainer job named in jobs.env is gone, False when the server exits first."""
    watch = JobWatch()
    while process.poll() is None:
        trainer = next((ref for ref in read_jobs_file(plan.files) if ref.role == TRAINER), None)
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
    """Wait for `min_replicas` healthy replicas of each of the run's server roles (their jobs named in jobs.env),
    then `accelerate launch` the training on the job's nodes, its pool the roles' address directories. The first
    node then ends the run (`end_run`). Returns the job's exit status."""
    files, lead = plan.files, ctx.node_rank == 0
    me = JobRef.of(files, TRAINER, ctx.job_id, ctx.executor, ctx.launcher)
    servers = [ref for ref in read_jobs_file(files) if ref.role in plan.server_roles]
    missing = [role for role in plan.server_roles if not any(ref.role == role for ref in servers)]
    if missing:
        raise LaunchError(f"{me}: {files.jobs} names no {' or '.join(missing)} job; launch the run with "
                          "slurm/grpo.slurm or open-r1-ext launch")
    watch, process, code, ended = JobWatch([me, *servers]), None, 1, False
    stop_on_signals()
    files.logs.mkdir(parents=True, exist_ok=True)
    try:
        if lead:
            record(files, f"{me}: started on {','.join(ctx.nodes)}", echo)
        for role, replicas in wait_for_replicas(plan, watch, echo).items():
            for job_id, url in replicas.items() if lead else ():
                record(files, f"{me}: {role} job {job_id} is up at {url}", echo)
        process = start_on_nodes(plan, TRAINER, ctx, port=rendezvous_port(plan, ctx, echo))
        code = process.wait()
    except KeyboardInterrupt:
        code = SIGTERM_EXIT
        if lead:  # said before waiting for the trainer: SLURM may SIGKILL this job (KillWait) before the end below
            watch.refresh()
            ended = being_requeued(ctx, me, watch)
            if ended:  # the servers stay up whatever happens next
                end_run(plan, ctx, me, code, watch, echo)
            else:
                record(files, f"{me}: SIGTERM: the trainer saves a checkpoint of its last finished step and stops "
                              f"(given up to {TRAINER_STOP_GRACE_S:.0f} s, or SLURM's KillWait)", echo)
    except LaunchError as err:
        echo(str(err))
    finally:
        _stop(process, TRAINER_STOP_GRACE_S)
        if lead and not ended:
            end_run(plan, ctx, me, code, watch, echo)
    return code


def end_run(plan: SlurmPlan, ctx: JobContext, me: JobRef, code: int, watch: JobWatch, echo: Echo = log) -> None:
    """The one owner of a run's end, on both launch paths: unless the trainer job is being requeued, say how it
    ended (naming any server job that died under it, with its URL) and cancel every server job still running,
    replicas added during the run (jobs.env, read again now) included."""
    for ref in read_jobs_file(plan.files):
        if ref.role != TRAINER and ref.job_id not in {r.job_id for r in watch.refs}:
            watch.add(ref)
    watch.refresh()
    if being_requeued(ctx, me, watch):
        record(plan.files, f"{me}: requeued; it resumes from the last checkpoint, the servers stay up", echo)
        return
    urls = replica_urls(plan.files)
    servers = [ref for ref in watch.refs if ref.role != TRAINER]
    lost = "".join(f"; {s} ({urls.get(s.job_id, 'no URL yet')}) is no longer running ({watch.state(s)})"
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
def submit_env() -> dict:
    """The environment of the jobs sbatch submits: this one, without the submitting job's own SLURM variables, and
    with this interpreter for serve.slurm and train.slurm to exec."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    env["PYTHON"] = sys.executable
    return env


def submit_run(plan: SlurmPlan, echo: Echo = log) -> int:
    """`slurm/grpo.slurm`: sbatch each role's replica server jobs, then the trainer job (it starts once the first
    `min_replicas` of each role have started), with jobs.env written for each; a submission that stops half-way
    cancels what it submitted."""
    env = submit_env()
    stop_on_signals()
    prepare_run_dir(plan)
    submitted: list[JobRef] = []
    try:
        for role in plan.server_roles:
            for _, index in plan.jobs_of(role):
                submitted.append(_sbatch(plan, role, index, [], env, echo))
                register_jobs(plan.files, submitted[-1:], plan, SBATCH)
        first = [ref.job_id for role in plan.server_roles
                 for ref in [s for s in submitted if s.role == role][:plan.spec(role).min_replicas]]
        after = [f"--dependency=after:{':'.join(first)}", "--kill-on-invalid-dep=yes"] if first else []
        submitted.append(_sbatch(plan, TRAINER, 0, after, env, echo))
        register_jobs(plan.files, submitted[-1:], plan, SBATCH)
    except BaseException:
        if submitted:
            cancel(submitted)
            record(plan.files, f"submission failed: cancelled job(s) {' '.join(ref.job_id for ref in submitted)}", echo)
        raise
    ids = [ref.job_id for ref in submitted]
    print(f"run {plan.files.run_dir}: jobs {' '.join(ids)} (ids in {plan.files.jobs})\n"
          f"  follow: tail -f {plan.files.logs}/*.out; cat {plan.files.status}")
    return 0


def _sbatch(plan: SlurmPlan, role: str, index: int, options: list[str], env: dict, echo: Echo,
            launcher: str = SBATCH) -> JobRef:
    """sbatch one job: the trainer, or server job `index` of a role (logs named as `launcher` names them)."""
    script = SLURM_DIR / ("train.slurm" if role == TRAINER else "serve.slurm")
    script_args = [] if role == TRAINER else ["--role", role, "--resources-index", str(index)]
    out = subprocess.run(["sbatch", "--parsable", *plan.sbatch_args(role, index, launcher), *options, str(script),
                          *job_args(plan), *script_args], env=env, capture_output=True, text=True)
    if out.returncode:
        raise LaunchError(f"sbatch of the {role} job failed: {out.stderr.strip()}")
    ref = JobRef.of(plan.files, role, out.stdout.strip().split(";")[0], "slurm", launcher)
    record(plan.files, f"submitted {ref} (logs: {plan.files.log(role, ref.job_id, launcher, 'out')}, .err)", echo)
    return ref


def add_server(run_dir: Path, role: str = SERVER, index: int = 0, echo: Echo = log) -> JobRef:
    """`open-r1-ext add-server`: sbatch one more server job (resources entry `index`) for a running run, launched
    by either launcher, with the run's recipe and overrides (jobs.env's `RECIPE_ARGS`, loaded from `LAUNCH_DIR`
    like the launch). It is listed in jobs.env, so the run's end cancels it, and joins the trainer's pool once it
    advertises itself."""
    files = RunFiles(Path(run_dir).resolve())
    values = read_jobs_env(files)
    if "RECIPE_ARGS" not in values:
        raise LaunchError(f"{files.jobs}: {'no RECIPE_ARGS' if values else 'no such file'}: add-server joins a run "
                          "launched with slurm/grpo.slurm or open-r1-ext launch (give its trainer.output_dir)")
    if values.get("EXECUTOR") == "local":
        raise LaunchError(f"{files.run_dir} runs on submitit's local executor; add-server submits SLURM jobs")
    trainer = [ref for ref in read_jobs_file(files) if ref.role == TRAINER]
    watch = JobWatch(trainer)
    if trainer and not watch.alive(trainer[0]):
        raise LaunchError(f"the run's {trainer[0]} has ended ({watch.state(trainer[0])}): there is no run to join; "
                          "launch it again (it resumes from its last checkpoint)")
    from open_r1_ext.config.recipe import load_recipe

    try:
        os.chdir(values["LAUNCH_DIR"])  # the recipe's relative paths are relative to where the run was launched
    except OSError as err:
        raise LaunchError(f"{files.jobs}: LAUNCH_DIR {values['LAUNCH_DIR']}: {err.strerror}; run add-server on a "
                          "machine that sees the directory the run was launched from") from None
    recipe_path, *sets = shlex.split(values["RECIPE_ARGS"])
    overrides = [item.removeprefix("--set=") for item in sets]
    plan = SlurmPlan(load_recipe(recipe_path, overrides), overrides)
    if role not in plan.server_roles:
        raise LaunchError(f"the run starts no {role} jobs (its servers: {', '.join(plan.server_roles) or 'none'})")
    plan.check_index(role, index)
    ref = _sbatch(plan, role, index, [], submit_env(), echo, values.get("LAUNCHER", SBATCH))
    register_jobs(files, [ref])
    return ref


# ---------------------------------------------------------------------------------- entry point
def main(cli_args: Optional[list[str]] = None) -> int:
    from open_r1_ext.config.recipe import RecipeError, load_recipe
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
        add_recipe_arguments(job)
        if name == "server":
            job.add_argument("--role", choices=(SERVER, REF_SERVER), default=SERVER)
        if name in ("server", "node"):
            job.add_argument("--resources-index", type=int, default=0,
                             help="the entry of the spec's resources list this server job has (default 0)")
        if name == "node":
            job.add_argument("--port", type=int, default=None,
                             help="the port the server job took on its first node, or the trainer job's rendezvous port")
    args = parser.parse_args(cli_args)
    try:
        # the submission checks the recipe whole; its jobs read what was checked (the trainer checks it again)
        plan = SlurmPlan(load_recipe(args.recipe, args.set, checked=args.job == "submit"), args.set)
        if args.job == "submit":  # slurm/grpo.slurm: the preflight first, nothing submitted on an error
            return 2 if launch_refused(plan.recipe) else submit_run(plan)
        ctx = JobContext.from_slurm_env()
        if args.job == "server":
            return run_server_job(plan, args.role, ctx, args.resources_index)
        if args.job == "trainer":
            return run_trainer_job(plan, ctx)
        cmd = node_command(plan, args.role, ctx, args.resources_index, args.port)
        log_resources(args.role)
        if args.role == TRAINER:
            os.execvp(cmd[0], cmd)  # this node's trainer replaces the entry: srun signals it directly
        return run_node_server(cmd)
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
