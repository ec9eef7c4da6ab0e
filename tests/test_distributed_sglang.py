"""Weight sync over the network (`sync.transport: distributed`, issue #22) against real SGLang 0.5.23 on the CPU
(gloo): a broadcast loads exactly what a dump loads; a tiny run on a pool of SGLang and a built-in server ends with
both serving exactly the final policy; a resumed run, and SGLang losing the weights mid-run, get them sent before it
samples again; a trainer killed mid-broadcast, a stalled broadcaster and a wrong address end
in bounded time with SGLang serving again (and taking the next trainer's group); a server killed between two buckets
fails alone. The module's SGLang server is killed by its last test."""

import json
import signal
import time
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext import weight_broadcast
from open_r1_ext.launch.local_server import BuiltinServer
from open_r1_ext.sglang_client import SGLangClient
from open_r1_ext.weight_broadcast import WeightBroadcast
from tests.helpers import restore_default_weights, reward_len, tiny_config, tiny_dataset
from tests.weight_buckets import (before_broadcast, kill_trainer_mid_broadcast, same, send_model, served_logprobs,
                                  stop_process)


@pytest.fixture(scope="module")
def builtin(tiny_model):
    with BuiltinServer(str(tiny_model)) as srv:
        yield srv


def log_says(server, text: str, within_s: float = 60.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if text in Path(server.log_path).read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


def test_sglang_takes_a_broadcast_exactly_as_a_dump(sglang_server, tiny_model, other_tiny_model):
    url = sglang_server.url
    restore_default_weights(url, other_tiny_model)
    dumped = served_logprobs(url)
    restore_default_weights(url, tiny_model)
    assert not same(served_logprobs(url), dumped)
    assert send_model([url], other_tiny_model, "v1", buckets=3) == {url: None}
    client = SGLangClient(url)
    assert client.weight_version() == "v1" and same(served_logprobs(url), dumped)
    restore_default_weights(url, tiny_model)


def test_a_tiny_run_on_sglang_and_a_builtin_replica_ends_with_both_serving_the_final_policy(sglang_server, builtin,
                                                                                           tiny_model, tmp_path):
    urls = [sglang_server.url, builtin.url]
    args = tiny_config(tmp_path, max_steps=3, per_device_train_batch_size=8, beta=0.0, generation_url=urls,
                       transport="distributed")
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    trainer.train()
    assert not (tmp_path / "weights").exists()
    trainer.save_model(str(tmp_path / "final"))
    for url in urls:
        client = SGLangClient(url)
        assert client.weight_version() == "3"
        sent = served_logprobs(url)
        client.update_weights_from_disk(str(tmp_path / "final"), weight_version="final")
        assert same(sent, served_logprobs(url)), url  # what the broadcasts left is exactly the final policy
        restore_default_weights(url, tiny_model)


class LoseWeightsAt(TrainerCallback):
    """After optimizer step `step`, the server at `url` goes back to its start-up weights and version, as after a
    restart (the process itself stays: a real restart is tested on the built-in server)."""

    def __init__(self, url: str, model, step: int):
        self.url, self.model, self.step = url, model, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            restore_default_weights(self.url, self.model)


def test_a_resumed_run_and_a_server_that_lost_the_weights_get_them_sent(sglang_server, tiny_model, tmp_path):
    """2 steps with a checkpoint; SGLang back on its start-up weights; the run resumed to 4, SGLang losing the weights
    again after step 3: each time it is sent the trainer's weights before it samples, and ends on the final policy."""
    url = sglang_server.url
    settings = dict(per_device_train_batch_size=8, beta=0.0, generation_url=url, transport="distributed",
                    save_strategy="steps", save_steps=2)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, train_dataset=tiny_dataset(),
                                args=tiny_config(tmp_path, max_steps=2, **settings))
    trainer.train()
    restore_default_weights(url, tiny_model)
    resumed = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, train_dataset=tiny_dataset(),
                                args=tiny_config(tmp_path, max_steps=4, **settings))
    resumed.add_callback(LoseWeightsAt(url, tiny_model, step=3))  # after the sync of step 3: caught up at step 4
    sends = []
    send = resumed.weight_sync.send
    resumed.weight_sync.send = lambda *a, **k: sends.append((a[1], k.get("only"))) or send(*a, **k)
    resumed.train(resume_from_checkpoint=True)
    assert sends == [(2, None), (3, None), (3, [url]), (4, None)]  # resume; sync 3; its catch-up; sync 4
    rollouts = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [(e["step"], e["weight_version"], e["staleness"]) for e in rollouts[2:]] == [(3, 2, 0), (4, 3, 0)]
    client = SGLangClient(url)
    assert client.weight_version() == "4"
    sent = served_logprobs(url)
    resumed.save_model(str(tmp_path / "final"))
    client.update_weights_from_disk(str(tmp_path / "final"), weight_version="final")
    assert same(sent, served_logprobs(url))
    restore_default_weights(url, tiny_model)


