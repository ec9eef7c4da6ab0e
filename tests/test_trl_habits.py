"""A TRL user's habits with `RemoteGRPOTrainer`: every `GRPOTrainer` argument (an environment-owned reward, no
`reward_funcs`), `repetition_penalty` and transformers-style `generation_kwargs` on the built-in server and real
SGLang, the built-in server's penalties checked against SGLang's, and a sampling setting a server refuses found at
start-up and reported as a refusal, never as an outage."""

import inspect
from pathlib import Path

import pytest
import trl
from transformers import AutoTokenizer

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.server_pool import ServerPool
from open_r1_ext.sglang_client import ServerRequestError, SGLangClient
from tests.helpers import reward_len, tiny_config, tiny_dataset

OUTAGE_ADVICE = "answers again"


def test_init_takes_every_argument_of_trl_with_its_default():
    """Derived from trl's own signature: an argument a future TRL adds that the subclass does not take fails here."""
    trl_parameters = inspect.signature(trl.GRPOTrainer.__init__).parameters
    ours = inspect.signature(RemoteGRPOTrainer.__init__).parameters
    assert list(ours) == list(trl_parameters)
    for name, parameter in trl_parameters.items():
        assert (ours[name].kind, ours[name].default) == (parameter.kind, parameter.default), name
    assert trl_parameters["reward_funcs"].default is None  # optional in TRL, so in ours


class RewardingEnv:
    """An environment that owns the reward (TRL's `get_reward`) and offers no tools."""

    def reset(self, **kwargs):
        return None

    def get_reward(self) -> float:
        return 1.0


def tool_calling_tokenizer(tiny_model: Path):
    """The tiny model's tokenizer with TRL's Qwen2.5 chat template (environments need one that renders tool calls)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    return tokenizer


def test_environment_owned_reward_trains_without_reward_funcs(tiny_model, server, tmp_path):
    args = tiny_config(tmp_path, max_steps=1, beta=0.0, generation_url=server.url, weight_sync_steps=0)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), args=args, train_dataset=tiny_dataset(),
                                processing_class=tool_calling_tokenizer(tiny_model), environment_factory=RewardingEnv)
    trainer.train()
    assert trainer.state.global_step == 1
    assert trainer.state.log_history[0]["rewards/RewardingEnv/mean"] == 1.0


def test_no_reward_source_gives_trls_error(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="No reward source provided"):
        RemoteGRPOTrainer(model=str(tiny_model), args=tiny_config(tmp_path, beta=0.0), train_dataset=tiny_dataset())


def test_repetition_penalty_and_transformers_generation_kwargs_train(tiny_model, protocol_server, tmp_path):
    """GRPOConfig's repetition_penalty, `do_sample: true` (what sampling already does, dropped) and transformers'
    `stop_strings` (SGLang's `stop`) reach the server, which samples with them, on both servers."""
    args = tiny_config(tmp_path, max_steps=1, beta=0.0, generation_url=protocol_server.url, weight_sync_steps=0,
                       repetition_penalty=1.1, generation_kwargs={"do_sample": True, "stop_strings": ["\n\n"]})
    assert args.generation_kwargs == {"stop": ["\n\n"]}
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    sampling = trainer.remote_generation._sampling_params()
    assert (sampling["repetition_penalty"], sampling["stop"]) == (1.1, ["\n\n"]) and "do_sample" not in sampling
    trainer.train()
    assert trainer.state.global_step == 1


@pytest.mark.parametrize("kwargs, nearest", [
    ({"num_beams": 4}, "none: GRPO samples num_generations"),
    ({"do_sample": False}, "temperature: 0"),
    ({"no_repeat_ngram_size": 3}, "repetition_penalty or frequency_penalty"),
])
def test_transformers_generation_kwargs_without_sglang_twin_are_refused(tmp_path, kwargs, nearest):
    key = next(iter(kwargs))
    with pytest.raises(ValueError, match=rf"generation_kwargs\.{key}=.*nearest SGLang setting: {nearest}"):
        tiny_config(tmp_path, generation_url="http://g:1", generation_kwargs=kwargs)


def test_refused_sampling_setting_stops_at_start_up_as_a_refusal(tiny_model, server, tmp_path):
    """TRL's vllm_structured_outputs_regex is SGLang's `regex`, which the built-in server refuses: the start-up probe
    finds it before step 1, naming the setting and the server's message; a refusal met mid-run is no outage either."""
    args = tiny_config(tmp_path / "regex", max_steps=1, beta=0.0, generation_url=server.url, weight_sync_steps=0,
                       vllm_structured_outputs_regex="[0-9]+")
    with pytest.raises(ValueError) as refused:
        RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    message = str(refused.value)
    assert "refuses vllm_structured_outputs_regex='[0-9]+'" in message and "regex: not supported by the built-in server" in message
    assert "not an outage" in message and OUTAGE_ADVICE not in message

    args = tiny_config(tmp_path / "later", max_steps=1, beta=0.0, generation_url=server.url, weight_sync_steps=0)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    args.generation_kwargs = {"regex": "[0-9]+"}  # a setting refused only once training runs
    with pytest.raises(ServerRequestError) as stopped:
        trainer.train()
    message = str(stopped.value)
    assert "Training stopped at step 0" in message and "regex: not supported by the built-in server" in message
    assert "would be refused again" in message and OUTAGE_ADVICE not in message


def test_the_start_up_probe_asks_every_replica_of_a_pool(server, shared_sglang):
    """A pool of real SGLang, which takes `stop_regex`, and the built-in server, which refuses it: the built-in replica's
    refusal is found whichever replica would have served first."""
    for urls in ([shared_sglang.url, server.url], [server.url, shared_sglang.url]):
        pool = ServerPool(urls)
        try:
            with pytest.raises(ServerRequestError, match=rf"{server.url}/generate rejected .*stop_regex: not supported"):
                pool.check_sampling({"max_new_tokens": 4, "temperature": 1.0, "stop_regex": "x+"})
        finally:
            pool.close()


PENALTY_PROMPTS = [[1, 2, 3, 4, 5], [10, 20, 30], [100, 101, 102, 103, 104, 105, 106]]
PENALTIES = [{"repetition_penalty": 2.0}, {"repetition_penalty": 0.5}, {"frequency_penalty": 0.7},
             {"presence_penalty": 1.5}, {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.3}]


def greedy_outputs(url: str, penalty: dict) -> list[tuple[list[int], list[float]]]:
    body = {"input_ids": PENALTY_PROMPTS, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True, **penalty}}
    return [(r["output_ids"], [e[0] for e in r["meta_info"]["output_token_logprobs"]])
            for r in SGLangClient(url).post_json("/generate", body)]


@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda p: ",".join(p))
def test_penalties_match_sglang(server, shared_sglang, penalty):
    """SGLang's penalties, on the built-in server: greedy outputs and their log-probs equal to real SGLang's. The
    log-probs SGLang returns are the penalized ones (they differ from those without the penalty); its default
    scheduler counts a token from the step after next, the prompt's last token in its place at first."""
    ours, sglang = greedy_outputs(server.url, penalty), greedy_outputs(shared_sglang.url, penalty)
    plain = greedy_outputs(shared_sglang.url, {})
    assert [ids for ids, _ in ours] == [ids for ids, _ in sglang]
    for (_, mine), (_, theirs) in zip(ours, sglang):
        assert mine == pytest.approx(theirs, abs=2e-3)
    assert any(abs(a - b) > 0.05 for (_, lp), (_, free) in zip(sglang, plain) for a, b in zip(lp, free))
