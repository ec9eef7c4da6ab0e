"""The protocol over real HTTP, against the built-in server and real SGLang 0.5.23 on the CPU (`protocol_server`):
reference log-probs, generation, weight reloads, bad input; and what only the built-in server has (its batching, its
seeded sampling), each saying why."""

import ctypes
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from open_r1_ext.server.batcher import Batcher
from open_r1_ext.sglang_client import SGLangClient, ServerRequestError
from open_r1_ext.launch.local_server import BuiltinServer
from tests.helpers import restore_default_weights


def local_logprobs(model, seq):
    """log p(t_i | t_<i), i = 1..len-1, from an in-process forward."""
    ids = torch.tensor([seq])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def atol(server) -> float:
    """How close a server's log-probs come to a transformers forward of the same float32 weights: the built-in server
    runs that forward; SGLang's kernels sum in another order."""
    return 1e-5 if server.engine == "builtin" else 2e-3


@pytest.fixture()
def client(protocol_server):
    return SGLangClient(protocol_server.url, request_timeout=60, max_retries=2)


def test_ref_logprobs_match_in_process_forward(client, hf_model, protocol_server):
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 17, 64, 5, 40)]
    remote = client.ref_logprobs(sequences)
    for seq, got in zip(sequences, remote):
        want = local_logprobs(hf_model, seq)
        assert got.shape == want.shape == (len(seq) - 1,)
        torch.testing.assert_close(got, want, atol=atol(protocol_server), rtol=0)


def test_raw_response_has_sglang_shapes(protocol_server):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 0}
    out = requests.post(f"{protocol_server.url}/generate", json=body, timeout=30).json()
    assert isinstance(out, dict) and set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == len(out["output_ids"]) == 2
    assert meta["finish_reason"] == {"type": "length", "length": 2}
    assert meta["input_token_logprobs"][0] == [None, 5, None]
    assert [e[1] for e in meta["input_token_logprobs"]] == [5, 6, 7]
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    batch = requests.post(f"{protocol_server.url}/generate", json={"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 1, "n": 2}}, timeout=30).json()
    assert isinstance(batch, list) and [b["meta_info"]["prompt_tokens"] for b in batch] == [2, 2, 1, 1]  # prompt-major


def test_logprob_start_len_returns_the_tail_of_the_full_pass(protocol_server):
    """From `logprob_start_len` on; the first entry returned is null whatever the start (as SGLang 0.5.23 answers)."""
    seq = [5, 6, 7, 8, 9]

    def entries(start):
        body = {"input_ids": seq, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": start}
        return requests.post(f"{protocol_server.url}/generate", json=body, timeout=30).json()["meta_info"]["input_token_logprobs"]

    full = entries(0)
    assert [e[1] for e in full] == seq and full[0][0] is None and all(e[2] is None for e in full)
    for start in (1, 3, 4):
        tail = entries(start)
        assert [e[1] for e in tail] == seq[start:] and tail[0][0] is None
        assert [e[0] for e in tail[1:]] == pytest.approx([e[0] for e in full[start + 1:]], abs=1e-5)


def test_greedy_generation_equals_transformers_generate(client, hf_model):
    """Greedy decoding is the argmax of the same logits on both servers (the tiny model's top two logits are far
    enough apart for SGLang's kernels not to swap them)."""
    prompts = [[10, 20, 30], [7, 8, 9, 10, 11, 12, 13], [100]]
    outs = client.generate(prompts, {"max_new_tokens": 12, "temperature": 0.0})
    for prompt, (completion,) in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        eos = hf_model.generation_config.eos_token_id
        if eos in ref:
            ref = ref[: ref.index(eos) + 1]
        assert completion.token_ids == ref
        assert len(completion.logprobs) == len(completion.token_ids)


def test_sampling_with_seed_is_reproducible_and_seeds_differ(client, protocol_server):
    prompts = [[1, 2, 3], [4, 5]]
    sampling = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    a = client.generate(prompts, sampling, n=3, seeds=[11, 12, 13, 14, 15, 16])
    assert len({tuple(c.token_ids) for c in a[0]}) == 3  # each copy its own sample
    assert all(len(c.logprobs) == len(c.token_ids) == 16 and all(lp <= 0 for lp in c.logprobs) for p in a for c in p)
    if protocol_server.engine == "builtin":  # seeded sampling repeats only in deterministic mode, which SGLang's CPU
        b = client.generate(prompts, sampling, n=3, seeds=[11, 12, 13, 14, 15, 16])  # backend does not have
        assert [[c.token_ids for c in p] for p in a] == [[c.token_ids for c in p] for p in b]


def test_sampling_seed_counts_only_with_deterministic_inference(tiny_model, server):
    """As SGLang: without --enable-deterministic-inference a sampling_seed is ignored; with it (the `server` fixture) a
    request without one samples with seed 42. /server_info says which, and that the server can mix weights on load.
    The built-in server only: SGLang's deterministic mode needs a GPU attention backend."""
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True,
                                                        "sampling_seed": 5}}
    with BuiltinServer(str(tiny_model), extra_args=("--no-ref-slot",)) as plain:
        info = requests.get(f"{plain.url}/server_info", timeout=10).json()
        assert info["enable_deterministic_inference"] is False and info["supports_weight_mixup"] is True
        outputs = {tuple(requests.post(f"{plain.url}/generate", json=body, timeout=30).json()["output_ids"]) for _ in range(3)}
        assert len(outputs) > 1
    assert requests.get(f"{server.url}/server_info", timeout=10).json()["enable_deterministic_inference"] is True
    seeded = {tuple(requests.post(f"{server.url}/generate", json=body, timeout=30).json()["output_ids"]) for _ in range(2)}
    unseeded = {**body, "sampling_params": {**body["sampling_params"], "sampling_seed": None}}
    as_42 = {**body, "sampling_params": {**body["sampling_params"], "sampling_seed": 42}}
    default = {tuple(requests.post(f"{server.url}/generate", json=b, timeout=30).json()["output_ids"]) for b in (unseeded, as_42)}
    assert len(seeded) == 1 and len(default) == 1


def test_ignore_eos_turns_off_stop_token_ids_too(protocol_server):
    """As SGLang 0.5.23 (`schedule_batch.py` ~1856-1858): `ignore_eos` ends every token-based stop, `stop_token_ids`
    included, not only the model's EOS."""
    def generate(**params):
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8, "temperature": 0, **params}}
        out = requests.post(f"{protocol_server.url}/generate", json=body, timeout=60).json()
        return out["output_ids"], out["meta_info"]["finish_reason"]

    greedy, finish = generate(ignore_eos=True)
    assert len(greedy) == 8 and finish == {"type": "length", "length": 8}
    stop = greedy[2]
    stopped, finish = generate(stop_token_ids=[stop])
    assert stopped == greedy[: greedy.index(stop) + 1] and finish == {"type": "stop", "matched": stop}
    assert generate(stop_token_ids=[stop], ignore_eos=True) == (greedy, {"type": "length", "length": 8})


