"""TRL's rollout extensions over remote generation, on the tiny model and a real built-in server: a user's
`rollout_func` doing two turns through the trainer's generation client, and TRL's tool-calling loop (`tools=`)
taking every turn from the server, with a model that really calls the tool."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.sglang_client import SGLangClient
from tests.helpers import restore_default_weights, reward_len, tiny_config, tiny_dataset


def test_rollout_func_takes_two_turns_through_the_server(tiny_model, server, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    feedback = tokenizer("\nCheck your answer:", add_special_tokens=False)["input_ids"]
    turns = []

    def two_turns(prompts, trainer):
        """First turn: `num_generations` samples of each prompt; second: each sample continues its own history."""
        generation = trainer.remote_generation
        prompt_ids = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
        first = generation.generate(prompt_ids, trainer.num_generations)
        second = generation.generate([p + c.token_ids + feedback for p, c in zip(prompt_ids, first)], 1)
        turns.append((first, second))
        return {"prompt_ids": prompt_ids,
                "completion_ids": [a.token_ids + feedback + b.token_ids for a, b in zip(first, second)],
                "logprobs": [a.logprobs + [0.0] * len(feedback) + b.logprobs for a, b in zip(first, second)],
                "env_mask": [[1] * len(a.token_ids) + [0] * len(feedback) + [1] * len(b.token_ids)
                             for a, b in zip(first, second)]}

    args = tiny_config(tmp_path, max_steps=2, generation_url=server.url, ref_model_url=f"{server.url}/ref")
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset(),
                                rollout_func=two_turns)
    try:
        trainer.train()
    finally:
        trainer.weight_sync.wait_durable()
        restore_default_weights(server.url, tiny_model)
    assert trainer.state.global_step == 2 and len(turns) == 2
    for step, (first, second) in enumerate(turns):
        assert len(first) == len(second) == 4
        # both turns came from the server, from the weights synced after the previous step
        assert {c.weight_version for c in first + second} == {"default" if step == 0 else "1"}
        assert all(len(c.logprobs) == len(c.token_ids) > 0 for c in first + second)
    # the second turn samples with seeds of its own, not the first turn's again
    first, second = turns[0]
    assert [c.token_ids for c in second] != [c.token_ids[: len(d.token_ids)] for c, d in zip(first, second)]
    with pytest.raises(ValueError, match="rollout_func and async_generation=True are exclusive"):
        RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, train_dataset=tiny_dataset(),
                          args=tiny_config(tmp_path, generation_url=server.url, beta=0.0, async_generation=True),
                          rollout_func=two_turns)


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call><|im_end|>'
QUESTION = [{"role": "user", "content": "What is 6 times 7? Use the multiply tool."}]


def tool_calling_model(base, out, tokenizer) -> None:
    """The tiny model taught (teacher forcing on one sequence, a few seconds) to answer QUESTION with CALL when it
    decodes greedily: a tiny random model never calls a tool by itself; this one does, through the real server."""
    prompt = tokenizer.apply_chat_template([QUESTION], tools=[multiply], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"][0]
    call = torch.tensor(tokenizer(CALL, add_special_tokens=False)["input_ids"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base)
    ids = torch.cat([torch.tensor(prompt), call]).unsqueeze(0)
    labels = torch.cat([torch.full((len(prompt),), -100), call]).unsqueeze(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(200):
        output = model(input_ids=ids, labels=labels)
        if torch.equal(output.logits[0, len(prompt) - 1 : -1].argmax(-1), call):  # greedy decoding gives the call
            break
        optimizer.zero_grad()
        output.loss.backward()
        optimizer.step()
    else:
        raise AssertionError(f"the model did not learn the call (loss {output.loss.item():.3f})")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def test_tool_call_round_trip_through_the_server(tiny_model, server, tmp_path):
    from trl.chat_template_utils import qwen2_5_chat_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = qwen2_5_chat_template  # a template that renders tools and that TRL parses calls from
    tool_model = tmp_path / "tool-model"
    tool_calling_model(tiny_model, tool_model, tokenizer)
    client = SGLangClient(server.url)
    client.update_weights_from_disk(str(tool_model), weight_version="default")  # the server now holds that model
    args = tiny_config(tmp_path / "run", max_steps=1, generation_url=server.url, weight_sync_steps=0, beta=0.0,
                       max_completion_length=128, max_tool_calling_iterations=1,
                       generation_kwargs={"temperature": 0.0})  # the server decodes greedily: the call
    trainer = RemoteGRPOTrainer(model=str(tool_model), reward_funcs=reward_len, args=args, processing_class=tokenizer,
                                train_dataset=Dataset.from_list([{"prompt": QUESTION}] * 4), tools=[multiply])
    # TRL's tool loop reads use_vllm (on: it switches TRL's importance sampling) with vllm_mode == "colocate" to reach
    # for a local vLLM engine; with remote generation its turns come from the server instead
    assert trainer.use_vllm and trainer.vllm_mode != "colocate"
    calls = []
    real_generate = trainer.remote_generation.client.generate

    def record(prompts, sampling, n=1, seeds=None):  # what the trainer asked the real server, unchanged
        calls.append((prompts, n))
        return real_generate(prompts, sampling, n=n, seeds=seeds)

    trainer.remote_generation.client.generate = record
    try:
        trainer.train()
    finally:
        restore_default_weights(server.url, tiny_model)
    assert trainer.state.global_step == 1
    (first, first_n), (next_turn, next_n) = calls[:2]
    assert first_n == 4 and len(first) == 1
    assert next_n == 1 and len(next_turn) == 4  # each sample continues its own history on the server
    assert all("42" in tokenizer.decode(ids[len(first[0]):]) for ids in next_turn)  # the tool's answer, in the prompt
    logged = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert logged and logged[0]["tools/call_frequency"] > 0 and logged[0]["tools/failure_frequency"] == 0
