"""A rehearsal of every shipped recipe (recipes/**/*.yaml but the accelerate configs; one added later joins by itself)
on the local SLURM cluster, whose two nodes declare stand-in GPUs (tools/local_slurm.sh): `sbatch slurm/grpo.slurm
RECIPE` with only the overrides a machine without a GPU needs (`cpu_overrides`, each with why). Each of the run's jobs
got the GPUs and CPUs its recipe asks for (what each node's task logged at its start, `jobs.log_resources`), its
servers became healthy (SGLang's own launcher, reading the run's key from --config), its trainer trained and synced
every step, and the trainer's end cancelled every server job, with every process it had started.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.slurm_helpers import NOT_ENDED, REPO, job_processes, run_script, slurm_state, wait_until

RECIPES = sorted(str(path.relative_to(REPO)) for path in (REPO / "recipes").rglob("*.yaml")
                 if "accelerate_configs" not in path.parts)
STEPS = 2
SGLANG_AT_ONCE = 4  # SGLang servers of the runs side by side: ~2 GB each (a run with its trainer ~6 GB; 24 GB here)
RUN_WAIT_S = 600  # bound of the wait for a run to end, next to another on 2 cores (~240 s at a load average of 8)
RESOURCES_LINE = re.compile(r"\] (server|ref-server|trainer) on (\S+): "  # jobs.log_resources, one per task
                            r"resources: CUDA_VISIBLE_DEVICES=(\S+) cpus=(\d+)")
SGLANG_VENV_PYTHON = ".venv-sglang/bin/python"  # where the README's install puts SGLang (`make sglang-venv`)
REHEARSAL_TIMEOUT_S = 3 * RUN_WAIT_S  # pytest-timeout's bound of the first test, whose fixture runs every recipe:
# its own waits are bounded (RUN_WAIT_S a run), and it took 510 s on a fresh clone, 600 s being pytest-timeout's default
pytestmark = [pytest.mark.xdist_group("rehearsal"),  # a worker of its own beside the other SLURM tests (conftest.py)
              pytest.mark.timeout(REHEARSAL_TIMEOUT_S)]


def cpu_overrides(recipe: dict, run_dir: Path, tiny_model: Path, sglang_python: str) -> list[tuple[str, str]]:
    """`(--set value, why)`: what this machine needs changed in a recipe written for GPUs; nothing about the jobs'
    GPUs, CPUs, nodes or the servers' interpreter (unless a recipe names one that is not this repository's SGLang
    venv): those are what the rehearsal checks."""
    overrides = [
        (f"model.name_or_path={tiny_model}", "the tiny model: no download, and it trains on 2 cores"),
        ("model.dtype=float32", "the tiny model's dtype"),
        ("data.dataset=recipes/tiny/data/arith.jsonl", "no internet here for a hub dataset"),
        (f"trainer.output_dir={run_dir}", "the test's own directory"),
        (f"sync.sync_dir={run_dir}/weights", "the test's own directory"),
        (f"trainer.max_steps={STEPS}", "a few steps show the run trains and syncs"),
        ("trainer.per_device_train_batch_size=2", "a CPU-sized batch"),
        ("trainer.gradient_accumulation_steps=1", "a CPU-sized batch"),
        ("trainer.num_generations=2", "a CPU-sized batch"),
        ("trainer.max_completion_length=8", "short completions: generation on 2 cores"),
        ("trainer.use_cpu=true", "no GPU: the trainer on the CPU"),
        ("slurm.trainer.processes_per_node=1", "2 cores: one trainer process per node (the job still asks for the "
                                               "recipe's GPUs and CPUs)"),
    ]
    for role, spec in recipe["servers"].items():
        if not isinstance(spec, dict) or spec.get("engine") != "sglang":
            continue
        key = f"servers.{role}"
        overrides += [(f"{key}.device=cpu", "no GPU: SGLang's CPU engine (the job still asks for the recipe's GPUs)"),
                      (f"{key}.dtype=float32", "the tiny model's dtype"),
                      (f"{key}.tp_size=1", "SGLang on the CPU runs one process"),
                      (f"{key}.dp_size=1", "SGLang on the CPU refuses dp_size > 1")]
        if spec.get("python") not in (None, SGLANG_VENV_PYTHON):
            overrides.append((f"{key}.python={sglang_python}", "the recipe's SGLang interpreter is not here"))
    return overrides


def sglang_servers(recipe: dict) -> int:
    """How many SGLang servers a recipe's run starts."""
    return sum(isinstance(spec, dict) and spec.get("engine") == "sglang" for spec in recipe["servers"].values())


@dataclass
class Run:
    """One recipe's rehearsal: its recipe as written, run directory, submission and jobs (`jobs.env`)."""

    recipe: dict
    run_dir: Path
    submitted: subprocess.CompletedProcess
    ids: dict = field(default_factory=dict)
    final_states: dict = field(default_factory=dict)  # each job's state when the run was seen to end

    @property
    def submit_job(self) -> str:
        return self.submitted.stdout.strip().split(";")[0]

    def ended(self) -> bool:
        """Whether the submission and every job it made have ended."""
        submitting = slurm_state(self.submit_job) in NOT_ENDED  # first: once it has ended, jobs.env is complete
        jobs_env = self.run_dir / "jobs.env"
        if not self.ids and jobs_env.exists() and "TRAINER_JOB" in jobs_env.read_text():
            self.ids = dict(line.split("=", 1) for line in jobs_env.read_text().splitlines())
        states = {job: slurm_state(job) for job in self.job_ids()}
        if submitting or any(state in NOT_ENDED for state in states.values()):
            return False
        # kept: SLURM forgets an ended job after MinJobAge (300 s), and other runs may take longer than that
        self.final_states = states
        return True

    def job_ids(self) -> list[str]:
        return [job for key, job in self.ids.items() if key.endswith("_JOB")]