def test_an_input_of_max_req_input_len_tokens_is_refused(protocol_server):
    """`/server_info.max_req_input_len` means the same on both: an input (here a whole sequence to score) of that many
    tokens is refused, one token less is served. SGLang's is min(context - 1, KV tokens - 1) - 5."""
    bound = requests.get(f"{protocol_server.url}/server_info", timeout=10).json()["max_req_input_len"]
    assert bound == 2048 - 6  # the tiny model's context: 2048 (SGLang here: 8192 KV tokens)
    client = SGLangClient(protocol_server.url, max_retries=0)
    assert client.sequence_limit() == bound - 1
    assert len(client.ref_logprobs([[5] * (bound - 1)])[0]) == bound - 2
    with pytest.raises(ServerRequestError) as refused:
        client.ref_logprobs([[5] * bound])
    assert refused.value.status_code == 400 and str(bound) in refused.value.detail


def test_top_k_and_top_p_restrict_the_sampled_set(client):
    prompts = [[1, 2, 3], [9, 8, 7, 6]]
    greedy = client.generate(prompts, {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True})
    for restrict in ({"top_k": 1}, {"top_p": 1e-4}):
        sampled = client.generate(prompts, {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True, **restrict},
                                  n=2, seeds=[1, 2, 3, 4])
        assert [[c.token_ids for c in g] for g in sampled] == [[g[0].token_ids] * 2 for g in greedy]
    wide = client.generate(prompts, {"max_new_tokens": 10, "temperature": 1.0, "top_k": 50, "ignore_eos": True},
                           n=2, seeds=[1, 2, 3, 4])
    assert wide[0][0].token_ids != greedy[0][0].token_ids


