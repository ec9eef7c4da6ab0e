"""The training entry point: `python -m open_r1_ext.train --config RECIPE.yaml` (or `open-r1-ext train RECIPE`).

Reads top to bottom as the story of a run: load and validate the recipe, find the last checkpoint, load the
prompts and rewards, find (or, for the built-in engine on a laptop, start) the servers, build the trainer,
train, save. Servers come from `--server-url`/`--ref-url` (repeatable: a pool of replicas) or the address
directories `--server-dir`/`--ref-dir` (the launchers pass these), else the environment
(`OPEN_R1_EXT_SERVER_URL`, `OPEN_R1_EXT_REF_URL`), else the recipe's
`servers.generation.url`/`servers.reference.url`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence, Union

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from open_r1_ext.config.arguments import add_recipe_arguments
from open_r1_ext.config.recipe import Recipe, RecipeError, ServerSpec, load_recipe
from open_r1_ext.launch.jobs import SIGTERM_EXIT, write_atomic
from open_r1_ext.launch.run_key import read_run_key, write_run_key
from open_r1_ext.launch.run_status import METRICS_FILE
from open_r1_ext.sglang_client import ServerError

logger = logging.getLogger("open_r1_ext.train")
SERVER_URL_ENV, REF_URL_ENV = "OPEN_R1_EXT_SERVER_URL", "OPEN_R1_EXT_REF_URL"
URLs = Union[str, list[str], None]  # a server's URL, or several: a pool of replicas
EMBEDDED_URLS_FILE = "embedded_servers.json"  # in output_dir: the first process's embedded servers, for the others


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m open_r1_ext.train", description="GRPO with a remote reference and generation.")
    parser.add_argument("--config", required=True, help="the recipe YAML")
    add_recipe_arguments(parser, server_urls=True)
    args = parser.parse_args(argv)
    return train_recipe(args.config, args.set, args.server_url, args.ref_url, args.server_dir, args.ref_dir)


def train_recipe(path: str, overrides: list[str], server_url: URLs = None, ref_url: URLs = None,
                 server_dir: Optional[str] = None, ref_dir: Optional[str] = None) -> int:
    """Load and validate the recipe, then train (`run`); 2 for an invalid recipe, with its problems on stderr."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_libraries()
    try:
        recipe = load_recipe(path, overrides)
    except RecipeError as err:
        print(err, file=sys.stderr)
        return 2
    try:
        trainer = run(recipe, server_url=server_url, ref_url=ref_url, server_dir=server_dir, ref_dir=ref_dir)
    except RecipeError as err:  # what this machine cannot give the recipe (GPUs for its embedded servers)
        print(err, file=sys.stderr)
        return 2
    except ServerError as err:  # a server gone, a failed sync or dump: the story in a few lines, the traceback in a file
        print(f"{err}\n(traceback in {save_traceback(recipe)})", file=sys.stderr, flush=True)
        return 1
    stop = trainer.stop_signal
    if stop.stopped_at is not None:
        print(f"{stop.received}: stopped after step {stop.stopped_at} with a checkpoint in "
              f"{recipe.output_dir}/checkpoint-{stop.stopped_at}; run the same command again to resume from it",
              file=sys.stderr, flush=True)
        return SIGTERM_EXIT
    return 0


def run(recipe: Recipe, server_url: URLs = None, ref_url: URLs = None, server_dir: Optional[str] = None,
        ref_dir: Optional[str] = None):
    """Train as the recipe says; returns the trainer."""
    from transformers import set_seed
    from transformers.trainer_utils import get_last_checkpoint

    from open_r1_ext.trainer.data import load_prompts
    from open_r1_ext.trainer.remote_trainer import RemoteGRPOTrainer

    set_seed(recipe.trainer.get("seed", 42))
    output_dir = Path(recipe.output_dir)
    last_checkpoint = get_last_checkpoint(str(output_dir)) if output_dir.is_dir() else None
    if last_checkpoint:
        logger.info("resuming from %s", last_checkpoint)
    dataset = load_prompts(recipe.data)
    reward_funcs = build_rewards(recipe)

    with servers(recipe, server_url, ref_url, server_dir, ref_dir) as (generation_url, ref_model_url):
        args = recipe.trainer_config(generation_url=generation_url, ref_model_url=ref_model_url,
                                     api_key=read_run_key(recipe, output_dir),
                                     **pool_settings(recipe, server_dir, ref_dir))
        trainer = RemoteGRPOTrainer(model=recipe.model.name_or_path, reward_funcs=reward_funcs, args=args,
                                    train_dataset=dataset, peft_config=recipe.model.peft_config())
        # One readable line per step (StepPrinter) instead of tqdm bars and metric dicts, for terminals and SLURM logs.
        trainer.remove_callback(ProgressCallback)
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(StepPrinter())
        trainer.add_callback(MetricsLog())
        trainer.train(resume_from_checkpoint=last_checkpoint)
        if trainer.stop_signal.stopped_at is not None:
            return trainer  # stopped by a signal: the checkpoint is the run's state, not a final model
        trainer.save_model(str(output_dir))
    logger.info("training finished: model saved to %s", output_dir)
    return trainer


