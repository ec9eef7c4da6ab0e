"""The OpenAI side: the official `openai` Python client against the built-in server and real SGLang 0.5.23 on the CPU
(`protocol_server`: SGLang's `test/srt/test_openai_server.py` completion, chat completion and model tests, ported to
the tiny model; what only the built-in server does is asserted for it alone, saying why), and the OpenAI backend (`OpenAICompletionsClient`) against the built-in server as SGLang, as vLLM, and as a plain
OpenAI-compatible server (`--openai-text-only`: text prompts only, `n` dropped, no token ids), plus a server that
answers 500 every time (a small HTTP server in this file, standing in for a broken third-party server). SGLang's
`test_penalty` and `test_regex` become checks that the built-in server refuses `frequency_penalty` and `regex` by
name (it does neither), and `test_response_prefill` checks the prompt SGLang builds (the tiny model writes no JSON)."""

import json
import logging
import re
import shutil
import time

import openai
import pytest
import requests
from transformers import AutoTokenizer

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.launch.local_server import BuiltinServer
from open_r1_ext.openai_client import OpenAICompletionsClient, ServerAbilities
from open_r1_ext.protocol import completion_from_choice
from open_r1_ext.sglang_client import ServerError
from tests.helpers import JsonHandler, http_server, reward_len, tiny_config, tiny_dataset

