"""The layout's import rules: the server side and the shared modules import neither TRL nor DeepSpeed, so a server
node needs only the server's dependencies; the launch side validates nothing by importing the trainer eagerly."""

import subprocess
import sys

import pytest

TRAINER_ONLY = ("trl", "deepspeed", "accelerate", "datasets")


def imported_by(module: str) -> set[str]:
    """Top-level packages that importing `module` in a fresh interpreter brings in."""
    code = f"import sys, {module}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(out.stdout.split())


@pytest.mark.parametrize("module", [
    "open_r1_ext.server.app",  # the built-in server and its whole HTTP layer
    "open_r1_ext.protocol",
    "open_r1_ext.weight_files",
    "open_r1_ext.sglang_client",
    "open_r1_ext.server_pool",
    "open_r1_ext.openai_client",
    "open_r1_ext.weight_broadcast",
])
def test_server_side_and_shared_modules_import_no_trainer_package(module):
    assert imported_by(module).isdisjoint(TRAINER_ONLY)


def test_server_room_imports_nothing_from_the_trainer_or_launch_rooms():
    code = ("import sys, open_r1_ext.server.app; "
            "print(' '.join(m for m in sys.modules if m.startswith(('open_r1_ext.trainer', 'open_r1_ext.launch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == [], out.stdout + out.stderr[-3000:]


def test_status_and_plot_import_no_trainer_package(tmp_path):
    """`open-r1-ext status` and `plot` run on a login node: reading a run with a job, a server address, a key and
    logged steps (every lazy import on their way) brings in no TRL, DeepSpeed, accelerate or datasets."""
    (tmp_path / "jobs.env").write_text("SERVER_JOB=999999999\nEXECUTOR=local\n")
    (tmp_path / "replicas" / "server").mkdir(parents=True)
    (tmp_path / "replicas" / "server" / "999999999.addr").write_text("127.0.0.1:9\n")
    (tmp_path / "api_key.yaml").write_text('api-key: "k"\n')
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "max_steps": 2, "time": 1.0, "reward": 0.5}\n'
                                            '{"step": 2, "max_steps": 2, "time": 2.0, "reward": 0.7}\n')
    code = ("import sys; from open_r1_ext.cli import main; "
            f"assert main(['status', {str(tmp_path)!r}]) == 0 and main(['plot', {str(tmp_path)!r}]) == 0; "
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    imported = set(out.stdout.splitlines()[-1].split())
    assert {"matplotlib", "requests"} <= imported and imported.isdisjoint(TRAINER_ONLY)
