"""Dynamic LoRA (#16 item 3, server half): `SGLangClient.load_lora_adapter` / `unload_lora_adapter` /
`generate(..., lora_path=...)` against SGLang 0.5.23's answers (real SGLang without `--enable-lora`; for what needs
a LoRA-enabled SGLang, `tests/fake_sglang.py`: such a server is a start of its own, ~20-60 s here, and
`tests/test_real_sglang_training.py` runs adapter-only sync on one) and against the real built-in server with the tiny
model and a tiny PEFT adapter made here."""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import peft
import pytest
import requests
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from open_r1_ext.launch.local_server import BuiltinServer
from open_r1_ext.named_tensors import AdapterTensors
from open_r1_ext.protocol import input_token_logprobs, reference_request
from open_r1_ext.server.app import parse_args
from open_r1_ext.sglang_client import SGLangClient, ServerRequestError
from tests.fake_sglang import FakeSGLang


# ------------------------------------------------------------------------------------------ SGLang 0.5.23 (fake)
def test_client_loads_generates_with_and_unloads_an_adapter_as_sglang_answers(tmp_path):
    """The fake: the bodies and keys the client sends, as a LoRA-enabled SGLang with an admin key takes them."""
    adapter = tmp_path / "step-3"
    adapter.mkdir()
    with FakeSGLang(enable_lora=True, api_key="user", admin_api_key="admin") as fake:
        client = SGLangClient(fake.url, api_key="user", admin_api_key="admin")
        loaded = client.load_lora_adapter("policy-v3", str(adapter))
        assert loaded["success"] and loaded["loaded_adapters"] == {"policy-v3": str(adapter)}
        client.generate([[1, 2], [3, 4]], {"max_new_tokens": 2}, n=2, lora_path="policy-v3")
        client.ref_logprobs([[1, 2, 3]])
        assert client.unload_lora_adapter("policy-v3")["loaded_adapters"] == {}
        bodies = {path: (body, auth) for method, path, body, auth in fake.calls if method == "POST"}
        # the admin routes get the admin key (SGLang refuses the user key there once an admin key is set)
        assert bodies["/load_lora_adapter"] == ({"lora_name": "policy-v3", "lora_path": str(adapter), "pinned": False},
                                                "Bearer admin")
        assert bodies["/unload_lora_adapter"] == ({"lora_name": "policy-v3"}, "Bearer admin")
        generate = [body for method, path, body, _ in fake.calls if path == "/generate"]
        assert generate[0]["lora_path"] == ["policy-v3"] * 4  # every item names the adapter
        assert "lora_path" not in generate[1]  # the reference pass: the base model


def test_client_raises_sglang_s_message_when_a_lora_call_fails(tmp_path, shared_sglang):
    """Real SGLang started without --enable-lora; the fake for the refusals of a LoRA-enabled one."""
    with pytest.raises(ServerRequestError, match="LoRA is not enabled. Please set `--enable-lora`") as err:
        SGLangClient(shared_sglang.url).load_lora_adapter("v1", str(tmp_path))
    assert err.value.status_code == 400
    with pytest.raises(ServerRequestError, match="LoRA is not enabled"):
        SGLangClient(shared_sglang.url).generate([[1]], {"max_new_tokens": 1}, lora_path="v1")
    with FakeSGLang(enable_lora=True) as fake:
        client = SGLangClient(fake.url)
        client.load_lora_adapter("v1", str(tmp_path))
        with pytest.raises(ServerRequestError, match="refused the LoRA adapter v1 .*because it is already loaded"):
            client.load_lora_adapter("v1", str(tmp_path))
        with pytest.raises(ServerRequestError, match="LoRA with name v2 does not exist"):
            client.unload_lora_adapter("v2")
        with pytest.raises(ServerRequestError, match="never been loaded: v2"):
            client.generate([[1]], {"max_new_tokens": 1}, lora_path="v2")


# ------------------------------------------------------------------------------------ the built-in server, real
LORA_MODULES = ("q_proj", "v_proj", "down_proj")
PROMPTS = [[5, 9, 2, 7, 1], [11, 3, 8], [4, 4, 6, 12, 30, 2]]