API_KEY = "sk-123456"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def text_only(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("text-only-log") / "server.log"
    with BuiltinServer(str(tiny_model), log_path=str(log), extra_args=("--no-ref-slot", "--openai-text-only"),
                       deterministic=True) as srv:
        yield srv


def seeded(server, seed: int) -> dict:
    """Sampling settings whose two runs give the same answer: seeded on the built-in server (deterministic); greedy on
    SGLang, whose CPU backend has no deterministic mode and ignores seeds."""
    return {"seed": seed} if server.engine == "builtin" else {"temperature": 0}


def official_client(server) -> openai.Client:  # a server started without a key takes any
    return openai.Client(api_key=API_KEY, base_url=f"{server.url}/v1")


# ---------------------------------------------------------------------------------- test_openai_server.py
def run_completion(server, tokenizer, model, echo, logprobs, use_list_input, parallel_sample_num, token_input):
    client = official_client(server)
    if token_input:
        prompt_input = tokenizer.encode(PROMPT)
        num_prompt_tokens = len(prompt_input)
    else:
        prompt_input = PROMPT
        num_prompt_tokens = len(tokenizer.encode(PROMPT))
    if use_list_input:
        prompt_arg = [prompt_input, prompt_input]
        num_choices = len(prompt_arg)
        num_prompt_tokens *= 2
    else:
        prompt_arg = prompt_input
        num_choices = 1
    response = client.completions.create(model=model, prompt=prompt_arg, temperature=0, max_tokens=32, echo=echo,
                                         logprobs=logprobs, n=parallel_sample_num)
    assert len(response.choices) == num_choices * parallel_sample_num
    if echo:
        assert response.choices[0].text.startswith(PROMPT)
    if logprobs:
        assert response.choices[0].logprobs
        assert isinstance(response.choices[0].logprobs.tokens[0], str)
        assert isinstance(response.choices[0].logprobs.top_logprobs[1], dict)
        assert len(response.choices[0].logprobs.top_logprobs[1]) > 0
        if not echo:  # with echo the first token's log-prob is None
            assert response.choices[0].logprobs.token_logprobs[0]
    assert response.id
    assert response.created
    assert response.usage.prompt_tokens == num_prompt_tokens, f"{response.usage.prompt_tokens} vs {num_prompt_tokens}"
    assert response.usage.completion_tokens > 0
    assert response.usage.total_tokens > 0


def run_completion_stream(server, tokenizer, model, echo, logprobs, use_list_input, parallel_sample_num, token_input):
    client = official_client(server)
    prompt_input = tokenizer.encode(PROMPT) if token_input else PROMPT
    prompt_arg, num_choices = ([prompt_input, prompt_input], 2) if use_list_input else (prompt_input, 1)
    generator = client.completions.create(model=model, prompt=prompt_arg, temperature=0, max_tokens=32, echo=echo,
                                          logprobs=logprobs, stream=True, stream_options={"include_usage": True},
                                          n=parallel_sample_num)
    is_firsts = {}
    usage_seen = False
    for response in generator:
        usage = response.usage
        if usage is not None:
            assert usage.prompt_tokens > 0 and usage.completion_tokens > 0 and usage.total_tokens > 0
            usage_seen = True
            continue
        index = response.choices[0].index
        is_first = is_firsts.get(index, True)
        if logprobs:
            assert response.choices[0].logprobs
            assert isinstance(response.choices[0].logprobs.tokens[0], str)
            if not (is_first and echo):
                assert isinstance(response.choices[0].logprobs.top_logprobs[0], dict)
                assert len(response.choices[0].logprobs.top_logprobs[0]) > 0
        if is_first:
            if echo:
                assert response.choices[0].text.startswith(PROMPT), response.choices[0].text
            is_firsts[index] = False
        assert response.id
        assert response.created
    for index in range(parallel_sample_num * num_choices):
        assert not is_firsts.get(index, True), f"index {index} is not found in the response"
    assert usage_seen


@pytest.mark.parametrize("logprobs", [None, 5])
def test_completion(protocol_server, tokenizer, tiny_model, logprobs):
    for echo in (False, True):
        for use_list_input in (True, False):
            for parallel_sample_num in (1, 2):
                for token_input in (False, True):
                    run_completion(protocol_server, tokenizer, str(tiny_model), echo, logprobs, use_list_input,
                                   parallel_sample_num, token_input)


@pytest.mark.parametrize("logprobs", [None, 5])
def test_completion_stream(protocol_server, tokenizer, tiny_model, logprobs):
    for echo in (False, True):
        for use_list_input, parallel_sample_num in ((False, 1), (True, 2)):
            for token_input in (False, True):
                run_completion_stream(protocol_server, tokenizer, str(tiny_model), echo, logprobs, use_list_input,
                                      parallel_sample_num, token_input)


def test_stream_deltas_add_up_to_the_answer(protocol_server, tiny_model):
    """Streamed text pieces join to the non-streamed text, also when a character's bytes span tokens (held back until
    complete) and when a stop string ends the answer (its start held back until it cannot be one)."""
    client = official_client(protocol_server)
    for extra in ({**seeded(protocol_server, 3), "echo": True, "n": 2},
                  {**seeded(protocol_server, 5), "stop": ["\u00e9", "ab"]}, {"temperature": 0, "stop": ["dd"]}):
        body = {"model": str(tiny_model), "prompt": "Hello world", "max_tokens": 20, "temperature": 1.0, **extra}
        whole = [c.text for c in client.completions.create(**body).choices]
        pieces = {}
        for chunk in client.completions.create(**body, stream=True):
            for choice in chunk.choices:
                pieces[choice.index] = pieces.get(choice.index, "") + choice.text
        assert [pieces[i] for i in range(len(whole))] == whole
    chunks = list(client.completions.create(model=str(tiny_model), prompt="Hi", max_tokens=4, temperature=0,
                                            stream=True, user="someone", extra_body={"rid": "my-request", "ignore_eos": True},
                                            stream_options={"continuous_usage_stats": True}))
    counted = [c.usage.completion_tokens for c in chunks]  # SGLang may send several tokens in one chunk
    assert counted == sorted(counted) and counted[-1] == 4 and {c.id for c in chunks} == {"my-request"}
    assert protocol_server.engine == "sglang" or counted == [1, 2, 3, 4]  # the built-in server: a chunk per token


def test_model_list(protocol_server):
    models = list(official_client(protocol_server).models.list())
    assert len(models) == 1
    assert isinstance(getattr(models[0], "max_model_len", None), int)
    assert isinstance(models[0].created, int) and models[0].created > 0


def test_retrieve_model(protocol_server, tiny_model):
    client = official_client(protocol_server)
    retrieved_model = client.models.retrieve(str(tiny_model))
    assert retrieved_model.id == str(tiny_model) and retrieved_model.root == str(tiny_model)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("non-existent-model")


def test_stop_strings_and_unsupported_fields(protocol_server, tiny_model):
    client = official_client(protocol_server)
    greedy = client.completions.create(model=str(tiny_model), prompt=PROMPT, temperature=0, max_tokens=12)
    stop = greedy.choices[0].text[3:6]  # a piece of what greedy decoding writes
    stopped = client.completions.create(model=str(tiny_model), prompt=PROMPT, temperature=0, max_tokens=12, stop=[stop])
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and stop not in choice.text and greedy.choices[0].text.startswith(choice.text)
    assert choice.model_extra["matched_stop"] == stop
    with pytest.raises(openai.BadRequestError, match="top_k"):  # SGLang's range (0 is refused), on both
        client.completions.create(model=str(tiny_model), prompt=PROMPT, max_tokens=2, extra_body={"top_k": 0})
    with pytest.raises(openai.BadRequestError, match="min_.*tokens"):
        client.completions.create(model=str(tiny_model), prompt=PROMPT, max_tokens=2, extra_body={"min_tokens": 3})
    if protocol_server.engine == "sglang":
        return  # SGLang does best_of (one choice), and more than 5 log-probs: refused by the built-in server only
    with pytest.raises(openai.BadRequestError, match="best_of: not supported by the built-in server"):
        client.completions.create(model=str(tiny_model), prompt=PROMPT, max_tokens=2, best_of=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=str(tiny_model), prompt=PROMPT, max_tokens=2, logprobs=6)  # OpenAI's limit: 5


CHAT = [{"role": "system", "content": "You are a helpful AI assistant"},
        {"role": "user", "content": "What is the capital of France?"}]


def run_chat_completion(server, model, logprobs, parallel_sample_num):
    client = official_client(server)
    # adapted: max_tokens=32 (as SGLang's earlier version of this test): the tiny model rarely ends by itself, and
    # without a limit a completion runs to the end of the context, as in SGLang
    response = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=32,
                                              logprobs=logprobs is not None and logprobs > 0, top_logprobs=logprobs,
                                              n=parallel_sample_num)
    if logprobs:
        assert isinstance(response.choices[0].logprobs.content[0].top_logprobs[0].token, str)
        ret_num_top_logprobs = len(response.choices[0].logprobs.content[0].top_logprobs)
        assert ret_num_top_logprobs == logprobs, f"{ret_num_top_logprobs} vs {logprobs}"
    assert len(response.choices) == parallel_sample_num
    assert response.choices[0].message.role == "assistant"
    assert isinstance(response.choices[0].message.content, str)
    assert response.id
    assert response.created
    assert response.usage.prompt_tokens > 0
    assert response.usage.completion_tokens > 0
    assert response.usage.total_tokens > 0