def test_update_weights_from_disk_then_partial_dump_refused(protocol_server, tiny_model, other_tiny_model, tmp_path):
    """A reload serves the new weights under the new version; a missing directory is refused, the old weights still in
    service. A half-written safetensors file (no manifest to check) is refused by the built-in server; SGLang 0.5.23's
    scheduler raises on it and the whole server exits (seen on the CPU), so it is not sent to SGLang here: the client
    never sends a dump whose manifest does not match its files (test_sglang_exactness)."""
    client = SGLangClient(protocol_server.url, request_timeout=60, max_retries=1)
    seq = [[3, 1, 4, 1, 5, 9, 2, 6]]
    other = AutoModelForCausalLM.from_pretrained(other_tiny_model, dtype=torch.float32).eval()
    try:
        result = client.update_weights_from_disk(str(other_tiny_model), weight_version="7")
        assert result["success"]
        assert client.weight_version() == "7"
        torch.testing.assert_close(client.ref_logprobs(seq)[0], local_logprobs(other, seq[0]), atol=atol(protocol_server), rtol=0)
        out = client.generate([[1, 2]], {"max_new_tokens": 1})[0][0]
        assert out.weight_version == "7"

        if protocol_server.engine == "builtin":
            partial = tmp_path / "partial"
            shutil.copytree(tiny_model, partial)
            weights = partial / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a half-written dump
            with pytest.raises(ServerRequestError, match="model.safetensors"):
                client.update_weights_from_disk(str(partial), weight_version="8")
        with pytest.raises(ServerRequestError) as refused:
            client.update_weights_from_disk(str(tmp_path / "missing"), weight_version="8")
        said = "no such directory" if protocol_server.engine == "builtin" else "Failed to get weights iterator"
        assert refused.value.status_code == 400 and said in refused.value.detail
        assert client.weight_version() == "7"  # old weights still in service
        torch.testing.assert_close(client.ref_logprobs(seq)[0], local_logprobs(other, seq[0]), atol=atol(protocol_server), rtol=0)
    finally:
        restore_default_weights(protocol_server.url, tiny_model)


def test_wrong_shapes_refused(server, tiny_model, tmp_path):
    """The built-in server only: SGLang 0.5.23 answers 200 to a directory of another intermediate_size (seen on the
    CPU) and serves whatever it copied; the trainer only ever reloads dumps of its own policy."""
    from tests.helpers import model_variant

    narrow = model_variant(tiny_model, tmp_path / "narrow", intermediate_size=96)
    client = SGLangClient(server.url, request_timeout=60, max_retries=1)
    with pytest.raises(ServerRequestError, match="shape"):
        client.update_weights_from_disk(str(narrow))
    assert client.weight_version() == "default"


def test_sixteen_concurrent_clients_get_their_own_answers(server, hf_model):
    """The built-in server only: it is about its batcher (`batches_run` is its own field)."""
    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 300, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist() for _ in range(16)]

    def ask(seq):
        return SGLangClient(server.url, request_timeout=60).ref_logprobs([seq])[0]

    before = requests.get(f"{server.url}/get_server_info", timeout=10).json()["batches_run"]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, sequences))
    after = requests.get(f"{server.url}/get_server_info", timeout=10).json()["batches_run"]
    for seq, got in zip(sequences, answers):
        torch.testing.assert_close(got, local_logprobs(hf_model, seq), atol=1e-5, rtol=0)
    assert after - before < 16, "concurrent requests were not batched together"


def test_lone_request_does_not_wait_out_the_batch_window(tiny_model, hf_model):
    with BuiltinServer(str(tiny_model), extra_args=("--no-ref-slot", "--max-batch-wait-ms", "3000")) as srv:
        client = SGLangClient(srv.url, request_timeout=60, max_retries=0)
        seq = [3, 1, 4, 1, 5]
        client.ref_logprobs([seq])  # warm-up
        started = time.perf_counter()
        got = client.ref_logprobs([seq])[0]
        assert time.perf_counter() - started < 1.5, "a request with nothing else on its way waited for the 3 s window"
        torch.testing.assert_close(got, local_logprobs(hf_model, seq), atol=1e-5, rtol=0)


def test_batcher_worker_keeps_the_torch_thread_count():
    """OpenMP counts threads per OS thread: the worker must not fall back to every core (`--num-threads` ignored)."""
    omp_get_max_threads = getattr(ctypes.CDLL(None), "omp_get_max_threads", None)
    if omp_get_max_threads is None:
        pytest.skip("torch's OpenMP runtime is not visible through ctypes here")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batcher = Batcher(engine=None)  # type: ignore[arg-type]  # only `call_exclusive` is used
        assert batcher.call_exclusive(omp_get_max_threads).result(timeout=10) == 1
        batcher.close()
    finally:
        torch.set_num_threads(before)


