"""The OpenAI backend against a real third-party OpenAI-compatible server: Hugging Face's `transformers serve`
(transformers 5, installed with this project; a process of its own over HTTP, on the tiny model). Its
`/v1/completions` takes one string prompt a request, ignores `n` and `logprobs`, refuses fields beyond OpenAI's and
has no weight reload: the backend learns that at start-up and adapts, or refuses weight sync before step 1."""

import logging
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.launch.local_server import CommandServer, free_port
from open_r1_ext.openai_client import OpenAICompletionsClient, ServerAbilities
from tests.helpers import reward_len, tiny_config, tiny_dataset

TRANSFORMERS_SERVE = [str(Path(sys.executable).with_name("transformers")), "serve"]


@pytest.fixture(scope="module")
def transformers_serve(tiny_model, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("transformers-serve") / "server.log"
    command = [*TRANSFORMERS_SERVE, "--host", "127.0.0.1", "--port", str(port), str(tiny_model)]
    with CommandServer(command, "transformers serve", str(tiny_model), port, log_path=str(log)) as server:
        yield server


def completion_requests(server) -> int:
    return server.log_path.read_text().count('"POST /v1/completions HTTP/1.1" 200')


def test_the_probe_finds_what_transformers_serve_does_and_generation_adapts(transformers_serve, tiny_model, caplog):
    """One string prompt a request, one choice whatever `n`, text only, no log-probs, no reload: 2 prompts x 3
    copies are 6 requests of one prompt each, every group full."""
    client = OpenAICompletionsClient(transformers_serve.url, tokenizer=AutoTokenizer.from_pretrained(tiny_model))
    with caplog.at_level(logging.WARNING, logger="open_r1_ext.openai_client"):
        client.wait_until_healthy(timeout=60, progress=False)
        assert client.abilities == ServerAbilities(
            token_id_prompts=False, prompt_lists=False, n_in_one_request=False, token_ids=False, logprobs=False,
            extensions=False, reloads_weights=False)
        before = completion_requests(transformers_serve)
        groups = client.generate([[5, 6, 7], [8, 9]], {"max_new_tokens": 4, "temperature": 1.0}, n=3)
    assert completion_requests(transformers_serve) - before == 6
    assert [len(group) for group in groups] == [3, 3]
    assert all(c.token_ids and len(c.token_ids) <= 4 and c.logprobs is None for group in groups for c in group)
    assert any("answers one choice per prompt whatever `n`" in r.message for r in caplog.records)


def test_weight_sync_to_a_server_that_cannot_reload_is_refused_before_step_one(transformers_serve, tiny_model, tmp_path):
    """The default `weight_sync_steps=1` would send the policy to a server with no reload: refused when the trainer
    is built, naming the fix, before any batch is generated."""
    args = tiny_config(tmp_path, generation_url=transformers_serve.url, generation_backend="openai", beta=0.0)
    before = completion_requests(transformers_serve)
    with pytest.raises(ValueError, match=r"weight_sync_steps=1: the generation server at .* cannot reload weights .*"
                                         r"Set weight_sync_steps=0"):
        RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    assert completion_requests(transformers_serve) - before <= 6  # the probe's forms only: no batch was asked


def test_a_run_without_weight_sync_trains_on_transformers_serve(transformers_serve, tiny_model, tmp_path, caplog):
    """`weight_sync_steps=0`: the run trains (completions re-tokenized, importance sampling off, said once)."""
    args = tiny_config(tmp_path, generation_url=transformers_serve.url, generation_backend="openai", beta=0.0,
                       weight_sync_steps=0, max_steps=2)
    with caplog.at_level(logging.WARNING):
        trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args,
                                    train_dataset=tiny_dataset())
        trainer.train()
    assert trainer.state.global_step == 2 and trainer.use_vllm is False
    assert sum("gives no sampling log-probs" in r.message for r in caplog.records) == 1