def run_chat_completion_stream(server, model, logprobs, parallel_sample_num=1):
    client = official_client(server)
    generator = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=32,  # as above
                                               logprobs=logprobs is not None and logprobs > 0, top_logprobs=logprobs,
                                               stream=True, stream_options={"include_usage": True}, n=parallel_sample_num)
    is_firsts, is_finished, finish_reason_counts = {}, {}, {}
    usage_seen = False  # added: the usage chunk include_usage asks for does come
    for response in generator:
        usage = response.usage
        if usage is not None:
            assert usage.prompt_tokens > 0, "usage.prompt_tokens was zero"
            assert usage.completion_tokens > 0, "usage.completion_tokens was zero"
            assert usage.total_tokens > 0, "usage.total_tokens was zero"
            usage_seen = True
            continue
        index = response.choices[0].index
        finish_reason = response.choices[0].finish_reason
        if finish_reason is not None:
            is_finished[index] = True
            finish_reason_counts[index] = finish_reason_counts.get(index, 0) + 1
        data = response.choices[0].delta
        if is_firsts.get(index, True):
            assert data.role == "assistant", "data.role was not 'assistant' for first chunk"
            is_firsts[index] = False
            continue
        if logprobs and not is_finished.get(index, False):
            assert response.choices[0].logprobs, "logprobs was not returned"
            assert isinstance(response.choices[0].logprobs.content[0].top_logprobs[0].token, str)
            assert isinstance(response.choices[0].logprobs.content[0].top_logprobs, list)
            ret_num_top_logprobs = len(response.choices[0].logprobs.content[0].top_logprobs)
            assert ret_num_top_logprobs == logprobs, f"{ret_num_top_logprobs} vs {logprobs}"
        assert (isinstance(data.content, str) or isinstance(data.model_extra.get("reasoning_content"), str)
                or (isinstance(data.tool_calls, list) and len(data.tool_calls) > 0) or response.choices[0].finish_reason)
        assert response.id
        assert response.created
    for index in range(parallel_sample_num):
        assert not is_firsts.get(index, True), f"index {index} is not found in the response"
    for index in range(parallel_sample_num):
        assert index in finish_reason_counts, f"No finish_reason found for index {index}"
        assert finish_reason_counts[index] == 1, f"Expected 1 finish_reason chunk for index {index}, got {finish_reason_counts[index]}"
    assert usage_seen


