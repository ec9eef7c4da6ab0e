"""The preflight (`open-r1-ext validate --preflight`, and the launchers before they submit): each check against the
real thing it checks: interpreters run (a bare venv, the SGLang venv), transformers' report_to callbacks, accelerate
configs, a small tmpfs for the disk, a real HTTP server that speaks only OpenAI's routes, the HF cache's own layout."""

import importlib.util
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from huggingface_hub import constants

from open_r1_ext.cli import main as cli_main
from open_r1_ext.config.recipe import INSTALLS, load_recipe
from open_r1_ext.launch import preflight as pf
from open_r1_ext.protocol import SGLANG_VERSION
from tests.helpers import REPO, JsonHandler, http_server, tiny_recipe
from tests.slurm_helpers import RECIPE, run_script


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "open_r1_ext.cli", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=300)


def errors(recipe, findings) -> list[str]:
    return [f.line(recipe.path) for f in findings if f.level == pf.ERROR]


def lines(recipe, findings, level) -> list[str]:
    return [f.line(recipe.path) for f in findings if f.level == level]


def bare_venv(path: Path) -> Path:
    """A real venv without pip or any package: its python imports neither SGLang nor this project."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    return path / "bin" / "python"


def sglang_spec(python) -> str:
    return f"servers.generation={{engine: sglang, device: cpu, python: {python}, dtype: float32, resources: {{gpus_per_node: 0}}}}"


def test_a_server_interpreter_without_its_engine_is_refused_and_sglangs_version_is_said(tmp_path, tiny_model,
                                                                                       sglang_python, capsys, monkeypatch):
    """One `validate --preflight` of two recipes: the bare venv's python cannot import sglang (refused, exit 1, the
    fix named), the SGLang venv's says 0.5.23. In this process (`cli.main`): a CLI process would spend ~5 s of CPU
    importing TRL again; the interpreters' imports are processes all the same."""
    python = bare_venv(tmp_path / "bare")
    recipes = []
    for name, interpreter in (("bare", python), ("sglang", sglang_python)):
        (tmp_path / name).mkdir(exist_ok=True)
        path = tiny_recipe(tmp_path / name, tiny_model)
        raw = yaml.safe_load(path.read_text())
        raw["servers"] = {"generation": yaml.safe_load(sglang_spec(interpreter).split("=", 1)[1]), "reference": "local"}
        path.write_text(yaml.safe_dump(raw))
        recipes.append(str(path))
    monkeypatch.chdir(REPO)  # where the user runs the command
    code = cli_main(["validate", "--preflight", *recipes])
    result = capsys.readouterr()
    assert code == 1, result.err
    assert "Traceback" not in result.err
    assert (f"{recipes[0]}: servers.generation.python: {python} cannot import sglang: ModuleNotFoundError: No module "
            f"named 'sglang': give servers.generation.python the python of a venv that has the sglang server "
            f"({INSTALLS['sglang']})") in result.err.splitlines()
    assert f".venv-sglang/bin/pip install sglang=={SGLANG_VERSION}" in INSTALLS["sglang"]  # the fix, as the README says
    assert (f"{recipes[1]}: servers.generation.python: ok: {sglang_python} imports sglang (sglang {SGLANG_VERSION})"
            in result.out.splitlines()), result.out
    assert not [line for line in result.err.splitlines() if line.startswith(f"{recipes[1]}: ") and ": warning: " not in line]


def test_an_sglang_release_other_than_the_supported_one_is_refused(tmp_path, tiny_model):
    """No other SGLang release installs here: a stand-in `sglang` package saying 0.5.22 in a bare venv."""
    python = bare_venv(tmp_path / "old")
    site = next((tmp_path / "old" / "lib").glob("python3*/site-packages"))
    (site / "sglang").mkdir()
    (site / "sglang" / "__init__.py").write_text('__version__ = "0.5.22"\n')
    recipe = load_recipe(tiny_recipe(tmp_path, tiny_model), [sglang_spec(python), "servers.reference=local"])
    assert errors(recipe, pf.check_engines(recipe)) == [
        f"{recipe.path}: servers.generation.python: {python} has sglang 0.5.22; this project supports sglang "
        f"{SGLANG_VERSION} (its protocol and workarounds follow that release): {python} -m pip install "
        f"sglang=={SGLANG_VERSION}, or give servers.generation.python the python of a venv that has the sglang server "
        f"({INSTALLS['sglang']})"]


