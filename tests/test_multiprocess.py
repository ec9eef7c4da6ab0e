"""Two trainer processes (accelerate launch, CPU, gloo) against one real server: shards, gathers, weight sync."""

import json
import os
import subprocess
import sys
from pathlib import Path

import requests

from tests.helpers import REPO, restore_default_weights


def run_ranks(tiny_model, url, out: Path, processes: int, per_device: int) -> list[dict]:
    # `--multi_gpu` selects accelerate's torchrun launcher; with no GPU the ranks run on CPU over gloo (`--cpu` would
    # pick its MPI launcher instead).
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if processes == 1:
        launcher = [sys.executable]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    result = subprocess.run([*launcher, "-m", "tests.multiprocess_train", str(tiny_model), url, str(out), str(per_device)],
                            capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [json.loads((out / f"rank-{i}.json").read_text()) for i in range(processes)]


def generated(url) -> int:
    return requests.get(f"{url}/get_server_info", timeout=10).json()["sequences_generated"]


def test_two_processes_match_one_process(tiny_model, server, tmp_path):
    before = generated(server.url)
    one = run_ranks(tiny_model, server.url, tmp_path / "one", processes=1, per_device=4)
    after_one = generated(server.url)
    restore_default_weights(server.url, tiny_model)
    two = run_ranks(tiny_model, server.url, tmp_path / "two", processes=2, per_device=2)
    after_two = generated(server.url)

    assert [r["world"] for r in two] == [2, 2] and all(r["global_step"] == 3 for r in one + two)
    # each rank generated and scored only its own shard; together, as many samples as one process
    assert [r["local_samples"] for r in two] == [6, 6] and one[0]["local_samples"] == 12
    assert after_one - before == after_two - after_one == 12
    # only the main process wrote dumps (one log line per sync, no duplicates), and every rank saw the new version
    log = [json.loads(line) for line in (tmp_path / "two" / "weight_sync.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == [1, 2, 3]
    assert {r["server_version"] for r in two} == {r["target_version"] for r in two} == {"3"}
    restore_default_weights(server.url, tiny_model)
