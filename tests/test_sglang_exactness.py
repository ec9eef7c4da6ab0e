"""The client, trainer and launch plan against what SGLang 0.5.23 really does (issues #11 and #21): real SGLang on the
CPU (`shared_sglang`), and the built-in server where it must behave the same (`protocol_server`). `tests/fake_sglang.py`
stands in only for what real SGLang cannot be made to do from outside (aborting chosen items), saying so.
"""

import shutil

import pytest
import requests
import yaml
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.config.recipe import RecipeError, load_recipe
from open_r1_ext.launch.slurm_plan import SlurmPlan
from open_r1_ext.sglang_client import AbortedRequestError, IncompleteDumpError, SGLangClient
from open_r1_ext.weight_files import MANIFEST, write_weight_dir
from tests.fake_sglang import FakeSGLang
from open_r1_ext.protocol import sampling_range_problems
from tests.helpers import restore_default_weights, reward_len, tiny_config, tiny_dataset


def sglang_log_count(server, text: str) -> int:
    """How many lines of a real SGLang server's log hold `text` (its access log names every request's route)."""
    return sum(text in line for line in server.log_path.read_text(errors="replace").splitlines())


# ------------------------------------------------------------------ 3. soft reference updates need a mixing server
def test_soft_reference_update_refused_against_a_server_that_cannot_mix(tiny_model, shared_sglang, tmp_path):
    """SGLang drops `mixup_alpha` from a reload and reports the new version (msgspec_utils.py ~95-99): a soft update
    would silently be a full copy."""
    assert "supports_weight_mixup" not in SGLangClient(shared_sglang.url).server_info()
    args = tiny_config(tmp_path, sync_ref_model=True, ref_model_mixup_alpha=0.6, ref_model_sync_steps=1,
                       ref_model_url=shared_sglang.url)
    reloads = sglang_log_count(shared_sglang, "POST /update_weights_from_disk")
    with pytest.raises(ValueError, match=r"ref_model_mixup_alpha=0.6: the reference server .* does not say it can mix"):
        RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    assert sglang_log_count(shared_sglang, "POST /update_weights_from_disk") == reloads  # refused before training
    args.ref_model_mixup_alpha = 1.0  # a hard copy is what SGLang does: accepted
    RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())


def test_soft_reference_update_accepted_by_the_builtin_server(tiny_model, server, tmp_path):
    assert SGLangClient(server.url).server_info()["supports_weight_mixup"] is True
    args = tiny_config(tmp_path, sync_ref_model=True, ref_model_mixup_alpha=0.6, ref_model_sync_steps=1,
                       ref_model_url=f"{server.url}/ref")
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    assert trainer.reference_target.mixup_alpha == 0.6


# --------------------------------------------------------------------------- recipes (4, 5, 9)
def recipe_file(tmp_path, tiny_model, servers: dict, **trainer) -> str:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1 + 1?"}\n')
    recipe = {"model": {"name_or_path": str(tiny_model)}, "data": {"dataset": str(data)}, "rewards": ["length"],
              "trainer": {"output_dir": str(tmp_path / "run"), "per_device_train_batch_size": 4, "num_generations": 4,
                          **trainer},
              "servers": servers, "slurm": {"trainer": {"gpus_per_node": 8}}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


SGLANG = {"engine": "sglang", "tp_size": 8, "resources": {"nodes": 2, "gpus_per_node": 4}}


@pytest.mark.parametrize("spec, problem", [
    ({**SGLANG, "tp_size": 4, "dp_size": 2}, "dp_size"),  # validation_hook.py ~198-201: no multi-node DP replicas
    ({**SGLANG, "tp_size": 3}, "tp_size"),  # ~179-181: (tp_size * pp_size) % nnodes == 0
    ({**SGLANG, "tp_size": 1, "extra_args": ["--pp-size", "3"]}, "tp_size"),
])
def test_validate_refuses_multi_node_layouts_sglang_refuses(tmp_path, tiny_model, spec, problem):
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe_file(tmp_path, tiny_model, {"generation": spec, "reference": "local"}))
    assert f"servers.generation.{problem}" in str(err.value) and "nnodes" in str(err.value)
    ok = load_recipe(recipe_file(tmp_path, tiny_model, {"generation": SGLANG, "reference": "local"}))
    assert "--nnodes" in SlurmPlan(ok).describe()


