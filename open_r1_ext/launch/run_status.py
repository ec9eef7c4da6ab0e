"""`open-r1-ext status RUN_DIR`: the state of a run, from its run directory, while it runs and after it ended.

Reads what the jobs and the trainer write there (jobs.env, replicas/<role>/<job id>.addr, status.log, metrics.jsonl,
weight_sync.jsonl, rollouts.jsonl), asks SLURM for the jobs' states (one squeue call through `jobs.JobWatch`, one
sacct call for jobs squeue has forgotten) and each server replica for its health and weight version. Imports no TRL: it runs on a login node. `run_metrics` is also what `plot` reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from open_r1_ext.launch.slurm_plan import REF_SERVER, SERVER, TRAINER, RunFiles

METRICS_FILE = "metrics.jsonl"  # one JSON object per trainer log (open_r1_ext.train.MetricsLog writes it)
# The trainer's `dynamic_sampling/*` metrics (`trainer/dynamic_sampling.py`) that `status` and `plot` show.
DYNAMIC_SAMPLING_METRICS = ("groups_generated", "groups_kept", "groups_filtered", "rounds", "informative_share")
SCHEMA_VERSION = 1  # of `--json`; bumped only when a documented key changes meaning or goes away
EVENTS_SHOWN = 8
RATE_WINDOW = 10  # steps/s over the last this many logged steps
HEALTH_TIMEOUT_S = 3.0


def read_jsonl(path: Path) -> list[dict]:
    """The entries of a JSONL file the trainer appends to; a line cut short by a writer mid-append is skipped."""
    if not path.is_file():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:
            continue
    return entries


def run_metrics(run_dir: Path) -> tuple[list[dict], Optional[dict]]:
    """`(steps, summary)`: the trainer's logged metrics, one dict per step (a resumed run's repeated steps keep their
    latest values), and the end-of-training summary (`train_runtime`, ...) when training has finished.

    From `metrics.jsonl` (runs started with `open-r1-ext train`), else the `log_history` of the newest checkpoint's
    `trainer_state.json` (no times, so no steps/s).
    """
    entries = read_jsonl(run_dir / METRICS_FILE)
    if not entries:
        states = sorted(run_dir.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
        if states:
            state = json.loads(states[-1].read_text())
            entries = [dict(entry, max_steps=state.get("max_steps")) for entry in state.get("log_history", [])]
    by_step: dict[int, dict] = {}
    summary = None
    for entry in entries:
        if "train_runtime" in entry:
            summary = entry
        elif "step" in entry:
            by_step[entry["step"]] = entry
            summary = None  # a resumed run after a finished one is running again
    return [by_step[step] for step in sorted(by_step)], summary


# ----------------------------------------------------------------------------------------- parts
def read_jobs(files: RunFiles) -> list[dict]:
    """The run's jobs from jobs.env, servers first (one per replica), each `{role, job_id, executor, state}`:
    SLURM's state (one squeue call for all, as the jobs watch each other; for jobs squeue no longer lists, one sacct
    call; `GONE` when neither knows the job), or a local executor's `RUNNING`/`ENDED`. Empty before a launcher wrote
    jobs.env."""
    from open_r1_ext.launch.jobs import JobWatch, read_jobs_file

    refs = read_jobs_file(files)
    watch = JobWatch(refs)
    jobs = [{"role": ref.role, "job_id": ref.job_id, "executor": ref.executor, "state": watch.state(ref)} for ref in refs]
    gone = {job["job_id"]: job for job in jobs if job["state"] == "GONE"}
    for job_id, state in (accounted_states(list(gone)) if gone else {}).items():
        gone[job_id]["state"] = state
    return jobs


def accounted_states(job_ids: list[str]) -> dict[str, str]:
    """The final states of jobs squeue has forgotten (after SLURM's MinJobAge), from one sacct call; {} where the
    cluster keeps no accounting."""
    try:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if out.returncode:
        return {}
    states = (line.split("|") for line in out.stdout.splitlines() if line.count("|") == 1)
    return {job_id: state.split()[0] for job_id, state in states if job_id in job_ids and state}


def server_replicas(files: RunFiles, jobs: list[dict]) -> list[tuple[str, str, Optional[str]]]:
    """`(role, job id, URL)` of each server replica: every server job of jobs.env, then any other replica in the
    address directories. The URL is the replica's address file (written once healthy), else the job's last
    `healthy at URL` event in status.log (the address file goes when the server stops), else None (never healthy)."""
    from open_r1_ext.launch.jobs import advertised, replica_urls

    replicas = [(job["role"], job["job_id"]) for job in jobs if job["role"] != TRAINER]
    replicas += [(role, name) for role in (SERVER, REF_SERVER) for name in advertised(files, role)
                 if (role, name) not in replicas]
    urls = replica_urls(files)
    return [(role, job_id, urls.get(job_id)) for role, job_id in replicas]


def run_api_key(files: RunFiles) -> Optional[str]:
    """The key the run's servers require (the launchers' owner-only key file in the run directory), if any."""
    import yaml

    from open_r1_ext.launch.run_key import FLAG, key_file

    path = key_file(files.run_dir)
    return yaml.safe_load(path.read_text())[FLAG] if path.is_file() else None


def probe_server(role: str, job_id: str, url: Optional[str], api_key: Optional[str]) -> dict:
    """`{role, job_id, url, healthy, weight_version, error}`: /health, then the weight version the replica reports."""
    from open_r1_ext.sglang_client import ServerError, SGLangClient

    server: dict[str, Any] = {"role": role, "job_id": job_id, "url": url, "healthy": False, "weight_version": None,
                              "error": None}
    if url is None:
        server["error"] = "no address: the server never became healthy"
        return server
    client = SGLangClient(url, api_key=api_key, request_timeout=HEALTH_TIMEOUT_S, max_retries=0)
    server["healthy"] = client.is_healthy(timeout=HEALTH_TIMEOUT_S)
    if not server["healthy"]:
        server["error"] = f"{url}/health does not answer"
        return server
    try:
        server["weight_version"] = client.weight_version()
    except ServerError as err:
        server["error"] = str(err)
    return server


def read_events(files: RunFiles) -> list[dict]:
    """status.log as `[{at, message}]` (each line `<ISO time> <message>`)."""
    if not files.status.is_file():
        return []
    events = []
    for line in files.status.read_text().splitlines():
        at, _, message = line.partition(" ")
        events.append({"at": at, "message": message})
    return events


def trainer_progress(run_dir: Path) -> Optional[dict]:
    """Step / max, steps per second over the last logged steps, ETA, last reward, KL and loss."""
    steps, summary = run_metrics(run_dir)
    now = time.time()  # after the read: a step logged meanwhile is not in the future
    if not steps:
        return None
    last = steps[-1]
    timed = [s for s in steps[-RATE_WINDOW:] if "time" in s]
    rate = None
    if len(timed) >= 2 and timed[-1]["time"] > timed[0]["time"]:
        rate = (timed[-1]["step"] - timed[0]["step"]) / (timed[-1]["time"] - timed[0]["time"])
    max_steps = last.get("max_steps")
    eta = (max_steps - last["step"]) / rate if rate and max_steps and summary is None else None
    return {
        "step": last["step"], "max_steps": max_steps, "steps_per_s": rate, "eta_s": eta,
        "reward": last.get("reward"), "reward_std": last.get("reward_std"), "kl": last.get("kl"), "loss": last.get("loss"),
        "logged_at": _iso(last["time"]) if "time" in last else None,
        "age_s": now - last["time"] if "time" in last else None,
        "finished": summary is not None,
    }


def last_syncs(run_dir: Path) -> dict[str, dict]:
    """The last confirmed weight sync per role (`generation`, `reference`) from weight_sync.jsonl."""
    syncs, entries = {}, read_jsonl(run_dir / "weight_sync.jsonl")
    now = time.time()
    for entry in entries:
        syncs[entry["role"]] = {"step": entry["step"], "weight_version": entry.get("weight_version"),
                                "at": _iso(entry["time"]), "age_s": now - entry["time"]}
    return syncs


def staleness(run_dir: Path) -> Optional[dict]:
    """The last step's staleness (steps between the weights its completions were sampled from, their oldest token,
    and the policy it trained) and the largest so far, from rollouts.jsonl. With in-flight updates (an entry per group),
    also the weight versions the last step's groups came from and the groups dropped as too stale so far."""
    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    trained = [r for r in rollouts if not r.get("dropped")]
    if not trained:
        return None
    last = [r for r in trained if r["step"] == trained[-1]["step"]]
    found = {"step": last[-1]["step"], "last": max(r["staleness"] for r in last),
             "max": max(r["staleness"] for r in trained)}
    if "group" in last[-1]:
        found["versions"] = sorted({v for r in last for v in r["versions"]})
        found["dropped"] = len(rollouts) - len(trained)
    return found


