"""The replica pool (`open_r1_ext.server_pool.ServerPool`, issue #12, trainer side).

The spreading, failover, joining and weight-tracking logic runs against stand-in SGLang servers (tests/fake_sglang.py:
real HTTP, a fixed function of the prompt, every call recorded; replicas that go down, come back or reload slowly on
demand, which real SGLang processes cannot be made to do from outside); the training runs use real built-in servers;
replicas paused (`/pause_generation`, under which SGLang's `/health` hangs) run on both servers, SGLang's real.
"""

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from open_r1_ext import RemoteGRPOTrainer, cli
from open_r1_ext.config.recipe import load_recipe
from open_r1_ext.launch.local_server import BuiltinServer, SGLangServer
from open_r1_ext.server_pool import NoReplicaError, ServerPool
from open_r1_ext.sglang_client import ServerError, ServerRequestError, SGLangClient
from open_r1_ext.train import pool_settings
from tests.fake_sglang import FakeSGLang
from tests.helpers import (KillServerAt, WaitAt, read_jsonl, restore_default_weights, reward_len, served, synced,
                           tiny_config, tiny_dataset, tiny_recipe)

SAMPLING = {"max_new_tokens": 4, "temperature": 1.0}


def generate_bodies(fake: FakeSGLang) -> list[dict]:
    return [body for method, path, body, _ in fake.calls if path == "/generate"]


def prompts_seen(fake: FakeSGLang) -> list[tuple[int, ...]]:
    return [tuple(ids) for body in generate_bodies(fake) for ids in body["input_ids"]]


def down(fake: FakeSGLang) -> None:
    """The stand-in answers 503 on every route, /health included (a server that is gone)."""
    fake._answer = lambda method, path, body: (503, {"error": {"message": "gone"}})