def save_traceback(recipe: Recipe) -> Path:
    """Append the exception being handled, with its traceback, to `<output_dir>/traceback.log`; return that file."""
    path = Path(recipe.output_dir) / "traceback.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} rank {os.environ.get('RANK', '0')}\n{traceback.format_exc()}")
    return path


def build_rewards(recipe: Recipe) -> list:
    from open_r1_ext.rewards import resolve_reward

    funcs = []
    for spec in recipe.rewards:
        func = resolve_reward(spec.name)
        if spec.kwargs:
            func = functools.update_wrapper(functools.partial(func, **spec.kwargs), func)
        funcs.append(func)
    return funcs


@contextlib.contextmanager
def servers(recipe: Recipe, server_url: URLs, ref_url: URLs, server_dir: Optional[str] = None,
            ref_dir: Optional[str] = None) -> Iterator[tuple[URLs, URLs]]:
    """`(generation_url, ref_model_url)`: given (one URL, or a list: a pool of replicas), from the environment or
    recipe, or embedded servers (built-in or SGLang, started at once, on GPUs of their own: `bind_gpus`); None for a
    role whose replicas advertise themselves in an address directory (`server_dir`, `ref_dir`: `pool_settings`).
    Under `accelerate launch` the first process starts the embedded servers and the others use their URLs."""
    given = {"generation": listed(server_url) or listed(os.environ.get(SERVER_URL_ENV)),
             "reference": listed(ref_url) or listed(os.environ.get(REF_URL_ENV))}
    directories = {"generation": server_dir, "reference": ref_dir}
    urls: dict[str, list[str]] = {}
    embedded = []
    specs = recipe.servers.specs()
    started_here = {role: spec for role, spec in specs.items() if not (given[role] or spec.url or directories[role])}
    server_gpus = bind_gpus(recipe, started_here)  # before anything asks CUDA what it sees
    threads = cpu_threads_each(len(started_here))
    with contextlib.ExitStack() as stack:
        for role, spec in specs.items():
            urls[role] = given[role] or listed(None if directories[role] else spec.url)
        if started_here and not first_process():  # the first process of `accelerate launch` starts them
            urls.update(wait_for_embedded_urls(recipe))
        elif started_here:
            write_run_key(recipe, Path(recipe.output_dir))  # a new key for this run's embedded servers
            embedded_urls(recipe).unlink(missing_ok=True)
            for role, spec in started_here.items():
                embedded.append(embedded_server(recipe, role, spec, threads, server_gpus.get(role)))
                stack.callback(embedded[-1].stop)
                embedded[-1].launch()
            for role, server in zip(started_here, embedded):  # each started before any is waited for: their start-ups
                urls[role] = [server.wait_until_healthy().url]  # overlap; its URL once up (a port taken: another)
            write_atomic(embedded_urls(recipe), json.dumps({role: urls[role] for role in started_here}))
        generation = urls.get("generation", [])
        if recipe.servers.reference == "generation":  # each generation server's reference (its /ref slot, built-in)
            reference = [recipe.role_urls(url, None)[1] for url in generation]
        else:
            reference = urls.get("reference", [])
        yield one_or_list(generation), one_or_list(reference)


def first_process() -> bool:
    """Whether this is the first process of the run (`RANK` 0 under `accelerate launch`, or the only one)."""
    return int(os.environ.get("RANK", "0")) == 0


def embedded_urls(recipe: Recipe) -> Path:
    """Where the first process writes the URLs of the embedded servers it started, for the other processes."""
    return Path(recipe.output_dir) / EMBEDDED_URLS_FILE