def dynamic_sampling(run_dir: Path) -> Optional[dict]:
    """With `dynamic_sampling`: the last logged step's groups (generated, kept, filtered: all processes'), rounds and
    informative share (kept / the batch's groups), from the trainer's metrics (averaged over `logging_steps`)."""
    logged = [s for s in run_metrics(run_dir)[0] if "dynamic_sampling/groups_generated" in s]
    if not logged:
        return None
    last = logged[-1]
    return {"step": last["step"], **{name: last.get(f"dynamic_sampling/{name}") for name in DYNAMIC_SAMPLING_METRICS}}


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp).astimezone().isoformat(timespec="seconds")


# ------------------------------------------------------------------------------------------ status
def run_status(run_dir: Path) -> dict:
    """Everything `status` shows, as the documented `--json` object."""
    files = RunFiles(run_dir.resolve())
    events = read_events(files)
    jobs = read_jobs(files)
    api_key = run_api_key(files)
    return {
        "schema": SCHEMA_VERSION,
        "run_dir": str(files.run_dir),
        "checked_at": _iso(time.time()),
        "jobs": jobs,
        "servers": [probe_server(role, job_id, url, api_key)
                    for role, job_id, url in server_replicas(files, jobs)],
        "trainer": trainer_progress(files.run_dir),
        "last_sync": last_syncs(files.run_dir),
        "staleness": staleness(files.run_dir),
        "dynamic_sampling": dynamic_sampling(files.run_dir),
        "events": events[-EVENTS_SHOWN:],
    }


