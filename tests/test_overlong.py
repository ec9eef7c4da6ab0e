"""TRL's own overlong handling with generation on the built-in server: `mask_truncated_completions` masks out of the
loss the completions the server cut at `max_completion_length` (finish reason `length`), and TRL's soft overlong
punishment reward scores the lengths the server produced, with and without `dynamic_sampling`; and dynamic sampling
over a pool of two replicas trains only informative groups. The model is the tiny one with its EOS row raised, so some
of its completions end (EOS) within the 8 tokens allowed and the others are cut (seeded: the same ones every run)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.rewards import get_soft_overlong_punishment

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.sglang_client import SGLangClient
from tests.helpers import restore_default_weights, served, server_like, tiny_config, tiny_dataset
from tests.test_dynamic_sampling import (ROWS, RecordingTrainer, assert_informative_full_batches, prompts,
                                         spread_unless_uniform)

MAX_LENGTH = 8  # max_completion_length (tiny_config's)
REWARD = "soft_overlong_punishment_reward"  # TRL's name of it, in its logs
SOFT_CACHE = 6  # the soft punishment's L_cache: lengths 3..8 are punished, 8 by -1


@pytest.fixture(scope="module")
def eos_model(tiny_model, tmp_path_factory):
    """The tiny model whose EOS embedding (tied: its output row too) is 0.25 x the final norm's weight."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    eos = AutoTokenizer.from_pretrained(tiny_model).eos_token_id
    with torch.no_grad():
        model.lm_head.weight[eos] = 0.25 * model.model.norm.weight
    out = tmp_path_factory.mktemp("eos-model")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out


class OverlongTrainer(RemoteGRPOTrainer):
    """Records the server's completions of each generation call and what TRL made of each batch (its output, and the
    rewards it logged for its rows)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_completions: list[list] = []
        self.scored: list[dict] = []
        generate = self.remote_generation.generate

        def recorded(*pargs, **kw):
            completions = generate(*pargs, **kw)
            self.server_completions.append(completions)
            return completions

        self.remote_generation.generate = recorded

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        rewards = {name: list(values) for name, values in self._logs["rewards"].items()}  # TRL's log of this batch
        self.scored.append({**output, "rewards": rewards})
        return output


class RecordedReward:
    """TRL's soft overlong punishment, recording the completion ids it was given and what it returned."""

    __name__ = REWARD

    def __init__(self):
        self.reward = get_soft_overlong_punishment(max_completion_len=MAX_LENGTH, soft_punish_cache=SOFT_CACHE)
        self.calls: list[tuple[list, list]] = []

    def __call__(self, completion_ids, **kwargs):
        rewards = self.reward(completion_ids, **kwargs)
        self.calls.append(([list(ids) for ids in completion_ids], rewards))
        return rewards


def punishment(length: int) -> float:
    return min(0.0, (MAX_LENGTH - SOFT_CACHE - length) / SOFT_CACHE)


def train_on_eos_model(eos_model, tiny_model, server, tmp_path, reward, **settings) -> OverlongTrainer:
    client = SGLangClient(server.url)
    assert client.update_weights_from_disk(str(eos_model), weight_version="eos")["success"]
    args = tiny_config(tmp_path, per_device_train_batch_size=8, beta=0.0, generation_url=server.url, **settings)
    trainer = OverlongTrainer(model=str(eos_model), reward_funcs=reward, args=args, train_dataset=tiny_dataset())
    try:
        trainer.train()
    finally:
        restore_default_weights(server.url, tiny_model)
    return trainer


@pytest.mark.parametrize("mask", [True, False], ids=["masked", "unmasked"])
def test_mask_truncated_completions_masks_what_the_server_cut(eos_model, tiny_model, server, tmp_path, mask):
    trainer = train_on_eos_model(eos_model, tiny_model, server, tmp_path, RecordedReward(), max_steps=1,
                                 mask_truncated_completions=mask)
    [completions], [output] = trainer.server_completions, trainer.scored
    reasons = [c.finish_reason for c in completions]
    assert {"length", "stop"} <= set(reasons), reasons  # the run had both kinds
    lengths = output["completion_mask"].sum(dim=1).tolist()  # TRL's loss mask, row by row
    for completion, reason, length in zip(completions, reasons, lengths, strict=True):
        cut = reason == "length"
        assert (len(completion.token_ids) == MAX_LENGTH) if cut else (completion.token_ids[-1] in trainer.eos_token_ids)
        assert length == (0 if cut and mask else len(completion.token_ids)), (reason, completion.token_ids, length)
    clipped = [h["completions/clipped_ratio"] for h in trainer.state.log_history if "completions/clipped_ratio" in h]
    assert clipped == [reasons.count("length") / len(reasons)]


@pytest.mark.parametrize("dynamic", [False, True], ids=["plain", "dynamic_sampling"])
def test_soft_overlong_punishment_scores_the_lengths_the_server_produced(eos_model, tiny_model, server, tmp_path,
                                                                       dynamic):
    reward = RecordedReward()
    trainer = train_on_eos_model(eos_model, tiny_model, server, tmp_path, reward, max_steps=2, dynamic_sampling=dynamic)
    # every call of the reward (a dynamic-sampling round each) scored the completions of one generation call
    calls = len(reward.calls)
    assert calls == len(trainer.server_completions) and (calls > 2 if dynamic else calls == 2)  # rounds refilled
    for (given, rewards), completions in zip(reward.calls, trainer.server_completions):
        assert given == [c.token_ids for c in completions]
        assert rewards == [punishment(len(c.token_ids)) for c in completions]
    assert len({r for _, rewards in reward.calls for r in rewards}) > 2  # lengths graded, not only cut or not
    assert len(trainer.scored) == 2
    for output in trainer.scored:  # the trained rows' rewards, row by row: their own lengths
        lengths = output["completion_mask"].sum(dim=1).tolist()
        assert output["rewards"][REWARD] == pytest.approx([punishment(length) for length in lengths])  # float32


@pytest.fixture(scope="module")
def second_server(server):
    """Another built-in server on the tiny model: with `server`, a pool of two replicas."""
    with server_like(server) as other:
        yield other


def test_dynamic_sampling_over_two_replicas_trains_only_informative_groups(tiny_model, server, second_server, tmp_path):
    replicas = [server.url, second_server.url]
    args = tiny_config(tmp_path, per_device_train_batch_size=ROWS, num_generations=4, max_steps=2,
                       generation_url=replicas, ref_model_url=f"{server.url}/ref", dynamic_sampling=True)
    trainer = RecordingTrainer(model=str(tiny_model), reward_funcs=spread_unless_uniform, args=args,
                               train_dataset=prompts(uniform_every=2))
    try:
        trainer.train()
    finally:
        for url in replicas:
            restore_default_weights(url, tiny_model)
    assert_informative_full_batches(trainer, batches=2)
    assert trainer.scored == [ROWS] * 2  # the reference for the kept groups alone
    assert {url for batch in served(tmp_path) for url in batch} == set(replicas)  # both replicas sampled
