"""The preflight: what the cluster will execute, tried before anything is submitted, without loading weights: each
server's interpreter imports its engine, the trainer's builds its report_to callbacks, the accelerate config meets
slurm.trainer, hub ids are in the HF cache, the disk holds the dumps and checkpoints, an OpenAI server reloads.
`open-r1-ext validate --preflight` runs it; the launchers (`cli.cmd_launch`, `jobs submit`) submit nothing on an error.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import yaml

from open_r1_ext.config.recipe import INSTALLS, Recipe, ServerSpec, is_local_path
from open_r1_ext.launch.local_server import SGLANG_CPU_ENV
from open_r1_ext.protocol import SGLANG_VERSION

ERROR, WARNING, OK = "error", "warning", "ok"
IMPORT_TIMEOUT_S = 120.0  # an engine's import (SGLang's: ~7 s on 2 busy cores)
PROBE_TIMEOUT_S = 10.0
# the package a server job runs, per engine, imported by the server's interpreter; its __version__ is reported
ENGINE_MODULES = {"sglang": "sglang", "builtin": "open_r1_ext"}
NODE_LOCAL_FS = {"tmpfs", "ramfs", "devtmpfs"}
NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
GPU_DISTRIBUTED_TYPES = {"MULTI_GPU", "DEEPSPEED", "FSDP"}
ADAM_STATE_BYTES = 12  # DeepSpeed's optimizer state per parameter in a checkpoint: fp32 master weights, two moments
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Finding:
    """One line of the preflight: an error refuses the launch, a warning is said, `ok` reports what was found."""

    key: str
    message: str
    level: str = ERROR

    def line(self, path: str) -> str:
        return f"{path}: {self.key}: {'' if self.level == ERROR else self.level + ': '}{self.message}"


def preflight(recipe: Recipe) -> list[Finding]:
    """Every check; the interpreters' imports (a process of a few seconds each) run beside the others."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        engines = pool.submit(_guarded, check_engines, recipe)
        checks = (check_idle_gpus, check_report_to, check_accelerate, check_hub_cache, check_disk, check_reloads)
        findings = [finding for check in checks for finding in _guarded(check, recipe)]
        return engines.result() + findings


def _guarded(check: Callable[[Recipe], list[Finding]], recipe: Recipe) -> list[Finding]:
    """A check's findings; a check that fails itself is a warning line, never a traceback or a refusal."""
    try:
        return check(recipe)
    except Exception as err:  # noqa: BLE001 - whatever went wrong, the other checks still answer
        return [Finding("(preflight)", f"{check.__name__} could not run: {type(err).__name__}: {err}", WARNING)]


def report(recipe: Recipe, findings: list[Finding]) -> bool:
    """Print each finding (`ok` lines to stdout, the others to stderr); True when none is an error."""
    for finding in findings:
        print(finding.line(recipe.path), file=sys.stdout if finding.level == OK else sys.stderr)
    return not any(finding.level == ERROR for finding in findings)


def launch_refused(recipe: Recipe) -> bool:
    """The launchers' gate: the preflight's lines, and True (after `nothing submitted`) when it found an error."""
    if report(recipe, preflight(recipe)):
        return False
    print("nothing submitted: fix the errors above (open-r1-ext validate --preflight RECIPE checks again)",
          file=sys.stderr)
    return True


# ---------------------------------------------------------------------------------------------- engines
def check_engines(recipe: Recipe) -> list[Finding]:
    """Each started server's interpreter imports what its job runs, in the environment the job gives it (one process
    per interpreter and engine, at once); SGLang must be the supported release."""
    specs = {role: spec for role, spec in recipe.servers.specs().items() if spec.started and spec.engine in ENGINE_MODULES}
    with ThreadPoolExecutor(max_workers=max(1, len(specs))) as pool:
        imports = {run: pool.submit(import_engine, *run) for run in {_engine_run(spec) for spec in specs.values()}}
        return [_engine_finding(role, spec, imports[_engine_run(spec)].result()) for role, spec in specs.items()]


def check_idle_gpus(recipe: Recipe) -> list[Finding]:
    """A server on the CPU (`device: cpu`) in a job that asks for GPUs: allowed (a rehearsal of a GPU launch on CPUs,
    as tests/test_rehearsal.py runs every shipped recipe), but on a real cluster those GPUs are held and left idle."""
    return [Finding(f"servers.{role}.{where}.gpus_per_node",
                    f"{job.gpus_per_node} GPU(s) asked for a server that runs on the CPU (device: cpu): they are "
                    "allocated and left idle; set gpus_per_node: 0, or remove device to run on them", WARNING)
            for role, spec in recipe.servers.specs().items() if spec.started and spec.device == "cpu"
            for where, job in spec.resource_entries() if job.gpus_per_node > 0]


