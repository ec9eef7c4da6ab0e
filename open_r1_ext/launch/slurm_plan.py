"""A recipe as SLURM jobs: each job's sbatch options, its per-node command, and the run directory's files.

What the job runtime (`jobs.py`, behind both `slurm/*.slurm` and the submitit launcher) reads; `describe` prints
it for `--dry-run`. `server_command` is also what `open-r1-ext train` runs for an embedded server. Pure: nothing
here submits or waits.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from open_r1_ext.config.recipe import Recipe, Resources, ServerSpec
from open_r1_ext.launch.local_server import SGLANG_CPU_ENV, sglang_cpu_args
from open_r1_ext.launch.run_key import key_file
from open_r1_ext.sglang_client import DEFAULT_SERVER_WAIT_TIMEOUT

SERVER, REF_SERVER, TRAINER = "server", "ref-server", "trainer"
SERVER_ROLES = {SERVER: "generation", REF_SERVER: "reference"}  # a server job's role in the recipe's `servers:`
DIST_INIT_PORT_OFFSET = 100  # SGLang's multi-node rendezvous: server port + this, on the server's first node
POLL_S = 10  # seconds between progress lines of every wait, and the longest interval between squeue calls
SBATCH, SUBMITIT = "sbatch", "submitit"  # the two launchers; each names its jobs' log files its own way
DETERMINISTIC_FLAG = "--enable-deterministic-inference"  # SGLang's spelling; the built-in server takes it too


class PlanError(ValueError):
    """A valid recipe that these launchers cannot run as asked; the message names the key and the fix."""


@dataclass(frozen=True)
class ShellVar:
    """A value known only inside the job (node rank, first node, server URL): `"$NAME"` where `--dry-run` prints a
    command."""

    name: str


Part = Union[str, int, float, ShellVar]
Word = Union[Part, tuple]  # a tuple of parts is one word, e.g. ("$HEAD_NODE", ":30100")


def shell_join(words: Sequence[Word]) -> str:
    """A command line as a shell would take it: literal parts quoted, `ShellVar`s as `"$NAME"` placeholders."""

    def part(p: Part) -> str:
        return f'"${p.name}"' if isinstance(p, ShellVar) else shlex.quote(str(p))

    return " ".join("".join(part(p) for p in (w if isinstance(w, tuple) else (w,))) for w in words)


def argv(words: Sequence[Word]) -> list[str]:
    """The same command as a list of strings, for a command built with concrete values."""
    out = []
    for word in words:
        parts = word if isinstance(word, tuple) else (word,)
        if any(isinstance(p, ShellVar) for p in parts):
            raise ValueError(f"{word!r} still holds a shell variable")
        out.append("".join(map(str, parts)))
    return out


def role_var(role: str) -> str:
    """`ref-server` -> `REF_SERVER`: the prefix of a job's shell variables."""
    return role.upper().replace("-", "_")


def time_minutes(text: str) -> int:
    """SLURM's time limit formats (`MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`, `D-HH:MM:SS`) in whole minutes."""
    try:
        days, dash, clock = text.partition("-")
        if not dash:
            days, clock = "0", text
        fields = [int(x) for x in clock.split(":")]
        if len(fields) > 3 or min(fields) < 0:
            raise ValueError(text)
        if dash or len(fields) == 3:  # [D-]HH[:MM[:SS]]
            hours, minutes, seconds = (fields + [0, 0])[:3]
        else:  # MM[:SS]
            hours, (minutes, seconds) = 0, (fields + [0])[:2]
        return int(days) * 1440 + hours * 60 + minutes + (1 if seconds else 0)
    except ValueError:
        raise PlanError(f"slurm.time: {text!r} is not a SLURM time limit (e.g. 90, 04:00:00, 1-00:00:00)") from None


