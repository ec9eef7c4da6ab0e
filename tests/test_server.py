"""The built-in server over real HTTP: exact log-probs, generation, weight reloads, batching, bad input."""

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


def local_logprobs(model, seq):
    """log p(t_i | t_<i), i = 1..len-1, from an in-process forward."""
    ids = torch.tensor([seq])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture()
def client(server):
    return SGLangClient(server.url, request_timeout=60, max_retries=2)


def test_ref_logprobs_match_in_process_forward(client, hf_model):
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 17, 64, 5, 40)]
    remote = client.ref_logprobs(sequences)
    for seq, got in zip(sequences, remote):
        want = local_logprobs(hf_model, seq)
        assert got.shape == want.shape == (len(seq) - 1,)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_raw_response_has_sglang_shapes(server):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 0}
    out = requests.post(f"{server.url}/generate", json=body, timeout=30).json()
    assert isinstance(out, dict) and set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == len(out["output_ids"]) == 2
    assert meta["finish_reason"] == {"type": "length", "length": 2}
    assert meta["input_token_logprobs"][0] == [None, 5, None]
    assert [e[1] for e in meta["input_token_logprobs"]] == [5, 6, 7]
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    batch = requests.post(f"{server.url}/generate", json={"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 1, "n": 2}}, timeout=30).json()
    assert isinstance(batch, list) and [b["meta_info"]["prompt_tokens"] for b in batch] == [2, 2, 1, 1]  # prompt-major


def test_logprob_start_len_returns_the_tail_of_the_full_pass(server):
    seq = [5, 6, 7, 8, 9]

    def entries(start):
        body = {"input_ids": seq, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": start}
        return requests.post(f"{server.url}/generate", json=body, timeout=30).json()["meta_info"]["input_token_logprobs"]

    full = entries(0)
    assert [e[1] for e in full] == seq and full[0][0] is None and all(e[2] is None for e in full)
    for start in (1, 3, 4):
        tail = entries(start)
        assert [e[1] for e in tail] == seq[start:]
        assert [e[0] for e in tail] == pytest.approx([e[0] for e in full[start:]], abs=1e-6)


def test_greedy_generation_equals_transformers_generate(client, hf_model):
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


def test_sampling_with_seed_is_reproducible_and_seeds_differ(client):
    prompts = [[1, 2, 3], [4, 5]]
    sampling = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    a = client.generate(prompts, sampling, n=3, seeds=[11, 12, 13, 14, 15, 16])
    b = client.generate(prompts, sampling, n=3, seeds=[11, 12, 13, 14, 15, 16])
    assert [[c.token_ids for c in p] for p in a] == [[c.token_ids for c in p] for p in b]
    assert len({tuple(c.token_ids) for c in a[0]}) == 3  # each copy its own seed -> different samples
    # the sampling log-probs are those of the chosen tokens
    assert all(lp <= 0 for p in a for c in p for lp in c.logprobs)


def test_sampling_seed_counts_only_with_deterministic_inference(tiny_model, server):
    """As SGLang: without --enable-deterministic-inference a sampling_seed is ignored; with it (the `server` fixture) a
    request without one samples with seed 42. /server_info says which, and that the server can mix weights on load."""
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


def test_update_weights_from_disk_then_partial_dump_refused(server, tiny_model, other_tiny_model, tmp_path):
    client = SGLangClient(server.url, request_timeout=60, max_retries=1)
    seq = [[3, 1, 4, 1, 5, 9, 2, 6]]
    other = AutoModelForCausalLM.from_pretrained(other_tiny_model, dtype=torch.float32).eval()
    try:
        result = client.update_weights_from_disk(str(other_tiny_model), weight_version="7")
        assert result["success"]
        assert client.weight_version() == "7"
        torch.testing.assert_close(client.ref_logprobs(seq)[0], local_logprobs(other, seq[0]), atol=1e-5, rtol=0)
        out = client.generate([[1, 2]], {"max_new_tokens": 1})[0][0]
        assert out.weight_version == "7"

        partial = tmp_path / "partial"
        shutil.copytree(tiny_model, partial)
        weights = partial / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a half-written dump
        with pytest.raises(ServerRequestError, match="model.safetensors"):
            client.update_weights_from_disk(str(partial), weight_version="8")
        with pytest.raises(ServerRequestError, match="no such directory"):
            client.update_weights_from_disk(str(tmp_path / "missing"), weight_version="8")
        assert client.weight_version() == "7"  # old weights still in service
        torch.testing.assert_close(client.ref_logprobs(seq)[0], local_logprobs(other, seq[0]), atol=1e-5, rtol=0)
    finally:
        client.update_weights_from_disk(str(tiny_model), weight_version="default")


def test_wrong_shapes_refused(server, tiny_model, tmp_path):
    from tests.helpers import model_variant

    narrow = model_variant(tiny_model, tmp_path / "narrow", intermediate_size=96)
    client = SGLangClient(server.url, request_timeout=60, max_retries=1)
    with pytest.raises(ServerRequestError, match="shape"):
        client.update_weights_from_disk(str(narrow))
    assert client.weight_version() == "default"


def test_sixteen_concurrent_clients_get_their_own_answers(server, hf_model):
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


BAD_BODIES = [
    (b"{not json", "not valid JSON"),
    (b'{"input_ids": [1, 2], "unknown_field": 1}', "unknown_field"),
    (b'{"input_ids": [1, 999999]}', "outside the vocabulary"),
    (b'{"input_ids": [1, -1]}', "outside the vocabulary"),
    (b'{"input_ids": []}', "empty"),
    (b'{"input_ids": [[1, 2], []]}', "empty"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 100000}}', "context length"),
    (b'{"input_ids": "hello"}', "input_ids"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": "3"}}', "max_new_tokens"),
    (b'{"input_ids": [1], "sampling_params": {"temperature": -1}}', "temperature"),
    (b'{"input_ids": [1], "sampling_params": {"top_p": 0}}', "top_p"),
    (b'{"input_ids": [1, 2], "logprob_start_len": 5, "return_logprob": true}', "logprob_start_len"),
    (b'{"input_ids": [[1], [2]], "sampling_params": [{"n": 1}]}', "sampling_params"),
    (b'[1, 2, 3]', "body"),
]


@pytest.mark.parametrize("body,expected", BAD_BODIES)
def test_bad_input_gets_400_and_server_stays_up(server, body, expected):
    r = requests.post(f"{server.url}/generate", data=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert expected in r.json()["error"]["message"]
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200


def test_bad_weight_update_body_gets_400(server):
    r = requests.post(f"{server.url}/update_weights_from_disk", json={"path": "/x"}, timeout=30)
    assert r.status_code == 400 and "model_path" in r.json()["error"]["message"]


def test_health_info_and_flush_routes(server):
    assert requests.get(f"{server.url}/health_generate", timeout=30).status_code == 200
    info = requests.get(f"{server.url}/get_model_info", timeout=10).json()
    assert info["weight_version"] == "default" and info["model_type"] == "qwen2" and info["vocab_size"] == 300
    assert requests.post(f"{server.url}/flush_cache", timeout=10).status_code == 200


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
