"""DeepSpeed ZeRO-3 on CPU (2 gloo processes): the weight dump gathers the partitioned parameters whole."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # `-m tests.<script>` runs from the repository root


def test_zero3_dump_equals_the_unsharded_weights(tiny_model, tmp_path):
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "-m", "tests.zero3_dump", str(tiny_model), str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-5000:]
    report = json.loads((tmp_path / "zero3.json").read_text())
    assert report["stage"] == 3
    assert report["local_numel"] == 0 < report["full_numel"]  # every parameter really was partitioned
    assert report["error"] is None and report["manifest"]
    assert report["same_keys"] and report["max_diff"] == 0.0  # learning rate 0: the gathered dump is the original