def wait_for_embedded_urls(recipe: Recipe) -> dict[str, list[str]]:
    """`{role: [URL]}` of the embedded servers the first process started, once it has written them (a file of this
    launch: written after the launcher started this process), waited for up to `server_wait_timeout`."""
    import psutil

    from open_r1_ext.wait_progress import WaitProgress

    path, timeout = embedded_urls(recipe), float(recipe.setting("server_wait_timeout"))
    launched = psutil.Process(os.getppid()).create_time()  # the launcher's start: an older file is an earlier run's
    with WaitProgress(f"the first process's embedded servers ({path})", timeout) as progress:
        while not (path.is_file() and path.stat().st_mtime >= launched):
            if time.monotonic() - progress.start > timeout:
                raise ServerError(f"no embedded servers from the first process in {path} within {timeout:.0f} s "
                                  "(trainer.server_wait_timeout): see its output")
            time.sleep(0.5)
            progress.update()
    return json.loads(path.read_text())


def gpus_asked(spec: ServerSpec) -> int:
    """The GPUs an embedded server takes on this machine: its resources' `gpus_per_node` (the built-in server uses
    one device: at most 1), none with `device: cpu`."""
    asked = 0 if spec.device == "cpu" else spec.replica_resources(0).gpus_per_node
    return min(asked, 1) if spec.engine == "builtin" else asked


def split_gpus(visible: Sequence[str], asked: Mapping[str, int],
               trainer_processes: int = 1) -> tuple[list[str], dict[str, list[str]]]:
    """`(the trainer's GPUs, {role: its server's GPUs})` of the GPUs `visible` on this machine: each server takes the
    number `asked` from the end, the trainer keeps the rest (the first, where its processes run). ValueError when
    fewer than `trainer_processes` would be left."""
    kept = len(visible) - sum(asked.values())
    if kept < trainer_processes:
        wanted = ", ".join(f"{n} for the {role} server" for role, n in asked.items() if n)
        raise ValueError(f"{len(visible)} GPU(s) visible here ({','.join(visible) or 'none'}): {wanted} leave "
                         f"{max(kept, 0)} for the trainer's {trainer_processes} process(es)")
    servers, start = {}, kept
    for role, n in asked.items():
        servers[role], start = list(visible[start:start + n]), start + n
    return list(visible[:kept]), servers