def make_adapter(base: Path, out: Path, seed: int, r: int = 4, modules=LORA_MODULES) -> Path:
    """A PEFT LoRA adapter of `base` with random (not zero) weights, saved as peft saves one."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                                peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=list(modules)))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.2)
    model.save_pretrained(out)
    return out


def merged(base: Path, adapter: Optional[Path]):
    """The model a request should be answered with: the base, or the base with `adapter` merged in (peft)."""
    model = AutoModelForCausalLM.from_pretrained(base)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


def logprobs_of(model, sequence: list[int]) -> list[float]:
    """log p(t_i | t_<i), i = 1..len-1."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([sequence])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def weights(tmp_path_factory, tiny_model) -> Path:
    """The directory the LoRA server reads adapters from (--weight-dirs), with adapters v1 and v2 in it."""
    root = tmp_path_factory.mktemp("lora-weights")
    make_adapter(tiny_model, root / "step-1", seed=1)
    make_adapter(tiny_model, root / "step-2", seed=2)
    return root


@pytest.fixture(scope="module")
def lora_server(tiny_model, weights, tmp_path_factory):
    log = tmp_path_factory.mktemp("lora-log") / "server.log"
    flags = ("--no-ref-slot", "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", *LORA_MODULES,
             "--weight-dirs", str(weights))
    with BuiltinServer(str(tiny_model), log_path=str(log), extra_args=flags, deterministic=True) as srv:
        yield SGLangClient(srv.url)


@pytest.fixture(scope="module")
def models(tiny_model, weights):
    return {None: merged(tiny_model, None), "step-1": merged(tiny_model, weights / "step-1"),
            "step-2": merged(tiny_model, weights / "step-2")}


def score(client: SGLangClient, sequences, lora_path=None) -> list[list[float]]:
    """The server's log-probs of whole sequences (a reference pass), with `lora_path` (a name, or one per sequence)."""
    body = {**reference_request(sequences), "lora_path": lora_path}
    return [[e[0] for e in input_token_logprobs(r)[1:]] for r in client.post_json("/generate", body)]


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < 1e-5


def test_an_adapter_serves_the_merged_model_and_no_lora_path_the_base(lora_server, weights, models):
    loaded = lora_server.load_lora_adapter("policy-v1", str(weights / "step-1"))
    assert loaded == {"success": True, "error_message": "", "loaded_adapters": {"policy-v1": str(weights / "step-1")}}
    try:
        for sequence, got in zip(PROMPTS, score(lora_server, PROMPTS, "policy-v1")):
            assert close(got, logprobs_of(models["step-1"], sequence))
        for sequence, got in zip(PROMPTS, score(lora_server, PROMPTS)):  # the reference: the base model
            assert close(got, logprobs_of(models[None], sequence))
        # sampling: each completion's log-probs are those of the merged model, a step at a time (the KV cache path)
        sampled = lora_server.generate(PROMPTS, {"max_new_tokens": 6, "temperature": 1.0}, n=2, seeds=range(6),
                                       lora_path="policy-v1")
        for prompt, copies in zip(PROMPTS, sampled):
            for completion in copies:
                want = logprobs_of(models["step-1"], prompt + completion.token_ids)[len(prompt) - 1:]
                assert close(completion.logprobs, want)
        assert score(lora_server, PROMPTS[:1], "policy-v1") != score(lora_server, PROMPTS[:1])  # the adapter counts
        # the prompt's top log-probs too (another path of the engine)
        body = {**reference_request(PROMPTS[:1]), "top_logprobs_num": 1, "lora_path": "policy-v1"}
        tops = lora_server.post_json("/generate", body)[0]["meta_info"]["input_top_logprobs"][1:]
        with torch.inference_mode():
            logits = models["step-1"](input_ids=torch.tensor(PROMPTS[:1])).logits[0, :-1]
        assert close([top[0][0] for top in tops], torch.log_softmax(logits, -1).max(-1).values.tolist())
    finally:
        lora_server.unload_lora_adapter("policy-v1")


def test_an_adapter_loaded_after_an_unload_serves_its_own_weights(lora_server, weights, models):
    """The trainer's rotation (load v2, unload v1, load v3, ...): an unloaded adapter's modules take the next
    adapter's weights (the engine keeps them), which must serve that adapter exactly, beside the one still loaded."""
    lora_server.load_lora_adapter("v1", str(weights / "step-1"))
    lora_server.load_lora_adapter("v2", str(weights / "step-2"))
    lora_server.unload_lora_adapter("v1")
    lora_server.load_lora_adapter("v3", str(weights / "step-2"))  # into v1's modules, which held step-1
    try:
        for name, step in (("v3", "step-2"), ("v2", "step-2"), (None, None)):
            for sequence, got in zip(PROMPTS, score(lora_server, PROMPTS, name)):
                assert close(got, logprobs_of(models[step], sequence)), name
        lora_server.unload_lora_adapter("v2")
        lora_server.load_lora_adapter("v4", str(weights / "step-1"))  # into v2's modules (step-2's)
        for sequence, got in zip(PROMPTS, score(lora_server, PROMPTS, "v4")):
            assert close(got, logprobs_of(models["step-1"], sequence))
        lora_server.unload_lora_adapter("v4")
    finally:
        lora_server.unload_lora_adapter("v3")
    for sequence, got in zip(PROMPTS, score(lora_server, PROMPTS)):  # only retired modules left: the base model
        assert close(got, logprobs_of(models[None], sequence))


