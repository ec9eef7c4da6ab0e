"""Weight sync over the network (`sync.transport: distributed`, issue #22) on the built-in server: SGLang 0.5.23's
five routes and their answers, a broadcast that loads exactly what a dump loads, tiny runs (one server, a resume,
two replicas, one killed mid-run and brought back), and every fault ending in bounded time with the server serving
again. Each fault is real: a trainer process SIGKILLed mid-broadcast, a broadcaster SIGSTOPped, a server SIGKILLed
between two buckets, a group at an address or port that goes nowhere. The same against real SGLang:
tests/test_distributed_sglang.py. NCCL cannot run here (no GPU): its test covers what can, named as such."""

import json
import signal
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.launch.local_server import BuiltinServer, free_port
from open_r1_ext.config.recipe import RecipeError, load_recipe
from open_r1_ext.protocol import init_weights_update_group_request, update_weights_from_distributed_request
from open_r1_ext.server_pool import ServerPool
from open_r1_ext.sglang_client import SGLangClient
from open_r1_ext.config.grpo_config import RemoteGRPOConfig
from open_r1_ext import weight_broadcast
from open_r1_ext.weight_broadcast import WeightBroadcast, WeightUpdate, resolve_backend
from tests.fake_sglang import FakeSGLang
from tests.helpers import (KillServerAt, WaitAt, gone, reward_len, restore_default_weights, tiny_config, tiny_dataset,
                           tiny_recipe)
from tests.weight_buckets import (before_broadcast, kill_trainer_mid_broadcast, same, send_model, served_logprobs,
                                  stop_process)


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory):
    """Two built-in servers on the tiny model (`--weight-update-timeout 6`), shared by the module; tests that change
    their weights put them back."""
    logs = tmp_path_factory.mktemp("dist-logs")
    servers = [BuiltinServer(str(tiny_model), log_path=str(logs / f"{name}.log"),
                             extra_args=("--weight-update-timeout", "6")) for name in "ab"]
    for server in servers:
        server.start()
    yield servers
    for server in servers:
        server.stop()


def post(url: str, route: str, body: dict) -> tuple[int, dict]:
    answer = requests.post(url + route, json=body, timeout=60)
    return answer.status_code, answer.json()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------- the routes
