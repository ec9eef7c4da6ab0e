"""`make demo`'s recipe (recipes/tiny/grpo.yaml) learns where anyone can see it, its output stays to one line per step,
and `status` / `plot` read the finished run: the real path (embedded built-in server, remote reference and
generation, weight sync every step), as `make demo` runs it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from open_r1_ext.launch.run_plot import DPI, FIGSIZE, PANELS, flat_rewards
from open_r1_ext.launch.run_status import run_metrics
from tests.slurm_helpers import RECIPE, REPO

STEPS = 30  # the recipe's max_steps


@pytest.fixture(scope="module")
def demo_run(tiny_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    result = subprocess.run([sys.executable, "-m", "open_r1_ext.train", "--config", RECIPE,
                             "--set", f"model.name_or_path={tiny_model}", "--set", f"trainer.output_dir={run_dir}"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


def test_the_demo_reward_climbs(demo_run):
    run_dir, _ = demo_run
    steps = [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward" in e]
    rewards = [e["reward"] for e in steps]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.5, rewards  # measured: 0.00-0.02 -> 0.98-0.99
    syncs = [json.loads(line) for line in (run_dir / "weight_sync.jsonl").read_text().splitlines()]
    assert [s["step"] for s in syncs if s["role"] == "generation"] == list(range(1, STEPS + 1))  # every step


def test_the_demo_output_is_one_line_per_step_and_no_warnings(demo_run):
    _, result = demo_run
    output = result.stdout + result.stderr
    assert not re.search(r"(Future|Deprecation|User)Warning", output), output[-3000:]
    step_lines = re.findall(r"^step\s+(\d+)/(\d+)  reward \S+  kl \S+  loss \S+  .*s:.*$", result.stdout, re.MULTILINE)
    assert step_lines == [(str(i), str(STEPS)) for i in range(1, STEPS + 1)]


def test_status_of_the_finished_demo(demo_run, tmp_path):
    run_dir, _ = demo_run
    out = subprocess.run([sys.executable, "-m", "open_r1_ext.cli", "status", str(run_dir), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["jobs"] == [] and status["servers"] == []  # the embedded server went with the run
    trainer = status["trainer"]
    assert trainer["step"] == trainer["max_steps"] == STEPS and trainer["finished"] and trainer["eta_s"] is None
    assert trainer["steps_per_s"] > 0 and trainer["reward"] > 0.5
    assert status["last_sync"]["generation"]["step"] == STEPS and status["last_sync"]["generation"]["weight_version"] == str(STEPS)
    assert status["staleness"] == {"step": STEPS, "last": 0, "max": 0}
    text = subprocess.run([sys.executable, "-m", "open_r1_ext.cli", "status", str(run_dir)], capture_output=True,
                          text=True, timeout=120).stdout
    assert f"step {STEPS}/{STEPS}" in text and "finished" in text and f"generation: step {STEPS} (weights {STEPS})" in text
    watched = subprocess.run([sys.executable, "-m", "open_r1_ext.cli", "status", str(run_dir), "--watch", "5"],
                             capture_output=True, text=True, timeout=120)
    assert watched.returncode == 0 and watched.stdout.count("run       ") == 1  # training has finished: one look
    refused = subprocess.run([sys.executable, "-m", "open_r1_ext.cli", "status", str(run_dir), "--watch", "0"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--watch 0: give the seconds between two looks" in refused.stderr


def test_plot_of_the_demo(demo_run, tmp_path):
    import matplotlib.image

    run_dir, _ = demo_run
    out = tmp_path / "plot.png"
    result = subprocess.run([sys.executable, "-m", "open_r1_ext.cli", "plot", str(run_dir), "-o", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(out).shape
    assert (width, height) == (FIGSIZE[0] * DPI, FIGSIZE[1] * DPI)
    drawn = result.stdout.strip().split("; panels: ", 1)[1].split(", ")
    assert drawn == list(PANELS)  # every panel has data: rewards, KL, loss, step time, sync time, staleness
    steps, _ = run_metrics(run_dir)
    assert flat_rewards(steps) == {"accuracy": 0.0}  # labelled on the plot; target_token, which it learns, is not


def test_status_and_plot_without_metrics_read_the_checkpoint(demo_run, tmp_path):
    """A run of the Python API (no metrics.jsonl): the newest checkpoint's trainer_state.json."""
    import shutil

    run_dir, _ = demo_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "metrics.jsonl").unlink()
    status = json.loads(subprocess.run([sys.executable, "-m", "open_r1_ext.cli", "status", str(copy), "--json"],
                                       capture_output=True, text=True, timeout=120).stdout)
    assert status["trainer"]["step"] == STEPS and status["trainer"]["steps_per_s"] is None
    result = subprocess.run([sys.executable, "-m", "open_r1_ext.cli", "plot", str(copy)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and (copy / "plot.png").is_file(), result.stderr