def ended(status: dict) -> bool:
    """A launched run has ended when none of its jobs may still run; one without jobs (`open-r1-ext train` on this
    machine) when the trainer has logged its end."""
    from open_r1_ext.launch.jobs import ACTIVE_STATES

    if status["jobs"]:
        return not any(job["state"] in ACTIVE_STATES for job in status["jobs"])
    return status["trainer"] is not None and status["trainer"]["finished"]


def _num(value: Optional[float], fmt: str = ".4f") -> str:
    return "-" if value is None else format(value, fmt)


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    if seconds < 120:
        return f"{seconds} s"
    hours, rest = divmod(seconds, 3600)
    return f"{hours} h {rest // 60:02d} min" if hours else f"{rest // 60} min {rest % 60:02d} s"


def format_status(status: dict) -> str:
    """The human-readable form: one line per part, the events indented below."""
    lines = [f"run       {status['run_dir']}  (at {status['checked_at']})"]
    jobs = ", ".join(f"{j['role']} {j['job_id']} {j['state']}" for j in status["jobs"])
    lines.append(f"jobs      {jobs or 'none (no jobs.env: a run of open-r1-ext train, or not submitted yet)'}")
    for server in status["servers"]:
        health = f"healthy, weights {server['weight_version']}" if server["healthy"] else "NOT HEALTHY"
        error = f" ({server['error']})" if server["error"] else ""
        lines.append(f"server    {server['role']} {server['job_id']} {server['url'] or '-'}: {health}{error}")
    trainer = status["trainer"]
    if trainer is None:
        lines.append("trainer   no step logged yet")
    else:
        done = "finished" if trainer["finished"] else f"ETA {_duration(trainer['eta_s'])}"
        rate = "-" if trainer["steps_per_s"] is None else f"{trainer['steps_per_s']:.2f}"
        age = "" if trainer["age_s"] is None else f"  (logged {_duration(trainer['age_s'])} ago)"
        lines.append(f"trainer   step {trainer['step']}/{trainer['max_steps'] or '?'}  {rate} steps/s  {done}  "
                     f"reward {_num(trainer['reward'])}  kl {_num(trainer['kl'])}  loss {_num(trainer['loss'])}{age}")
    for role, sync in status["last_sync"].items():
        lines.append(f"sync      {role}: step {sync['step']} (weights {sync['weight_version']}), "
                     f"{_duration(sync['age_s'])} ago")
    found = status["staleness"]
    if found:
        in_flight = "" if "versions" not in found else (
            f"; in flight: its groups from weights {', '.join(map(str, found['versions']))}; "
            f"{found['dropped']} group(s) dropped as too stale (sent again) so far")
        lines.append(f"staleness {found['last']} step(s) at step {found['step']} (max {found['max']}){in_flight}")
    sampled = status.get("dynamic_sampling")
    if sampled:
        lines.append(f"sampling  step {sampled['step']}: kept {sampled['groups_kept']:g} of {sampled['groups_generated']:g} "
                     f"groups generated ({sampled['groups_filtered']:g} filtered) in {sampled['rounds']:g} round(s); "
                     f"informative share {sampled['informative_share']:.2f}")
    for i, event in enumerate(status["events"]):
        lines.append(f"{'events' if i == 0 else '':<10}{event['at']} {event['message']}")
    return "\n".join(lines)


def main(run_dir: str, as_json: bool = False, watch: Optional[float] = None) -> int:
    """Print the status once, or every `watch` seconds until the run has ended (or Ctrl-C)."""
    path = Path(run_dir)
    if not path.is_dir():
        print(f"{run_dir}: no such run directory (a recipe's trainer.output_dir)", file=sys.stderr)
        return 2
    if watch is not None and watch <= 0:
        print(f"--watch {watch:g}: give the seconds between two looks, e.g. --watch 30", file=sys.stderr)
        return 2
    try:
        while True:
            status = run_status(path)
            if as_json:
                print(json.dumps(status), flush=True)
            else:
                clear = "\033[H\033[J" if watch and sys.stdout.isatty() else ""
                print(clear + format_status(status), end="\n\n" if watch else "\n", flush=True)
            if not watch or ended(status):
                return 0
            time.sleep(watch)
    except KeyboardInterrupt:
        return 0