# (body, what the built-in server's 400 says, what SGLang 0.5.23's 400 says)
BAD_BODIES = [
    (b"{not json", "not valid JSON", "JSON decode error"),
    (b'{"input_ids": []}', "empty", "input_ids cannot be empty"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 100000}}', "context length", "maximum context length"),
    (b'{"input_ids": "hello"}', "input_ids", "must be list or null"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": "3"}}', "max_new_tokens", "expected i64"),
    (b'{"input_ids": [1], "sampling_params": {"temperature": -1}}', "temperature", "temperature must be"),
    (b'{"input_ids": [1], "sampling_params": {"top_p": 0}}', "top_p", "top_p must be in (0, 1]"),
    (b'{"input_ids": [1, 2], "logprob_start_len": 5, "return_logprob": true}', "logprob_start_len", "logprob_start_len=5"),
    (b'[1, 2, 3]', "body", "GenerateReqInput"),
]


@pytest.mark.parametrize("body,expected,sglang_says", BAD_BODIES)
def test_bad_input_gets_400_and_server_stays_up(protocol_server, body, expected, sglang_says):
    r = requests.post(f"{protocol_server.url}/generate", data=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    if protocol_server.engine == "builtin":
        assert expected in r.json()["error"]["message"]
    else:
        assert sglang_says in r.text
    assert requests.get(f"{protocol_server.url}/health", timeout=10).status_code == 200


BAD_FOR_THE_BUILTIN_SERVER_ONLY = [
    (b'{"input_ids": [1, 2], "unknown_field": 1}', "unknown_field"),  # SGLang drops unknown top-level keys: 200
    (b'{"input_ids": [[1, 2], []]}', "empty"),  # SGLang samples from the empty prompt of a batch: 200
    (b'{"input_ids": [1, 999999]}', "outside the vocabulary"),  # SGLang dies (below)
    (b'{"input_ids": [1, -1]}', "outside the vocabulary"),
    (b'{"input_ids": [[1], [2]], "sampling_params": [{"n": 1}]}', "sampling_params"),  # SGLang: HTTP 500
]


@pytest.mark.parametrize("body,expected", BAD_FOR_THE_BUILTIN_SERVER_ONLY)
def test_bad_input_sglang_does_not_refuse_gets_400_from_the_builtin_server(server, body, expected):
    """What SGLang 0.5.23 answers otherwise, seen on the CPU: it drops an unknown key, samples from an empty prompt,
    answers 500 to a list of sampling_params of another length, and does not check token ids at all: its scheduler dies
    on one outside the vocabulary (an IndexError in the embedding), the whole server with it. The trainer only sends
    ids of its tokenizer, the policy's; the built-in server's stricter 400 stands."""
    r = requests.post(f"{server.url}/generate", data=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and expected in r.json()["error"]["message"]
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200


def test_bad_weight_update_body_gets_400(protocol_server):
    r = requests.post(f"{protocol_server.url}/update_weights_from_disk", json={"path": "/x"}, timeout=30)
    assert r.status_code == 400 and "model_path" in r.text  # SGLang: pydantic's list of errors, naming the body's type


def test_health_info_and_flush_routes(protocol_server):
    assert requests.get(f"{protocol_server.url}/health_generate", timeout=30).status_code == 200
    info = requests.get(f"{protocol_server.url}/model_info", timeout=10).json()
    assert info["weight_version"] == "default" and info["model_type"] == "qwen2"
    assert info["architectures"] == ["Qwen2ForCausalLM"]
    assert "vocab_size" not in info  # SGLang's /model_info has none, and the built-in server's answers the same way
    assert requests.post(f"{protocol_server.url}/flush_cache", timeout=10).status_code == 200


def test_client_rides_through_server_restart(tiny_model, hf_model, tmp_path):
    srv = BuiltinServer(str(tiny_model), log_path=str(tmp_path / "log")).start()
    client = SGLangClient(srv.url, request_timeout=30, max_retries=10, backoff_factor=0.5)
    seq = [1, 2, 3, 4]
    try:
        assert len(client.ref_logprobs([seq])[0]) == 3
        srv.stop(signal_kill := 9)
        assert signal_kill == 9
        # restart in the background on the same port while the client retries
        import threading

        restarted = BuiltinServer(str(tiny_model), port=srv.port, log_path=str(tmp_path / "log2"))
        threading.Timer(1.0, restarted.start).start()
        got = client.ref_logprobs([seq])[0]
        torch.testing.assert_close(got, local_logprobs(hf_model, seq), atol=1e-5, rtol=0)
    finally:
        srv.stop()
        restarted.stop()


def test_client_error_names_url_when_server_never_comes(tiny_model):
    from open_r1_ext.sglang_client import ServerError
    from open_r1_ext.launch.local_server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    client = SGLangClient(url, max_retries=2, backoff_factor=0.05)
    with pytest.raises(ServerError, match=url):
        client.ref_logprobs([[1, 2]])
    with pytest.raises(ServerError, match="did not become healthy"):
        client.wait_until_healthy(timeout=1.0, poll_interval=0.2, progress=False)
