"""In-flight weight updates with adapter-only LoRA sync (#34): a sync loads the new adapter and aborts the requests
under way, which continue from their tokens so far under it; each token keeps the version of the adapter that sampled
it, so staleness counts from a group's oldest token. The run here is on the built-in server; the same run on real
SGLang 0.5.23 is in tests/test_real_sglang_training.py (its LoRA server)."""

import json

import pytest

from open_r1_ext.protocol import Completion
from open_r1_ext.sglang_client import SGLangClient
from open_r1_ext.trainer.inflight import InFlightGeneration, continued
from tests.helpers import loaded_adapters
from tests import test_lora
from tests.test_inflight import rollouts, shape_groups, trained_positions
from tests.test_lora import lora_trainer

pytestmark = test_lora.pytestmark  # test_lora's xdist group: on its worker, which starts the LoRA server once
lora_server = test_lora.lora_server  # its fixture: the shared LoRA server, without a test's adapters afterwards


def test_an_aborted_completion_continued_keeps_the_version_of_each_token():
    head = Completion([5, 6, 7], [-1.0, -2.0, -3.0], "abort", "1", [("0", 0, 2), ("1", 2, 3)])
    tail = Completion([8, 9], [-4.0, -5.0], "length", "2")
    joined = continued(head, tail)
    assert joined.token_ids == [5, 6, 7, 8, 9] and joined.logprobs == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert joined.finish_reason == "length" and joined.weight_version == "2"
    assert joined.weight_versions == [("0", 0, 2), ("1", 2, 3), ("2", 3, 5)] and joined.versions == ["0", "1", "2"]
    # aborted before its first token: the continuation alone; the same adapter again: one span
    assert continued(Completion([], [], "abort", "1"), tail) == tail
    again = continued(Completion([5], [-1.0], "abort", "2"), tail)
    assert again.weight_versions == [("2", 0, 3)] and again.versions == ["2"]


@pytest.mark.parametrize("transport", ["disk", "distributed"])
def test_in_flight_lora_continues_the_completions_under_way_with_the_new_adapter(tiny_model, lora_server, tmp_path,
                                                                                transport):
    check_in_flight_lora(tiny_model, lora_server.url, tmp_path, transport)


def check_in_flight_lora(tiny_model, url: str, tmp_path, transport: str = "disk") -> None:
    """4 prompts in flight, 2 a step: step 1 trains the short groups of the first two batches, their long groups sent
    once those are complete (`shape_groups`' `shorts_first`). A long group is under way at the syncs, which load the
    step's adapter (its dump; with `transport: distributed` its tensors in the request, no file) and abort it; it
    continues under the new adapter, spanning versions within the bound (2). Each group trains once, the server ends
    with the last two adapters (also run on real SGLang: test_real_sglang_training.py)."""
    trainer = lora_trainer(tiny_model, tmp_path, url, max_steps=3, per_device_train_batch_size=8, num_generations=4,
                           max_completion_length=256, async_generation=True, in_flight_updates=True,
                           max_weight_staleness=2, max_prompts_in_flight=4, beta=0.0,
                           generation_kwargs={"ignore_eos": True}, transport=transport)
    assert isinstance(trainer.remote_generation, InFlightGeneration) and trainer.weight_sync.adapter_only
    shape_groups(trainer, shorts_first=2)
    trainer.train()
    log = rollouts(tmp_path)
    trained = [e for e in log if not e.get("dropped")]
    assert [e["step"] for e in trained] == [1, 1, 2, 2, 3, 3]
    assert sorted(e["group"] for e in trained if e["step"] == 1) == [[0, 1], [1, 1]], log
    assert max(trained_positions(log).values()) == 1  # each group trained once
    assert all(e["staleness"] == e["step"] - 1 - min(e["versions"]) for e in log)  # from the oldest token
    assert all(e["staleness"] <= 2 for e in trained), trained
    # a long group under way at a sync continued under the new adapter (the built-in server loads it between two
    # decode steps, as SGLang between batches), not after it ended
    assert any(len(e["versions"]) > 1 for e in trained if e["group"][1] == 0), log
    syncs = [json.loads(line) for line in (tmp_path / "weight_sync.jsonl").read_text().splitlines()]
    assert [e["weight_version"] for e in syncs] == ["1", "2", "3"]
    assert loaded_adapters(SGLangClient(url)) == ["policy-v2", "policy-v3"]
    if transport == "distributed":  # nothing written
        assert [e["path"] for e in syncs] == [None] * 3 and not (tmp_path / "weights").exists()