def test_a_mixed_batch_gives_each_item_its_own_model(lora_server, weights, models):
    lora_server.load_lora_adapter("a", str(weights / "step-1"))
    lora_server.load_lora_adapter("b", str(weights / "step-2"))
    try:
        names, which = ["a", None, "b"], ["step-1", None, "step-2"]
        for sequence, got, model in zip(PROMPTS, score(lora_server, PROMPTS, names), which):
            assert close(got, logprobs_of(models[model], sequence))
        body = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 5, "temperature": 0.0},
                "return_logprob": True, "lora_path": names}
        for prompt, answer, model in zip(PROMPTS, lora_server.post_json("/generate", body), which):
            output = answer["output_ids"]
            want = logprobs_of(models[model], prompt + output)[len(prompt) - 1:]
            assert close([e[0] for e in answer["meta_info"]["output_token_logprobs"]], want)
            alone = lora_server.post_json("/generate", {**body, "input_ids": prompt, "lora_path": names[PROMPTS.index(prompt)]})
            assert alone["output_ids"] == output  # greedy: the same tokens as when sent alone
    finally:
        lora_server.unload_lora_adapter("a")
        lora_server.unload_lora_adapter("b")


def test_versioned_names_load_the_next_then_unload_the_previous(lora_server, weights, models):
    lora_server.load_lora_adapter("policy-v1", str(weights / "step-1"))
    with pytest.raises(ServerRequestError, match="policy-v1 because it is already loaded"):
        lora_server.load_lora_adapter("policy-v1", str(weights / "step-2"))
    assert lora_server.load_lora_adapter("policy-v2", str(weights / "step-2"))["loaded_adapters"] == {
        "policy-v1": str(weights / "step-1"), "policy-v2": str(weights / "step-2")}
    base, *adapters = lora_server.get_json("/v1/models")["data"]  # listed after the model, as SGLang lists them
    assert [(card["id"], card["root"], card["parent"]) for card in adapters] == [
        ("policy-v1", str(weights / "step-1"), base["id"]), ("policy-v2", str(weights / "step-2"), base["id"])]
    assert close(score(lora_server, PROMPTS[:1], "policy-v2")[0], logprobs_of(models["step-2"], PROMPTS[0]))
    assert lora_server.unload_lora_adapter("policy-v1")["loaded_adapters"] == {"policy-v2": str(weights / "step-2")}
    with pytest.raises(ServerRequestError, match="'policy-v1' was unloaded") as err:
        lora_server.generate(PROMPTS[:1], {"max_new_tokens": 2}, lora_path="policy-v1")
    assert err.value.status_code == 400
    with pytest.raises(ServerRequestError, match="'policy-v9' is not loaded"):
        score(lora_server, PROMPTS[:1], "policy-v9")
    with pytest.raises(ServerRequestError, match="LoRA with name policy-v1 does not exist"):
        lora_server.unload_lora_adapter("policy-v1")
    assert close(score(lora_server, PROMPTS[:1], "policy-v2")[0], logprobs_of(models["step-2"], PROMPTS[0]))
    # the name can be served again, by other weights
    lora_server.load_lora_adapter("policy-v1", str(weights / "step-2"))
    assert close(score(lora_server, PROMPTS[:1], "policy-v1")[0], logprobs_of(models["step-2"], PROMPTS[0]))
    lora_server.unload_lora_adapter("policy-v1")
    lora_server.unload_lora_adapter("policy-v2")


def test_an_unload_waits_for_the_request_running_with_the_adapter(lora_server, weights, models):
    """A stream with the adapter has begun when the unload is sent: the unload answers once the stream's generation is
    done, and every token of it came from the adapter."""
    lora_server.load_lora_adapter("busy", str(weights / "step-1"))
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 256, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": True, "stream": True, "lora_path": "busy"}
    with requests.post(f"{lora_server.base_url}/generate", json=body, stream=True, timeout=60) as stream:
        events = stream.iter_lines()
        first = next(line for line in events if line)  # the generation is running
        with ThreadPoolExecutor(1) as pool:
            unloaded = pool.submit(lora_server.unload_lora_adapter, "busy")
            last = [line for line in events if line.startswith(b"data: {")][-1]
            assert unloaded.result(timeout=60)["loaded_adapters"] == {}
    assert first.startswith(b"data: {")
    answer = json.loads(last[len(b"data: "):])
    assert len(answer["output_ids"]) == 256
    want = logprobs_of(models["step-1"], PROMPTS[0] + answer["output_ids"])[len(PROMPTS[0]) - 1:]
    assert close([e[0] for e in answer["meta_info"]["output_token_logprobs"]], want)
    with pytest.raises(ServerRequestError, match="'busy' was unloaded"):
        score(lora_server, PROMPTS[:1], "busy")