def test_the_builtin_server_answers_the_weight_update_routes_as_sglang(pair):
    url = pair[0].url
    assert post(url, "/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}) == (
        400, {"success": False, "message": "update_weights_from_distributed must run between begin_weight_update() "
                                           "and end_weight_update()"})
    assert post(url, "/end_weight_update", {}) == (
        400, {"success": False, "message": "no weight-update session is open; call begin_weight_update() first"})
    assert post(url, "/begin_weight_update", {}) == (200, {"success": True, "message": "Success"})
    assert post(url, "/begin_weight_update", {}) == (
        400, {"success": False, "message": "a weight-update session is already open; call end_weight_update() first"})
    status, answer = post(url, "/update_weights_from_distributed",
                          {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"})
    assert status == 400 and answer["message"].startswith("Failed to receive weights: ") and "Group nope not in []" in answer["message"]
    assert post(url, "/end_weight_update", {}) == (200, {"success": True, "message": "Success"})
    assert post(url, "/destroy_weights_update_group", {"group_name": "nope"}) == (
        400, {"success": False, "message": "The group to be destroyed does not exist."})
    # SGLang's default backend is nccl: on a CPU server a clear refusal, at once
    status, answer = post(url, "/init_weights_update_group", init_weights_update_group_request(
        "127.0.0.1", free_port(), 1, 2, "g", "nccl"))
    assert status == 400 and "backend nccl needs the server on a GPU" in answer["message"]
    status, answer = post(url, "/init_weights_update_group", init_weights_update_group_request(
        "127.0.0.1", free_port(), 2, 2, "g", "gloo"))
    assert status == 400 and "rank_offset 2 is not below world_size 2" in answer["message"]
    # a malformed body: 400 naming the field (nothing is received, no broadcast is waited for)
    status, answer = post(url, "/update_weights_from_distributed", {"names": ["x", "y"], "dtypes": ["float32"],
                                                                     "shapes": [[1]]})
    assert status == 400 and "one entry per tensor: 2, 1 and 1" in answer["error"]["message"]
    status, answer = post(url, "/init_weights_update_group", {"master_address": "h", "master_port": 0, "rank_offset": 1,
                                                               "world_size": 2})
    assert status == 400 and "master_port" in answer["error"]["message"]
    assert SGLangClient(url).is_healthy()


def test_a_group_the_server_cannot_join_fails_within_its_timeout(pair, tmp_path):
    """The built-in server bounds a group's formation by --weight-update-timeout (6 s here; SGLang waits torch's 30
    minutes): nothing listens at the port it is given. It serves meanwhile and afterwards."""
    url = pair[1].url
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(zip(("status", "body"), post(
        url, "/init_weights_update_group", init_weights_update_group_request("127.0.0.1", free_port(), 1, 2, "g", "gloo")))))
    thread.start()
    assert SGLangClient(url).generate([[1, 2, 3]], {"max_new_tokens": 2})  # generation goes on while it waits
    thread.join(120)
    assert answer["status"] == 400
    assert answer["body"]["message"].startswith("Failed to initialize custom process group: ")


# ------------------------------------------------------------------------------------------ exactness
def test_a_broadcast_loads_exactly_what_a_dump_loads(pair, tiny_model, other_tiny_model):
    a, b = (server.url for server in pair)
    restore_default_weights(b, other_tiny_model)
    dumped = served_logprobs(b)
    assert not same(served_logprobs(a), dumped)  # (other weights: the comparison below can fail)
    sender = WeightBroadcast("gloo", torch.device("cpu"), timeout_s=60)
    partial = []
    send = WeightUpdate.send

    def watching(self, index, tensors):  # after each bucket, the server says it holds no whole version
        send(self, index, tensors)
        partial.append(SGLangClient(a).weight_version())

    WeightUpdate.send = watching
    try:
        assert send_model([a], other_tiny_model, "v7", buckets=3, sender=sender) == {a: None}
    finally:
        WeightUpdate.send = send
    assert partial == ["v7-partial", "v7-partial", "v7"]
    assert SGLangClient(a).weight_version() == "v7" and same(served_logprobs(a), dumped)
    # the group stays formed: a second update needs no new one, and sends the original weights back
    assert send_model([a], tiny_model, "default", sender=sender) == {a: None}
    restore_default_weights(b, tiny_model)
    assert same(served_logprobs(a), served_logprobs(b))
    assert len(sender.broadcaster.groups) == 1
    sender.close()


# ---------------------------------------------------------------------------------------------- runs
def test_a_tiny_run_sends_every_sync_over_the_network_and_a_resume_sends_its_weights_first(tiny_model, tmp_path):
    """3 steps, then a resume to 5 against a server that restarted meanwhile: nothing is dumped, each sync is logged
    with no path, and the server ends holding exactly the trainer's final policy (what a dump of it loads)."""
    with BuiltinServer(str(tiny_model)) as srv:
        settings = dict(generation_url=srv.url, ref_model_url=f"{srv.url}/ref", transport="distributed",
                        save_strategy="steps", save_steps=3)
        trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, train_dataset=tiny_dataset(),
                                    args=tiny_config(tmp_path, max_steps=3, **settings))
        trainer.train()
        assert SGLangClient(srv.url).weight_version() == "3"
        assert not (tmp_path / "weights").exists()  # no dump, not even a directory: 0 bytes on the sync file system
        assert [(e["step"], e["path"]) for e in read_jsonl(tmp_path / "weight_sync.jsonl")] == [(1, None), (2, None), (3, None)]
        restore_default_weights(srv.url, tiny_model)  # as a restarted server: its start-up weights

        resumed = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, train_dataset=tiny_dataset(),
                                    args=tiny_config(tmp_path, max_steps=5, **settings))
        resumed.train(resume_from_checkpoint=True)
        assert [h["step"] for h in resumed.state.log_history if "loss" in h] == [1, 2, 3, 4, 5]  # (3 restored)
        assert [e["step"] for e in read_jsonl(tmp_path / "weight_sync.jsonl")] == [1, 2, 3, 4, 5]
        client = SGLangClient(srv.url)
        assert client.weight_version() == "5"
        assert all(e["weight_version"] >= 3 and e["staleness"] == 0 for e in read_jsonl(tmp_path / "rollouts.jsonl")[3:])
        sent = served_logprobs(srv.url)
        resumed.save_model(str(tmp_path / "final"))
        client.update_weights_from_disk(str(tmp_path / "final"), weight_version="final")
        assert same(sent, served_logprobs(srv.url))