@dataclass(frozen=True)
class RunFiles:
    """The run directory (the trainer's output_dir) and the launch files in it."""

    run_dir: Path

    @property
    def logs(self) -> Path:
        return self.run_dir / "logs"

    @property
    def status(self) -> Path:
        """One line per event of the run's jobs: submitted, healthy, finished, failed and why."""
        return self.run_dir / "status.log"

    @property
    def jobs(self) -> Path:
        """`KEY=VALUE` lines: the job ids of the run (`SERVER_JOB`, `REF_SERVER_JOB`: comma-separated, one per
        replica; `TRAINER_JOB`), `EXECUTOR`, `LAUNCHER`, and how the run was launched (`RECIPE_ARGS`, `LAUNCH_DIR`)."""
        return self.run_dir / "jobs.env"

    def replica_dir(self, role: str) -> Path:
        """The address directory of a server role: one `<name>.addr` per replica that serves (the trainer's pool)."""
        return self.run_dir / "replicas" / role

    def replica_addr(self, role: str, name: str) -> Path:
        """Written (`host:port`, atomically) by server job `name` once its server answers /health; removed when the
        job stops."""
        return self.replica_dir(role) / f"{name}.addr"

    def log(self, role: str, job_id: str, launcher: str, stream: str) -> Path:
        """A job's `out` or `err` log: `logs/<role>-<id>` under sbatch, submitit's `logs/<role>/<id>_0_log`."""
        if launcher == SBATCH:
            return self.logs / f"{role}-{job_id}.{stream}"
        return self.logs / role / f"{job_id}_0_log.{stream}"


