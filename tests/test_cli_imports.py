"""What the light commands import: `open-r1-ext status` (a login node, `--watch`) and the module of the SLURM job
steps (`python -m open_r1_ext.launch.jobs`, on every job start) load neither torch nor TRL (~1.5 s and ~3.5 s of CPU
each time); only the code that handles tensors imports them."""

import inspect
import json
import subprocess
import sys
from pathlib import Path

from open_r1_ext.config.recipe import load_recipe
from tests.helpers import REPO, SHIPPED_RECIPES

HEAVY = ("torch", "trl", "transformers")


def test_status_and_the_job_steps_module_import_neither_torch_nor_trl(tmp_path):
    replicas = tmp_path / "replicas" / "server"
    replicas.mkdir(parents=True)
    (replicas / "r0.addr").write_text("127.0.0.1:1\n")  # nothing listens on port 1: status probes it and finds it down
    script = (
        "import json, sys\n"
        "from open_r1_ext import cli\n"
        f"code = cli.main(['status', {str(tmp_path)!r}, '--json'])\n"
        "import open_r1_ext.launch.jobs\n"
        f"print(json.dumps({{'code': code, 'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    status, imports = (json.loads(line) for line in out.stdout.splitlines())
    assert [(s["url"], s["healthy"]) for s in status["servers"]] == [("http://127.0.0.1:1", False)]
    assert imports == {"code": 0, "heavy": []}


SHIPPED = [str(path.relative_to(REPO)) for path in SHIPPED_RECIPES]
JOB_STEP_HEAVY = ("torch", "transformers", "trl.trainer.grpo_config")  # TRL's package alone: its ModelConfig defaults
VARIANTS = ([], ["sync.sync_dir=elsewhere/dumps", "trainer.server_wait_timeout=33"])  # the defaults, and set values


def job_step_view(recipe: str, overrides: list[str], checked: bool) -> list:
    """What a SLURM job step takes from a recipe: every job's sbatch and srun options and node commands, the
    trainer's wait for its servers, the servers' weight directory."""
    from open_r1_ext.config.recipe import load_recipe
    from open_r1_ext.launch.slurm_plan import SlurmPlan

    plan = SlurmPlan(load_recipe(recipe, overrides, checked=checked), overrides)
    return [plan.describe(), plan.server_wait_s, plan.recipe.sync_dir]


def test_a_job_step_reads_the_checked_recipe_without_torch_or_trl_and_sees_what_the_submission_saw():
    """`python -m open_r1_ext.launch.jobs server|trainer|node` loads the recipe unchecked (its submission checked it):
    the plan of each shipped recipe is the same as the checked one's, and making it imports neither torch nor TRL."""
    cases = [(recipe, overrides) for recipe in SHIPPED for overrides in VARIANTS]
    script = (f"import json, sys\n{inspect.getsource(job_step_view)}"  # this module imports torch (tests.helpers)
              f"views = [job_step_view(r, o, checked=False) for r, o in {cases!r}]\n"
              f"print(json.dumps({{'views': views, 'heavy': [m for m in {JOB_STEP_HEAVY!r} if m in sys.modules]}}))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    unchecked = json.loads(out.stdout)
    assert unchecked["heavy"] == []
    assert unchecked["views"] == [job_step_view(recipe, overrides, checked=True) for recipe, overrides in cases]
    for (recipe, overrides), (_, _, sync_dir) in zip(cases, unchecked["views"]):  # the trainer's own sync_dir
        config = load_recipe(recipe, overrides).trainer_config("http://g:0", "http://r:0", on_this_machine=False)
        assert sync_dir == str(Path(config.sync_dir).resolve())