def test_async_generation_sends_each_sync_from_the_training_thread(pair, tiny_model, tmp_path):
    """With the rollout thread generating beside it, each sync is sent at the step (not queued behind the read-ahead
    batches): batches stay within the staleness bound, nothing is dumped, and the server ends on the final policy."""
    url = pair[1].url
    args = tiny_config(tmp_path, max_steps=4, generation_url=url, ref_model_url=f"{url}/ref", transport="distributed",
                       async_generation=True)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    trainer.train()
    assert [e["step"] for e in read_jsonl(tmp_path / "weight_sync.jsonl")] == [1, 2, 3, 4]
    assert all(e["staleness"] <= 1 for e in read_jsonl(tmp_path / "rollouts.jsonl"))
    assert not (tmp_path / "weights").exists() and SGLangClient(url).weight_version() == "4"
    sent = served_logprobs(url)
    trainer.save_model(str(tmp_path / "final"))
    SGLangClient(url).update_weights_from_disk(str(tmp_path / "final"), weight_version="final")
    assert same(sent, served_logprobs(url))
    restore_default_weights(url, tiny_model)


def test_two_replicas_take_every_sync_and_one_killed_mid_run_catches_up(pair, tiny_model, tmp_path, monkeypatch):
    """A pool of a shared server and one killed after step 1 and started again on its port at the end of step 2 (the
    run waits for the pool to find it back): it comes back without the weights, is sent them at the start of the next
    batch (never sampled from before), and serves again; both end on the final policy."""
    monkeypatch.setattr("open_r1_ext.server_pool.RESCAN_INTERVAL", 0.2)
    a = pair[0]
    c = BuiltinServer(str(tiny_model)).start()
    killer = KillServerAt(c, step=1, restart_at=2)
    try:
        args = tiny_config(tmp_path, max_steps=5, per_device_train_batch_size=8, generation_url=[a.url, c.url],
                           ref_model_url=f"{a.url}/ref", transport="distributed")
        trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args,
                                    train_dataset=tiny_dataset(), callbacks=[killer])
        pool = trainer.remote_generation.client
        trainer.add_callback(WaitAt(2, lambda: c.url in pool.behind(), f"{c.url} back, waiting for the weights"))
        trainer.train()
        assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3, 4, 5]
        rollouts = read_jsonl(tmp_path / "rollouts.jsonl")
        assert all(e["staleness"] == 0 for e in rollouts)  # no batch sampled from other weights
        assert rollouts[1]["replicas"] == [a.url, a.url]  # step 2: c is gone
        assert c.url in rollouts[2]["replicas"]  # sent the weights at the start of step 3: it serves again
        syncs = {e["step"]: sorted(e["replicas"]) for e in read_jsonl(tmp_path / "weight_sync.jsonl")}
        assert syncs[1] == [a.url] and syncs[5] == sorted([a.url, c.url])
        assert SGLangClient(a.url).weight_version() == SGLangClient(c.url).weight_version() == "5"
        assert same(served_logprobs(a.url), served_logprobs(c.url))
    finally:
        killer.stop()
        restore_default_weights(a.url, tiny_model)


