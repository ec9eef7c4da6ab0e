"""RemoteGRPOTrainer against real built-in server processes: parity with stock TRL, remote generation, faults."""

import logging

import pytest
import requests
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.sglang_client import ServerError
from open_r1_ext.launch.local_server import BuiltinServer, free_port
from open_r1_ext.trainer.remote_trainer import RemoteReference
from tests.helpers import KillServerAt, model_variant, reward_len, tiny_config, tiny_dataset, tiny_settings


def losses_and_kl(trainer):
    return [(h["loss"], h["kl"]) for h in trainer.state.log_history if "kl" in h]


def test_remote_reference_matches_stock_trl(tiny_model, server, tmp_path):
    stock_args = GRPOConfig(**tiny_settings(tmp_path / "stock"))
    stock = GRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=stock_args, train_dataset=tiny_dataset())
    stock.train()
    remote = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, train_dataset=tiny_dataset(),
                               args=tiny_config(tmp_path / "remote", ref_model_url=f"{server.url}/ref"))
    remote.train()
    want, got = losses_and_kl(stock), losses_and_kl(remote)
    assert len(want) == len(got) == 3
    assert got[-1][1] > 0  # the policy moved away from the reference: KL is really compared
    for (loss_a, kl_a), (loss_b, kl_b) in zip(want, got):
        assert loss_a == pytest.approx(loss_b, abs=1e-4)
        assert kl_a == pytest.approx(kl_b, abs=1e-4)
    # no reference model lives in the trainer process
    assert isinstance(remote.ref_model, RemoteReference) and not hasattr(remote.ref_model, "parameters")
    assert sum(p.numel() for p in stock.ref_model.parameters()) > 0


def test_remote_generation_returns_server_token_ids(tiny_model, server, tmp_path):
    seen = {}

    def record(completions, completion_ids, **kwargs):
        seen.setdefault("ids", completion_ids)
        seen.setdefault("texts", [c[0]["content"] for c in completions])
        return reward_len(completions)

    args = tiny_config(tmp_path, max_steps=1, generation_url=server.url, ref_model_url=f"{server.url}/ref", weight_sync_steps=0)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=record, args=args, train_dataset=tiny_dataset())
    client = trainer.remote_generation.client
    calls = []
    real_generate = client.generate

    def spy(prompts, sampling, n=1, seeds=None):  # records what the real server answered
        groups = real_generate(prompts, sampling, n=n, seeds=seeds)
        calls.append((prompts, sampling, n, seeds, groups))
        return groups

    client.generate = spy
    trainer.train()
    (prompts, sampling, n, seeds, groups), = calls
    assert n == 4 and len(prompts) == 1  # one request: the prompt x num_generations, each copy its own seed
    assert len(set(seeds)) == 4
    server_ids = [c.token_ids for group in groups for c in group]
    assert seen["ids"] == server_ids  # the trainer trained on the server's ids, never re-encoded
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert [tokenizer.decode(ids, skip_special_tokens=True) for ids in server_ids] == seen["texts"]
    again = real_generate(prompts, sampling, n=n, seeds=seeds)  # seeded: the server reproduces them
    assert [c.token_ids for group in again for c in group] == server_ids
    assert {c.weight_version for group in groups for c in group} == {"default"}


def test_server_not_up_is_a_clear_error(tiny_model, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    args = tiny_config(tmp_path, ref_model_url=url, server_wait_timeout=2)
    with pytest.raises(ServerError, match=f"{url} did not become healthy within 2 s"):
        RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())


def test_vocabulary_mismatch_is_refused(tiny_model, tmp_path):
    other = model_variant(tiny_model, tmp_path / "other-vocab", vocab_size=320)
    with BuiltinServer(str(other), extra_args=("--no-ref-slot",)) as srv:
        args = tiny_config(tmp_path / "out", ref_model_url=srv.url)
        with pytest.raises(ValueError, match="vocabulary size 320 on the server, 300 in the trainer"):
            RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())


def test_prompt_longer_than_server_context_names_prompt_and_limit(tiny_model, tmp_path):
    with BuiltinServer(str(tiny_model), extra_args=("--context-length", "24", "--no-ref-slot")) as srv:
        args = tiny_config(tmp_path, max_steps=1, generation_url=srv.url, weight_sync_steps=0, beta=0.0)
        trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
        with pytest.raises(ServerError, match=r"input_ids\[\d+\].*context length \(24 tokens\)"):
            trainer.train()


def test_training_rides_through_a_server_restart(tiny_model, tmp_path):
    srv = BuiltinServer(str(tiny_model)).start()
    killer = KillServerAt(srv, step=2, restart_after=1.0)
    try:
        args = tiny_config(tmp_path, max_steps=5, generation_url=srv.url, ref_model_url=f"{srv.url}/ref", max_retries=10)
        trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
        trainer.add_callback(killer)
        trainer.train()
        steps = [h["step"] for h in trainer.state.log_history if "loss" in h]
        assert steps == [1, 2, 3, 4, 5]  # no step lost, none trained twice
        assert killer.restarted is not None and killer.restarted.process is not None
        # after the restart the trainer re-pushed its weights: the server reports the latest version
        assert requests.get(f"{srv.url}/get_model_info", timeout=10).json()["weight_version"] == "5"
    finally:
        killer.stop()


def test_server_gone_for_good_stops_with_a_checkpoint(tiny_model, tmp_path):
    srv = BuiltinServer(str(tiny_model)).start()
    args = tiny_config(tmp_path, max_steps=5, generation_url=srv.url, ref_model_url=f"{srv.url}/ref", max_retries=1)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    trainer.add_callback(KillServerAt(srv, step=2))
    with pytest.raises(ServerError, match=r"Training stopped at step 2\. A checkpoint to resume from is in .*checkpoint-2"):
        trainer.train()
    assert (tmp_path / "checkpoint-2" / "trainer_state.json").is_file()


def test_openai_backend_with_token_ids_and_text_only(tiny_model, server, tmp_path, caplog):
    from open_r1_ext.openai_client import OpenAICompletionsClient

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    client = OpenAICompletionsClient(server.url, tokenizer=tokenizer)
    sampling = {"max_new_tokens": 6, "temperature": 1.0}
    groups = client.generate([[1, 2, 3], [4, 5]], sampling, n=2, seeds=[7, 8, 9, 10])
    assert [len(g) for g in groups] == [2, 2]
    assert all(c.logprobs is not None and len(c.logprobs) == len(c.token_ids) for g in groups for c in g)
    assert groups[0][0].token_ids != groups[0][1].token_ids  # copies differ
    # a server that returns text only: re-tokenized, warned once, no sampling log-probs
    body = {"model": "m", "prompt": [[1, 2, 3]], "n": 1, "max_tokens": 6, "seed": 7}
    text_only = requests.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    with caplog.at_level(logging.WARNING):
        c1 = client._completion(text_only["choices"][0])
        client._completion(text_only["choices"][0])
    assert c1.logprobs is None and c1.token_ids == tokenizer(text_only["choices"][0]["text"], add_special_tokens=False)["input_ids"]
    assert sum("lossy" in r.message for r in caplog.records) == 1
    # and the trainer trains through it
    args = tiny_config(tmp_path, max_steps=1, generation_url=server.url, generation_backend="openai",
                       weight_sync_steps=0, beta=0.0)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    trainer.train()
    assert trainer.state.global_step == 1
