"""Two trainer processes (accelerate launch, CPU, gloo) against one real server: shards, gathers, weight sync, and
in-flight updates in each; and a trainer process leaves its process group at exit."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import requests

from open_r1_ext.launch.local_server import free_port
from tests.helpers import REPO, restore_default_weights


def run_ranks(tiny_model, url, out: Path, processes: int, per_device: int, *mode: str) -> list[dict]:
    # `--multi_gpu` selects accelerate's torchrun launcher; with no GPU the ranks run on CPU over gloo (`--cpu` would
    # pick its MPI launcher instead).
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if processes == 1:
        launcher = [sys.executable]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    script = ["-m", "tests.multiprocess_train", str(tiny_model), url, str(out), str(per_device), *mode]
    result = subprocess.run([*launcher, *script],
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
    # each rank generated and scored only its own shard; together, as many samples as one process (besides each
    # process's one-token probe of the sampling settings at start-up, `RemoteGeneration.check_sampling`)
    assert [r["local_samples"] for r in two] == [6, 6] and one[0]["local_samples"] == 12
    assert (after_one - before - 1, after_two - after_one - 2) == (12, 12)
    # only the main process wrote dumps (one log line per sync, no duplicates), and every rank saw the new version
    log = [json.loads(line) for line in (tmp_path / "two" / "weight_sync.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == [1, 2, 3]
    assert {r["server_version"] for r in two} == {r["target_version"] for r in two} == {"3"}
    restore_default_weights(server.url, tiny_model)


def test_two_processes_keep_prompts_in_flight_and_log_every_group(tiny_model, server, tmp_path):
    """In-flight updates in each of two processes (one group a step each, up to two in flight): every group either
    trained is in rollouts.jsonl, once, named by its process."""
    try:
        ranks = run_ranks(tiny_model, server.url, tmp_path, 2, 4, "in-flight")
    finally:
        restore_default_weights(server.url, tiny_model)
    assert [r["global_step"] for r in ranks] == [2, 2]
    assert [r["most_in_flight"] for r in ranks] == [2, 2]  # a group beyond the one its step takes
    log = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    logged = Counter((e["process"], e["epoch"], *e["group"]) for e in log if not e.get("dropped"))
    assert logged == Counter((r["rank"], *position) for r in ranks for position in r["trained"])
    assert len(logged) == 4 and set(logged.values()) == {1}


LEAVES_AT_EXIT = """
import atexit, sys
import torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[4], rank=0, world_size=1)
from open_r1_ext import RemoteGRPOTrainer
from tests.helpers import reward_len, tiny_config, tiny_dataset
RemoteGRPOTrainer(model=sys.argv[1], reward_funcs=reward_len, args=tiny_config(sys.argv[2], generation_url=sys.argv[3]),
                  train_dataset=tiny_dataset())
print("before:", dist.is_initialized())
atexit._run_exitfuncs()
print("after:", dist.is_initialized())
"""


def test_a_trainer_process_leaves_its_process_group_at_exit(tiny_model, server, tmp_path):
    """A gloo rank of torch 2.13 that exits with its process group up while another rank runs on was seen to abort
    ("terminate called without an active exception": a ZeRO-3 trainer rank in a suite run, 5 exits in 8 of a bare
    2-rank script, none once it destroyed the group): a trainer made in a process group destroys it at exit."""
    result = subprocess.run([sys.executable, "-c", LEAVES_AT_EXIT, str(tiny_model), str(tmp_path), server.url,
                             str(free_port())], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-2:] == ["before: True", "after: False"], result.stdout