def write_address(directory: Path, name: str, url: str) -> None:
    """As a server job does: `host:port` written to a temporary file, then renamed into place."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{name}.addr.tmp"
    tmp.write_text(url.removeprefix("http://") + "\n")
    tmp.rename(directory / f"{name}.addr")


def test_samples_of_a_prompt_stay_on_one_replica_and_the_batch_spreads():
    prompts = [[i + 1, i + 2, i + 3] for i in range(6)]
    seeds = list(range(6 * 3))
    with FakeSGLang() as a, FakeSGLang() as b, FakeSGLang() as single:
        pool = ServerPool([a.url, b.url])
        groups = pool.generate(prompts, SAMPLING, n=3, seeds=seeds)
        alone = SGLangClient(single.url).generate(prompts, SAMPLING, n=3, seeds=seeds)
        served = pool.served_by()
    assert groups == alone  # in input order, whatever replica answered
    for fake in (a, b):
        seen = prompts_seen(fake)
        assert seen, "both replicas serve a part of the batch"
        assert all(seen.count(p) == 3 for p in set(seen))  # a prompt's 3 samples together
        for body in generate_bodies(fake):  # and their own seeds
            assert sorted(p["sampling_seed"] for p in body["sampling_params"]) == sorted(
                seeds[prompts.index(list(ids)) * 3 + k] for ids in dict.fromkeys(map(tuple, body["input_ids"]))
                for k in range(3))
    assert set(prompts_seen(a)).isdisjoint(prompts_seen(b))
    assert [a.url if tuple(p) in prompts_seen(a) else b.url for p in prompts] == served
    assert sorted(served.count(url) for url in (a.url, b.url)) == [3, 3]  # equal prompts: equal shares


def test_work_goes_to_the_replica_with_the_fewest_outstanding_tokens():
    with FakeSGLang() as a, FakeSGLang() as b:
        release, busy = threading.Event(), threading.Event()

        def held(fake):  # the first request (to either) stays in flight until released
            answer = fake.generate

            def generate(body):
                if not busy.is_set():
                    busy.set()
                    release.wait(10)
                return answer(body)
            return generate

        a.generate, b.generate = held(a), held(b)
        pool = ServerPool([a.url, b.url])
        first = threading.Thread(target=pool.generate, args=([[1] * 50], SAMPLING))
        first.start()
        assert busy.wait(10)
        holding = a if prompts_seen(a) else b
        pool.generate([[7, 8], [9, 10], [11, 12]], SAMPLING)
        assert pool.served_by() == [(b if holding is a else a).url] * 3  # the other holds no tokens in flight
        release.set()
        first.join(10)
        assert prompts_seen(holding) == [tuple([1] * 50)]


def test_a_failing_replica_is_dropped_and_its_part_sent_to_the_others():
    prompts = [[i, i + 1] for i in range(1, 5)]
    with FakeSGLang() as a, FakeSGLang() as b:
        pool = ServerPool([a.url, b.url], replica_max_retries=0)
        pool.wait_until_healthy(timeout=10)
        down(a)
        groups = pool.generate(prompts, SAMPLING, n=2, seeds=list(range(8)))
        assert pool.served_by() == [b.url] * 4
        assert pool.replicas() == {a.url: "dropped", b.url: "serving"}
        assert groups == SGLangClient(b.url).generate(prompts, SAMPLING, n=2, seeds=list(range(8)))
        assert [len(s) for s in pool.ref_logprobs([[1, 2, 3], [4, 5]])] == [2, 1]  # from b alone


def test_below_min_replicas_waits_then_names_the_lost_replica():
    with FakeSGLang() as a, FakeSGLang() as b:
        pool = ServerPool([a.url, b.url], min_replicas=2, wait_timeout=1.5, replica_max_retries=0)
        pool.wait_until_healthy(timeout=10)
        down(b)
        start = time.monotonic()
        with pytest.raises(NoReplicaError) as err:
            pool.generate([[1, 2], [3, 4]], SAMPLING)  # a part for each
        assert 1.5 <= time.monotonic() - start < 10
    message = str(err.value)
    assert "1 of min_replicas 2 serving" in message and b.url in message and "503" in message


def test_a_replica_that_answers_again_rejoins_with_the_current_weights(monkeypatch):
    monkeypatch.setattr("open_r1_ext.server_pool.RESCAN_INTERVAL", 0.1)
    with FakeSGLang() as a, FakeSGLang() as b:
        pool = ServerPool([a.url, b.url], replica_max_retries=0)
        pool.update_weights_from_disk("/dumps/step-3", weight_version="3")
        serve = b._answer
        down(b)
        pool.update_weights_from_disk("/dumps/step-4", weight_version="4")  # b misses it and is dropped
        assert pool.replicas()[b.url] == "dropped" and b.weight_version == "3"
        b._answer = serve  # back
        deadline = time.monotonic() + 10
        while pool.replicas()[b.url] != "serving" and time.monotonic() < deadline:
            pool.generate([[1, 2]], SAMPLING)
            time.sleep(0.1)
        assert b.weight_version == "4" and pool.replicas_at("4") == [a.url, b.url]


def test_a_replica_busy_with_a_long_reload_stays_in_the_pool(monkeypatch):
    """Two trainer processes' pools find a replica restarted: one catches it up (a reload of 3 s); meanwhile the other
    probes it, and its `/health` answers 503 after a wait, as SGLang's does behind a long reload (its one-token
    generation waits for the scheduler). The replica stays in that pool (joining, never dropped), then serves from
    the weights the first pool loaded, without a second reload. A stand-in server (tests/fake_sglang.py): real
    SGLang reloads the tiny model in ~0.1 s, and nothing outside it makes a reload long without killing it."""
    monkeypatch.setattr("open_r1_ext.server_pool.RESCAN_INTERVAL", 0.1)
    with FakeSGLang(reload_s=3.0, busy_health_s=0.5) as a, FakeSGLang() as b:
        first, second = ServerPool([a.url, b.url]), ServerPool([a.url, b.url])
        first.update_weights_from_disk("/dumps/step-2", weight_version="2")
        second.expect_weights("/dumps/step-2", "2")
        a.weight_version = "default"  # restarted: its start-up weights
        catching_up = threading.Thread(target=first.weight_version)  # finds it behind, reloads it
        catching_up.start()
        assert a.reloading.wait(10)
        assert SGLangClient(a.url).probe(timeout=0.2) == "busy"  # taken, not answered within the time: busy too
        states = set()
        while a.reloading.is_set():
            second.weight_version()  # asks every replica: a reports "default", so it is caught up
            states.add(second.replicas()[a.url])
            time.sleep(0.1)
        catching_up.join()
        assert "joining" in states and "dropped" not in states
        deadline = time.monotonic() + 10
        while second.replicas()[a.url] != "serving" and time.monotonic() < deadline:
            second.generate([[1, 2]], SAMPLING)
            time.sleep(0.1)
        assert second.replicas_at("2") == [a.url, b.url]
        assert a.paths("POST").count("/update_weights_from_disk") == 2  # the pool's update, then one catch-up


def test_a_joiner_is_sent_the_adapters_the_pool_loaded_from_tensors(tmp_path, monkeypatch):
    """An adapter sent as tensors (`transport: distributed` with LoRA) is kept by the pool and sent, the same payload,
    to a replica that joins later, before it serves."""
    import torch

    from open_r1_ext.named_tensors import AdapterTensors, deserialize_named_tensors

    monkeypatch.setattr("open_r1_ext.server_pool.RESCAN_INTERVAL", 0.1)
    addresses = tmp_path / "replicas" / "server"
    tensors, config = {"x.lora_A.weight": torch.arange(6.0).reshape(2, 3)}, {"peft_type": "LORA", "r": 2}
    with FakeSGLang(enable_lora=True) as a, FakeSGLang(enable_lora=True) as b:
        write_address(addresses, "101", a.url)
        pool = ServerPool(directory=str(addresses))
        pool.wait_until_healthy(timeout=10)
        pool.load_lora_adapter_from_tensors("policy-v5", AdapterTensors.of(tensors, config))
        write_address(addresses, "102", b.url)
        deadline = time.monotonic() + 10
        while "102" not in (pool.served_by() or ()) and time.monotonic() < deadline:
            pool.generate([[1, 2], [3, 4]], SAMPLING, lora_path="policy-v5")
            time.sleep(0.05)
        assert "102" in pool.served_by() and pool.replicas_holding("policy-v5") == ["101", "102"]
        paths = b.paths("POST")
        assert paths.index("/load_lora_adapter_from_tensors") < paths.index("/generate")
        assert dict(b.adapters) == {"policy-v5": "__tensor__"}
        sent = deserialize_named_tensors(b.sent_adapters["policy-v5"][0])
        assert sent.keys() == tensors.keys() and torch.equal(sent["x.lora_A.weight"], tensors["x.lora_A.weight"])
        assert a.paths("POST").count("/load_lora_adapter_from_tensors") == 1  # sent once to the replica that had it


def test_a_joiner_is_brought_to_the_pools_weights_and_adapters_before_it_serves(tmp_path, monkeypatch):
    monkeypatch.setattr("open_r1_ext.server_pool.RESCAN_INTERVAL", 0.1)
    addresses, adapter = tmp_path / "replicas" / "server", tmp_path / "adapter"
    adapter.mkdir()
    with FakeSGLang(enable_lora=True) as a, FakeSGLang(enable_lora=True) as b:
        write_address(addresses, "101", a.url)
        pool = ServerPool(directory=str(addresses))
        pool.wait_until_healthy(timeout=10)
        assert pool.update_weights_from_disk("/dumps/step-5", weight_version="5")["replicas"] == {"101": "5"}
        pool.load_lora_adapter("policy-v5", str(adapter))
        write_address(addresses, "102", b.url)  # a new server job advertises itself
        deadline = time.monotonic() + 10
        while "102" not in (pool.served_by() or ()) and time.monotonic() < deadline:
            pool.generate([[1, 2], [3, 4]], SAMPLING, lora_path="policy-v5")
            time.sleep(0.05)
        assert "102" in pool.served_by()
        paths = b.paths("POST")
        assert paths.index("/update_weights_from_disk") < paths.index("/load_lora_adapter") < paths.index("/generate")
        assert b.weight_version == "5" and dict(b.adapters) == {"policy-v5": str(adapter)}
        assert pool.weight_version() == "5" and sorted(pool.replicas_at("5")) == ["101", "102"]

        (addresses / "101.addr").unlink()  # its job stopped: it leaves
        time.sleep(0.2)
        pool.generate([[1, 2], [3, 4]], SAMPLING, lora_path="policy-v5")
        assert pool.served_by() == ["102", "102"] and pool.replicas() == {"102": "serving"}


def test_a_restarted_replica_is_caught_up_and_not_served_from_until_then():
    with FakeSGLang() as a, FakeSGLang() as b:
        pool = ServerPool([a.url, b.url])
        pool.update_weights_from_disk("/dumps/step-2", weight_version="2")
        b.weight_version = "default"  # restarted: its start-up weights
        assert pool.weight_version() == "2"
        deadline = time.monotonic() + 10
        while b.weight_version != "2" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.weight_version == "2"
        b.weight_version = "default"  # restarted again, found by the weights its samples report
        pool.generate([[i, i] for i in range(1, 5)], SAMPLING)
        assert all(c.weight_version == "2" for group in pool.generate([[1, 1]], SAMPLING) for c in group)


def test_a_replica_that_never_answers_from_the_pools_weights_stops_the_batch(monkeypatch):
    monkeypatch.setattr("open_r1_ext.server_pool.MAX_ROUNDS", 3)
    with FakeSGLang() as a:
        pool = ServerPool([a.url])
        pool.update_weights_from_disk("/dumps/step-3", weight_version="3")
        a.weight_version = "default"  # its samples say so, while /model_info keeps saying 3
        reported = a.model_info
        a.model_info = lambda: {**reported(), "weight_version": "3"}
        with pytest.raises(ServerError, match="1 part.s. of a batch failed on every replica tried, 3 times"):
            pool.generate([[1, 2]], SAMPLING)


def test_a_pool_of_another_trainer_process_takes_the_main_processes_weights_as_its_own():
    with FakeSGLang() as a, FakeSGLang() as b:
        main, other = ServerPool([a.url, b.url]), ServerPool([a.url, b.url])
        other.generate([[1, 2], [3, 4]], SAMPLING)
        main.update_weights_from_disk("/dumps/step-3", weight_version="3")
        other.expect_weights("/dumps/step-3", "3")  # what WeightSync.confirm does on the other processes
        b.weight_version = "default"  # b restarted since
        groups = other.generate([[1, 2], [3, 4]], SAMPLING)
        assert {c.weight_version for group in groups for c in group} == {"3"} and b.weight_version == "3"
        assert [path for path in a.paths("POST") if path != "/generate"] == ["/update_weights_from_disk"]  # main's


def test_a_refused_reload_names_the_replica():
    with FakeSGLang() as a, FakeSGLang() as b:
        b.update_weights_from_disk = lambda body: (400, {"error": {"message": "cannot read the dump"}})
        pool = ServerPool([a.url, b.url])
        with pytest.raises(ServerRequestError, match=f"1 of 2 generation replica.*{b.url}.*cannot read the dump"):
            pool.update_weights_from_disk("/dumps/step-1", weight_version="1")


# ------------------------------------------------------------------ paused replicas (SGLang's /health hangs then)
def test_a_paused_replica_stays_in_the_pool_and_is_caught_up_while_paused(any_server, tiny_model, other_tiny_model,
                                                                          monkeypatch):
    """The pool pauses its replica (as in-flight updates do) and checks its health over several rescans: it serves
    on. Then it is reloaded behind the pool's back (another process, or a restart) while still paused: the pool probes
    it, catches it up, paused, and continues it. (SGLang's `/health` gives no answer while paused; the built-in
    server's answers, so there the pool would hold on without the fix too.)"""
    monkeypatch.setattr("open_r1_ext.server_pool.RESCAN_INTERVAL", 0.5)
    pool = ServerPool([any_server.url], wait_timeout=30, request_timeout=60)
    pool.update_weights_from_disk(str(tiny_model), weight_version="1")
    pool.pause_generation()
    start = time.monotonic()
    while time.monotonic() - start < 4 * 0.5:  # four rescan periods, each a health check of the paused replica
        assert pool.is_healthy(timeout=2.0)
        assert pool.replicas() == {any_server.url: "serving"}
    SGLangClient(any_server.url).update_weights_from_disk(str(other_tiny_model), weight_version="other")
    assert pool.weight_version() == "1"  # found behind, caught up while paused
    assert pool.replicas() == {any_server.url: "serving"}
    assert pool.continue_generation()["replicas"] == [any_server.url]
    (completion,), = pool.generate([[1, 2]], {"max_new_tokens": 2, "ignore_eos": True})
    assert completion.weight_version == "1"


@pytest.mark.parametrize("engine", ["builtin", "sglang"])
def test_a_killed_paused_replica_leaves_the_pool(engine, tiny_model, sglang_python, tmp_path):
    """A replica SIGKILLed (its whole process group) while the pool has it paused: the pool's next health check finds
    the connection refused and drops it; continuing then waits for replicas and names it."""
    log = str(tmp_path / "server.log")
    replica = BuiltinServer(str(tiny_model), log_path=log) if engine == "builtin" else SGLangServer(
        str(tiny_model), python=sglang_python, log_path=log)
    with replica:
        pool = ServerPool([replica.url], wait_timeout=2)
        pool.pause_generation()
        assert pool.is_healthy(timeout=2.0) and pool.replicas() == {replica.url: "serving"}
        os.killpg(replica.process.pid, signal.SIGKILL)
        replica.process.wait()
        assert not pool.is_healthy(timeout=2.0)
        assert pool.replicas() == {replica.url: "dropped"}
        with pytest.raises(NoReplicaError, match=rf"lost: {replica.url}: .*no connection \(refused or reset\)"):
            pool.continue_generation()


# ---------------------------------------------------------------------------------------- training on a real pool
# the tests on the four real servers of `replicas` run on one pytest-xdist worker, which starts them once
on_real_servers = pytest.mark.xdist_group("pool-replicas")


@pytest.fixture(scope="module")
def replicas(tiny_model):
    """Four built-in servers on the tiny model, started at once: `a` and `b` are shared (their weights restored by
    `pair`), `c` and `d` are killed by one test each."""
    servers = {name: BuiltinServer(str(tiny_model)) for name in "abcd"}
    with ThreadPoolExecutor(len(servers)) as threads:  # off the main thread: stopped by `stop()`, not at our death
        list(threads.map(BuiltinServer.start, servers.values()))
    yield servers
    for srv in servers.values():
        srv.stop()


@pytest.fixture()
def pair(replicas, tiny_model):
    for name in "ab":
        restore_default_weights(replicas[name].url, tiny_model)
    return replicas["a"], replicas["b"]


def pool_config(output_dir: Path, **settings):
    """Two prompts x 4 samples per step: a batch for two replicas."""
    return tiny_config(output_dir, per_device_train_batch_size=8, num_generations=4, **settings)


@on_real_servers
def test_a_static_pool_of_two_trains_with_both_replicas_serving_and_confirming_every_sync(pair, tiny_model, tmp_path):
    a, b = pair
    recipe = tiny_recipe(tmp_path, tiny_model, max_steps=3)  # 2 prompts x 4 samples a step, the reference in /ref
    assert cli.main(["train", str(recipe), "--server-url", a.url, "--server-url", b.url]) == 0
    run = tmp_path / "run"
    assert [e["step"] for e in read_jsonl(run / "metrics.jsonl") if "loss" in e] == [1, 2, 3]
    assert synced(run) == {step: sorted([a.url, b.url]) for step in (1, 2, 3)}
    assert [sorted(batch) for batch in served(run)] == [sorted([a.url, b.url])] * 3
    for srv in (a, b):
        assert SGLangClient(srv.url).weight_version() == "3"


@on_real_servers
def test_a_replica_killed_mid_run_is_dropped_and_the_run_finishes(pair, replicas, tiny_model, tmp_path):
    a, c = pair[0], replicas["c"]
    killer = KillServerAt(c, step=1)
    args = pool_config(tmp_path, max_steps=4, generation_url=[a.url, c.url], ref_model_url=[f"{a.url}/ref", f"{c.url}/ref"])
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset(),
                                callbacks=[killer])
    trainer.train()
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3, 4]  # none lost, none twice
    batches = served(tmp_path)
    assert sorted(batches[0]) == sorted([a.url, c.url]) and batches[1:] == [[a.url, a.url]] * 3
    assert synced(tmp_path) == {step: [a.url] for step in (1, 2, 3, 4)}
    assert trainer.remote_generation.client.replicas() == {a.url: "serving", c.url: "dropped"}


