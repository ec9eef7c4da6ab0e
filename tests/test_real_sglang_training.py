"""The trainer against real SGLang 0.5.23 on the CPU, through its Python API: the shared SGLang server (`a`,
`shared_sglang`) and a second server that also loads LoRA adapters (`b`), each put back on its start-up weights,
without adapters, after a test that changed them.

- The end-to-end runs (#21 item 4): weight sync every step with a reference server of its own that is re-synced,
  async generation, a pool of two generation replicas with one killed mid-run and brought back (weights synced by
  dumps, and over the network: `transport: distributed`), adapter-only LoRA sync. The built-in server's versions
  are in tests/test_weight_sync.py, test_async.py, test_pool.py, test_distributed_sync.py and test_lora.py; the
  resumed run is tests/test_stop.py's (`open-r1-ext train` with an embedded SGLang server), the launchers' runs
  tests/test_slurm.py's and test_launcher.py's.
- With SGLang as the reference at temperature 0.7 the KL is 0 at identical weights and equals a local reference's
  (#21 item 6); the OpenAI backend as SGLang's `/v1/completions` answers it (#21 item 7): the weight version read from
  `metadata`, the sampling settings sent and honoured, and a tiny GRPO run whose weight sync goes through SGLang's
  `/update_weights_from_disk`.

SGLang's CPU backend has no deterministic mode, so nothing here depends on seeded samples; its log-probs are compared
with a local float32 forward within 2e-3. Both servers run in float32 (`SGLANG_FLOAT32`; SGLang's auto dtype served
the float32 tiny model in float16, 2.2e-3 off once): 5e-7 off at the start-up weights, its kernels summing in
another order.
A server start costs 20-60 s here: the module starts two.
"""

import json

import pytest
import requests
import torch
from transformers import AutoTokenizer, TrainerCallback

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.launch.local_server import SGLangServer
from open_r1_ext.openai_client import OpenAICompletionsClient, ServerAbilities
from open_r1_ext.sglang_client import SGLangClient
from open_r1_ext.trainer.weight_sync import ADAPTER_CONFIG, ADAPTER_FILE
from open_r1_ext.weight_files import MANIFEST
from tests.helpers import (LORA_FLAGS, SGLANG_FLOAT32, KillServerAt, forward_logprobs, read_jsonl, restore_default_weights, reward_len, served,
                           synced, tiny_config, tiny_dataset, unload_adapters)
