"""The built-in server under hostile or broken input (issue #14): bounded requests, validation at the edge, one bad
request failing alone, 4xx naming the field or file, poisoned weights refused, API key and weight-directory checks,
and a seeded fuzz run of bad requests mixed with valid ones."""

import json
import os
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from open_r1_ext.launch.local_server import BuiltinServer
from open_r1_ext.server.batcher import Batcher
from open_r1_ext.server.engine import GenerationTask, ModelEngine
from open_r1_ext.server.limits import Limits
from open_r1_ext.protocol import SamplingParams
from open_r1_ext.sglang_client import SGLangClient, ServerRequestError

VOCAB = 300  # the tiny model's
LIMITED = dict(max_n=8, max_batch_items=16, max_request_tokens=2000, max_body_bytes=20000)


@pytest.fixture(scope="module")
def allowed_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("allowed-weights")


@pytest.fixture(scope="module")
def limited(tiny_model, allowed_dir, tmp_path_factory):
    """A server with small limits, one slot, reading weights only below `allowed_dir`."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in LIMITED.items()]
    log = tmp_path_factory.mktemp("limited-log") / "server.log"
    with BuiltinServer(str(tiny_model), log_path=str(log),
                       extra_args=("--no-ref-slot", *flags, "--weight-dirs", str(allowed_dir)), deterministic=True) as srv:
        yield srv


def post(url, route, body, timeout=30, **kwargs):
    data = body if not isinstance(body, (dict, list)) else json.dumps(body)  # bytes, or an iterator: sent chunked
    headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
    return requests.post(f"{url}{route}", data=data, headers=headers, timeout=timeout, **kwargs)


def message(response) -> str:
    body = response.json()
    return body["message"] if "message" in body else body["error"]["message"]


def assert_refused(response, *words):
    assert response.status_code == 400, (response.status_code, response.text)
    for word in words:
        assert word in message(response), (word, response.text)


def healthy(url) -> bool:
    return requests.get(f"{url}/health", timeout=5).status_code == 200


def reference_logprobs(url, seq=(3, 1, 4, 1, 5, 9, 2, 6)):
    body = {"input_ids": list(seq), "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0}
    return [e[0] for e in post(url, "/generate", body).json()["meta_info"]["input_token_logprobs"]]


# ------------------------------------------------------------------------------------------- bounded requests
def test_n_beyond_the_limit_is_refused_at_once_and_health_answers(server):
    for n in (Limits.max_n + 1, 100_000_000):
        started = time.monotonic()
        r = post(server.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "n": n}}, timeout=10)
        assert_refused(r, "sampling_params.n", "--max-n")
        assert_refused(post(server.url, "/v1/completions", {"prompt": [1, 2], "n": n, "max_tokens": 1}, timeout=10), "n:", "--max-n")
        assert time.monotonic() - started < 5
        assert healthy(server.url)


def test_limits_are_flags_and_answered_400(limited):
    url = limited.url
    assert_refused(post(url, "/generate", {"input_ids": [[1]] * 17, "sampling_params": {"max_new_tokens": 0}}),
                   "input_ids", "--max-batch-items 16")
    assert_refused(post(url, "/generate", {"input_ids": [1] * 200, "sampling_params": {"max_new_tokens": 100, "n": 8}}),
                   "input_ids", "2400 tokens", "--max-request-tokens 2000")
    big = {"input_ids": [1] * 8000, "sampling_params": {"max_new_tokens": 0}}
    assert_refused(post(url, "/generate", big), "body", "--max-body-bytes 20000")
    chunked = post(url, "/generate", (c for c in [json.dumps(big).encode()[:15000], json.dumps(big).encode()[15000:]]))
    assert_refused(chunked, "body", "--max-body-bytes 20000")
    small_chunked = post(url, "/generate", iter([b'{"input_ids": [1, 2], ', b'"sampling_params": {"max_new_tokens": 1}}']))
    assert small_chunked.status_code == 200, small_chunked.text
    at_limits = post(url, "/generate", {"input_ids": [[1] * 100] * 2, "sampling_params": {"max_new_tokens": 25, "n": 8}})
    assert at_limits.status_code == 200 and len(at_limits.json()) == 16
    assert healthy(url)


def test_a_fifo_in_a_weight_dir_is_refused_without_blocking(server, tiny_model, tmp_path):
    for name in ("model.safetensors", "manifest.json", "model.safetensors.index.json"):
        dump = tmp_path / name
        shutil.copytree(tiny_model, dump)
        (dump / name).unlink(missing_ok=True)
        os.mkfifo(dump / name)
        r = post(server.url, "/update_weights_from_disk", {"model_path": str(dump)}, timeout=10)
        assert_refused(r, name, "not a regular file")
    assert healthy(server.url)
    assert post(server.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}, timeout=10).ok
    assert requests.get(f"{server.url}/get_model_info", timeout=5).json()["weight_version"] == "default"


# ------------------------------------------------------------------------- one bad request fails only itself
OVERFLOWING = [
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 2**63, "max_new_tokens": 2}}, "sampling_params.top_k"),
    ({"input_ids": [1, 2], "sampling_params": {"sampling_seed": 2**64 - 1, "max_new_tokens": 2}}, "sampling_params.sampling_seed"),
    ({"input_ids": [1, 2], "sampling_params": {"sampling_seed": -(2**63) - 1, "max_new_tokens": 2}}, "sampling_params.sampling_seed"),
]


def test_values_that_would_overflow_in_a_batch_are_refused_and_valid_neighbours_served(server):
    valid = [{"input_ids": [i, i + 1, i + 2], "sampling_params": {"max_new_tokens": 4, "sampling_seed": i, "ignore_eos": True}}
             for i in range(1, 13)]
    alone = [post(server.url, "/generate", body).json() for body in valid]
    mixed = [(body, None) for body in valid] + OVERFLOWING * 3
    random.Random(0).shuffle(mixed)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda item: post(server.url, "/generate", item[0]), mixed))
    for (body, field), r in zip(mixed, answers):
        if field is None:
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == alone[valid.index(body)]["output_ids"]
        else:
            assert_refused(r, field)
    # the top seed, every copy's sampling_seed (as SGLang)
    r = post(server.url, "/v1/completions", {"prompt": [1, 2], "n": 3, "max_tokens": 2, "seed": 2**63 - 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3


def test_a_top_p_that_underflows_float32_still_samples_the_most_likely_token(server):
    """top_p 1e-300 passes validation (> 0) but is 0 in float32: every token was dropped and token 0 came out."""
    greedy = post(server.url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                                      "ignore_eos": True}}).json()
    tiny_p = post(server.url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "top_p": 1e-300,
                                                                                      "ignore_eos": True, "sampling_seed": 3}})
    assert tiny_p.json()["output_ids"] == greedy["output_ids"]


def test_a_failure_inside_a_batch_fails_only_the_request_that_caused_it(tiny_model):
    """Three requests start together (one prefill of 4 rows); a token id past the vocabulary makes it fail, as a value
    overflowing in torch would: each request is started again alone, and only the bad one gets the error."""
    engine = ModelEngine(str(tiny_model))
    rows = []
    forward = engine._forward
    engine._forward = lambda adapters, **inputs: rows.append(len(adapters)) or forward(adapters, **inputs)
    batcher = Batcher(engine, max_wait_ms=2000)
    try:
        gate = threading.Event()
        busy = batcher.call_exclusive(gate.wait)  # the worker waits while the three requests queue up
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        prompts = ([[1, 2], [3, 4]], [[10**6]], [[5, 6]])
        futures = [batcher.generate([GenerationTask(p, params, 0) for p in group]) for group in prompts]
        gate.set()
        busy.result(timeout=10)
        together = [[t.output_ids for t in futures[i].result(timeout=10)] for i in (0, 2)]
        with pytest.raises(IndexError):
            futures[1].result(timeout=10)
        assert rows[0] == 4, "the three requests were not started together"
        assert not engine.live_tasks
        alone = [engine.generate([GenerationTask(p, params, 0)])[0].output_ids for p in ([1, 2], [3, 4], [5, 6])]
        assert together == [alone[:2], alone[2:]]
    finally:
        batcher.close()


# ------------------------------------------------------------------------------ 4xx naming the field or file
def write_json(directory, name, content):
    (directory / name).write_text(content if isinstance(content, str) else json.dumps(content))


MALFORMED_FILES = [
    ("manifest.json", []),
    ("manifest.json", {"files": []}),
    ("manifest.json", {"files": {}}),
    ("manifest.json", "{not json"),
    ("manifest.json", {"files": {"model.safetensors": {"size": "12"}}}),
    ("manifest.json", {"files": {"model.safetensors": 12}}),
    ("manifest.json", {"files": {"../../etc/passwd": {"size": 1}}}),
    ("model.safetensors.index.json", []),
    ("model.safetensors.index.json", {"weight_map": ["model.safetensors"]}),
    ("model.safetensors.index.json", {"weight_map": {"w": 3}}),
    ("model.safetensors.index.json", {"weight_map": {"w": "/etc/passwd"}}),
    ("model.safetensors.index.json", "\xff"),
]


@pytest.mark.parametrize("name,content", MALFORMED_FILES)
def test_malformed_manifest_or_index_gets_400_naming_the_file(server, tiny_model, tmp_path, name, content):
    dump = tmp_path / "dump"
    shutil.copytree(tiny_model, dump)
    write_json(dump, name, content)
    r = post(server.url, "/update_weights_from_disk", {"model_path": str(dump), "weight_version": "bad"})
    assert_refused(r, str(dump), name)
    assert r.json()["success"] is False
    assert requests.get(f"{server.url}/get_model_info", timeout=5).json()["weight_version"] == "default"


def test_wrong_content_type_and_completion_fields_are_named(server):
    r = requests.post(f"{server.url}/generate", data='{"input_ids": [1]}', headers={"Content-Type": "text/plain"}, timeout=10)
    assert_refused(r, "Content-Type", "text/plain", "application/json")
    r = requests.post(f"{server.url}/generate", data=b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}', timeout=10)
    assert_refused(r, "Content-Type", "missing")
    r = post(server.url, "/v1/completions", {"prompt": []})
    assert_refused(r, "prompt[0]", "empty")
    assert "input_ids" not in message(r)
    r = post(server.url, "/v1/completions", {"prompt": [1], "max_tokens": 10**6})
    assert_refused(r, "prompt[0]", "max_tokens")
    r = post(server.url, "/generate", {"input_ids": [1], "sampling_params": {"temperature": "hot"}})
    assert_refused(r, "sampling_params.temperature")
    assert "SamplingParams" not in message(r)


# ------------------------------------------------------------------------------------ weights that would poison
@pytest.mark.parametrize("poison", ["nan", "inf", "int"])
def test_nan_inf_or_integer_weights_are_refused(server, tiny_model, tmp_path, poison):
    before = reference_logprobs(server.url)
    dump = tmp_path / "dump"
    shutil.copytree(tiny_model, dump)
    tensors = load_file(str(dump / "model.safetensors"))
    name = next(n for n in sorted(tensors) if n.endswith("mlp.up_proj.weight"))
    if poison == "int":
        tensors[name] = torch.ones_like(tensors[name], dtype=torch.int32)
    else:
        tensors[name] = tensors[name].clone()
        tensors[name][0, 0] = float(poison)
    save_file(tensors, str(dump / "model.safetensors"), metadata={"format": "pt"})
    r = post(server.url, "/update_weights_from_disk", {"model_path": str(dump), "weight_version": "poisoned"})
    assert_refused(r, name, "not floating point" if poison == "int" else "NaN or Inf")
    assert requests.get(f"{server.url}/get_model_info", timeout=5).json()["weight_version"] == "default"
    assert reference_logprobs(server.url) == before


# ------------------------------------------------------------------------------------------------ security
def test_api_key_is_compared_in_constant_time(monkeypatch):
    import asyncio
    import hmac

    from open_r1_ext.server import app as server_app

    compared = []
    constant_time = hmac.compare_digest

    def compare_digest(a, b):
        compared.append((a, b))
        return constant_time(a, b)

    monkeypatch.setattr(server_app.hmac, "compare_digest", compare_digest)
    application = server_app.create_app({}, api_key="sekret")

    def status(authorization):
        headers = [(b"authorization", authorization)] if authorization is not None else []
        scope = {"type": "http", "method": "GET", "path": "/model_info", "raw_path": b"/model_info", "query_string": b"",
                 "headers": headers, "http_version": "1.1", "scheme": "http", "server": ("t", 1), "client": ("t", 2),
                 "root_path": "", "asgi": {"version": "3.0"}}
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        asyncio.run(application(scope, receive, send))
        return sent[0]["status"]

    assert status(b"Bearer sekreT") == 401
    assert status(None) == 401
    assert status(b"Bearer sekret") == 404  # past the key check; this app has no slots
    assert status(b"bearer sekret") == 404  # the scheme in any case, as SGLang (RFC 7235)
    assert status(b"Basic sekret") == 401
    assert compared and all(b == b"sekret" for _, b in compared)


def test_weight_updates_only_from_allowed_dirs(limited, tiny_model, other_tiny_model, allowed_dir, tmp_path):
    url = limited.url
    r = post(url, "/update_weights_from_disk", {"model_path": str(other_tiny_model), "weight_version": "outside"})
    assert_refused(r, "model_path", str(other_tiny_model), "--weight-dirs")
    link = allowed_dir / "link-out"
    link.symlink_to(other_tiny_model)
    assert_refused(post(url, "/update_weights_from_disk", {"model_path": str(link)}), "--weight-dirs")
    assert_refused(post(url, "/update_weights_from_disk", {"model_path": f"{allowed_dir}/../{other_tiny_model.name}"}), "--weight-dirs")
    inside = allowed_dir / "step-1"
    shutil.copytree(tiny_model, inside)
    r = post(url, "/update_weights_from_disk", {"model_path": str(inside), "weight_version": "1"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert requests.get(f"{url}/get_model_info", timeout=5).json()["weight_version"] == "1"


# ------------------------------------------------------------------------------------------------------ fuzz
def _valid_requests():
    """Deterministic requests (greedy or seeded), each with its route."""
    reqs = []
    for i in range(6):
        prompt = [(7 * i + j) % VOCAB for j in range(3 + i)]
        reqs.append(("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                                   "logprob_start_len": 0}))
        reqs.append(("/generate", {"input_ids": [prompt, prompt[:2]], "sampling_params": {"max_new_tokens": 3, "n": 2,
                                   "sampling_seed": i, "ignore_eos": True}, "return_logprob": True}))
        reqs.append(("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}))
        reqs.append(("/v1/completions", {"prompt": prompt, "max_tokens": 3, "seed": 100 + i, "n": 2, "logprobs": 0,
                                         "return_tokens_as_token_ids": True}))
        reqs.append(("/generate", {"text": f"prompt {i}", "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                   "stop": ["zz"], "logit_bias": {str(i): 2.0}}, "return_logprob": True,
                                   "logprob_start_len": 0, "top_logprobs_num": 2, "token_ids_logprob": [1, i]}))
        reqs.append(("/v1/completions", {"prompt": f"prompt {i}", "max_tokens": 3, "temperature": 0, "echo": True,
                                         "logprobs": 2, "return_token_ids": True}))
        reqs.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": f"prompt {i}"}], "max_tokens": 3,
                                              "seed": i, "n": 2, "logprobs": True, "top_logprobs": 2, "stop": "zz"}))
    return reqs


# (where in a /generate body, a bad value, the words its message must contain)
BAD_GENERATE_VALUES = [
    ("input_ids", "hello", "input_ids"), ("input_ids", [], "input_ids"), ("input_ids", [[1], []], "input_ids[1]"),
    ("input_ids", [1, VOCAB], "input_ids[0]"), ("input_ids", [-1], "input_ids[0]"), ("input_ids", [2**63], "input_ids[0]"),
    ("input_ids", [1.5], "input_ids"), ("input_ids", [[1]] * 17, "--max-batch-items"), ("input_ids", None, "input_ids"),
    ("sampling_params.max_new_tokens", -1, "sampling_params.max_new_tokens"),
    ("sampling_params.max_new_tokens", 10**6, "max_new_tokens"), ("sampling_params.max_new_tokens", "3", "max_new_tokens"),
    ("sampling_params.temperature", -0.5, "sampling_params.temperature"), ("sampling_params.temperature", "x", "temperature"),
    ("sampling_params.top_p", 0, "sampling_params.top_p"), ("sampling_params.top_p", 1.5, "top_p"),
    ("sampling_params.top_k", 2**63, "sampling_params.top_k"), ("sampling_params.top_k", -2, "top_k"),
    ("sampling_params.top_k", 2**31, "top_k"), ("sampling_params.n", 0, "sampling_params.n"),
    ("sampling_params.n", 9, "--max-n"), ("sampling_params.n", 10**8, "--max-n"), ("sampling_params.n", True, "n"),
    ("sampling_params.sampling_seed", 2**64 - 1, "sampling_seed"), ("sampling_params.sampling_seed", 2**63, "sampling_seed"),
    ("sampling_params.sampling_seed", "7", "sampling_seed"), ("sampling_params.stop_token_ids", [VOCAB], "stop_token_ids"),
    ("sampling_params.stop_token_ids", 3, "stop_token_ids"), ("sampling_params.ignore_eos", "yes", "ignore_eos"),
    ("sampling_params.min_tokens", 1, "min_tokens"), ("sampling_params", [{}, {}], "sampling_params"),
    ("sampling_params", "greedy", "sampling_params"), ("return_logprob", "yes", "return_logprob"),
    ("return_logprob", [True, False], "return_logprob"), ("logprob_start_len", 99, "logprob_start_len"),
    ("logprob_start_len", -2, "logprob_start_len"), ("top_logprobs_num", -1, "top_logprobs_num"),
    ("stream", "yes", "stream"), ("rid", 5, "rid"), ("no_such_field", 1, "no_such_field"),
    ("token_ids_logprob", [VOCAB], "token_ids_logprob"), ("lora_path", "adapter", "lora_path: the LoRA adapter 'adapter' was requested, but LoRA is not enabled"),
    ("lora_path", 5, "lora_path"),
    ("sampling_params.regex", "a+", "sampling_params.regex: not supported"),
    ("sampling_params.repetition_penalty", 2.5, "repetition_penalty"), ("sampling_params.logit_bias", {"x": 1.0}, "logit_bias"),
    ("text", 5, "text"),
]
BAD_COMPLETION_VALUES = [
    ("prompt", [], "prompt[0]"), ("prompt", 5, "prompt"), ("prompt", [VOCAB], "prompt[0]"), ("n", 10**8, "--max-n"),
    ("n", 0, "n"), ("max_tokens", 10**6, "max_tokens"), ("seed", 2**63, "seed"), ("top_k", 2**62, "top_k"),
    ("logprobs", 6, "logprobs"), ("temperature", -1, "temperature"), ("best_of", 2, "best_of: not supported"),
    ("stop", 5, "stop"), ("stream_options", {"x": 1}, "stream_options.x"),
]
BAD_CHAT_VALUES = [
    ("messages", [], "messages"), ("messages", [{"role": "bot", "content": "x"}], "messages[0].role"),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "image_url: not supported"),
    ("messages", "hello", "messages"), ("max_completion_tokens", 10**6, "max_completion_tokens"), ("n", 9, "--max-n"),
    ("top_logprobs", 21, "top_logprobs"), ("logprobs", "yes", "logprobs"), ("seed", 2**63, "seed"),
    ("tools", [{"type": "function", "function": {"name": "f"}}], "tools: not supported"),
    ("stream_options", {"x": 1}, "stream_options.x"),
]
BAD_RAW = [  # (route, body bytes, Content-Type, words)
    ("/generate", b"{not json", "application/json", "not valid JSON"), ("/generate", b"[1, 2]", "application/json", "body"),
    ("/generate", b'{"input_ids": [1]}', "text/plain", "Content-Type"), ("/generate", b"", "application/json", "body"),
    ("/generate", b'{"input_ids": [18446744073709551616]}', "application/json", "input_ids[0]"),
    ("/generate", b'{"input_ids": [' + b"1, " * 8000 + b"1]}", "application/json", "--max-body-bytes"),
    ("/v1/completions", b'{"prompt": [1]', "application/json", "not valid JSON"),
    ("/update_weights_from_disk", b'{"path": "/x"}', "application/json", "model_path"),
    ("/update_weights_from_disk", b'{"model_path": "/nonexistent/x"}', "application/json", "--weight-dirs"),
    ("/update_weights_from_disk", b'{"model_path": 5}', "application/json", "model_path"),
    ("/update_weights_from_disk", b'{"model_path": ""}', "application/json", "model_path"),
    ("/update_weights_from_disk", b'{"model_path": "/tmp/a\\u0000b"}', "application/json", "NUL"),
    ("/update_weights_from_disk", b'{"model_path": "/x", "mixup_alpha": 2}', "application/json", "mixup_alpha"),
    ("/load_lora_adapter", b'{"lora_name": "v1"}', "application/json", "lora_path"),
    ("/unload_lora_adapter", b'{"lora_name": ""}', "application/json", "lora_name"),
    ("/load_lora_adapter_from_tensors", b'{"lora_name": "v1", "config_dict": {}}', "application/json",
     "serialized_named_tensors"),
    ("/load_lora_adapter_from_tensors", b'{"lora_name": "v1", "config_dict": {}, "serialized_named_tensors": ["x"], '
     b'"load_format": "flattened_bucket"}', "application/json", "load_format"),
]


def _set(body, where, value):
    *parents, leaf = where.split(".")
    node = body
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[leaf] = value


def _bad_requests(rng, count, allowed_dir):
    """`count` bad requests, each with the words its message must contain: every case of the catalogues once, then
    random ones (one bad value in an otherwise valid body, a raw body, or a reload of a broken dump)."""
    def generate(where, value, words):
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        _set(body, where, value)
        return "/generate", json.dumps(body).encode(), "application/json", words

    def completion(key, value, words):
        body = {"prompt": [1, 2, 3], "max_tokens": 2, key: value}
        return "/v1/completions", json.dumps(body).encode(), "application/json", words

    def chat(key, value, words):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, key: value}
        return "/v1/chat/completions", json.dumps(body).encode(), "application/json", words

    def reload(dump):
        return "/update_weights_from_disk", json.dumps({"model_path": str(dump)}).encode(), "application/json", dump.name

    dumps = [allowed_dir / "fuzz-missing", allowed_dir / "fuzz-manifest"]
    out = [generate(*case) for case in BAD_GENERATE_VALUES] + [completion(*case) for case in BAD_COMPLETION_VALUES]
    out += [chat(*case) for case in BAD_CHAT_VALUES]
    out += BAD_RAW + [reload(dump) for dump in dumps]
    while len(out) < count:
        kind = rng.random()
        if kind < 0.55:
            out.append(generate(*rng.choice(BAD_GENERATE_VALUES)))
        elif kind < 0.68:
            out.append(completion(*rng.choice(BAD_COMPLETION_VALUES)))
        elif kind < 0.8:
            out.append(chat(*rng.choice(BAD_CHAT_VALUES)))
        elif kind < 0.9:
            out.append(rng.choice(BAD_RAW))
        else:
            out.append(reload(rng.choice(dumps)))
    return out


def _same_answer(got, want):
    """Token ids and texts equal; log-probs equal within float noise (a batch's padding may move the last bits); each
    answer has its own `id` and `created`."""
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want.keys() - {"id", "created"}:
            _same_answer(got[key], want[key])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _same_answer(g, w)
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-4)
    else:
        assert got == want


def test_fuzz_bad_requests_mixed_with_valid_ones(limited, allowed_dir):
    """300 seeded bad requests and 100 valid ones, shuffled, 6 at a time: every bad one gets 400 naming what is wrong,
    every valid one the answer it gets alone, /health answers throughout, the weights never change."""
    url = limited.url
    (allowed_dir / "fuzz-manifest").mkdir(exist_ok=True)
    write_json(allowed_dir / "fuzz-manifest", "manifest.json", {"files": [{"name": "x"}]})
    rng = random.Random(14)
    valid = _valid_requests()
    alone = [post(url, route, body).json() for route, body in valid]
    weights_before = reference_logprobs(url)
    version_before = requests.get(f"{url}/get_model_info", timeout=5).json()["weight_version"]

    work = [("bad", item) for item in _bad_requests(rng, 300, allowed_dir)]
    work += [("valid", rng.randrange(len(valid))) for _ in range(100)]
    rng.shuffle(work)

    def send(entry):
        kind, item = entry
        if kind == "valid":
            route, body = valid[item]
            return post(url, route, body)
        route, data, content_type, _ = item
        return requests.post(f"{url}{route}", data=data, headers={"Content-Type": content_type}, timeout=30)

    started = time.monotonic()
    health_failures = []
    stop = threading.Event()

    def watch_health():
        while not stop.wait(0.2):
            try:
                if requests.get(f"{url}/health", timeout=2).status_code != 200:
                    health_failures.append("status")
            except requests.RequestException as err:
                health_failures.append(repr(err))

    watcher = threading.Thread(target=watch_health)
    watcher.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(send, work))
    finally:
        stop.set()
        watcher.join()
    elapsed = time.monotonic() - started

    for (kind, item), r in zip(work, answers):
        if kind == "valid":
            assert r.status_code == 200, (valid[item], r.text)
            _same_answer(r.json(), alone[item])
        else:
            route, data, _, words = item
            assert 400 <= r.status_code < 500, (route, data[:200], r.status_code, r.text)
            assert words in message(r), (route, data[:200], words, r.text)
    assert not health_failures
    assert healthy(url)
    assert requests.get(f"{url}/get_model_info", timeout=5).json()["weight_version"] == version_before
    assert reference_logprobs(url) == weights_before
    assert elapsed < 60, f"the fuzz run took {elapsed:.1f} s"


def test_a_server_without_enable_lora_refuses_adapters(limited, allowed_dir):
    """As SGLang started without --enable-lora: load and unload answer 400 with its message."""
    client = SGLangClient(limited.url)
    with pytest.raises(ServerRequestError, match="LoRA is not enabled. Please set `--enable-lora`") as err:
        client.load_lora_adapter("v1", str(allowed_dir))
    assert err.value.status_code == 400
    with pytest.raises(ServerRequestError, match="LoRA is not enabled"):
        client.unload_lora_adapter("v1")
    assert client.server_info()["enable_lora"] is False
