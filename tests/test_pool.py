"""The replica pool (`open_r1_ext.server_pool.ServerPool`, issue #12, trainer side).

The spreading, failover, joining and weight-tracking logic runs against stand-in SGLang servers (tests/fake_sglang.py:
real HTTP, a fixed function of the prompt, every call recorded); the training runs use real built-in servers.
"""

import threading
import time
from pathlib import Path

import pytest

from open_r1_ext.server_pool import NoReplicaError, ServerPool
from open_r1_ext.sglang_client import ServerRequestError, SGLangClient
from tests.fake_sglang import FakeSGLang

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
        answer = a.generate

        def slow(body):  # a's first request stays in flight until released
            busy.set()
            release.wait(10)
            return answer(body)

        a.generate = slow
        pool = ServerPool([a.url, b.url])
        first = threading.Thread(target=pool.generate, args=([[1] * 50], SAMPLING))
        first.start()
        assert busy.wait(10)
        pool.generate([[7, 8], [9, 10], [11, 12]], SAMPLING)
        assert pool.served_by() == [b.url] * 3  # a still holds the first request's tokens
        release.set()
        first.join(10)
        assert prompts_seen(a) == [tuple([1] * 50)]


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
            pool.generate([[1, 2]], SAMPLING)
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


def test_a_refused_reload_names_the_replica():
    with FakeSGLang() as a, FakeSGLang() as b:
        b.update_weights_from_disk = lambda body: (400, {"error": {"message": "cannot read the dump"}})
        pool = ServerPool([a.url, b.url])
        with pytest.raises(ServerRequestError, match=f"1 of 2 generation replica.*{b.url}.*cannot read the dump"):
            pool.update_weights_from_disk("/dumps/step-1", weight_version="1")
