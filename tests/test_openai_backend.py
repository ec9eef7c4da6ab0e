"""The OpenAI backend (`generation_backend: openai`) where real SGLang does not show the behaviour (#21 item 7): a
choice SGLang aborted, a restarted server's weight version (`tests/fake_sglang.py`, answering `/v1/completions` as
SGLang 0.5.23's source does), and servers other than SGLang, stood in for by `OpenAIStandIn` below: one that ignores
`n`, one that gives no log-probs, one that refuses every field beyond OpenAI's. Real SGLang's `/v1/completions`:
tests/test_real_sglang_training.py."""

import json
import logging

import pytest
from transformers import AutoTokenizer, TrainerCallback

from open_r1_ext import RemoteGRPOConfig, RemoteGRPOTrainer
from open_r1_ext.openai_client import OpenAICompletionsClient, ServerAbilities
from open_r1_ext.sglang_client import AbortedRequestError, ServerError
from tests.fake_sglang import FakeSGLang
from tests.helpers import reward_len, tiny_config, tiny_dataset, tiny_settings

SAMPLING = {"max_new_tokens": 6, "temperature": 1.0}
OPENAI_FIELDS = {"model", "prompt", "n", "max_tokens", "temperature", "top_p", "logprobs", "seed", "stop",
                 "presence_penalty", "frequency_penalty", "logit_bias", "echo", "best_of", "suffix", "user", "stream"}


class OpenAIStandIn(FakeSGLang):
    """A stand-in for OpenAI-compatible servers other than SGLang (it has no model): FakeSGLang's `/v1/completions`
    with a quirk: `ignores_n` (one choice per prompt whatever `n`, as llama.cpp's server), `no_logprobs` (never any
    log-probs), `strict` (HTTP 400 for any field beyond OpenAI's, as OpenAI's own API: no token ids come back)."""

    def __init__(self, ignores_n: bool = False, no_logprobs: bool = False, strict: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.ignores_n, self.no_logprobs, self.strict = ignores_n, no_logprobs, strict

    def completions(self, body: dict):
        extra = sorted(set(body) - OPENAI_FIELDS)
        if self.strict and extra:
            return 400, {"error": {"message": f"Unrecognized request argument supplied: {extra[0]}"}}
        status, answer = super().completions({**body, "n": 1} if self.ignores_n else body)
        for choice in answer["choices"]:
            choice["logprobs"] = None if self.no_logprobs else choice["logprobs"]
        return status, answer


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def completion_bodies(fake) -> list[dict]:
    return [body for method, path, body, _ in fake.calls if path == "/v1/completions"]


def openai_trainer(tiny_model, url, output_dir, **settings):
    args = tiny_config(output_dir, generation_url=url, generation_backend="openai", beta=0.0,
                       **{"weight_sync_steps": 0, "max_steps": 1, **settings})
    return RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())


def test_a_choice_the_server_aborted_is_asked_again_never_returned(tokenizer, caplog):
    """SGLang answers an aborted choice with `finish_reason: "abort"` and its partial output: the client asks for
    that choice again (the others are kept), as the native client does on /generate; one that keeps being aborted
    stops with AbortedRequestError after ABORT_RETRIES more tries."""
    with FakeSGLang() as fake:
        client = OpenAICompletionsClient(fake.url, tokenizer)
        assert client.abilities.n_in_one_request  # probed before the aborts begin
        fake.calls.clear()
        fake.aborts = 2
        with caplog.at_level(logging.WARNING, logger="open_r1_ext.openai_client"):
            groups = client.generate([[1, 2, 3], [4, 5]], SAMPLING, n=2)
        assert [[(len(c.token_ids), c.finish_reason) for c in g] for g in groups] == [[(6, "length")] * 2] * 2
        first, again = completion_bodies(fake)
        assert (first["prompt"], first["n"]) == ([[1, 2, 3], [4, 5]], 2)
        assert (again["prompt"], again["n"]) == ([[1, 2, 3], [1, 2, 3]], 1)  # the two aborted choices, asked again
        assert sum("aborted 2 choice(s): asking for them again" in r.message for r in caplog.records) == 1
        fake.aborts = 100
        with pytest.raises(AbortedRequestError, match=r"aborted 1 of 1 choice\(s\) 3 times; their partial output is "
                                                      "not trained on"):
            client.generate([[1, 2, 3]], SAMPLING, n=1, seeds=[7])


class RestartAt(TrainerCallback):
    """After step `step` (and its sync): the fake server forgets its weights, as a restarted server would."""

    def __init__(self, fake: FakeSGLang, step: int):
        self.fake, self.step = fake, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.fake.weight_version = "default"


