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
    "open_r1_ext.openai_client",
])
def test_server_side_and_shared_modules_import_no_trainer_package(module):
    assert imported_by(module).isdisjoint(TRAINER_ONLY)


def test_server_room_imports_nothing_from_the_trainer_or_launch_rooms():
    code = ("import sys, open_r1_ext.server.app; "
            "print(' '.join(m for m in sys.modules if m.startswith(('open_r1_ext.trainer', 'open_r1_ext.launch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == [], out.stdout + out.stderr[-3000:]