def _engine_run(spec: ServerSpec) -> tuple[str, str, bool]:
    return spec.interpreter(), ENGINE_MODULES[spec.engine], spec.engine == "sglang" and spec.device == "cpu"


@functools.cache
def import_engine(python: str, module: str, on_cpu: bool = False) -> tuple[Optional[str], str]:
    """`(version, "")` once `python` imported `module` (its `__version__`), else `(None, why not)`."""
    env = dict(os.environ, **(SGLANG_CPU_ENV if on_cpu else {}))
    code = "import importlib, sys; print(importlib.import_module(sys.argv[1]).__version__)"
    try:
        done = subprocess.run([python, "-c", code, module], capture_output=True, text=True, env=env,
                              timeout=IMPORT_TIMEOUT_S)
    except OSError as err:  # not found, not executable, not a program
        return None, f"cannot be run: {err.strerror}"
    except subprocess.TimeoutExpired:
        return None, f"did not import {module} within {IMPORT_TIMEOUT_S:.0f} s"
    if done.returncode:
        return None, f"cannot import {module}: " + (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return (done.stdout.strip().splitlines() or ["?"])[-1], ""


def _engine_finding(role: str, spec: ServerSpec, imported: tuple[Optional[str], str]) -> Finding:
    key, python, module = f"servers.{role}.python", spec.interpreter(), ENGINE_MODULES[spec.engine]
    version, why_not = imported
    which = "" if spec.python else " (the launcher's own: the spec names no python)"
    fix = f"give servers.{role}.python the python of a venv that has the {spec.engine} server ({INSTALLS[spec.engine]})"
    if version is None:
        return Finding(key, f"{python}{which} {why_not}: {fix}")
    if spec.engine == "sglang" and version != SGLANG_VERSION:
        return Finding(key, f"{python} has sglang {version}; this project supports sglang {SGLANG_VERSION} (its protocol "
                            f"and workarounds follow that release): {python} -m pip install sglang=={SGLANG_VERSION}, "
                            f"or {fix}")
    return Finding(key, f"{python} imports {module} ({module} {version})", OK)


# ------------------------------------------------------------------------------------------- report_to
def check_report_to(recipe: Recipe) -> list[Finding]:
    """Each `report_to` integration's callback, built as the trainer builds it, in this interpreter (the trainer's:
    the launchers run the trainer with it); wandb on compute nodes also needs its key or offline mode."""
    from transformers.integrations import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

    report_to = recipe.setting("report_to")
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if names == ["all"]:
        return [Finding("trainer.report_to", f"all: every integration installed here: "
                                             f"{', '.join(get_available_reporting_integrations()) or 'none'}", OK)]
    findings = []
    for name in [name for name in names if name in INTEGRATION_TO_CALLBACK]:  # others: the config refuses them
        try:
            INTEGRATION_TO_CALLBACK[name]()
        except Exception as err:  # noqa: BLE001 - whatever the callback raises is why the trainer would fail
            fix = "pip install -e '.[wandb]'" if name == "wandb" else f"install it, or remove {name} from report_to"
            findings.append(Finding("trainer.report_to", f"{name} cannot be used in {sys.executable} (the trainer's "
                                                         f"interpreter): {err} ({fix})"))
            continue
        findings.append(Finding("trainer.report_to", f"{name}: its callback builds in {sys.executable}", OK))
        if name == "wandb" and not _wandb_can_log():
            findings.append(Finding("trainer.report_to", "wandb: no WANDB_API_KEY, no wandb login (~/.netrc) and no "
                                                         "WANDB_MODE=offline in this environment, which the jobs "
                                                         "inherit: the trainer fails at its first log; export one "
                                                         "before launching (offline on nodes without internet)", WARNING))
    return findings


def _wandb_can_log() -> bool:
    netrc = Path("~/.netrc").expanduser()
    return bool(os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") in ("offline", "disabled")
                or (netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="replace")))