def test_deterministic_inference_is_a_recipe_choice(tmp_path, tiny_model):
    flag = "--enable-deterministic-inference"
    for engine in ("sglang", "builtin"):
        resources = {"nodes": 1, "gpus_per_node": 1}
        default = SlurmPlan(load_recipe(recipe_file(tmp_path, tiny_model, {
            "generation": {"engine": engine, "resources": resources}, "reference": "local"})))
        assert flag not in default.server_command("server", 0, "head")  # off by default
        chosen = SlurmPlan(load_recipe(recipe_file(tmp_path, tiny_model, {
            "generation": {"engine": engine, "deterministic": True, "resources": resources}, "reference": "local"})))
        assert flag in chosen.server_command("server", 0, "head")


def test_embedded_server_takes_the_deterministic_choice(tmp_path, tiny_model):
    from open_r1_ext.launch.run_key import read_run_key
    from open_r1_ext.train import servers

    recipe = load_recipe(recipe_file(tmp_path, tiny_model, {"generation": {"deterministic": True}, "reference": "local"}))
    with servers(recipe, None, None) as (generation_url, _):
        client = SGLangClient(generation_url, api_key=read_run_key(recipe, tmp_path / "run"))
        assert client.server_info()["enable_deterministic_inference"] is True


def test_admin_api_key(tmp_path, tiny_model):
    with pytest.raises(RecipeError, match=r"extra_args: --admin-api-key locks .*trainer.server_admin_api_key"):
        load_recipe(recipe_file(tmp_path, tiny_model, {"generation": {**SGLANG, "extra_args": ["--admin-api-key=x"]},
                                                       "reference": "local"}))
    recipe = load_recipe(recipe_file(tmp_path, tiny_model, {"generation": {"engine": "sglang", "url": "http://g:1"},
                                                            "reference": "local"}, server_admin_api_key="adm"))
    assert recipe.trainer_config("http://g:1", on_this_machine=False).server_admin_api_key == "adm"
    # the client against servers that take it: tests/test_server_keys.py (real SGLang and the built-in server)


# ------------------------------------------------------------------ 6. /model_info and /server_info
def tiny_llama(tiny_model, out):
    """A random Llama of the tiny Qwen2's sizes, with its tokenizer: another architecture than the server's."""
    qwen = AutoConfig.from_pretrained(tiny_model)
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "max_position_embeddings")
    LlamaForCausalLM(LlamaConfig(**{name: getattr(qwen, name) for name in sizes})).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out


def test_client_uses_model_info_and_server_info_and_checks_architectures(tiny_model, shared_sglang, tmp_path):
    """A run reads `/model_info` and `/server_info`, never the deprecated `/get_*` routes (SGLang logs a warning per
    call), and syncs its weights; a policy of another architecture than the server's is refused at start."""
    args = tiny_config(tmp_path, max_steps=1, beta=0.0, weight_sync_steps=1, generation_url=shared_sglang.url)
    before = {route: sglang_log_count(shared_sglang, f"GET {route} ") for route in
              ("/model_info", "/server_info", "/get_model_info", "/get_server_info")}
    try:
        trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
        trainer.train()
        assert SGLangClient(shared_sglang.url).weight_version() == "1"
    finally:
        restore_default_weights(shared_sglang.url, tiny_model)
    after = {route: sglang_log_count(shared_sglang, f"GET {route} ") - count for route, count in before.items()}
    assert after["/model_info"] > 0 and after["/server_info"] > 0
    assert after["/get_model_info"] == after["/get_server_info"] == 0
    with pytest.raises(ValueError, match=r"model_type 'qwen2' on the server, 'llama' in the trainer; architectures "
                                         r"\['Qwen2ForCausalLM'\] on the server, \['LlamaForCausalLM'\] in the trainer"):
        RemoteGRPOTrainer(model=str(tiny_llama(tiny_model, tmp_path / "llama")), reward_funcs=reward_len, args=args,
                          train_dataset=tiny_dataset())