def test_gpus_asked_for_a_server_on_the_cpu_are_a_warning(tmp_path, tiny_model):
    """`device: cpu` in a job with GPUs validates (the rehearsal runs GPU recipes so), but the preflight says the GPUs
    would be held idle; without GPUs, nothing is said."""
    path = tiny_recipe(tmp_path, tiny_model)
    idle = load_recipe(path, ["servers.generation={engine: builtin, device: cpu, resources: {gpus_per_node: 2}}"])
    assert lines(idle, pf.check_idle_gpus(idle), pf.WARNING) == [
        f"{path}: servers.generation.resources.gpus_per_node: warning: 2 GPU(s) asked for a server that runs on the CPU "
        "(device: cpu): they are allocated and left idle; set gpus_per_node: 0, or remove device to run on them"]
    assert pf.check_idle_gpus(load_recipe(path)) == []


def test_a_report_to_integration_not_installed_is_refused(tmp_path, tiny_model):
    """transformers' own callback for each integration is built in this interpreter (the trainer's): wandb is not
    installed here (an extra), tensorboard is (a dependency)."""
    assert importlib.util.find_spec("wandb") is None  # the premise: the project's .venv has no wandb
    path = tiny_recipe(tmp_path, tiny_model)
    missing = load_recipe(path, ["trainer.report_to=[tensorboard, wandb]"])
    findings = pf.check_report_to(missing)
    assert errors(missing, findings) == [
        f"{path}: trainer.report_to: wandb cannot be used in {sys.executable} (the trainer's interpreter): WandbCallback "
        "requires wandb to be installed. Run `pip install wandb`. (pip install -e '.[wandb]')"]
    assert lines(missing, findings, pf.OK) == [f"{path}: trainer.report_to: ok: tensorboard: its callback builds in "
                                               f"{sys.executable}"]


def test_an_accelerate_config_that_disagrees_with_the_trainers_resources_is_refused(tmp_path, tiny_model):
    """accelerate launch takes num_processes from the command line (slurm.trainer) but the launcher kind from the
    file: `distributed_type: NO` starts one process whatever the trainer asks; `use_cpu: true` leaves its GPUs idle.
    The shipped configs agree with the shipped trainers' resources."""
    path = tiny_recipe(tmp_path, tiny_model)
    single = tmp_path / "single.yaml"
    single.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO",
                                      "num_processes": 1, "use_cpu": True}))
    gpus = ["slurm.trainer={nodes: 1, gpus_per_node: 2}", f"accelerate_config={single}"]
    recipe = load_recipe(path, gpus)
    assert errors(recipe, pf.check_accelerate(recipe)) == [
        f"{path}: accelerate_config: {single} says distributed_type: NO, with which accelerate launch starts one "
        "process, and slurm.trainer asks for 2 (1 node(s) x 2): use recipes/accelerate_configs/ddp.yaml, zero2.yaml or "
        "zero3.yaml, or give the trainer one process",
        f"{path}: accelerate_config: {single} says use_cpu: true, which trains on the CPU, and slurm.trainer holds 2 "
        "GPU(s) a node: set use_cpu: false there, or slurm.trainer.gpus_per_node: 0"]
    for config in ("ddp", "zero2", "zero3"):
        fits = load_recipe(path, ["slurm.trainer={nodes: 2, gpus_per_node: 8}",
                                  f"accelerate_config={REPO}/recipes/accelerate_configs/{config}.yaml"])
        assert errors(fits, pf.check_accelerate(fits)) == []