# --------------------------------------------------------------------------------------------- faults
def test_a_trainer_killed_mid_broadcast_leaves_the_server_serving_and_the_next_one_updates_it(pair, tiny_model,
                                                                                              other_tiny_model, tmp_path):
    url = pair[0].url
    broadcaster = kill_trainer_mid_broadcast(url, other_tiny_model, "v1", tmp_path)
    client = SGLangClient(url)
    assert client.generate([[1, 2, 3]], {"max_new_tokens": 2})  # it serves
    deadline = time.monotonic() + 60
    while "Failed to receive weights" not in Path(pair[0].log_path).read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "Failed to receive weights" in Path(pair[0].log_path).read_text()  # it was receiving, and stopped
    # the broadcaster dies with its trainer (PR_SET_PDEATHSIG); the server may notice the trainer's closed connection
    # first, so the broadcaster can still be exiting at that moment
    assert gone(broadcaster, within_s=30)
    assert client.weight_version() == "v1-partial"  # bucket 1 went in: mixed weights, and it says so
    assert post(url, "/begin_weight_update", {})[0] == 400  # the dead trainer's session is still open ...
    assert send_model([url], tiny_model, "default") == {url: None}  # ... the next trainer closes it and updates
    assert client.weight_version() == "default" and same(served_logprobs(url), served_logprobs(pair[1].url))


def test_a_stalled_broadcaster_is_killed_at_its_deadline_and_the_server_recovers(pair, tiny_model, other_tiny_model,
                                                                                 monkeypatch):
    url = pair[0].url
    monkeypatch.setattr(weight_broadcast, "DEADLINE_MARGIN_S", 1.0)
    with before_broadcast(2, stop_process):  # the broadcaster stalls in bucket 2
        outcome = send_model([url], other_tiny_model, "v2", timeout_s=3)
    error = str(outcome[url])
    assert url in error and "did not finish broadcast within 4 s" in error and "killed it" in error
    client = SGLangClient(url)
    client.wait_until_healthy(timeout=60, progress=False)
    assert client.generate([[1, 2, 3]], {"max_new_tokens": 2}) and client.weight_version() == "v2-partial"
    assert send_model([url], tiny_model, "default") == {url: None}  # a new broadcaster, a new group
    assert client.weight_version() == "default"


def test_a_server_killed_between_two_buckets_fails_alone(pair, tiny_model, other_tiny_model):
    a = pair[1]
    doomed = BuiltinServer(str(tiny_model)).start()
    try:
        with before_broadcast(2, lambda _: doomed.stop(signal.SIGKILL)):  # injected fault: it dies after bucket 1
            outcome = send_model([a.url, doomed.url], other_tiny_model, "v3", buckets=3)
    finally:
        doomed.stop()
        doomed.stop()
    assert outcome[a.url] is None and SGLangClient(a.url).weight_version() == "v3"
    assert doomed.url in str(outcome[doomed.url]) and "bucket 2/3" in str(outcome[doomed.url])
    restore_default_weights(a.url, tiny_model)


def test_a_group_that_cannot_form_is_refused_or_times_out_naming_the_server(pair, tiny_model):
    url = pair[1].url
    # an address that is not this machine's: refused before the server is asked to go there
    sender = WeightBroadcast("gloo", torch.device("cpu"), timeout_s=3, master_address="192.0.2.254")
    update = sender.update([SGLangClient(url)], "v4", 1)
    assert "sync.distributed_master_address 192.0.2.254: not an address of this machine" in str(update.failed[url])
    assert post(url, "/destroy_weights_update_group", {"group_name": weight_broadcast.group_name_for(url)})[0] == 400
    # a server that never joins (a stand-in: its init never returns, as SGLang's behind a firewall): bounded
    with FakeSGLang() as fake:
        answer = fake._answer

        def never_joins(method, path, body):
            if path == "/init_weights_update_group":
                time.sleep(30)
            return answer(method, path, body) if path in ("/model_info", "/server_info", "/health") else (
                400, {"success": False, "message": "(stand-in)"})

        fake._answer = never_joins
        update = WeightBroadcast("gloo", torch.device("cpu"), timeout_s=3).update([SGLangClient(fake.url)], "v4", 1)
        error = str(update.failed[fake.url])
        assert f"could not form the weight-update group with {fake.url}" in error and "timeout 3 s" in error
        # SGLang asserts (HTTP 500) on dp_size > 1: refused before anything is sent (the stand-in reports dp_size 2)
        info = fake.server_info
        fake.server_info = lambda: {**info(), "dp_size": 2}
        update = WeightBroadcast("gloo", torch.device("cpu")).update([SGLangClient(fake.url)], "v4", 1)
        assert "runs dp_size 2: SGLang refuses distributed weight updates" in str(update.failed[fake.url])
    assert SGLangClient(url).weight_version() == "default"