# ------------------------------------------------------------------------------------------ accelerate
def check_accelerate(recipe: Recipe) -> list[Finding]:
    """What `accelerate launch` takes from the config file (slurm_plan.trainer_command gives num_processes,
    num_machines and machine_rank on its command line, from slurm.trainer) against slurm.trainer."""
    if not recipe.accelerate_config:
        return []
    key, path, job = "accelerate_config", recipe.accelerate_config, recipe.slurm.trainer
    try:
        config = _accelerate_settings(recipe)
    except (OSError, yaml.YAMLError) as err:
        return [Finding(key, f"{path} cannot be read as an accelerate config: {err}")]
    if not isinstance(config, dict):
        return [Finding(key, f"{path} is not an accelerate config (a mapping, as `accelerate config` writes)")]
    findings = []
    kind = str(config.get("distributed_type", "NO")).upper()
    per_node = job.processes_per_node or max(1, job.gpus_per_node)
    if kind == "NO" and job.num_processes > 1:
        findings.append(Finding(key, f"{path} says distributed_type: NO, with which accelerate launch starts one "
                                     f"process, and slurm.trainer asks for {job.num_processes} ({job.nodes} node(s) x "
                                     f"{per_node}): use recipes/accelerate_configs/ddp.yaml, zero2.yaml or zero3.yaml, "
                                     "or give the trainer one process"))
    if config.get("use_cpu") and job.gpus_per_node > 0:
        findings.append(Finding(key, f"{path} says use_cpu: true, which trains on the CPU, and slurm.trainer holds "
                                     f"{job.gpus_per_node} GPU(s) a node: set use_cpu: false there, or "
                                     "slurm.trainer.gpus_per_node: 0"))
    if kind in GPU_DISTRIBUTED_TYPES and not config.get("use_cpu") and job.gpus_per_node == 0:
        findings.append(Finding(key, f"{path} is for GPUs (distributed_type: {kind}) and slurm.trainer has "
                                     "gpus_per_node: 0: remove accelerate_config (a CPU trainer runs with accelerate's "
                                     "--cpu), or give the trainer GPUs", WARNING))  # gloo may still run it
    gpu_ids = str(config.get("gpu_ids", "all"))
    if gpu_ids != "all" and job.gpus_per_node > 0 and len(gpu_ids.split(",")) < per_node:
        findings.append(Finding(key, f"{path} says gpu_ids: {gpu_ids}, fewer GPUs than the {per_node} trainer "
                                     "processes a node of slurm.trainer runs: set gpu_ids: all (SLURM gives the job its "
                                     "GPUs)"))
    stage = (config.get("deepspeed_config") or {}).get("zero_stage") if kind == "DEEPSPEED" else None
    named = re.search(r"zero([0-3])", Path(recipe.path).stem)
    if named and stage is not None and int(named.group(1)) != stage:
        findings.append(Finding(key, f"{path} is ZeRO-{stage}, and the recipe's name says ZeRO-{named.group(1)}: "
                                     f"point accelerate_config at the ZeRO-{named.group(1)} config (e.g. "
                                     f"recipes/accelerate_configs/zero{named.group(1)}.yaml), or rename the recipe",
                                WARNING))
    if stage and job.num_processes == 1:
        findings.append(Finding(key, f"ZeRO-{stage} shards the model over the trainer's processes, and slurm.trainer "
                                     "runs one: nothing is sharded", WARNING))
    return findings


def _accelerate_settings(recipe: Recipe) -> dict:
    """The recipe's accelerate config file as read (`{}` without one)."""
    path = recipe.accelerate_config
    return (yaml.safe_load(Path(path).read_text()) or {}) if path else {}


# -------------------------------------------------------------------------------------------- HF cache
def check_hub_cache(recipe: Recipe) -> list[Finding]:
    """Each hub model of the run is in the HF hub cache and its hub dataset in datasets' cache (where their offline
    loads look: a dataset's hub snapshot alone does not load under HF_HUB_OFFLINE with datasets 5.2), or each job
    downloads it at start: a warning; an error under HF_HUB_OFFLINE (the jobs inherit it and cannot download)."""
    import datasets
    from huggingface_hub import constants

    wanted = {("model", recipe.model.name_or_path): "model.name_or_path",
              **{("model", spec.model_path): f"servers.{role}.model_path"
                 for role, spec in recipe.servers.specs().items() if spec.model_path},
              ("dataset", recipe.data.dataset): "data.dataset"}
    findings = []
    for (kind, repo_id), key in wanted.items():
        if is_local_path(repo_id):
            continue
        where = hub_snapshot(repo_id) if kind == "model" else _datasets_cache(repo_id)
        if where:
            findings.append(Finding(key, f"{repo_id} is in the local cache ({where})", OK))
            continue
        if kind == "model":
            missing, fetch = f"the local HF cache ({constants.HF_HUB_CACHE})", f"hf download {repo_id}"
        else:
            missing = f"datasets' cache ({datasets.config.HF_DATASETS_CACHE})"
            fetch = (f"python -c \"import datasets; datasets.load_dataset('{repo_id}', split='{recipe.data.split}'"
                     + (f", name='{recipe.data.config}'" if recipe.data.config else "") + ")\"")
        if constants.HF_HUB_OFFLINE:
            findings.append(Finding(key, f"{repo_id} is not in {missing}, and HF_HUB_OFFLINE is set: the jobs cannot "
                                         f"download it; run on a machine with internet, with the same HF_HOME: {fetch}"))
        else:
            findings.append(Finding(key, f"{repo_id} is not in {missing}: every job downloads it at start; nodes without "
                                         f"internet: run {fetch} on a login node first, then export HF_HUB_OFFLINE=1",
                                    WARNING))
    return findings