def test_adapters_the_server_cannot_serve_are_refused_by_name(lora_server, weights, tiny_model, tmp_path):
    cases = {  # lora_path -> what the refusal says
        str(make_adapter(tiny_model, tmp_path / "elsewhere", seed=3)): "is not below a directory this server may read",
        str(make_adapter(tiny_model, weights / "rank-16", seed=3, r=16)): "rank 16 is above the server's --max-lora-rank 8",
        str(make_adapter(tiny_model, weights / "o-proj", seed=3, modules=("q_proj", "o_proj"))):
            "adapts o_proj, outside the server's --lora-target-modules down_proj q_proj v_proj",
        str(weights / "missing"): "no adapter_config.json",
    }
    (weights / "no-weights").mkdir()
    (weights / "no-weights" / "adapter_config.json").write_text((weights / "step-1" / "adapter_config.json").read_text())
    cases[str(weights / "no-weights")] = "no adapter_model.safetensors"
    broken = {  # variants of step-1: config changes, or a change to its tensors
        "dora": ({"use_dora": True}, None, "a DoRA adapter"),
        "saved-modules": ({"modules_to_save": ["lm_head"]}, None, "modules_to_save ['lm_head']"),
        "not-lora": ({"peft_type": "IA3"}, None, "peft_type 'IA3'"),
        "no-such-module": ({"target_modules": ["qkv_proj"]}, None, "qkv_proj"),
        "other-rank": ({"r": 2}, None, "size mismatch"),
        "nan": ({}, lambda t: {k: v.fill_(float("nan")) if "lora_B" in k else v for k, v in t.items()}, "NaN or Inf"),
        "stray-tensor": ({}, lambda t: {**t, "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight":
                                         torch.zeros(4, 64)}, "tensors that fit no module"),
        "missing-tensor": ({}, lambda t: {k: v for k, v in t.items() if "layers.1.mlp.down_proj.lora_B" not in k},
                           "no tensor for base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"),
        # values of the wrong type, which peft meets building the modules (HTTP 500 before, as a TypeError)
        "alpha-string": ({"lora_alpha": "x"}, None, "unsupported operand type(s)"),
        "rank-string": ({"r": "16"}, None, "not a readable PEFT config"),
        "targets-number": ({"target_modules": 5}, None, "'int' object is not iterable"),
    }
    for name, (config_changes, tensor_change, words) in broken.items():
        shutil.copytree(weights / "step-1", weights / name)
        config = json.loads((weights / name / "adapter_config.json").read_text())
        (weights / name / "adapter_config.json").write_text(json.dumps({**config, **config_changes}))
        if tensor_change:
            save_file(tensor_change(load_file(weights / name / "adapter_model.safetensors")),
                      weights / name / "adapter_model.safetensors")
        cases[str(weights / name)] = words
    for path, words in cases.items():
        with pytest.raises(ServerRequestError, match="refused the LoRA adapter bad") as err:
            lora_server.load_lora_adapter("bad", path)
        assert err.value.status_code == 400 and words in str(err.value), (path, str(err.value))
    for name, (_, _, words) in broken.items():  # the same adapters sent as tensors: the same refusals, naming the field
        with pytest.raises(ServerRequestError, match="refused the LoRA adapter bad from tensors") as err:
            lora_server.load_lora_adapter_from_tensors("bad", adapter_tensors(weights / name))
        field = "serialized_named_tensors" if name in ("other-rank", "nan", "stray-tensor", "missing-tensor") else "config_dict"
        assert err.value.status_code == 400 and f"{field}: " in str(err.value) and words in str(err.value), name
    assert lora_server.post_json("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})  # still serving
    assert lora_server.load_lora_adapter("good", str(weights / "step-1"))["loaded_adapters"] == {"good": str(weights / "step-1")}
    lora_server.unload_lora_adapter("good")


def adapter_tensors(adapter: Path) -> AdapterTensors:
    """A saved adapter's tensors and `adapter_config.json`, as a trainer sends them."""
    return AdapterTensors.of(load_file(adapter / "adapter_model.safetensors"),
                             json.loads((adapter / "adapter_config.json").read_text()))


def test_an_adapter_sent_as_tensors_serves_as_the_same_adapter_from_disk(lora_server, weights, models):
    """SGLang's `/load_lora_adapter_from_tensors`: the adapter in the request (plainly pickled, `named_tensors`), no
    file; listed as SGLang lists it."""
    loaded = lora_server.load_lora_adapter_from_tensors("sent-v2", adapter_tensors(weights / "step-2"))
    assert loaded["success"] and loaded["loaded_adapters"]["sent-v2"] == "__tensor__"
    try:
        for sequence, got in zip(PROMPTS, score(lora_server, PROMPTS, "sent-v2")):
            assert close(got, logprobs_of(models["step-2"], sequence))
        with pytest.raises(ServerRequestError, match="because it is already loaded"):
            lora_server.load_lora_adapter_from_tensors("sent-v2", adapter_tensors(weights / "step-1"))
    finally:
        lora_server.unload_lora_adapter("sent-v2")


def test_a_tensors_body_is_unpickled_as_tensors_only(lora_server, weights, tmp_path):
    """A body's pickle may name nothing but tensors (a hostile one would run code in SGLang's plain unpickler; SGLang
    0.5.23 allow-lists names too): refused with HTTP 400, nothing run, the server serving on."""
    ran = tmp_path / "ran"

    class Command:
        def __reduce__(self):
            return os.system, (f"touch {ran}",)

    config = adapter_tensors(weights / "step-1").config
    payloads = {  # serialized_named_tensors[0] -> what the refusal says
        base64.b64encode(pickle.dumps({"x": Command()})).decode(): "system is not allowed",
        base64.b64encode(pickle.dumps(["not", "a", "dict"])).decode(): "not a dict of tensors by name",
        "%%%": "not base64",
        base64.b64encode(b"not a pickle").decode(): "not a pickle of tensors",
    }
    url = f"{lora_server.base_url}/load_lora_adapter_from_tensors"
    for payload, words in payloads.items():
        answer = requests.post(url, json={"lora_name": "bad", "config_dict": config,
                                          "serialized_named_tensors": [payload]}, timeout=30)
        assert answer.status_code == 400 and words in answer.json()["error_message"], (words, answer.text)
    missing = requests.post(url, json={"lora_name": "bad", "config_dict": config}, timeout=30)
    assert missing.status_code == 400 and "serialized_named_tensors" in missing.text
    assert not ran.exists()
    assert "bad" not in lora_server.load_lora_adapter_from_tensors("good", adapter_tensors(weights / "step-1"))[
        "loaded_adapters"]
    lora_server.unload_lora_adapter("good")


def test_base_weight_reloads_keep_the_adapters(lora_server, weights, models, tiny_model, other_tiny_model):
    """/update_weights_from_disk replaces the base weights under a loaded adapter (as SGLang): base = the new model,
    adapter = the new base with the adapter merged."""
    dump, base = weights / "other-base", weights / "base"
    shutil.copytree(other_tiny_model, dump)
    shutil.copytree(tiny_model, base)
    lora_server.load_lora_adapter("v1", str(weights / "step-1"))
    try:
        lora_server.update_weights_from_disk(str(dump), weight_version="other")
        assert close(score(lora_server, PROMPTS[:1])[0], logprobs_of(merged(other_tiny_model, None), PROMPTS[0]))
        assert close(score(lora_server, PROMPTS[:1], "v1")[0],
                     logprobs_of(merged(other_tiny_model, weights / "step-1"), PROMPTS[0]))
    finally:
        lora_server.update_weights_from_disk(str(base), weight_version="default")
        lora_server.unload_lora_adapter("v1")
    assert close(score(lora_server, PROMPTS[:1])[0], logprobs_of(models[None], PROMPTS[0]))


@pytest.mark.parametrize("flags, words", [
    (["--enable-lora"], "--enable-lora needs both --max-lora-rank and --lora-target-modules"),
    (["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all", "q_proj"], "'all' must be the only"),
    (["--max-lora-rank", "8"], "--max-lora-rank takes effect only with --enable-lora"),
    (["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "attn"], "invalid choice: 'attn'"),
])
def test_lora_flags_are_checked_at_start(flags, words, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", *flags])
    assert words in capsys.readouterr().err


def test_enable_lora_without_peft_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed: find_spec answers None
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"])
    assert "--enable-lora needs peft, which is not installed: pip install peft" in capsys.readouterr().err


def test_server_info_reports_the_lora_settings(lora_server):
    info = lora_server.server_info()
    assert (info["enable_lora"], info["max_lora_rank"], info["lora_target_modules"]) == (True, 8, sorted(LORA_MODULES))