def test_samples_labelled_partial_are_never_used():
    """A server in the middle of an update (or stopped half-way) labels what it samples `<N>-partial`: the pool sends
    that part to another replica (stand-in servers: the label on demand)."""
    with FakeSGLang() as a, FakeSGLang() as b:
        a.weight_version = "3-partial"
        pool = ServerPool([a.url, b.url], replica_max_retries=0)
        pool.generate([[1, 2], [3, 4], [5, 6], [7, 8]], {"max_new_tokens": 2})
        assert pool.served_by() == [b.url] * 4


# ------------------------------------------------------------------------------------- settings, NCCL
def test_nccl_is_chosen_on_gpus_and_named_in_the_requests():
    """NCCL cannot run here (no GPU): what can is checked: the backend choice and the bodies SGLang gets
    (tools/gpu_check.sh runs the NCCL transport on a GPU machine)."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_backend("auto", cuda, ["cuda", None]) == "nccl"
    assert resolve_backend("auto", cuda, ["cpu"]) == "gloo"  # a server that says it runs on the CPU
    assert resolve_backend("auto", cpu, ["cuda"]) == "gloo" and resolve_backend("nccl", cpu, []) == "nccl"
    assert init_weights_update_group_request("10.0.0.1", 29500, 1, 9, "g", "nccl") == {
        "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 9, "group_name": "g",
        "backend": "nccl"}
    assert update_weights_from_distributed_request(["w"], ["bfloat16"], [[2, 3]], "g", "7", flush_cache=True) == {
        "names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 3]], "group_name": "g", "flush_cache": True,
        "load_format": "flattened_bucket", "weight_version": "7"}
    with pytest.raises(ValueError, match="backend 'mpi': gloo or nccl"):
        WeightBroadcast("mpi", cpu)


def test_a_bucket_of_mixed_types_is_laid_out_aligned():
    tensors = {"half": torch.ones(3, dtype=torch.bfloat16), "full": torch.ones(3), "byte": torch.ones(1, dtype=torch.uint8),
               "double": torch.ones(1, dtype=torch.float64)}
    layout = weight_broadcast.layout_of(tensors)
    assert layout.names == ["double", "full", "half", "byte"] and layout.offsets == [0, 8, 20, 26]
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    weight_broadcast.flatten_into(buffer, tensors, layout)
    _, views = weight_broadcast.empty_bucket(layout.names, layout.dtypes, layout.shapes, torch.device("cpu"))
    with pytest.raises(ValueError, match="Unaligned received tensor full: byte offset 6"):
        weight_broadcast.empty_bucket(["half", "full"], ["bfloat16", "float32"], [[3], [3]], torch.device("cpu"))


@pytest.mark.parametrize("overrides, key, message", [
    (["sync.transport=network"], "sync.transport", "choose one of disk, distributed"),
    (["sync.transport=distributed", "servers.generation={engine: sglang, dp_size: 2, resources: {gpus_per_node: 2}}",
      "servers.reference=local"], "servers.generation.dp_size", "SGLang refuses distributed weight updates"),
    (["sync.transport=distributed", "servers.generation=local"], "sync.transport", "generation: local runs none"),
    (["sync.transport=distributed", "sync.distributed_timeout=0"], "sync.distributed_timeout", "must be > 0"),
])
def test_the_recipe_checks_the_transport(tmp_path, tiny_model, overrides, key, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(tiny_recipe(tmp_path, tiny_model), overrides)
    assert any(k == key and message in m for k, m in err.value.problems), err.value.problems


def test_the_config_refuses_the_transport_where_it_cannot_work(tmp_path):
    with pytest.raises(ValueError, match="an OpenAI-compatible server has no distributed weight update"):
        RemoteGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], transport="distributed",
                         generation_url="http://h:1", generation_backend="openai")
    config = load_recipe(tiny_recipe(tmp_path, Path("/nonexistent")), ["sync.transport=distributed",
                                                                       "sync.distributed_port=29600"],
                         check_paths=False).trainer_config("http://h:1", "http://h:1/ref", on_this_machine=False)
    assert (config.transport, config.distributed_port, config.distributed_backend) == ("distributed", 29600, "auto")