from tests.test_inflight_lora import check_in_flight_lora
from tests.test_lora import ServerMatchesPolicy, lora_trainer
from tests.test_lora_server import PROMPTS, adapter_tensors, make_adapter, score


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def test_kl_against_sglang_at_temperature_07_is_zero_at_identical_weights(tiny_model, shared_sglang, tmp_path):
    """Step 1 trains the reference's own weights: KL 0 (SGLang's log-probs equal a local forward within ~1e-3, so
    within ~1e-6 of 0; before the fix the untempered SGLang reference against the tempered policy logged ~3e-3).
    Step 2 (the policy moved): the same KL as TRL's local reference scored at temperature 1."""
    settings = dict(temperature=0.7, max_steps=2)
    remote = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, train_dataset=tiny_dataset(),
                               args=tiny_config(tmp_path / "sglang", ref_model_url=shared_sglang.url, **settings))
    remote.train()
    local = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, train_dataset=tiny_dataset(),
                              args=tiny_config(tmp_path / "local", **settings))
    local.train()
    kl_remote, kl_local = logged(remote, "kl"), logged(local, "kl")
    assert kl_remote[0] == pytest.approx(0.0, abs=1e-5) and kl_local[0] == 0.0
    assert kl_local[1] > 1e-3
    assert kl_remote[1] == pytest.approx(kl_local[1], rel=1e-2)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def test_the_openai_client_on_sglang_completions(shared_sglang, tokenizer, tiny_model):
    """What SGLang's /v1/completions can do (the probe), the weight version it says (also after a reload), and the
    sampling settings sent under their names and honoured: a greedy completion of the tiny model repeats a token;
    `repetition_penalty` and `frequency_penalty` (generation_kwargs) change it, `min_p: 1.0` at temperature 1 keeps
    only the top token, i.e. the greedy completion."""
    client = OpenAICompletionsClient(shared_sglang.url, tokenizer)
    client.wait_until_healthy(timeout=60, progress=False)
    assert client.abilities == ServerAbilities(token_id_prompts=True, prompt_lists=True, n_in_one_request=True,
                                               token_ids=True, logprobs=True, extensions=True, reloads_weights=True)
    groups = client.generate([[5, 17, 42], [7, 8]], {"max_new_tokens": 8, "temperature": 1.0,
                                                      "stop_token_ids": list(range(0, 300, 3))}, n=2, seeds=[1, 2, 3, 4])
    completions = [c for g in groups for c in g]
    assert [len(g) for g in groups] == [2, 2] and {c.weight_version for c in completions} == {"default"}
    assert all(len(c.logprobs) == len(c.token_ids) for c in completions)  # a stop token has its log-prob too
    assert any(c.finish_reason == "stop" and c.token_ids[-1] % 3 == 0 for c in completions)

    def first(**sampling):
        return client.generate([[5, 17, 42]], {"max_new_tokens": 16, **sampling}, n=1)[0][0].token_ids

    greedy = first(temperature=0.0)
    assert len(set(greedy)) < len(greedy)  # it repeats tokens: a penalty on repeats must change it
    assert first(temperature=0.0, repetition_penalty=2.0) != greedy
    assert first(temperature=0.0, frequency_penalty=2.0) != greedy
    assert first(temperature=1.0, min_p=1.0) == greedy
    client.check_sampling({"max_new_tokens": 4, "min_p": 0.1, "repetition_penalty": 1.1, "min_new_tokens": 1})
    with pytest.raises(ValueError, match="structural_tag='{}': SGLang's /v1/completions has no such field"):
        client.check_sampling({"max_new_tokens": 4, "structural_tag": "{}"})
    try:
        assert client.http.update_weights_from_disk(str(tiny_model), weight_version="5")["success"]
        assert {c.weight_version for g in client.generate([[1, 2]], {"max_new_tokens": 2}, n=2) for c in g} == {"5"}
    finally:
        restore_default_weights(shared_sglang.url, tiny_model)


def test_a_grpo_run_with_the_openai_backend_on_sglang(tiny_model, shared_sglang, tmp_path):
    """A tiny GRPO run generating through SGLang's /v1/completions (temperature 0.7, min_p, repetition_penalty and a
    generation_kwargs setting sent), each step's policy synced through SGLang's /update_weights_from_disk: each batch
    was sampled from the previous step's weights (rollouts.jsonl: staleness 0), SGLang ends on the last step's
    weights, and TRL's importance sampling ran on SGLang's sampling log-probs."""
    args = tiny_config(tmp_path, max_steps=3, generation_url=shared_sglang.url, generation_backend="openai", beta=0.0,
                       temperature=0.7, min_p=0.01, repetition_penalty=1.05, generation_kwargs={"presence_penalty": 0.1})
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    http = trainer.remote_generation.client.http
    bodies, post_json = [], http.post_json

    def recorded(route, body, timeout=None):
        bodies.append((route, body))
        return post_json(route, body, timeout)

    http.post_json = recorded
    try:
        trainer.train()
        assert requests.get(f"{shared_sglang.url}/model_info", timeout=30).json()["weight_version"] == "3"
    finally:
        restore_default_weights(shared_sglang.url, tiny_model)
    rollouts = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [(r["step"], r["weight_version"], r["staleness"]) for r in rollouts] == [(1, 0, 0), (2, 1, 0), (3, 2, 0)]
    synced = [json.loads(line) for line in (tmp_path / "weight_sync.jsonl").read_text().splitlines()]
    assert [(e["step"], e["weight_version"]) for e in synced] == [(1, "1"), (2, "2"), (3, "3")]
    sent = [body for route, body in bodies if route == "/v1/completions"]
    assert len(sent) == 3 * 4  # one request per copy (each its own seed), 4 copies a step
    assert all((b["temperature"], b["min_p"], b["repetition_penalty"], b["presence_penalty"]) == (0.7, 0.01, 1.05, 0.1)
               for b in sent)
    assert trainer.use_vllm and len(logged(trainer, "sampling/importance_sampling_ratio/mean")) == 3