@pytest.mark.parametrize("logprobs", [None, 5])
def test_chat_completion(protocol_server, tiny_model, logprobs):
    for parallel_sample_num in (1, 2):
        run_chat_completion(protocol_server, str(tiny_model), logprobs, parallel_sample_num)


@pytest.mark.parametrize("logprobs", [None, 5])
def test_chat_completion_stream(protocol_server, tiny_model, logprobs):
    for parallel_sample_num in (1, 2):
        run_chat_completion_stream(protocol_server, str(tiny_model), logprobs, parallel_sample_num)


def test_chat_is_the_chat_template_then_a_completion(protocol_server, tokenizer, tiny_model):
    """The messages go through the model's chat template with the assistant's turn opened: the chat answer is the
    completion of those token ids (same text, tokens and log-probs, greedy and seeded), and usage counts them. (The
    built-in server's ids start `chatcmpl-` as OpenAI's; SGLang's are bare hex.)"""
    client = official_client(protocol_server)
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    pieces = 0
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "top_p": 0.9, **seeded(protocol_server, 11)}):
        chat = client.chat.completions.create(model=str(tiny_model), messages=CHAT, max_completion_tokens=12,
                                              logprobs=True, top_logprobs=2, **sampling)
        plain = client.completions.create(model=str(tiny_model), prompt=prompt, max_tokens=12, logprobs=2,
                                          extra_body={"return_token_ids": True}, **sampling)
        assert chat.object == "chat.completion" and chat.id
        assert chat.model == str(tiny_model) and chat.usage.prompt_tokens == len(prompt)
        assert chat.choices[0].message.content == plain.choices[0].text
        assert chat.usage.completion_tokens == plain.usage.completion_tokens == len(chat.choices[0].logprobs.content)
        entries = chat.choices[0].logprobs.content
        assert [e.logprob for e in entries] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
        assert [e.token for e in entries] == plain.choices[0].logprobs.tokens
        assert all(len(e.top_logprobs) == 2 for e in entries)
        # bytes: the tokens' own (a byte-level BPE tokenizer), also for a piece of a character (its text reads U+FFFD)
        ids = plain.choices[0].model_extra["token_ids"]
        assert bytes(b for e in entries for b in e.bytes).decode(errors="replace") == tokenizer.decode(ids)
        assert all(e.bytes != list("\ufffd".encode()) for e in entries if e.token == "\ufffd")
        pieces += sum(e.token == "\ufffd" for e in entries)
        assert chat.choices[0].finish_reason == plain.choices[0].finish_reason
    if protocol_server.engine == "builtin":  # its seeded answer has such a token; SGLang's greedy ones have none
        assert pieces, "no token of these answers is part of a character: the bytes check above proved less"
    # text content parts are joined with spaces, as SGLang does
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "the capital?"}]}]
    joined = [{"role": "user", "content": "What is the capital?"}]
    answers = [client.chat.completions.create(model=str(tiny_model), messages=m, temperature=0, max_tokens=8)
               for m in (parts, joined)]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[0].usage.prompt_tokens == answers[1].usage.prompt_tokens