def test_a_trainer_killed_mid_broadcast_leaves_sglang_serving_and_the_next_one_updates_it(sglang_server, tiny_model,
                                                                                          other_tiny_model, tmp_path):
    url = sglang_server.url
    kill_trainer_mid_broadcast(url, other_tiny_model, "v2", tmp_path)
    assert log_says(sglang_server, "Failed to receive weights")  # it was receiving; its broadcaster died with it
    client = SGLangClient(url)
    client.wait_until_healthy(timeout=60, progress=False)
    assert client.generate([[1, 2, 3]], {"max_new_tokens": 2})
    assert client.weight_version() == "v2-partial"  # bucket 1 went in: mixed weights, and it says so
    assert client.post_once("/begin_weight_update", {}, timeout=30)["message"].startswith(
        "a weight-update session is already open")  # the dead trainer's session ...
    assert client.post_once("/end_weight_update", {}, timeout=30)["success"]  # (what the next trainer closes first)
    assert send_model([url], tiny_model, "default") == {url: None}  # ... and a new group under the dead one's name
    restore_default_weights(url, tiny_model)
    expected = served_logprobs(url)
    assert send_model([url], tiny_model, "v3") == {url: None} and same(served_logprobs(url), expected)
    restore_default_weights(url, tiny_model)


def test_a_stalled_broadcaster_is_killed_and_sglang_serves_again(sglang_server, tiny_model, other_tiny_model,
                                                                 monkeypatch):
    url = sglang_server.url
    monkeypatch.setattr(weight_broadcast, "DEADLINE_MARGIN_S", 1.0)
    with before_broadcast(2, stop_process):  # the broadcaster stalls in bucket 2
        outcome = send_model([url], other_tiny_model, "v4", timeout_s=4)
    assert url in str(outcome[url]) and "did not finish broadcast within 5 s" in str(outcome[url])
    client = SGLangClient(url)
    client.wait_until_healthy(timeout=60, progress=False)  # SGLang's scheduler was blocked until the kill
    assert client.generate([[1, 2, 3]], {"max_new_tokens": 2}) and client.weight_version() == "v4-partial"
    assert send_model([url], tiny_model, "default") == {url: None}


def test_a_wrong_master_address_is_refused_before_sglang_is_asked(sglang_server):
    url = sglang_server.url
    sender = WeightBroadcast("gloo", torch.device("cpu"), timeout_s=5, master_address="192.0.2.254")
    update = sender.update([SGLangClient(url)], "v5", 1)
    assert "192.0.2.254: not an address of this machine" in str(update.failed[url])
    client = SGLangClient(url)
    assert client.post_once("/destroy_weights_update_group", {"group_name": weight_broadcast.group_name_for(url)},
                            timeout=30)["message"] == "The group to be destroyed does not exist."
    assert client.weight_version() == "default" and client.generate([[1, 2, 3]], {"max_new_tokens": 2})


def test_sglang_killed_between_two_buckets_fails_alone(sglang_server, builtin, other_tiny_model, tiny_model):
    """Last in the module: it kills the module's SGLang server."""
    try:
        with before_broadcast(2, lambda _: sglang_server.stop(signal.SIGKILL)):  # injected fault: dies after bucket 1
            outcome = send_model([sglang_server.url, builtin.url], other_tiny_model, "v6", buckets=3)
    finally:
        sglang_server.stop()
    assert outcome[builtin.url] is None and SGLangClient(builtin.url).weight_version() == "v6"
    assert sglang_server.url in str(outcome[sglang_server.url]) and "bucket 2/3" in str(outcome[sglang_server.url])
    restore_default_weights(builtin.url, tiny_model)
