"""SGLang's `/pause_generation` and `/continue_generation` (#23), the same requests on the built-in server and on real
SGLang 0.5.23 on the CPU: generations paused mid-sequence, weights replaced, continued. With `retract` the tokens after
the update carry the new weights' log-probs (checked against a local forward of each model) and `meta_info` says which
tokens came from which weights; `in_place` keeps the old KV cache (a reload must say `flush_cache: false`); `abort` ends
the requests under way; requests sent while paused wait. Real SGLang ignores `sampling_seed` here (no deterministic
mode on a CPU), so the checks hold for whatever was sampled."""

import json
import threading
import time
from collections import Counter

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.protocol import completion_from_generate
from open_r1_ext.sglang_client import SGLangClient
from tests.helpers import reward_len, tiny_config, tiny_dataset

ABORTED_TOKENS = 1500  # what the abort test asks for
HELD_TOKENS = 1000  # the retract and in-place pause tests: requests still under way when the pause lands (with 300, a
# busy machine's SGLang finished some first: the reload then found nothing to refuse for, a retracted stream one span)
PAUSED = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUED = {"message": "Generation continued successfully.", "status": "ok"}


class Streams:
    """Long generations streamed on threads (`ignore_eos`, temperature 1, log-probs), their token counts followed so
    that a pause lands mid-sequence; `.finals` are the last chunks (with `meta_info.weight_versions`)."""

    def __init__(self, url: str, prompts: list[list[int]], new_tokens: int):
        self.counts, self.finals, self.new_tokens = [0] * len(prompts), [None] * len(prompts), new_tokens
        self.threads = [threading.Thread(target=self._run, args=(url, prompt, i))
                        for i, prompt in enumerate(prompts)]
        for thread in self.threads:
            thread.start()

    def _run(self, url, prompt, i):
        body = {"input_ids": prompt, "return_logprob": True, "stream": True,
                "sampling_params": {"max_new_tokens": self.new_tokens, "temperature": 1.0, "ignore_eos": True}}
        with requests.post(f"{url}/generate", json=body, stream=True, timeout=300) as answer:
            for line in answer.iter_lines():
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    self.finals[i] = json.loads(line[5:])
                    self.counts[i] = self.finals[i]["meta_info"]["completion_tokens"]

    def wait_for(self, tokens: int) -> None:
        deadline = time.monotonic() + 120
        while min(self.counts) < tokens:
            assert time.monotonic() < deadline, f"generation did not reach {tokens} tokens: {self.counts}"
            time.sleep(0.005)

    def join(self) -> list[dict]:
        for thread in self.threads:
            thread.join(timeout=300)
        return self.finals