def test_the_weight_version_is_read_and_a_restarted_server_gets_the_weights_again(tiny_model, tmp_path):
    """SGLang's `metadata.weight_version` is each completion's weight version: the staleness is logged
    (rollouts.jsonl), and a server that restarted (it reports its start-up weights) gets the last dump again before
    the batch is sampled again. Before, the version was None: no staleness, a restart unseen."""
    with FakeSGLang() as fake:
        trainer = openai_trainer(tiny_model, fake.url, tmp_path, weight_sync_steps=1, max_steps=3)
        trainer.add_callback(RestartAt(fake, step=2))
        trainer.train()
        reloads = [body["weight_version"] for method, path, body, _ in fake.calls if path == "/update_weights_from_disk"]
    assert reloads == ["1", "2", "2", "3"]  # the dump of step 2 again after the restart
    rollouts = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [(r["step"], r["weight_version"], r["staleness"]) for r in rollouts] == [(1, 0, 0), (2, 1, 0), (3, 2, 0)]


def test_a_server_that_ignores_n_is_asked_once_per_copy_said_once(tiny_model, tokenizer, tmp_path, caplog):
    """A server that answers one choice per prompt whatever `n`: one request per copy, said once at the probe; one
    that stops honouring `n` after the probe gets a clear error naming what it returned, never an IndexError."""
    with OpenAIStandIn(ignores_n=True) as fake:
        with caplog.at_level(logging.WARNING):
            trainer = openai_trainer(tiny_model, fake.url, tmp_path)
            client = trainer.remote_generation.client
            groups = client.generate([[1, 2, 3], [4, 5]], SAMPLING, n=3)
            trainer.train()
        assert not client.abilities.n_in_one_request and [len(g) for g in groups] == [3, 3]
        assert sum("whatever `n`" in r.message for r in caplog.records) == 1
        assert trainer.state.global_step == 1
    with OpenAIStandIn() as fake:
        client = OpenAICompletionsClient(fake.url, tokenizer)
        assert client.abilities.n_in_one_request
        fake.ignores_n = True
        with pytest.raises(ServerError, match=r"returned 2 choices for 2 prompt\(s\) x n=3 \(it ignores n\): expected 6"):
            client.generate([[1, 2, 3], [4, 5]], SAMPLING, n=3)


def test_a_server_without_log_probs_turns_importance_sampling_off_said_once(tiny_model, tmp_path, caplog):
    """Without sampling log-probs TRL's importance-sampling correction cannot run: the trainer says so once, at
    start-up (from the probe), switches it off, and trains."""
    with OpenAIStandIn(no_logprobs=True) as fake, caplog.at_level(logging.WARNING):
        trainer = openai_trainer(tiny_model, fake.url, tmp_path, max_steps=2)
        assert trainer.remote_generation.client.abilities.logprobs is False and trainer.use_vllm is False
        trainer.train()
    assert trainer.state.global_step == 2
    assert sum("gives no sampling log-probs" in r.message for r in caplog.records) == 1


def test_sampling_settings_a_server_cannot_be_sent_are_refused_at_start(tiny_model, tmp_path, caplog):
    """A generation_kwargs key SGLang's /v1/completions has no field for is refused by the config; SGLang's extra
    settings (min_p, repetition_penalty, ...) to a server that refuses fields beyond OpenAI's are refused when the
    trainer starts, naming them; with the defaults such a server trains (stop_token_ids left out, said once)."""
    with pytest.raises(ValueError, match="generation_kwargs.structural_tag: SGLang's /v1/completions has no such field"):
        RemoteGRPOConfig(**tiny_settings(tmp_path, generation_url="http://x:1", generation_backend="openai",
                                         generation_kwargs={"structural_tag": "{}"}))
    with OpenAIStandIn(strict=True) as fake:
        with pytest.raises(ValueError, match=r"cannot be sent min_p=0\.1, min_new_tokens=2: the server refused fields "
                                             "beyond OpenAI's"):
            openai_trainer(tiny_model, fake.url, tmp_path / "refused", min_p=0.1, generation_kwargs={"min_tokens": 2})
        assert not any(path == "/v1/completions" and body["max_tokens"] > 1 for _, path, body, _ in fake.calls)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            trainer = openai_trainer(tiny_model, fake.url, tmp_path / "trains", max_steps=2)
            trainer.train()
        assert trainer.remote_generation.client.abilities == ServerAbilities(
            token_id_prompts=True, prompt_lists=True, n_in_one_request=True, token_ids=False, logprobs=True,
            extensions=False, reloads_weights=True)
        assert trainer.state.global_step == 2
        assert sum("stop_token_ids are not sent" in r.message for r in caplog.records) == 1
        assert all(set(body) <= OPENAI_FIELDS for body in completion_bodies(fake)[-2:])