def test_chat_response_prefill(protocol_server, tokenizer, tiny_model):
    """SGLang's test_response_prefill, adapted to what SGLang 0.5.23 does with a last assistant message (the tiny model
    extracts no JSON): with `continue_final_message` the answer continues it (its tokens follow the opened assistant
    turn); without, it is sent as a user message."""
    client = official_client(protocol_server)
    prefill = [CHAT[1], {"role": "assistant", "content": "{\n"}]
    opened = tokenizer.apply_chat_template(prefill[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    as_user = tokenizer.apply_chat_template([CHAT[1], {"role": "user", "content": "{\n"}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    for extra, prompt in (({"continue_final_message": True}, opened + tokenizer.encode("{\n")), ({}, as_user)):
        chat = client.chat.completions.create(model=str(tiny_model), messages=prefill, temperature=0, max_tokens=8,
                                              extra_body=extra)
        plain = client.completions.create(model=str(tiny_model), prompt=prompt, temperature=0, max_tokens=8)
        assert chat.usage.prompt_tokens == len(prompt) and chat.choices[0].message.content == plain.choices[0].text


def test_chat_stream_deltas_add_up_to_the_answer(protocol_server, tiny_model):
    """Streamed content pieces join to the non-streamed message, each choice's log-probs in the stream are those of
    the whole answer, the finish chunk carries the finish reason and matched stop, and continuous usage counts up."""
    client = official_client(protocol_server)
    for extra in ({**seeded(protocol_server, 3), "n": 2, "logprobs": True, "top_logprobs": 1},
                  {**seeded(protocol_server, 5), "stop": ["\u00e9", "ab"]}, {"temperature": 0, "stop": ["dd"], "logprobs": True}):
        body = {"model": str(tiny_model), "messages": CHAT, "max_tokens": 20, "temperature": 1.0, **extra}
        whole = client.chat.completions.create(**body).choices
        pieces, logprobs, finish = {}, {}, {}
        for chunk in client.chat.completions.create(**body, stream=True):
            assert chunk.object == "chat.completion.chunk"
            for choice in chunk.choices:
                pieces[choice.index] = pieces.get(choice.index, "") + (choice.delta.content or "")
                logprobs.setdefault(choice.index, []).extend(choice.logprobs.content if choice.logprobs else [])
                if choice.finish_reason:
                    finish[choice.index] = (choice.finish_reason, choice.model_extra["matched_stop"])
        assert [pieces[i] for i in range(len(whole))] == [c.message.content for c in whole]
        assert [finish[i] for i in range(len(whole))] == [(c.finish_reason, c.model_extra["matched_stop"]) for c in whole]
        if body.get("logprobs"):
            assert [[e.token for e in logprobs[i]] for i in range(len(whole))] == [[e.token for e in c.logprobs.content]
                                                                                  for c in whole]
    chunks = list(client.chat.completions.create(model=str(tiny_model), messages=CHAT, max_completion_tokens=4,
                                                 temperature=0, stream=True, user="someone",
                                                 extra_body={"rid": "my-chat", "ignore_eos": True},
                                                 stream_options={"continuous_usage_stats": True}))
    counted = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert counted == sorted(counted) and counted[-1] == 4 and {c.id for c in chunks} == {"my-chat"}


def test_chat_limits_and_unsupported_fields(protocol_server, tiny_model):
    """SGLang's test_penalty and test_regex, adapted: the built-in server does neither, and says so by name (as it
    refuses every SGLang chat field it does not do, e.g. tools); SGLang does them (and takes `top_logprobs` without
    `logprobs`, or above 20), so those are asserted for the built-in server only. Both refuse image parts for a text
    model, no messages, and a completion past the context."""
    client = official_client(protocol_server)
    answer = client.chat.completions.create(model=str(tiny_model), messages=CHAT, max_completion_tokens=5, max_tokens=50,
                                            extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 5 and answer.choices[0].finish_reason == "length"  # the newer name wins
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}
    refused = {  # the built-in server's message, SGLang's
        ("image_url: not supported", "unsupported content type 'image_url'"): image,
        ("messages: List should have at least 1 item", "Messages cannot be empty"): {"messages": []},
        ("max_completion_tokens", "maximum context length"): {"max_completion_tokens": 5000},  # past the context
    }
    if protocol_server.engine == "builtin":
        refused.update({(f"{field}: not supported by the built-in server", None): fields for field, fields in (
            ("frequency_penalty", {"frequency_penalty": 1.0}), ("regex", {"extra_body": {"regex": r"\{\n"}}),
            ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
            ("response_format", {"response_format": {"type": "json_object"}}))})
        refused[("top_logprobs: needs logprobs: true", None)] = {"top_logprobs": 2}
        refused[("top_logprobs: Input should be less than or equal to 20", None)] = {"logprobs": True, "top_logprobs": 21}
    for messages, fields in refused.items():
        message = messages[0] if protocol_server.engine == "builtin" else messages[1]
        with pytest.raises(openai.BadRequestError, match=re.escape(message)):
            client.chat.completions.create(**{"model": str(tiny_model), "messages": CHAT, "max_tokens": 2, **fields})


def test_chat_refused_by_the_models_template_or_without_one(tiny_model, tmp_path):
    """A model without a chat template (the root slot) and one whose template raises on a system message (the /ref
    slot, as many templates do): 400 saying so, never a traceback."""
    bare, strict = tmp_path / "no-template", tmp_path / "no-system"
    shutil.copytree(tiny_model, bare, ignore=shutil.ignore_patterns("chat_template.jinja"))
    shutil.copytree(tiny_model, strict)
    template = (strict / "chat_template.jinja").read_text()
    (strict / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}" + template)
    with BuiltinServer(str(bare), log_path=str(tmp_path / "server.log"), extra_args=("--ref-model-path", str(strict))) as srv:
        r = requests.post(f"{srv.url}/v1/chat/completions", json={"messages": CHAT}, timeout=30)
        assert r.status_code == 400 and "has no chat template; use /v1/completions" in r.json()["error"]["message"]
        r = requests.post(f"{srv.url}/ref/v1/chat/completions", json={"messages": CHAT}, timeout=30)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "messages: the model's chat template refused them: System role not supported"
        r = requests.post(f"{srv.url}/ref/v1/chat/completions", json={"messages": CHAT[1:], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


# ------------------------------------------------------------------------------------------ the OpenAI backend
def test_token_ids_come_back_the_sglang_way_and_the_vllm_way(server):
    """Divergence 1: SGLang says ids in `choices[i].token_ids` (`return_token_ids`), vLLM as `"token_id:N"` tokens
    (`return_tokens_as_token_ids`); the backend reads either, and they are the ids the server sampled."""
    body = {"model": "m", "prompt": [[1, 2, 3]], "max_tokens": 6, "temperature": 0, "logprobs": 0}
    native = requests.post(f"{server.url}/generate", timeout=30, json={
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    for switch in ("return_token_ids", "return_tokens_as_token_ids"):
        choice = requests.post(f"{server.url}/v1/completions", json={**body, switch: True}, timeout=30).json()["choices"][0]
        completion = completion_from_choice(choice)
        assert completion is not None and completion.token_ids == native["output_ids"]
        assert len(completion.logprobs) == 6
    text_only = requests.post(f"{server.url}/v1/completions", json=body, timeout=30).json()["choices"][0]
    assert completion_from_choice(text_only) is None


def test_backend_against_the_builtin_server(server, tokenizer):
    client = OpenAICompletionsClient(server.url, tokenizer=tokenizer)
    client.wait_until_healthy(timeout=30, progress=False)
    assert client.abilities == ServerAbilities(token_id_prompts=True, prompt_lists=True, n_in_one_request=True,
                                               token_ids=True, logprobs=True, extensions=True, reloads_weights=True)
    sampling = {"max_new_tokens": 8, "temperature": 1.0}
    groups = client.generate([[1, 2, 3], [4, 5]], sampling, n=3, seeds=[7, 8, 9, 10, 11, 12])
    # divergence 2: a deterministic server gives every copy of a seeded request the same seed; one request per copy
    assert all(len({tuple(c.token_ids) for c in g}) == 3 for g in groups)
    again = client.generate([[1, 2, 3], [4, 5]], sampling, n=3, seeds=[7, 8, 9, 10, 11, 12])
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in groups]
    assert all(c.logprobs is not None and len(c.logprobs) == len(c.token_ids) for g in groups for c in g)
    unseeded = client.generate([[1, 2, 3]], {**sampling, "temperature": 0.0}, n=2)  # one request with n
    assert [len(g) for g in unseeded] == [2]


def test_backend_adapts_to_a_plain_openai_server(text_only, tokenizer, tiny_model, tmp_path, caplog):
    """A server like llama.cpp's: text prompts only, one choice per prompt whatever n, text instead of ids."""
    r = requests.post(f"{text_only.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and "text prompts only" in r.text
    client = OpenAICompletionsClient(text_only.url, tokenizer=tokenizer)
    with caplog.at_level(logging.WARNING, logger="open_r1_ext.openai_client"):
        client.wait_until_healthy(timeout=30, progress=False)
        assert client.abilities == ServerAbilities(token_id_prompts=False, prompt_lists=True, n_in_one_request=False,
                                                   token_ids=False, logprobs=True, extensions=True,
                                                   reloads_weights=True)
        prompts = [tokenizer.encode("Hello there"), tokenizer.encode(PROMPT)]
        groups = client.generate(prompts, {"max_new_tokens": 6, "temperature": 1.0}, n=2)
        client.generate(prompts, {"max_new_tokens": 6, "temperature": 1.0}, n=2, seeds=[1, 2, 3, 4])
    assert [len(g) for g in groups] == [2, 2]
    assert all(c.logprobs is None and c.token_ids for g in groups for c in g)  # re-tokenized text: no log-probs
    warnings = [r.message for r in caplog.records]
    assert sum("text prompts only" in m for m in warnings) == 1 and sum("lossy" in m for m in warnings) == 1
    # and the trainer trains through it
    args = tiny_config(tmp_path, max_steps=1, generation_url=text_only.url, generation_backend="openai",
                       weight_sync_steps=0, beta=0.0)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    trainer.train()
    assert trainer.state.global_step == 1


class FailsOnIds(JsonHandler):
    """A broken OpenAI-compatible server (as FastChat's: a token-id prompt gets HTTP 500): the text probe answers, and
    every other completion gets the same 500."""

    bodies: list = []

    def do_GET(self):
        self.answer(200, {"object": "list", "data": [{"id": "broken", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if body["max_tokens"] == 1 and isinstance(body["prompt"][0], str):
            return self.answer(200, {"choices": [{"index": i, "text": "x", "finish_reason": "length"} for i in range(2)]})
        self.answer(500, {"error": {"message": "prompt_logprobs: value is not a valid integer"}})



def test_a_deterministic_500_is_retried_a_few_times_and_reported(tokenizer):
    with http_server(FailsOnIds) as url:
        client = OpenAICompletionsClient(url, tokenizer=tokenizer, backoff_factor=0.1)
        started = time.monotonic()
        assert client.abilities.token_id_prompts is False  # the probe went on to text prompts
        with pytest.raises(ServerError, match="HTTP 500 after retries: .*prompt_logprobs: value is not a valid integer"):
            client.generate([[1, 2, 3]], {"max_new_tokens": 2})
        probes = [b for b in FailsOnIds.bodies if b["max_tokens"] == 1]
        assert [isinstance(b["prompt"][0], str) for b in probes] == [False] * 3 + [True]  # 1 try + 2 retries, then text
        assert len(FailsOnIds.bodies) - len(probes) == 3  # the first try and two retries, not minutes of them
        assert time.monotonic() - started < 10