def hub_snapshot(repo_id: str) -> Optional[Path]:
    """The local snapshot of a hub model (its `main`), or None; never downloads."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        return None


def _datasets_cache(repo_id: str) -> Optional[Path]:
    """datasets' own cache of a hub dataset it prepared, where its offline load looks (`CachedDatasetModuleFactory`:
    `org___snake_case_name/<config>/<version>/<hash>/`), or None."""
    import datasets
    from datasets.naming import camelcase_to_snakecase

    org, name = repo_id.split("/")
    folder = Path(datasets.config.HF_DATASETS_CACHE) / f"{org}___{camelcase_to_snakecase(name)}"
    return folder if any(path.is_dir() for path in folder.glob("*/*/*")) else None


# ------------------------------------------------------------------------------------------------ disk
def check_disk(recipe: Recipe) -> list[Finding]:
    """The bytes the dumps (`keep_last_dumps` + 1 being written) and checkpoints (`save_total_limit` + 1 being
    written, with optimizer state) need, against the free space of the file systems `sync_dir` and `output_dir` are
    on; and a warning for either on a node-local file system when server jobs must read it."""
    findings, needs = [], []
    starts_servers = any(spec.started for spec in recipe.servers.specs().values())
    dumps = _dumps_kept(recipe, findings)
    checkpoints = _checkpoints_kept(recipe, findings)
    params = model_parameters(recipe) if (dumps or checkpoints) and not recipe.model.use_peft else None
    if (dumps or checkpoints) and params is None and not recipe.model.use_peft:
        findings.append(Finding("model.name_or_path", f"{recipe.model.name_or_path}: no config.json here to count its "
                                                      "parameters by: the disk the run needs is not estimated", WARNING))
    if params is not None:
        count, weight = params
        dump = count * weight
        ckpt = count * (weight + ADAM_STATE_BYTES if _deepspeed(recipe) else 3 * weight)
        needs = [("sync.sync_dir", Path(recipe.sync_dir), dumps * dump,
                  f"{dumps} dump(s) of {_size(dump)}"),
                 ("trainer.output_dir", Path(recipe.output_dir).resolve(), checkpoints * ckpt,
                  f"{checkpoints} checkpoint(s) of about {_size(ckpt)} with optimizer state")]
    by_fs: dict[int, list] = {}
    for key, path, need, what in needs:
        if need:
            by_fs.setdefault(os.stat(_existing(path)).st_dev, []).append((key, path, need, what))
    for group in by_fs.values():
        free = shutil.disk_usage(_existing(group[0][1])).free
        need = sum(item[2] for item in group)
        keys = " and ".join(f"{key} ({path})" for key, path, _, _ in group)
        detail = f"about {_size(need)} ({'; '.join(item[3] for item in group)}) where {_size(free)} is free"
        if need > free:
            findings.append(Finding(group[0][0], f"{keys} need {detail}: free space there, lower "
                                                 "sync.keep_last_dumps / trainer.save_total_limit, or move them"))
        else:
            findings.append(Finding(group[0][0], f"{keys}: {detail}", OK))
    if starts_servers:
        for key, path in (("trainer.output_dir", Path(recipe.output_dir).resolve()),
                          *((("sync.sync_dir", Path(recipe.sync_dir)),) if dumps else ())):
            local = node_local(path)
            if local:
                findings.append(Finding(key, f"{path} is on a node-local file system ({local}): the server jobs on "
                                             "other nodes cannot read it (addresses, run key, dumps); put it on a "
                                             "file system every node sees", WARNING))
    return findings


def _dumps_kept(recipe: Recipe, findings: list) -> int:
    """How many full dumps can be on disk at once: none without a generation server, syncs, or over the network."""
    steps, keep = recipe.setting("weight_sync_steps"), recipe.setting("keep_last_dumps")
    if not isinstance(recipe.servers.generation, ServerSpec) or not steps or recipe.setting("transport") != "disk":
        return 0
    if keep:
        return keep + 1
    max_steps = recipe.setting("max_steps")
    if max_steps > 0:
        return max_steps // steps
    findings.append(Finding("sync.keep_last_dumps", "0 keeps every dump, and the run has no max_steps to count them "
                                                    "by: the estimate below counts one; set keep_last_dumps", WARNING))
    return 1


def _checkpoints_kept(recipe: Recipe, findings: list) -> int:
    strategy, limit = str(recipe.setting("save_strategy")), recipe.setting("save_total_limit")
    if strategy in ("no", "IntervalStrategy.NO", "SaveStrategy.NO"):
        return 0
    if limit:
        return limit + 1
    max_steps, every = recipe.setting("max_steps"), recipe.setting("save_steps")
    if max_steps > 0 and strategy.lower().endswith("steps") and every >= 1:
        return math.ceil(max_steps / every)
    findings.append(Finding("trainer.save_total_limit", "unset: every checkpoint is kept, and their number is not "
                                                        "known here; the estimate below counts one: set "
                                                        "save_total_limit", WARNING))
    return 1


def model_parameters(recipe: Recipe) -> Optional[tuple[int, int]]:
    """`(parameters, bytes per parameter)` of the policy, counted on the meta device from its config.json (a local
    directory, or the hub cache's): no weights are read. None when there is no config.json here."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    name = recipe.model.name_or_path
    folder = Path(name).expanduser() if is_local_path(name) else hub_snapshot(name)
    if folder is None or not (folder / "config.json").is_file():
        return None
    config = AutoConfig.from_pretrained(folder, trust_remote_code=recipe.model.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=recipe.model.trust_remote_code)
    dtype = recipe.model.dtype if recipe.model.dtype != "auto" else str(getattr(config, "dtype", None) or "float32")
    return sum(p.numel() for p in model.parameters()), DTYPE_BYTES.get(dtype.removeprefix("torch."), 4)


def _deepspeed(recipe: Recipe) -> bool:
    """Whether the trainer runs under DeepSpeed (its checkpoints then hold fp32 optimizer state)."""
    try:
        return str(_accelerate_settings(recipe).get("distributed_type", "")).upper() == "DEEPSPEED"
    except (OSError, yaml.YAMLError, AttributeError):
        return False


def _existing(path: Path) -> Path:
    """The path, or its nearest parent that exists (a run directory not made yet)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def node_local(path: Path) -> Optional[str]:
    """Why `path` is on a node-local file system (a tmpfs-like mount, or /tmp, /var/tmp, /dev/shm), or None."""
    real = os.path.realpath(_existing(path))
    mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines() if len(line.split()) > 2]
    under = [(point, kind) for point, kind in mounts if real == point or real.startswith(point.rstrip("/") + "/")]
    point, kind = max(under, key=lambda item: len(item[0])) if under else ("/", "?")
    if kind in NODE_LOCAL_FS:
        return f"{kind} at {point}"
    top = next((d for d in NODE_LOCAL_DIRS if real == d or real.startswith(d + "/")), None)
    return f"under {top}" if top else None


def _size(count: float) -> str:
    return f"{count / 1e9:.1f} GB" if count >= 1e9 else f"{count / 1e6:.1f} MB"


# ----------------------------------------------------------------------------------------- reloads
def check_reloads(recipe: Recipe) -> list[Finding]:
    """An OpenAI-compatible generation server (`engine: openai`, `url`) must reload weights when the run syncs them,
    as the trainer's start-up probe judges it (`openai_client.reloads_weights`: it answers SGLang's `/model_info`)."""
    from open_r1_ext.openai_client import reloads_weights
    from open_r1_ext.sglang_client import SGLangClient, ServerError

    spec, steps = recipe.servers.generation, recipe.setting("weight_sync_steps")
    if not (isinstance(spec, ServerSpec) and spec.engine == "openai" and spec.url and steps):
        return []
    key = "servers.generation.url"
    client = SGLangClient(spec.url, api_key=recipe.setting("server_api_key"), request_timeout=PROBE_TIMEOUT_S,
                          max_retries=0)
    try:
        reloads = reloads_weights(client)
    except ServerError as err:
        return [Finding(key, f"{spec.url} did not answer ({err}); whether it reloads weights was not checked", WARNING)]
    if not reloads:
        return [Finding(key, f"{spec.url} does not answer SGLang's /model_info: it cannot reload weights (as vLLM's and "
                             "llama.cpp's OpenAI servers; SGLang and the built-in server can), and "
                             f"sync.weight_sync_steps is {steps}: set sync.weight_sync_steps: 0 (generation then stays "
                             "on the server's weights), or generate on a server that reloads (engine: sglang or builtin)")]
    return [Finding(key, f"{spec.url} answers /model_info: it can reload weights", OK)]
