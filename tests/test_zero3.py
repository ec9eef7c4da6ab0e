"""DeepSpeed ZeRO-3 on CPU (2 gloo processes): the weight dump gathers the partitioned parameters bucket by bucket,
both ranks write shards, a rank killed mid-dump publishes nothing and the next run resumes."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from open_r1_ext.launch.local_server import free_port
from open_r1_ext.sglang_client import SGLangClient
from open_r1_ext.weight_files import INDEX, check_manifest
from tests.helpers import REPO, restore_default_weights


def launch(*args, env=None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
               "--dynamo_backend", "no", "-m", "tests.zero3_dump",
               *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)


def writes(out: Path, rank: int) -> list[dict]:
    path = out / f"writes-{rank}.json"
    return json.loads(path.read_text()) if path.exists() else []


def test_zero3_dump_in_small_buckets_equals_the_unsharded_weights(tiny_model, tmp_path):
    result = launch(tiny_model, tmp_path, "dump")
    assert result.returncode == 0, result.stderr[-5000:]
    report = json.loads((tmp_path / "zero3.json").read_text())
    assert report["stage"] == 3
    assert report["local_numel"] == 0 < report["full_numel"]  # every parameter really was partitioned
    assert report["keys"] and report["max_diff"] == 0.0  # learning rate 0: the gathered dump is the original
    dump = Path(report["path"])
    check_manifest(dump, checksums=False)
    index = json.loads((dump / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    # buckets of 20 kB, smaller than one layer: many shards, every one written by exactly one of the two ranks
    assert len(shards) > 2 * 2 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    by_rank = [{w["shard"] for w in writes(tmp_path, rank)} for rank in (0, 1)]
    assert by_rank[0] and by_rank[1] and by_rank[0] | by_rank[1] == set(shards) and not by_rank[0] & by_rank[1]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in load_file(
        str(tiny_model / "model.safetensors")).values())
    # rank 1 failing to write (its disk full) stops both ranks with the same message, and nothing is published
    failures = [(tmp_path / f"failed-{rank}.txt").read_text() for rank in (0, 1)]
    assert failures[0] == failures[1]
    assert failures[0].startswith(f"could not write the weight dump {dump.parent / 'step-2'} (model-00002-of-")
    assert "rank 1): no space left on device" in failures[0]
    assert not (dump.parent / "step-2").exists() and [p.name for p in dump.parent.iterdir()] == ["step-1"]
    # transformers reads the sharded dump as it is
    original = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    reloaded = AutoModelForCausalLM.from_pretrained(dump).state_dict()
    assert all(torch.equal(reloaded[k], original[k]) for k in original)


def test_rank_killed_mid_dump_publishes_nothing_and_the_next_run_resumes(tiny_model, server, tmp_path):
    killed = launch(tiny_model, tmp_path, "train", server.url, env={"KILL_RANK_1_AT_STEP": "2"})
    assert killed.returncode != 0
    assert [w["dump"].split(".tmp-")[0] for w in writes(tmp_path, 1)][-1] == ".step-2"  # died inside step 2's dump
    weights = tmp_path / "weights"
    assert not (weights / "step-2").exists()  # nothing published ...
    (leftover,) = weights.glob(".step-2.tmp-*")  # ... the half-written dump is a hidden temporary directory
    assert (tmp_path / "checkpoint-1").is_dir() and not (tmp_path / "checkpoint-2").exists()
    client = SGLangClient(server.url)
    assert client.weight_version() == "1"

    resumed = launch(tiny_model, tmp_path, "train", server.url)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert json.loads((tmp_path / "zero3.json").read_text())["global_step"] == 3
    assert "a weight dump a crash left unfinished" in resumed.stderr and str(leftover) in resumed.stderr
    assert not list(weights.glob(".*")) and client.weight_version() == "3"
    log = [json.loads(line) for line in (tmp_path / "weight_sync.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log][-2:] == [2, 3]
    check_manifest(weights / "step-3", checksums=True)
    restore_default_weights(server.url, tiny_model)


@pytest.mark.parametrize("mode", ["sync", "in-flight"])
def test_zero3_distributed_sync_sends_from_the_main_process_one_gathered_bucket_at_a_time(tiny_model, server, tmp_path,
                                                                                       mode):
    """`transport: distributed` under ZeRO-3 on 2 processes: both gather each bucket (the dump's walk), only the main
    process broadcasts them, and the server ends on exactly the final policy. With in-flight updates the main process
    stages the gathered buckets and its update thread broadcasts them beside training."""
    result = launch(tiny_model, tmp_path, "distributed", server.url, *(["in-flight"] if mode == "in-flight" else []))
    assert result.returncode == 0, result.stderr[-5000:]
    main, other = (json.loads((tmp_path / f"zero3-{rank}.json").read_text()) for rank in (0, 1))
    assert main["stage"] == 3 and main["broadcaster"] and not other["broadcaster"]
    assert main["buckets"] > 4 and main["sent"] == list(range(main["buckets"])) * 2  # every bucket, every sync
    assert other["sent"] == []
    if mode == "in-flight":  # each process kept its own prompts in flight; every group it trained logged once
        log = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
        trained = Counter((e["process"], e["epoch"], *e["group"]) for e in log if not e.get("dropped"))
        assert {process for process, *_ in trained} == {0, 1} and set(trained.values()) == {1}, log
        steps = Counter(e["step"] for e in log if not e.get("dropped"))
        assert set(steps) == {1, 2} and steps[1] == steps[2], log
    client = SGLangClient(server.url)
    assert client.weight_version() == "2" and [p.name for p in (tmp_path / "weights").iterdir()] == ["step-99"]
    sequences = [[5, 6, 7, 8, 9], [10, 11, 12]]
    sent = client.ref_logprobs(sequences)
    client.update_weights_from_disk(main["final"], weight_version="final")
    assert all(torch.equal(x, y) for x, y in zip(sent, client.ref_logprobs(sequences)))
    restore_default_weights(server.url, tiny_model)