def local_logprobs(model_path, prompt: list[int], output: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


PROMPTS = [[5, 17, 30, 44, 9], [6, 17, 30, 44, 9], [7, 8]]


def test_retract_pause_then_new_weights_go_on_with_the_new_weights_log_probs(any_server, tiny_model, other_tiny_model):
    client = SGLangClient(any_server.url, request_timeout=120)
    streams = Streams(any_server.url, PROMPTS, new_tokens=HELD_TOKENS)
    streams.wait_for(20)
    assert client.pause_generation("retract") == PAUSED
    time.sleep(0.5)  # what was sampled before the pause has been streamed by now (SGLang streams a few tokens late)
    while_paused = list(streams.counts)
    time.sleep(0.5)
    assert streams.counts == while_paused, "paused, yet tokens are still being sampled"
    late = {}
    waiting = threading.Thread(target=lambda: late.update(r=client.post_json("/generate", {
        "input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True})))
    waiting.start()
    time.sleep(0.3)
    assert "r" not in late, "a request sent while paused ran before /continue_generation"
    before = client.weight_version()
    assert client.update_weights_from_disk(str(other_tiny_model), weight_version="new")["success"]  # at once
    assert client.continue_generation() == CONTINUED
    waiting.join(timeout=120)
    assert completion_from_generate(late["r"]).weight_versions == [("new", 0, 4)]  # after the pause: new weights
    for prompt, final in zip(PROMPTS, streams.join()):
        completion = completion_from_generate(final)
        assert len(completion.weight_versions or ()) == 2, (while_paused, completion.weight_versions)
        (old, start, split), (new, split_again, end) = completion.weight_versions
        assert (old, start, new, split_again, end) == (before, 0, "new", split, HELD_TOKENS)
        assert while_paused[PROMPTS.index(prompt)] == split < HELD_TOKENS and completion.weight_version == "new"
        served = torch.tensor(completion.logprobs)
        mine, other = (local_logprobs(path, prompt, completion.token_ids) for path in (tiny_model, other_tiny_model))
        # every token carries the log-prob of the weights it was drawn with: before the split the old model's,
        # after it the new model's over the whole sequence (the KV cache recomputed)
        torch.testing.assert_close(served[:split], mine[:split], atol=2e-3, rtol=0)
        torch.testing.assert_close(served[split:], other[split:], atol=2e-3, rtol=0)
        assert (served[split:] - mine[split:]).abs().max() > 0.05  # the two models do differ there


def test_in_place_pause_keeps_the_old_cache_and_a_reload_must_not_flush_it(any_server, tiny_model, other_tiny_model):
    client = SGLangClient(any_server.url, request_timeout=120)
    streams = Streams(any_server.url, PROMPTS[:2], new_tokens=HELD_TOKENS)
    streams.wait_for(20)
    assert client.pause_generation("in_place") == PAUSED
    refused = requests.post(f"{any_server.url}/update_weights_from_disk",
                            json={"model_path": str(other_tiny_model), "weight_version": "new"}, timeout=60)
    assert refused.status_code == 400 and not refused.json()["success"]
    assert refused.json()["message"].startswith("Weights were updated, but the cache was not flushed")
    # as SGLang: the weights changed (the samples say so) while /model_info keeps the last reload that succeeded
    assert client.weight_version() == "default"
    assert client.update_weights_from_disk(str(other_tiny_model), weight_version="new2", flush_cache=False)["success"]
    assert client.continue_generation() == CONTINUED
    for prompt, final in zip(PROMPTS, streams.join()):
        completion = completion_from_generate(final)
        assert [span[0] for span in completion.weight_versions] == ["default", "new2"]
        split = completion.weight_versions[-1][1]
        served = torch.tensor(completion.logprobs)
        other = local_logprobs(other_tiny_model, prompt, completion.token_ids)
        # the positions before the pause keep the old model's keys and values: not the new model's log-probs
        assert (served[split + 1:] - other[split + 1:]).abs().max() > 0.01


def test_a_reload_refused_for_requests_under_way_is_sent_again_once_they_end(any_server, tiny_model, other_tiny_model):
    """SGLang refuses a reload whose cache flush finds requests running or queued (the batch just answered can still be
    the scheduler's for one iteration: a restore right after a generation failed CI that way). The client waits for
    them with `/flush_cache?timeout=` and reloads again. Made certain here by an `in_place` pause."""
    client = SGLangClient(any_server.url, request_timeout=120)
    streams = Streams(any_server.url, PROMPTS[:2], new_tokens=HELD_TOKENS)
    streams.wait_for(20)
    assert client.pause_generation("in_place") == PAUSED
    assert not client.flush_cache(wait_s=0.5)  # held in place: not flushed, after waiting
    threading.Timer(2.0, client.continue_generation).start()
    answer = client.update_weights_from_disk(str(other_tiny_model), weight_version="new")
    assert answer["success"] and client.weight_version() == "new"  # the refused try left "default" reported
    finals = streams.join()  # the requests ran to their end
    assert [(f["meta_info"]["completion_tokens"], f["meta_info"]["finish_reason"]["type"]) for f in finals] == [
        (HELD_TOKENS, "length")] * 2
    assert client.flush_cache()  # nothing under way


def test_abort_pause_ends_the_requests_under_way_and_holds_new_ones(any_server):
    client = SGLangClient(any_server.url, request_timeout=120)
    # aborted, they end early: 1,500 tokens cost nothing and leave room (SGLang ran all of 300 before the pause once)
    streams = Streams(any_server.url, PROMPTS[:2], new_tokens=ABORTED_TOKENS)
    streams.wait_for(20)
    assert client.pause_generation("abort") == PAUSED
    finals = streams.join()  # answered by the time the pause is in force
    for final in finals:
        assert final["meta_info"]["finish_reason"]["type"] == "abort"
        assert 20 <= final["meta_info"]["completion_tokens"] < ABORTED_TOKENS
    with pytest.raises(requests.Timeout):  # paused: a new request waits
        requests.post(f"{any_server.url}/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
                      timeout=2)
    assert client.continue_generation() == CONTINUED
    assert client.continue_generation() == CONTINUED  # not paused: nothing to do
    (done,), = client.generate([[1, 2]], {"max_new_tokens": 2, "ignore_eos": True})
    assert done.finish_reason == "length"


def test_pause_modes_are_checked(any_server):
    answer = requests.post(f"{any_server.url}/pause_generation", json={"mode": "later"}, timeout=30)
    assert answer.status_code == 400 and "mode" in answer.text


def test_an_in_flight_run_on_each_server_keeps_the_staleness_bound(any_server, tiny_model, tmp_path):
    """A tiny run with in-flight updates (#23) against each server: every sync pauses it (retract), reloads and
    continues it while groups are under way; each group trains once, within `max_weight_staleness`."""
    args = tiny_config(tmp_path, max_steps=6, per_device_train_batch_size=8, num_generations=4, max_completion_length=64,
                       beta=0.0, generation_url=any_server.url, async_generation=True, in_flight_updates=True,
                       max_weight_staleness=1, max_prompts_in_flight=8, generation_kwargs={"ignore_eos": True})
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset(64))
    trainer.train()
    log = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    trained = [e for e in log if not e.get("dropped")]
    assert [e["step"] for e in trained] == [step for step in range(1, 7) for _ in range(2)]
    assert all(e["staleness"] <= 1 for e in trained) and all(e["staleness"] > 1 for e in log if e.get("dropped"))
    assert max(Counter((e["epoch"], *e["group"]) for e in trained).values()) == 1
    assert SGLangClient(any_server.url).weight_version() == "6"
    paused = [h["background/paused"] for h in trainer.state.log_history if "background/paused" in h]
    assert len(paused) >= 4 and all(seconds > 0 for seconds in paused)  # the syncs paused the server