def visible_gpus() -> list[str]:
    """This machine's GPUs for the run: `CUDA_VISIBLE_DEVICES`'s ids when it is set, else every GPU torch sees."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [gpu.strip() for gpu in given.split(",") if gpu.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def bind_gpus(recipe: Recipe, started_here: Mapping[str, ServerSpec]) -> dict[str, list[str]]:
    """Give the embedded servers GPUs of their own (`split_gpus`): `{role: its GPUs}` for their
    `CUDA_VISIBLE_DEVICES`, the trainer keeping the rest in its own; nothing changes without a GPU or when no
    embedded server asks for one. Too few GPUs: a `RecipeError` naming the keys and the fixes."""
    asked = {role: gpus_asked(spec) for role, spec in started_here.items()}
    visible = visible_gpus() if any(asked.values()) else []
    if not visible:
        return {}
    try:
        # a trainer on the CPU (`use_cpu`) needs none of them: every GPU may go to the servers
        needed = 0 if recipe.setting("use_cpu") else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        trainer, servers = split_gpus(visible, asked, needed)
    except ValueError as err:
        keys = " / ".join(f"servers.{role}.resources.gpus_per_node" for role, n in asked.items() if n)
        raise RecipeError(recipe.path, [(keys, f"{err}: lower it (0: the server shares the trainer's GPUs), run the "
                                               "servers elsewhere (--server-url, --ref-url) or on the CPU (device: "
                                               "cpu), or make more GPUs visible (CUDA_VISIBLE_DEVICES)")]) from None
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(trainer)
    logger.info("GPUs: the trainer %s, %s (CUDA_VISIBLE_DEVICES)", ",".join(trainer),
                ", ".join(f"the {role} server {','.join(gpus) or 'none'}" for role, gpus in servers.items()))
    return servers


def pool_settings(recipe: Recipe, server_dir: Optional[str], ref_dir: Optional[str]) -> dict:
    """The trainer config's replica-pool settings: each role's address directory and its spec's `min_replicas`. A
    reference in the generation servers reads their directory (through the built-in server's `/ref` slot)."""
    specs, settings = recipe.servers.specs(), {}
    if "generation" in specs:
        settings.update(generation_server_dir=server_dir, generation_min_replicas=specs["generation"].min_replicas)
    if "reference" in specs:
        settings.update(ref_model_server_dir=ref_dir, reference_min_replicas=specs["reference"].min_replicas)
    elif recipe.servers.reference == "generation" and "generation" in specs:
        address = "http://replica"  # what role_urls appends to a generation server's address for its reference
        settings.update(ref_model_server_dir=server_dir, reference_min_replicas=specs["generation"].min_replicas,
                        ref_model_route=recipe.role_urls(address, None)[1].removeprefix(address))
    return settings


def listed(urls: URLs) -> list[str]:
    """A URL, a list of them, or None, as a list."""
    return [urls] if isinstance(urls, str) else list(urls or ())


def one_or_list(urls: list[str]) -> URLs:
    """The form a config's URL field takes: None, one URL, or a list of several (a pool)."""
    return None if not urls else urls[0] if len(urls) == 1 else urls


def cpu_threads_each(embedded: int) -> Optional[int]:
    """On a machine without a GPU, this process and its `embedded` servers share the cores: each gets an equal part
    (at least one), set here for the trainer and returned for the servers' `--num-threads`: OpenMP pools that
    together want more threads than there are cores slow each other down. None: nothing to share."""
    import torch

    if not embedded or torch.cuda.is_available():
        return None
    threads = max(1, (os.cpu_count() or 2) // (embedded + 1))
    torch.set_num_threads(threads)
    return threads


def embedded_server(recipe: Recipe, role: str, spec: ServerSpec, threads: Optional[int] = None,
                    gpus: Optional[list[str]] = None):
    """The recipe's server for `role` (`generation` or `reference`) on this machine, on a free port, with the command
    line a server job runs (`slurm_plan.server_command`: the run's key, the run's weight dumps, LoRA, SGLang on the
    CPU); `threads`: its CPU threads (the built-in server's `--num-threads`, SGLang's OpenMP threads); `gpus`: its
    `CUDA_VISIBLE_DEVICES` (None: this process's)."""
    from open_r1_ext.launch.local_server import CommandServer, free_port
    from open_r1_ext.launch.slurm_plan import argv, server_command

    log = Path(recipe.output_dir) / f"{role}-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    model_path = recipe.model_path(spec)
    logger.info("starting an embedded %s %s server on %s (log: %s)", spec.engine, role, model_path, log)
    local_args, env = [], {}
    if spec.engine == "builtin":  # (SGLang logs at its default level: its start-up lines help when it fails)
        local_args = ["--log-level", "warning", *(["--num-threads", str(threads)] if threads else [])]
    elif threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    port = free_port()
    command = argv(server_command(recipe, role, port, host="127.0.0.1", local_args=local_args))
    return CommandServer(command, f"embedded {spec.engine} {role} server", model_path, port, env=env, log_path=str(log),
                         startup_timeout=float(recipe.setting("server_wait_timeout")))


def quiet_libraries() -> None:
    """Keep a run's output to its own lines: hide the deprecation warnings TRL's own calls raise in transformers
    (TRL's `gradient_checkpointing` default and its helpers; nothing we can change), and transformers' progress bars
    for loading and saving a model (instant here; a long wait, for a server, keeps its progress line)."""
    from transformers.utils import logging as transformers_logging

    warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated", category=FutureWarning)
    transformers_logging.disable_progress_bar()


class MetricsLog(TrainerCallback):
    """Every trainer log as one JSON line of `<output_dir>/metrics.jsonl`, with its step, the run's max steps and the
    time: what `open-r1-ext status` and `open-r1-ext plot` read (`launch/run_status.py`)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        entry = {"step": state.global_step, "max_steps": state.max_steps, "time": round(time.time(), 3), **logs}
        with open(Path(args.output_dir) / METRICS_FILE, "a") as log:
            log.write(json.dumps(entry, default=str) + "\n")


class StepPrinter(TrainerCallback):
    """One line per logged step: reward, KL, loss and where the step's time went, for humans watching a terminal or
    a SLURM log."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        from open_r1_ext.trainer.step_timing import describe_step_time

        if not state.is_world_process_zero or not logs or "reward" not in logs:
            return
        extras = "".join(f"  {k} {logs[k]:.4f}" for k in ("kl", "loss") if k in logs)
        if "dynamic_sampling/groups_kept" in logs:  # dynamic sampling: the batch's informative groups, of all generated
            extras += (f"  groups {logs['dynamic_sampling/groups_kept']:g}/{logs['dynamic_sampling/groups_generated']:g}"
                       f" kept in {logs['dynamic_sampling/rounds']:g} round(s)")
        print(f"step {state.global_step:>4}/{state.max_steps}  reward {logs['reward']:.4f}{extras}"
              f"{describe_step_time(logs)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