# ------------------------------------------------------------------ 7. generation_kwargs are SGLang sampling params
def test_generation_kwargs_checked_against_sglang_names(tiny_model, tmp_path, shared_sglang):
    with pytest.raises(ValueError, match=r"generation_kwargs.best_of: not a sampling parameter of SGLang; valid names: .*min_new_tokens"):
        tiny_config(tmp_path, generation_url="http://g:1", generation_kwargs={"best_of": 2})
    with pytest.raises(ValueError, match=r"generation_kwargs.seed: set by the trainer"):
        tiny_config(tmp_path, generation_url="http://g:1", generation_kwargs={"seed": 1})
    assert tiny_config(tmp_path, generation_kwargs={"min_tokens": 2}).generation_kwargs == {"min_tokens": 2}  # TRL's own
    # SGLang answers 400 to vLLM's name (tokenizer_manager.py ~1565), so the config renames it; a run then trains
    r = requests.post(f"{shared_sglang.url}/generate", json={"input_ids": [1, 2], "sampling_params": {"min_tokens": 2}},
                      timeout=60)
    assert r.status_code == 400 and "min_tokens" in r.text
    args = tiny_config(tmp_path, max_steps=1, beta=0.0, weight_sync_steps=0, generation_kwargs={"min_tokens": 2},
                       generation_url=shared_sglang.url)
    assert args.generation_kwargs == {"min_new_tokens": 2}
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    trainer.train()
    assert trainer.state.global_step == 1


# SGLang sampling_params at the edges of SGLang's ranges, on both sides (with max_new_tokens 1)
SAMPLING_EDGES = [
    *({"repetition_penalty": v} for v in (0.0, 1e-3, 2.0, 2.01)),
    *({name: v} for name in ("frequency_penalty", "presence_penalty") for v in (-2.01, -2.0, 2.0, 2.01)),
    *({"top_k": v} for v in (-2, -1, 0, 1)),
    *({"min_new_tokens": v} for v in (-1, 1, 2)),
    *({"top_p": v} for v in (0.0, 1.0, 1.01)),
    *({"min_p": v} for v in (-0.01, 0.0, 1.0, 1.01)),
    {"temperature": -0.1}, {"temperature": 0.0},
]


def test_sglang_refuses_exactly_the_sampling_values_the_checks_refuse(shared_sglang, tmp_path):
    """The ranges `validate`, `RemoteGRPOConfig` and `sampling_kwargs` enforce (`protocol.SGLANG_SAMPLING_RANGES`) are
    SGLang's own: at each edge, real SGLang answers 400 exactly where the check refuses, and samples where it passes."""
    for params in SAMPLING_EDGES:
        refused = bool(sampling_range_problems(params, max_new_tokens=1))
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, **params}}
        r = requests.post(f"{shared_sglang.url}/generate", json=body, timeout=60)
        assert r.status_code == (400 if refused else 200), (params, r.text)
        if refused:
            assert next(iter(params)) in r.text
    with pytest.raises(ValueError, match=r"generation_kwargs.top_k=0: must be -1 \(no top-k\) or >= 1 \(0 is refused\)"):
        tiny_config(tmp_path, generation_url="http://g:1", generation_kwargs={"top_k": 0})
    with pytest.raises(ValueError, match=r"generation_kwargs.min_tokens=9: must be at most max_new_tokens \(8\)"):
        tiny_config(tmp_path, generation_url="http://g:1", generation_kwargs={"min_tokens": 9})
    with pytest.raises(ValueError, match=r"repetition_penalty=2.5: must be in \(0, 2\]"):
        tiny_config(tmp_path, generation_url="http://g:1", repetition_penalty=2.5)
    assert tiny_config(tmp_path, repetition_penalty=2.5).repetition_penalty == 2.5  # TRL generating itself: its range


# ------------------------------------------------------------------ 8. aborted items are never trained on
def test_aborted_items_are_sent_again_then_refused():
    """The fake SGLang server: real SGLang aborts items only under memory pressure, on an admin call or a reload with
    abort_all_requests, so which items are aborted, and how often, cannot be set from outside."""
    with FakeSGLang(aborts=2) as sglang:
        client = SGLangClient(sglang.url)
        groups = client.generate([[1, 2, 3], [4, 5]], {"max_new_tokens": 4}, n=2, seeds=[1, 2, 3, 4])
        assert all(len(c.token_ids) == 4 and c.finish_reason == "length" for g in groups for c in g)
        assert len(client.ref_logprobs([[1, 2, 3]])[0]) == 2
        assert sglang.paths().count("/generate") == 3  # the batch, then its two aborted items once more
        sglang.aborts = 10**6
        with pytest.raises(AbortedRequestError, match=r"aborted 2 of 2 item\(s\).*Abort in waiting queue.*3 times"):
            client.generate([[1, 2, 3], [4, 5]], {"max_new_tokens": 4})