@pytest.fixture(scope="module")
def rehearsal(request, slurm_cluster, tiny_model, sglang_python, tmp_path_factory) -> dict[str, Run]:
    """Every shipped recipe this session tests submitted, as many side by side as have at most `SGLANG_AT_ONCE` SGLang
    servers between them (the cluster's stand-in GPUs would hold all of them at once, this machine's memory not),
    those without SGLang first; each followed until its jobs have ended. `{recipe: Run}`."""
    runs: dict[str, Run] = {}
    running: list[Run] = []
    selected = [item.callspec.params["recipe_path"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")]
    recipes = {path: yaml.safe_load((REPO / path).read_text()) for path in selected}
    waiting = sorted(recipes, key=lambda path: sglang_servers(recipes[path]))
    try:
        while waiting or running:
            while waiting and (not running or sum(sglang_servers(run.recipe) for run in running)
                                  + sglang_servers(recipes[waiting[0]]) <= SGLANG_AT_ONCE):
                recipe_path = waiting.pop(0)
                recipe, out = recipes[recipe_path], tmp_path_factory.mktemp("rehearsal")
                sets = [arg for value, _ in cpu_overrides(recipe, out / "run", tiny_model, sglang_python)
                        for arg in ("--set", value)]
                runs[recipe_path] = Run(recipe, out / "run", run_script(
                    "sbatch", "--parsable", f"--output={out}/submit-%j.out", "slurm/grpo.slurm", recipe_path, *sets))
                if runs[recipe_path].submitted.returncode == 0:
                    running.append(runs[recipe_path])
            if running:
                ended = wait_until(lambda: [run for run in running if run.ended()], RUN_WAIT_S, "a run's jobs to end")
                running = [run for run in running if run not in ended]
        yield runs
    finally:
        for run in runs.values():
            if run.submitted.returncode == 0:
                subprocess.run(["scancel", run.submit_job, *run.job_ids()], check=False)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.mark.parametrize("recipe_path", RECIPES)
def test_a_shipped_recipe_runs_on_slurm_with_the_resources_it_asks_for(recipe_path, rehearsal):
    run = rehearsal[recipe_path]
    assert run.submitted.returncode == 0, run.submitted.stderr
    assert run.ids, (run.run_dir.parent / f"submit-{run.submit_job}.out").read_text()
    recipe, logs, status = run.recipe, run.run_dir / "logs", (run.run_dir / "status.log").read_text()
    specs = {"server": recipe["servers"]["generation"], "ref-server": recipe["servers"]["reference"]}
    servers = {role: run.ids[f"{role.upper().replace('-', '_')}_JOB"] for role, spec in specs.items()
               if isinstance(spec, dict)}
    asked = {**{role: specs[role]["resources"] for role in servers}, "trainer": recipe["slurm"]["trainer"]}
    for role, job in {**servers, "trainer": run.ids["TRAINER_JOB"]}.items():
        err = (logs / f"{role}-{job}.err").read_text()
        seen = [m.groups() for m in RESOURCES_LINE.finditer(err) if m.group(1) == role]
        want = asked[role]
        # one task a node, on nodes of its own, each with the GPUs and CPUs the recipe asks for
        assert len(seen) == want.get("nodes", 1) == len({node for _, node, _, _ in seen}), err[-3000:]
        for _, node, gpus, cpus in seen:
            assert len(gpus.split(",")) == want["gpus_per_node"] if want["gpus_per_node"] else gpus == "(unset)", err
            assert "cpus_per_task" not in want or int(cpus) == want["cpus_per_task"], err
        # the task's CPUs asked again on srun's line (a task inherits SLURM_CPUS_PER_TASK whatever srun was given)
        srun = next(line for line in err.splitlines() if re.match(r"\[[\d:]+\] \+ srun ", line))
        assert "cpus_per_task" not in want or f" --cpus-per-task={want['cpus_per_task']} " in srun, srun
    for role, job in servers.items():
        assert f"{role} job {job}: healthy at http://" in status, status
        if specs[role]["engine"] == "sglang":  # SGLang's own launcher read the run's key from its --config file
            served = (logs / f"{role}-{job}.out").read_text() + (logs / f"{role}-{job}.err").read_text()
            key = yaml.safe_load((run.run_dir / "api_key.yaml").read_text())["api-key"]
            assert "server_args={" in served and f"'api_key': '{key}'" in served, served[-3000:]
            commands = [line for line in served.splitlines() if re.match(r"\[[\d:]+\] \+ ", line)]  # what the job ran
            assert commands and not any(key in line for line in commands)
    trainer = run.ids["TRAINER_JOB"]
    assert f"trainer job {trainer}: succeeded" in status, status + (logs / f"trainer-{trainer}.err").read_text()[-5000:]
    assert re.search(rf"step\s+{STEPS}/{STEPS}\b", (logs / f"trainer-{trainer}.out").read_text())
    syncs = [e["step"] for e in jsonl(run.run_dir / "weight_sync.jsonl") if e["role"] == "generation"]
    assert syncs == list(range(1, STEPS + 1)), syncs
    assert f"trainer job {trainer}: cancelled server job(s) {' '.join(servers.values())}" in status, status
    assert all(run.final_states[job] == "CANCELLED" for job in servers.values()), run.final_states
    assert not list((run.run_dir / "replicas").glob("*/*.addr"))  # every server withdrew its address
    for job in servers.values():
        wait_until(lambda: not job_processes(job), 30, f"server job {job}'s processes to exit")