class SlurmPlan:
    """The jobs of a run: `replicas` server jobs per role to start (`server` for generation, `ref-server` for a
    reference server of its own) and the trainer.

    Server job `index` of a role gets its spec's resources (`servers.<role>.resources`, or entry `index` of a list),
    the trainer `slurm.trainer`'s; all get `slurm:`'s account, qos, time, constraint, exclusive and extra_sbatch, and
    its partition unless their resources name their own. `overrides` are the `--set` values the recipe was loaded
    with; jobs load it again with the same ones.
    """

    def __init__(self, recipe: Recipe, overrides: Sequence[str] = ()):
        self.recipe = recipe
        self.overrides = tuple(overrides)
        self.recipe_path = str(Path(recipe.path).resolve())
        self.files = RunFiles(Path(recipe.output_dir).resolve())
        self.server_roles = self._server_roles()
        self.timeout_min = time_minutes(recipe.slurm.time)
        self.extra_sbatch = self._extra_sbatch()
        trainer = recipe.slurm.trainer
        if trainer.gpus_per_node == 0 and trainer.num_processes > 1:
            raise PlanError(f"slurm.trainer: {trainer.num_processes} trainer processes on CPU nodes: accelerate runs one "
                            "CPU process per machine here; set nodes: 1 and processes_per_node: 1, or give GPUs")

    # ------------------------------------------------------------------ jobs
    def _server_roles(self) -> list[str]:
        """The servers this run starts: the roles on a server of their own that the recipe gives no URL for."""
        specs = self.recipe.servers.specs()
        return [role for role, name in SERVER_ROLES.items() if name in specs and specs[name].started]

    def spec(self, role: str) -> ServerSpec:
        """The recipe's spec of a server job (`servers.generation` or `servers.reference`)."""
        return self.recipe.servers.specs()[SERVER_ROLES[role]]

    @property
    def roles(self) -> list[str]:
        return [*self.server_roles, TRAINER]

    def resources(self, role: str, index: int = 0) -> Resources:
        """The trainer's resources, or those of a role's server job `index` (its entry of a `resources` list)."""
        return self.recipe.slurm.trainer if role == TRAINER else self.spec(role).replica_resources(index)

    def check_index(self, role: str, index: int) -> None:
        """A server job's resources index names an entry of the role's `resources` (a list, or the one mapping: 0)."""
        resources = self.spec(role).resources
        entries = len(resources) if isinstance(resources, list) else 1
        if not 0 <= index < entries:
            raise PlanError(f"servers.{SERVER_ROLES[role]}.resources: no entry {index} (resources index), it has "
                            f"{entries}: give 0{f' to {entries - 1}' if entries > 1 else ''}")

    def partition(self, role: str, index: int = 0) -> Optional[str]:
        return self.resources(role, index).partition or self.recipe.slurm.partition

    def job_name(self, role: str) -> str:
        return f"{self.recipe.slurm.job_name}-{role}"

    def port(self, role: str) -> int:
        return self.spec(role).port

    @property
    def server_wait_s(self) -> float:
        """How long a trainer waits for its servers: the recipe's `trainer.server_wait_timeout` (read without the
        config's defaults, which import TRL: a job step's recipe is loaded unchecked, `load_recipe(checked=False)`)."""
        return float(self.recipe.trainer.get("server_wait_timeout", DEFAULT_SERVER_WAIT_TIMEOUT))

    def _extra_sbatch(self) -> list[str]:
        options = []
        for i, line in enumerate(self.recipe.slurm.extra_sbatch):
            option = str(line).removeprefix("#SBATCH").strip()
            if not option.startswith("--") or " " in option.split("=", 1)[0]:
                raise PlanError(f"slurm.extra_sbatch[{i}]: {line!r}: give one long sbatch option, e.g. --reservation=r1")
            options.append(option)
        return options

    # ------------------------------------------------------------- sbatch
    def sbatch_args(self, role: str, index: int = 0, launcher: str = SBATCH) -> list[str]:
        """The sbatch options of a job (server job `index` of a role), as `jobs.submit_run` passes them (they override
        the scripts' #SBATCH lines); its logs are named as `launcher` names them (`add-server` in a submitit run)."""
        slurm, job = self.recipe.slurm, self.resources(role, index)
        optional = {"partition": self.partition(role, index), "account": slurm.account, "qos": slurm.qos,
                    "constraint": slurm.constraint, "cpus-per-task": job.cpus_per_task, "mem": job.mem,
                    "gres": f"gpu:{job.gpus_per_node}" if job.gpus_per_node > 0 else None}
        args = [f"--job-name={self.job_name(role)}", f"--time={slurm.time}", f"--nodes={job.nodes}", "--ntasks-per-node=1"]
        args += [f"--{key}={value}" for key, value in optional.items() if value is not None]
        args += ["--exclusive"] if slurm.exclusive else []
        args += self.extra_sbatch
        logs = [f"--output={self.files.log(role, '%j', launcher, 'out')}", f"--error={self.files.log(role, '%j', launcher, 'err')}"]
        return args + logs + ["--open-mode=append"]  # appended to, so a requeued job keeps the log of its earlier starts

    def srun_args(self, role: str, index: int = 0) -> list[str]:
        """One task per node, with the job's CPUs and GPUs (Slurm 22.05-23.02's srun does not inherit
        --cpus-per-task from sbatch)."""
        job = self.resources(role, index)
        args = [f"--nodes={job.nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
        args += [f"--cpus-per-task={job.cpus_per_task}"] if job.cpus_per_task else []
        return args + ([f"--gres=gpu:{job.gpus_per_node}"] if job.gpus_per_node > 0 else [])

    def submitit_parameters(self, role: str, index: int = 0) -> dict:
        """The same job for `submitit.AutoExecutor.update_parameters` (slurm_* keys are ignored by the local executor)."""
        slurm, job = self.recipe.slurm, self.resources(role, index)
        params: dict = {"name": self.job_name(role), "nodes": job.nodes, "tasks_per_node": 1, "timeout_min": self.timeout_min}
        specific = {"partition": self.partition(role, index), "account": slurm.account, "qos": slurm.qos,
                    "constraint": slurm.constraint, "mem": job.mem, "exclusive": slurm.exclusive or None,
                    "gres": f"gpu:{job.gpus_per_node}" if job.gpus_per_node > 0 else None}
        params.update({f"slurm_{key}": value for key, value in specific.items() if value is not None})
        if job.cpus_per_task:  # and to submitit's own srun, which does not inherit it (Slurm 22.05-23.02)
            params.update(cpus_per_task=job.cpus_per_task, slurm_srun_args=[f"--cpus-per-task={job.cpus_per_task}"])
        if job.gpus_per_node > 0:
            params["local_gpus_per_node"] = job.gpus_per_node
        if self.extra_sbatch:
            params["slurm_additional_parameters"] = dict(_option_item(o) for o in self.extra_sbatch)
        return params

    # ----------------------------------------------------------- commands
    def server_command(self, role: str, node_rank: Union[int, ShellVar], head: Union[str, ShellVar],
                       index: int = 0, port: Optional[int] = None) -> list[Word]:
        """The command each node of server job `index` of a role runs; `head` is the job's first node (SGLang's
        rendezvous); `port` the one the job took (default: the spec's)."""
        return server_command(self.recipe, SERVER_ROLES[role], port or self.port(role), nodes=self.resources(role, index).nodes,
                              node_rank=node_rank, head=head)

    def trainer_command(self, node_rank: Union[int, ShellVar], main_addr: Union[str, ShellVar],
                        main_port: Union[int, ShellVar]) -> list[Word]:
        """`accelerate launch` of `open_r1_ext.train` on one node, its servers the replicas advertised in the address
        directories of the roles this run starts (`--server-dir`, `--ref-dir`); `main_port` is the rendezvous port
        the job took on its first node (`main_addr`)."""
        recipe, job = self.recipe, self.recipe.slurm.trainer
        cmd: list[Word] = [sys.executable, "-m", "accelerate.commands.launch"]
        if recipe.accelerate_config:
            cmd += ["--config_file", str(Path(recipe.accelerate_config).resolve())]
        else:  # accelerate's defaults, said out loud (it warns about each one left out)
            cmd += ["--cpu"] if job.gpus_per_node == 0 else ["--multi_gpu"] if job.num_processes > 1 else []
            cmd += ["--dynamo_backend", "no"]
        cmd += ["--num_machines", job.nodes, "--num_processes", job.num_processes, "--machine_rank", node_rank,
                "--main_process_ip", main_addr, "--main_process_port", main_port]
        cmd += ["-m", "open_r1_ext.train", *self.recipe_args()]
        for role, flag in ((SERVER, "--server-dir"), (REF_SERVER, "--ref-dir")):
            if role in self.server_roles:
                cmd += [flag, str(self.files.replica_dir(role))]
        return cmd

    def recipe_args(self) -> list[str]:
        """`--config RECIPE --set K=V ...`: how a job loads this same recipe."""
        return ["--config", self.recipe_path, *(f"--set={item}" for item in self.overrides)]

    # ------------------------------------------------------------- output
    def jobs_of(self, role: str) -> list[tuple[str, int]]:
        """`(title, resources index)` of each job a launch submits for a role: one per replica of a server role
        (`server job 2/3`; the index of its entry of a `resources` list, else 0), one trainer job."""
        if role == TRAINER:
            return [(f"{role} job", 0)]
        spec = self.spec(role)
        per_replica = isinstance(spec.resources, list)
        return [(f"{role} job" + (f" {i + 1}/{spec.replicas}" if spec.replicas > 1 else ""), i if per_replica else 0)
                for i in range(spec.replicas)]

    def describe(self) -> str:
        """What a launch would submit, for humans (`--dry-run`): every job, each replica's server job too."""
        lines = [f"run directory {self.files.run_dir}: logs in {self.files.logs}/, status in {self.files.status}"]
        node, head, port = ShellVar("SLURM_NODEID"), ShellVar("HEAD_NODE"), ShellVar("MAIN_PORT")  # what only the job knows
        for role in self.roles:
            for title, index in self.jobs_of(role):
                job = self.resources(role, index)
                if role == TRAINER:
                    what, command = f"{job.num_processes} process(es)", self.trainer_command(node, head, port)
                else:
                    spec = self.spec(role)
                    what = (f"port {self.port(role)}, advertised in {self.files.replica_addr(role, '<job id>')} once "
                            f"healthy; the trainer starts once {spec.min_replicas} of {spec.replicas} are")
                    command = self.server_command(role, node, head, index)
                lines += [f"{title}: {job.nodes} node(s) x {job.gpus_per_node} GPU(s), {what}",
                          f"  sbatch {' '.join(map(shlex.quote, self.sbatch_args(role, index)))}",
                          f"  srun {' '.join(self.srun_args(role, index))} on each node:",
                          f"    {shell_join(command)}"]
        for name, spec in self.recipe.servers.specs().items():
            if not spec.started:
                lines.append(f"{name} server: {spec.url} (given by the recipe; no server job)")
        return "\n".join(lines)


def server_command(recipe: Recipe, role: str, port: int, host: str = "0.0.0.0", nodes: int = 1,
                   node_rank: Union[int, ShellVar] = 0, head: Union[str, ShellVar] = "",
                   local_args: Sequence[str] = ()) -> list[Word]:
    """The command line of the recipe's server for `role` (`generation` or `reference`), either engine: what each
    node of a server job runs (`SlurmPlan.server_command`) and what `open-r1-ext train` embeds. `head` is the first
    of the job's `nodes` (SGLang's rendezvous); `local_args` go before the spec's `extra_args`, which come last (a
    flag given twice: the last wins). SGLang on the CPU runs under `env SGLANG_USE_CPU_ENGINE=1 ...` (`SGLANG_CPU_ENV`)."""
    server = recipe.servers.specs()[role]
    python = server.interpreter()  # a path: made absolute here, a bare name: found on the job's PATH
    lora = recipe.model.lora_server_flags() if role == "generation" else []  # model.use_peft: dynamic LoRA
    common = ["--model-path", recipe.model_path(server), "--host", host, "--port", port]
    if server.engine == "sglang":
        on_cpu = server.device == "cpu"
        cmd: list[Word] = ["env", *(f"{k}={v}" for k, v in SGLANG_CPU_ENV.items())] if on_cpu else []
        cmd += [python, "-m", "sglang.launch_server", *common, "--tp-size", server.tp_size, "--dp-size", server.dp_size]
        cmd += sglang_cpu_args(lora=bool(lora)) if on_cpu else ["--device", server.device] if server.device else []
        if server.dtype != "auto":
            cmd += ["--dtype", server.dtype]
        if server.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", server.mem_fraction_static]
        if recipe.model.trust_remote_code:  # the model's own code, as the trainer loads it
            cmd.append("--trust-remote-code")
        if nodes > 1:
            cmd += ["--nnodes", nodes, "--node-rank", node_rank,
                    "--dist-init-addr", (head, f":{port + DIST_INIT_PORT_OFFSET}")]
    else:
        cmd = [python, "-m", "open_r1_ext.server", *common, "--dtype", server.dtype]
        cmd += ["--device", server.device] if server.device else []
        cmd += [] if recipe.ref_slot(role) else ["--no-ref-slot"]
    if server.deterministic:
        cmd.append(DETERMINISTIC_FLAG)
    cmd += lora
    if server.engine == "builtin":  # /update_weights_from_disk reads only this run's dumps (SGLang has no such flag)
        cmd += ["--weight-dirs", recipe.sync_dir]
    if recipe.servers.uses_key:  # the run's key, from its owner-only file: never on the command line (run_key.py)
        cmd += ["--config", key_file(Path(recipe.output_dir).resolve())]
    return cmd + list(local_args) + [str(a) for a in server.extra_args]


def _option_item(option: str) -> tuple:
    """`--key=value` -> `("key", "value")`, `--flag` -> `("flag", True)`: submitit's additional parameters."""
    key, sep, value = option[2:].partition("=")
    return key, (value if sep else True)