# ------------------------------------------------------------------ 10. a partial dump is never sent for loading
def test_incomplete_dump_is_not_sent_to_the_server(tiny_model, tmp_path, shared_sglang):
    """Real SGLang loads whatever tensors a directory holds (weight_updater.py ~174-255), and its scheduler dies on a
    truncated safetensors file, the whole server with it (seen on the CPU): a dump whose manifest does not match its
    files is never sent."""
    def copy_model(tmp):
        for name in ("config.json", "model.safetensors"):
            shutil.copy(tiny_model / name, tmp)

    dump = write_weight_dir(tmp_path / "step-1", copy_model)
    client = SGLangClient(shared_sglang.url)
    reloads = sglang_log_count(shared_sglang, "POST /update_weights_from_disk")
    try:
        client.update_weights_from_disk(str(dump), "1")
        (dump / "model.safetensors").write_bytes(b"truncated")
        with pytest.raises(IncompleteDumpError, match=rf"not asking .* to load an incomplete dump: .*model.safetensors has 9 bytes, {MANIFEST}"):
            client.update_weights_from_disk(str(dump), "2")
        (dump / "model.safetensors").unlink()
        with pytest.raises(IncompleteDumpError, match="model.safetensors listed in manifest.json is missing"):
            client.update_weights_from_disk(str(dump), "3")
        assert sglang_log_count(shared_sglang, "POST /update_weights_from_disk") == reloads + 1
        assert client.weight_version() == "1" and client.is_healthy()
    finally:
        restore_default_weights(shared_sglang.url, tiny_model)  # a plain directory (no manifest) is sent as it is


# ------------------------------------------------------------------ 11. prompts that do not fit the context
def test_prompt_that_does_not_fit_refused_before_sending(tiny_model, tmp_path, protocol_server):
    """What fits: at most `max_req_input_len` - 1 tokens of prompt + completion (SGLang refuses an input of the context
    length - 6 tokens or more, and scores prompt + completion as one input; the built-in server reports and keeps the
    same bound). Checked at start-up against max_completion_length, and for each batch's prompts before anything is
    sent."""
    from datasets import Dataset

    limit = SGLangClient(protocol_server.url).server_info()["max_req_input_len"] - 1
    assert limit == 2048 - 7  # the tiny model's context: 2048
    long = "word " * 1200
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": long if i == 2 else f"{i} + {i}?"}]}
                                 for i in range(8)])
    settings = dict(beta=0.0, weight_sync_steps=0, generation_url=protocol_server.url)
    with pytest.raises(ValueError, match=rf"max_completion_length={limit} leaves no room for a prompt: the servers "
                                         rf"serve at most {limit} tokens of prompt \+ completion"):
        RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, train_dataset=dataset,
                          args=tiny_config(tmp_path, max_completion_length=limit, **settings))
    args = tiny_config(tmp_path, max_steps=1, shuffle_dataset=False, per_device_train_batch_size=8, num_generations=2,
                       **settings)  # prompts 0-3
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=dataset)
    generation = trainer.remote_generation
    assert generation.sequence_limit == limit
    sent = (lambda: SGLangClient(protocol_server.url).server_info()["sequences_generated"]) if protocol_server.engine == \
        "builtin" else (lambda: sglang_log_count(protocol_server, "POST /generate"))
    before = sent()
    with pytest.raises(ValueError, match=rf"prompt 2 of this batch \(\d+ tokens: 'user word word .* word assistant'\) plus "
                                         rf"max_completion_length=8 does not fit the {limit} tokens of prompt \+ "
                                         "completion the servers serve"):
        trainer.train()
    assert sent() == before  # nothing was sent
    with generation.later_turns():  # a turn after a tool call: asked for what fits (TRL cuts it to the budget anyway)
        (completion,) = generation.generate([[5] * (limit - 3)], 1)
    assert len(completion.token_ids) <= 3 and (len(completion.token_ids) == 3 or completion.finish_reason == "stop")