# -------------------------------------------------------------------------------------- end to end (#21 item 4)
SEQUENCES = [[5, 17, 42, 9, 100, 3, 250, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
ATOL = 2e-3


@pytest.fixture(scope="module", autouse=True)
def lora_sglang(tiny_model, sglang_python, tmp_path_factory):
    """`{"b": server}`: a second SGLang server on the tiny model that also loads LoRA adapters (rank 4, every linear
    layer), launched as the module starts, so that it starts beside `shared_sglang` (if that one is not up yet). A test that replaces it (killed
    and restarted) puts the new one in the dict; what is there is stopped at the end."""
    log = tmp_path_factory.mktemp("sglang-b") / "b.log"
    servers = {"b": SGLangServer(str(tiny_model), python=sglang_python, log_path=str(log), extra_args=(*SGLANG_FLOAT32, *LORA_FLAGS))}
    try:
        servers["b"].launch()
        yield servers
    finally:
        servers["b"].stop()


@pytest.fixture(scope="module")
def sglang_pair(lora_sglang, shared_sglang):
    """`{"a": shared_sglang, "b": the LoRA server}`, both healthy."""
    lora_sglang["b"].wait_until_healthy()
    lora_sglang["a"] = shared_sglang
    return lora_sglang


@pytest.fixture()
def pair(sglang_pair, tiny_model):
    """The module's servers, put back on their start-up weights, without adapters, afterwards (whatever the test did)."""
    yield sglang_pair
    for server in sglang_pair.values():
        if server.process is not None and server.process.poll() is None:
            restore_default_weights(server.url, tiny_model)
            unload_adapters(server.url)


def assert_serves(url: str, model, version: str) -> list[torch.Tensor]:
    """The server at `url` reports weight_version `version` and its reference log-probs are `model`'s forward."""
    client = SGLangClient(url)
    assert client.weight_version() == version
    served_logprobs = client.ref_logprobs(SEQUENCES)
    for got, want in zip(served_logprobs, forward_logprobs(model, SEQUENCES)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    return served_logprobs


def max_gap(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    """The largest difference between two lists of per-sequence log-probs."""
    return max((x - y).abs().max().item() for x, y in zip(xs, ys))


def test_sync_every_step_with_a_reference_server_of_its_own(pair, tiny_model, tmp_path):
    """Generation on `a` (synced every step), the reference on `b` (re-synced at step 3 of 4): afterwards `a` serves
    the saved final model and `b` the step-3 dump, each reporting its sync's version; each sync logged once."""
    a, b = pair["a"], pair["b"]
    args = tiny_config(tmp_path / "run", max_steps=4, learning_rate=2e-2, generation_url=a.url, ref_model_url=b.url,
                       sync_ref_model=True, ref_model_sync_steps=3, ref_model_mixup_alpha=1.0)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3, 4]
    log = [(e["step"], e["role"], e["weight_version"]) for e in read_jsonl(tmp_path / "run" / "weight_sync.jsonl")]
    assert sorted(log) == [(1, "generation", "1"), (2, "generation", "2"), (3, "generation", "3"),
                           (3, "reference", "ref-3"), (4, "generation", "4")]
    final = assert_serves(a.url, tmp_path / "final", "4")
    reference = assert_serves(b.url, tmp_path / "run" / "weights" / "step-3", "ref-3")
    initial = forward_logprobs(tiny_model, SEQUENCES)
    # training moved the weights well past the tolerance: a server still on older weights would fail the checks above
    assert max_gap(final, initial) > 20 * ATOL
    assert max_gap(final, reference) > 5 * ATOL


def test_async_generation_is_at_most_one_step_stale(pair, tiny_model, tmp_path):
    a, b = pair["a"], pair["b"]
    args = tiny_config(tmp_path, max_steps=4, generation_url=a.url, ref_model_url=b.url, async_generation=True)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    trainer.train()
    rollouts = read_jsonl(tmp_path / "rollouts.jsonl")
    assert [e["step"] for e in rollouts] == [1, 2, 3, 4]
    # batch N+1 was sampled while step N trained, from the weights of step N-1: SGLang reports each batch's version
    assert [(e["weight_version"], e["staleness"]) for e in rollouts] == [(0, 0), (0, 1), (1, 1), (2, 1)]
    assert sorted(synced(tmp_path)) == [1, 2, 3, 4]
    assert SGLangClient(a.url).weight_version() == "4"
    assert SGLangClient(b.url).weight_version() == "default"  # the reference is never synced here


class WaitForServer(TrainerCallback):
    """Records, at each step's end, whether the replaced server had come back (for the assertions)."""

    def __init__(self, killer: KillServerAt):
        self.killer, self.back_at = killer, []

    def on_step_end(self, args, state, control, **kwargs):
        restarted = self.killer.restarted
        if restarted is not None and restarted.process is not None and SGLangClient(restarted.url).is_healthy():
            self.back_at.append(state.global_step)


@pytest.mark.parametrize("transport", ["disk", "distributed"])
def test_a_replica_killed_mid_run_comes_back_and_confirms_the_later_syncs(pair, tiny_model, tmp_path, transport):
    """Two generation replicas, both needed (`generation_min_replicas=2`): `b` is killed (SIGKILL, its scheduler
    and detokenizer with it) after step 2 and started again on its port; the trainer waits for it, brings it to the
    current weights (`disk`: the pool reloads step 2's dump; `distributed`, where nothing is dumped: the trainer sends
    it step 2's weights alone), and it serves batches and confirms every later sync. No step is lost or done twice,
    no batch is sampled from older weights."""
    a, b = pair["a"], pair["b"]
    killer = KillServerAt(b, step=2, restart_after=0.0)
    watcher = WaitForServer(killer)
    args = tiny_config(tmp_path, max_steps=5, per_device_train_batch_size=8, beta=0.0, generation_url=[a.url, b.url],
                       generation_min_replicas=2, server_wait_timeout=600, transport=transport)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset(),
                                callbacks=[killer, watcher])
    sends, send = [], trainer.weight_sync.send  # the network sends: (step, only these servers)
    trainer.weight_sync.send = lambda *args, **kw: sends.append((args[1], kw.get("only"))) or send(*args, **kw)
    try:
        trainer.train()
    finally:
        if killer.restarted is not None:
            pair["b"] = killer.restarted  # stopped by the module's fixture
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3, 4, 5]
    assert killer.restarted.process.pid != b.process.pid and watcher.back_at[:1] == [3]  # back before step 3 ended
    # the new b confirmed 3, 4, 5. Sync 2 came after the kill: the pool's reload waits for b and replays the dump to
    # it (both hold step 2 when it is logged); a broadcast goes to the replicas serving then (a), and b is sent step 2's
    # weights when the next batch waits for it
    both = sorted([a.url, b.url])
    assert synced(tmp_path) == {1: both, 2: both if transport == "disk" else [a.url], 3: both, 4: both, 5: both}
    assert all(e["staleness"] == 0 for e in read_jsonl(tmp_path / "rollouts.jsonl"))
    log = read_jsonl(tmp_path / "weight_sync.jsonl")
    if transport == "distributed":  # each sync logged without a dump; b caught up with step 2's weights, alone
        assert not (tmp_path / "weights").exists() and all(e["path"] is None for e in log), log
        assert sends == [(1, None), (2, None), (2, [b.url]), (3, None), (4, None), (5, None)], sends
    else:
        assert [e["path"] for e in log] == [str(tmp_path / "weights" / f"step-{step}") for step in range(1, 6)]
        assert sends == []
    assert all(sorted(set(batch)) == both for batch in served(tmp_path))  # it served every batch after too
    final = {url: assert_serves(url, trainer.model, "5") for url in (a.url, b.url)}  # both on the final policy
    # training moved the weights past the tolerance: a server still on older weights would fail the checks above
    assert max_gap(final[a.url], forward_logprobs(tiny_model, SEQUENCES)) > 5 * ATOL


@pytest.mark.parametrize("transport", ["disk", "distributed"])
def test_in_flight_adapter_only_lora_sync(pair, tiny_model, tmp_path, transport):
    """In-flight updates with adapter-only LoRA on `b`: the syncs load the adapter (its dump, or its tensors in the
    request) and abort the requests under way, which continue from their tokens under the new adapter
    (`tests/test_inflight_lora.py`, as on the built-in server)."""
    check_in_flight_lora(tiny_model, pair["b"].url, tmp_path, transport)


@pytest.mark.parametrize("transport", ["disk", "distributed"])
def test_adapter_only_lora_sync(pair, tiny_model, tmp_path, transport):
    """A PEFT policy against `b` for generation and the reference: each sync loads the step's adapter alone
    (`policy-vN`; its dump, or with `transport: distributed` its tensors in the request, no file), with which SGLang
    samples as the trainer's policy; the reference is its base model; the previous adapter is unloaded. SGLang's LoRA
    on the CPU needs the pin_memory fix of tools/sglang_cpu/sitecustomize.py and `--lora-backend torch_native`
    (`sglang_cpu_args`)."""
    b = pair["b"]
    trainer = lora_trainer(tiny_model, tmp_path, b.url, max_steps=3, transport=transport)
    assert trainer.weight_sync.adapter_only and trainer.ref_model.client.base_url == b.url
    check = ServerMatchesPolicy(trainer, b.url, sglang=True)
    trainer.add_callback(check)
    trainer.train()
    assert check.checked == [1, 2, 3] and check.policy_diff <= ATOL and check.reference_diff <= ATOL
    assert check.adapter_effect > 5 * ATOL, check.adapter_effect  # sampling with the base model would not pass
    log = read_jsonl(tmp_path / "weight_sync.jsonl")
    assert [(e["step"], e["weight_version"]) for e in log] == [(1, "1"), (2, "2"), (3, "3")]
    if transport == "disk":
        assert sorted(p.name for p in (tmp_path / "weights" / "step-3").iterdir()) == sorted([ADAPTER_FILE,
                                                                                             ADAPTER_CONFIG, MANIFEST])
    else:
        assert not (tmp_path / "weights").exists() and [e["path"] for e in log] == [None] * 3
    rollouts = read_jsonl(tmp_path / "rollouts.jsonl")
    assert [(r["step"], r["weight_version"]) for r in rollouts] == [(1, 0), (2, 1), (3, 2)]  # each step's adapter


def test_an_adapter_sent_as_tensors_loads_on_sglang(pair, tiny_model, tmp_path):
    """What a trainer on another node can send SGLang 0.5.23's `/load_lora_adapter_from_tensors`: a plain pickle of
    the adapter's tensors (`named_tensors`; SGLang's SafeUnpickler takes it, where torch's ForkingPickler would send
    handles to this machine's shared memory). The adapter then serves as the same adapter loaded from its directory:
    the same log-probs, which are not the base model's."""
    client = SGLangClient(pair["b"].url)
    adapter = make_adapter(tiny_model, tmp_path / "adapter", seed=5)
    client.load_lora_adapter("from-disk", str(adapter))
    loaded = client.load_lora_adapter_from_tensors("from-tensors", adapter_tensors(adapter))
    assert loaded["success"] and loaded["loaded_adapters"]["from-tensors"] == "__tensor__"
    sent, read, base = (score(client, PROMPTS, name) for name in ("from-tensors", "from-disk", None))
    for got, want, plain in zip(sent, read, base):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
        assert max(abs(a - b) for a, b in zip(got, plain)) > 5 * ATOL  # the adapter counts