@pytest.fixture()
def small_tmpfs(tmp_path):
    """A real 512 KiB tmpfs (root mounts it; unmounted afterwards)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], capture_output=True, text=True)
    assert done.returncode == 0, f"this test mounts a tmpfs, which needs root: {done.stderr}"
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_disk_too_small_for_the_dumps_is_refused(tmp_path, tiny_model, small_tmpfs):
    """The tiny model's dumps (float32, ~0.38 MB; keep_last_dumps 2, and 1 being written: ~1.1 MB) on a 512 KiB
    tmpfs: refused, naming the estimate and the fixes, and said to be node-local (the server jobs must read it); on
    the disk beside it they fit."""
    path = tiny_recipe(tmp_path, tiny_model)
    recipe = load_recipe(path, [f"sync.sync_dir={small_tmpfs}/weights"])
    count, weight = pf.model_parameters(recipe)
    dump = count * weight
    assert weight == 4 and 0.3e6 < dump < 0.45e6  # float32; the safetensors file holds the same bytes
    findings = pf.check_disk(recipe)
    assert errors(recipe, findings) == [
        f"{path}: sync.sync_dir: sync.sync_dir ({small_tmpfs}/weights) need about {pf._size(3 * dump)} (3 dump(s) of "
        f"{pf._size(dump)}) where 0.5 MB is free: free space there, lower sync.keep_last_dumps / "
        "trainer.save_total_limit, or move them"]
    assert f"{path}: sync.sync_dir: warning: {small_tmpfs}/weights is on a node-local file system (tmpfs at " \
           f"{small_tmpfs})" in "\n".join(lines(recipe, findings, pf.WARNING))
    fits = load_recipe(path, [f"sync.sync_dir={tmp_path}/weights"])
    assert errors(fits, pf.check_disk(fits)) == []


class OpenAIOnly(JsonHandler):
    """Only OpenAI's routes, like llama.cpp's and vLLM's OpenAI servers: `/v1/models`, `/v1/completions`; 404
    elsewhere (no `/model_info`, no reload route)."""

    def do_GET(self):
        if self.path != "/v1/models":
            return self.answer(404, {"error": "not found"})
        self.answer(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    def do_POST(self):
        if self.path != "/v1/completions":
            return self.answer(404, {"error": "not found"})
        self.answer(200, {"choices": [{"index": 0, "text": "2", "finish_reason": "length"}]})


def test_an_openai_server_that_cannot_reload_is_refused(tmp_path, tiny_model, server):
    """With weight syncs a server that cannot reload is refused before anything starts (it failed mid-run with a 404
    on /model_info); without syncs it is fine; the built-in server (its OpenAI routes) reloads."""
    path = tiny_recipe(tmp_path, tiny_model)
    with http_server(OpenAIOnly) as url:
        openai = [f"servers.generation={{engine: openai, url: {url}}}", "servers.reference=local"]
        syncing = load_recipe(path, openai)
        assert errors(syncing, pf.check_reloads(syncing)) == [
            f"{path}: servers.generation.url: {url} does not answer SGLang's /model_info: it cannot reload weights (as "
            "vLLM's and llama.cpp's OpenAI servers; SGLang and the built-in server can), and sync.weight_sync_steps is "
            "1: set sync.weight_sync_steps: 0 (generation then stays on the server's weights), or generate on a server "
            "that reloads (engine: sglang or builtin)"]
        frozen = load_recipe(path, [*openai, "sync.weight_sync_steps=0"])
        assert pf.check_reloads(frozen) == []
    builtin = load_recipe(path, [f"servers.generation={{engine: openai, url: {server.url}}}", "servers.reference=local"])
    assert lines(builtin, pf.check_reloads(builtin), pf.OK) == [
        f"{path}: servers.generation.url: ok: {server.url} answers /model_info: it can reload weights"]


def hub_cache_with(cache: Path, repo_id: str, model: Path) -> None:
    """`model` as the HF cache holds a downloaded repository (refs/main -> snapshots/<commit>/): nothing downloads
    here, so the cache is written in huggingface_hub's own layout."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = uuid.uuid4().hex + uuid.uuid4().hex[:8]
    shutil.copytree(model, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


def test_hub_ids_missing_from_the_cache_warn_and_are_refused_offline(tmp_path, tiny_model):
    """A hub model in the cache is found (and its parameters counted from the cached config.json for the disk); one
    that is not, or a hub dataset datasets has not prepared: a warning naming the download command, an error under
    HF_HUB_OFFLINE (the jobs cannot download)."""
    cache, cached, missing = tmp_path / "hub", "open-r1-ext-tests/tiny-cached", f"open-r1-ext-tests/absent-{uuid.uuid4().hex[:8]}"
    hub_cache_with(cache, cached, tiny_model)
    path = tiny_recipe(tmp_path, tiny_model)
    recipes = []
    for name in (cached, missing):
        raw = yaml.safe_load(path.read_text())
        raw["model"]["name_or_path"] = name
        raw["data"]["dataset"] = raw["data"]["dataset"] if name == cached else missing + "-data"
        recipes.append(tmp_path / f"{name.split('/')[1]}.yaml")
        recipes[-1].write_text(yaml.safe_dump(raw))
    result = cli("validate", "--preflight", *map(str, recipes),
                 env=dict(os.environ, HF_HUB_CACHE=str(cache), HF_DATASETS_CACHE=str(tmp_path / "datasets"),
                          HF_HUB_OFFLINE="1"))
    assert result.returncode == 1, result.stderr
    out, err = result.stdout.splitlines(), result.stderr.splitlines()
    assert any(line.startswith(f"{recipes[0]}: model.name_or_path: ok: {cached} is in the local cache ({cache}/") for line in out)
    assert any(line.startswith(f"{recipes[0]}: sync.sync_dir: ok: ") and "3 dump(s) of 0.4 MB" in line for line in out)
    assert (f"{recipes[1]}: model.name_or_path: {missing} is not in the local HF cache ({cache}), and HF_HUB_OFFLINE is "
            f"set: the jobs cannot download it; run on a machine with internet, with the same HF_HOME: hf download "
            f"{missing}") in err, result.stderr
    assert (f"{recipes[1]}: data.dataset: {missing}-data is not in datasets' cache ({tmp_path / 'datasets'}), and "
            "HF_HUB_OFFLINE is set: the jobs cannot download it; run on a machine with internet, with the same "
            f"HF_HOME: python -c \"import datasets; datasets.load_dataset('{missing}-data', split='train')\"") in err
    online = load_recipe(recipes[1])  # this process: HF_HUB_OFFLINE unset, its default cache
    assert [line for line in lines(online, pf.check_hub_cache(online), pf.WARNING) if ": model." in line] == [
        f"{recipes[1]}: model.name_or_path: warning: {missing} is not in the local HF cache "
        f"({constants.HF_HUB_CACHE}): every job downloads it at start; nodes without internet: run hf download {missing} "
        "on a login node first, then export HF_HUB_OFFLINE=1"]


def test_the_launchers_submit_nothing_when_the_preflight_refuses(tmp_path, tiny_model, fake_slurm, capsys,
                                                                 monkeypatch):
    """`bash slurm/grpo.slurm` (a stand-in sbatch first on PATH, which must not be called) and `open-r1-ext launch`
    (local executor, and --dry-run) with a report_to integration that is not installed: exit 2, the line, nothing
    submitted, no run directory. `--dry-run`, which submits nothing either way, runs in this process (`cli.main`): a
    CLI process would spend ~5 s of CPU importing TRL again."""
    calls = fake_slurm()
    run_dir = tmp_path / "run"
    overrides = ["--set", f"model.name_or_path={tiny_model}", "--set", f"trainer.output_dir={run_dir}",
                 "--set", "trainer.report_to=[wandb]"]

    def as_a_process(*command: str) -> tuple[int, str]:
        result = run_script(*command, RECIPE, *overrides, timeout=300)
        return result.returncode, result.stderr

    def in_this_process(*args: str) -> tuple[int, str]:
        monkeypatch.chdir(REPO)
        return cli_main([*args, RECIPE, *overrides]), capsys.readouterr().err

    for run, command in ((as_a_process, ["bash", "slurm/grpo.slurm"]),
                         (as_a_process, [sys.executable, "-m", "open_r1_ext.cli", "launch", "--executor", "local"]),
                         (in_this_process, ["launch", "--dry-run"])):
        code, stderr = run(*command)
        assert code == 2, (command, stderr)
        assert f"{RECIPE}: trainer.report_to: wandb cannot be used in " in stderr
        assert "nothing submitted: fix the errors above" in stderr
        assert "sbatch" not in (calls.read_text() if calls.exists() else "")
        assert not run_dir.exists()
