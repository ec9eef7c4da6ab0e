"""What the light commands import: `open-r1-ext status` (a login node, `--watch`) and the module of the SLURM job
steps (`python -m open_r1_ext.launch.jobs`, on every job start) load neither torch nor TRL (~1.5 s and ~3.5 s of CPU
each time); only the code that handles tensors imports them."""

import json
import subprocess
import sys

from tests.helpers import REPO

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
