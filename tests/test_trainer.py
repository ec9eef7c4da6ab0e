"""RemoteGRPOTrainer against real built-in server processes: parity with stock TRL, remote generation, faults."""

import logging

import pytest
import requests
import torch
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.sglang_client import ServerError
from open_r1_ext.launch.local_server import BuiltinServer, free_port
from open_r1_ext.trainer.remote_trainer import RemoteReference
from tests.helpers import KillServerAt, model_variant, restore_default_weights, reward_len, tiny_config, tiny_dataset, tiny_settings


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


def test_generation_object_sync_and_async_behind_one_interface(tiny_model, server, tmp_path):
    from open_r1_ext.trainer.generation import AsyncRemoteGeneration, RemoteGeneration, sampling_seeds

    prompts = [[5, 17, 42]] * 4 + [[1, 2]] * 4  # TRL's layout: each prompt repeated num_generations times
    for kind in (RemoteGeneration, AsyncRemoteGeneration):
        args = tiny_config(tmp_path / kind.__name__, generation_url=server.url, beta=0.0,
                           async_generation=kind is AsyncRemoteGeneration)
        trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
        generation = trainer.remote_generation
        assert type(generation) is kind
        completions = generation.generate(prompts, num_generations=4)
        assert len(completions) == 8 and {c.weight_version for c in completions} == {"default"}
        assert len({tuple(c.token_ids) for c in completions[:4]}) > 1  # each copy has its own seed
        # seeds are a function of (seed, step, mode, rank): asked again, the server samples the same
        assert [c.token_ids for c in generation.generate(prompts, 4)] == [c.token_ids for c in completions]
        generation.sync_weights(1, references=[])
        generation.close()  # the async variant's reload was queued on its rollout thread: close() drains it
        assert generation.target.version == "1" and generation.client.weight_version() == "1"
        trainer.weight_sync.wait_durable()
        restore_default_weights(server.url, tiny_model)
    base = sampling_seeds(42, 3, "train", 0, 4)
    assert base == sampling_seeds(42, 3, "train", 0, 4) and len(set(base)) == 4
    for other in ((43, 3, "train", 0), (42, 4, "train", 0), (42, 3, "eval", 0), (42, 3, "train", 1)):
        assert sampling_seeds(*other, 4) != base
    assert sampling_seeds(42, 3, "train", 0, 4, salt=1) != base


def looped_completion_logps(client, input_ids, attention_mask, logits_to_keep):
    """`remote_completion_logps` as it was, one Python step per row and position: the reference for the vectorised one."""
    rows, masks = input_ids.tolist(), attention_mask.bool().tolist()
    scored = client.ref_logprobs([[t for t, m in zip(ids, mask) if m] for ids, mask in zip(rows, masks)])
    width = input_ids.size(1)
    out = torch.zeros((len(rows), logits_to_keep), dtype=torch.float32)
    for row, mask in enumerate(masks):
        first = mask.index(True)
        for j in range(logits_to_keep):
            column = width - logits_to_keep + j
            if mask[column] and column > first:
                out[row, j] = scored[row][column - first - 1]
    return out


class SeededScores:
    """A stand-in for the reference server: reproducible log-probs, one per token after the first."""

    def ref_logprobs(self, sequences):
        return [-5 * torch.rand(len(s) - 1, generator=torch.Generator().manual_seed(hash(tuple(s)) % 2**31))
                for s in sequences]


@pytest.mark.parametrize("trial", range(20))
def test_vectorised_reference_layout_equals_the_loop(trial):
    from open_r1_ext.trainer.remote_trainer import remote_completion_logps

    rng = torch.Generator().manual_seed(trial)
    rows = 1 + trial % 6
    prompt_width, completion_width = (int(w) for w in torch.randint(1, 9, (2,), generator=rng))
    input_ids = torch.randint(0, 300, (rows, prompt_width + completion_width), generator=rng)
    # TRL's layout: prompts left-padded (at least one token), completions right-padded (possibly empty)
    prompt_pad = torch.randint(0, prompt_width, (rows, 1), generator=rng)
    completion_len = torch.randint(0, completion_width + 1, (rows, 1), generator=rng)
    prompt_mask = torch.arange(prompt_width)[None] >= prompt_pad
    completion_mask = torch.arange(completion_width)[None] < completion_len
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    for logits_to_keep in (completion_width, completion_width + prompt_width // 2):
        got = remote_completion_logps(SeededScores(), input_ids, attention_mask, logits_to_keep)
        want = looped_completion_logps(SeededScores(), input_ids, attention_mask, logits_to_keep)
        assert torch.equal(got, want)