@on_real_servers
class AdvertiseAt(TrainerCallback):
    """A new server job advertising itself (its address file) at the end of optimizer step `step`."""

    def __init__(self, addresses: Path, name: str, url: str, step: int):
        self.addresses, self.name, self.url, self.step = addresses, name, url, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            write_address(self.addresses, self.name, self.url)


def test_a_joiner_gets_the_current_weights_before_it_serves(pair, tiny_model, tmp_path, monkeypatch):
    """`open-r1-ext train` on a pool read from an address directory: a second server advertises itself after step 1
    (the run waits until the pool has caught it up: a tiny step is faster than a rescan), is sent the weights (the
    last dump, replayed) before it serves, and serves from then on."""
    monkeypatch.setattr("open_r1_ext.server_pool.RESCAN_INTERVAL", 0.2)
    a, b = pair
    addresses, run = tmp_path / "replicas" / "server", tmp_path / "run"
    write_address(addresses, "1001", a.url)

    class WithJoiner(RemoteGRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(AdvertiseAt(addresses, "1002", b.url, step=1))
            pool = self.remote_generation.client
            self.add_callback(WaitAt(1, lambda: "1002" in pool.behind() or pool.replicas().get("1002") == "serving",
                                     "the pool to catch the joiner up"))

    monkeypatch.setattr("open_r1_ext.trainer.remote_trainer.RemoteGRPOTrainer", WithJoiner)
    recipe = tiny_recipe(tmp_path, tiny_model, max_steps=5)
    assert cli.main(["train", str(recipe), "--server-dir", str(addresses)]) == 0  # the reference: each one's /ref
    batches = served(run)
    assert batches[0] == ["1001", "1001"] and "1002" in batches[1]
    # every batch it served was sampled from the trainer's current weights (else staleness > 0 had stopped the run)
    assert all(e["staleness"] == 0 for e in read_jsonl(run / "rollouts.jsonl"))
    assert synced(run)[5] == ["1001", "1002"]
    first, second = SGLangClient(a.url), SGLangClient(b.url)
    assert first.weight_version() == second.weight_version() == "5"
    sequences = [[5, 6, 7, 8, 9], [10, 11, 12]]
    for x, y in zip(first.ref_logprobs(sequences), second.ref_logprobs(sequences)):
        assert torch.equal(x, y)


@on_real_servers
def test_below_min_replicas_the_trainer_stops_with_a_checkpoint_naming_the_lost_replica_and_resumes(pair, replicas, tiny_model,
                                                                                          tmp_path):
    a, d = pair[0], replicas["d"]
    args = pool_config(tmp_path, max_steps=4, generation_url=[a.url, d.url], ref_model_url=f"{a.url}/ref",
                       generation_min_replicas=2, server_wait_timeout=3)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset(),
                                callbacks=[KillServerAt(d, step=1)])
    with pytest.raises(ServerError) as err:  # at the sync after step 1, or the generation of step 2
        trainer.train()
    message = str(err.value)
    assert "1 of min_replicas 2 serving after waiting 3 s" in message
    assert f"lost: {d.url}: {d.url}" in message and "Connection refused" in message
    assert f"A checkpoint to resume from is in {tmp_path}/checkpoint-1" in message
    assert (tmp_path / "checkpoint-1").is_dir()
    # resumed with two replicas: it goes on from checkpoint-1 (pushing its weights to both first), no step redone
    b = pair[1]
    args = pool_config(tmp_path, max_steps=4, generation_url=[a.url, b.url], ref_model_url=f"{a.url}/ref",
                       generation_min_replicas=2)
    resumed = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    resumed.train(resume_from_checkpoint=True)
    steps = [h["step"] for h in resumed.state.log_history if "loss" in h]
    assert steps[-3:] == [2, 3, 4] and len(steps) == len(set(steps))
    assert synced(tmp_path)[4] == sorted([a.url, b.url])


def test_the_recipe_gives_the_pool_its_directories_and_min_replicas(tmp_path, tiny_model):
    recipe = load_recipe(tiny_recipe(tmp_path, tiny_model), ["servers.generation.replicas=3",
                                                             "servers.generation.min_replicas=2"])
    config = recipe.trainer_config(**pool_settings(recipe, "/run/replicas/server", None))
    assert (config.generation_server_dir, config.generation_min_replicas) == ("/run/replicas/server", 2)
    # reference: generation on built-in servers: each replica's /ref slot, as many needed
    assert (config.ref_model_server_dir, config.ref_model_route, config.reference_min_replicas) == (
        "/run/replicas/server", "/ref", 2)
    assert config.generation_on_server and config.remote_reference
