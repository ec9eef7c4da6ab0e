"""The client, trainer and launch plan against what SGLang 0.5.23 really does (issue #11, divergences 3-11).

Where the built-in server can show a behaviour, it is a real built-in server process; where only SGLang behaves
so (it needs CUDA), `tests/fake_sglang.py` answers over real HTTP as SGLang's source does, citing its lines.
"""

import shutil

import pytest
import yaml

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.config.recipe import RecipeError, load_recipe
from open_r1_ext.launch.local_server import BuiltinServer
from open_r1_ext.launch.slurm_plan import SlurmPlan
from open_r1_ext.sglang_client import AbortedRequestError, IncompleteDumpError, ServerRequestError, SGLangClient
from open_r1_ext.weight_files import MANIFEST, write_weight_dir
from tests.fake_sglang import FakeSGLang
from tests.helpers import reward_len, tiny_config, tiny_dataset


# ------------------------------------------------------------------ 3. soft reference updates need a mixing server
def test_soft_reference_update_refused_against_a_server_that_cannot_mix(tiny_model, tmp_path):
    args = tiny_config(tmp_path, sync_ref_model=True, ref_model_mixup_alpha=0.6, ref_model_sync_steps=1)
    with FakeSGLang() as sglang:  # SGLang drops mixup_alpha and reports the new version (msgspec_utils.py ~95-99)
        args.ref_model_url = sglang.url
        with pytest.raises(ValueError, match=r"ref_model_mixup_alpha=0.6: the reference server .* does not say it can mix"):
            RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
        assert "/update_weights_from_disk" not in sglang.paths()  # refused before training started
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
    # the client sends it on the routes SGLang locks to it (utils/auth.py ~130-139), the api key everywhere else
    with FakeSGLang(api_key="k", admin_api_key="adm") as sglang:
        SGLangClient(sglang.url, api_key="k", admin_api_key="adm").update_weights_from_disk(str(tiny_model), "3")
        SGLangClient(sglang.url, api_key="k").generate([[1, 2]], {"max_new_tokens": 2})
        with pytest.raises(ServerRequestError, match="401"):
            SGLangClient(sglang.url, api_key="k").update_weights_from_disk(str(tiny_model), "4")
        auth = {path: header for _, path, _, header in sglang.calls}
        assert auth["/generate"] == "Bearer k" and sglang.weight_version == "3"


# ------------------------------------------------------------------ 6. /model_info and /server_info
def test_client_uses_model_info_and_server_info_and_checks_architectures(tiny_model, tmp_path):
    args = tiny_config(tmp_path, max_steps=1, beta=0.0, weight_sync_steps=1)
    with FakeSGLang() as sglang:
        args.generation_url = sglang.url
        trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
        trainer.train()
        assert sglang.weight_version == "1" and "/model_info" in sglang.paths() and "/server_info" in sglang.paths()
        assert not {"/get_model_info", "/get_server_info"} & set(sglang.paths())  # deprecated: a warning per call
    with FakeSGLang(architectures=["LlamaForCausalLM"]) as sglang:
        args.generation_url = sglang.url
        with pytest.raises(ValueError, match=r"architectures \['LlamaForCausalLM'\] on the server"):
            RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())


# ------------------------------------------------------------------ 7. generation_kwargs are SGLang sampling params
def test_generation_kwargs_checked_against_sglang_names(tiny_model, tmp_path):
    with pytest.raises(ValueError, match=r"generation_kwargs.best_of: not a sampling parameter of SGLang; valid names: .*min_new_tokens"):
        tiny_config(tmp_path, generation_url="http://g:1", generation_kwargs={"best_of": 2})
    with pytest.raises(ValueError, match=r"generation_kwargs.seed: set by the trainer"):
        tiny_config(tmp_path, generation_url="http://g:1", generation_kwargs={"seed": 1})
    assert tiny_config(tmp_path, generation_kwargs={"min_tokens": 2}).generation_kwargs == {"min_tokens": 2}  # TRL's own
    with FakeSGLang() as sglang:  # answers 400 to min_tokens, as SGLang (tokenizer_manager.py ~1565)
        args = tiny_config(tmp_path, max_steps=1, beta=0.0, weight_sync_steps=0, generation_kwargs={"min_tokens": 2},
                           generation_url=sglang.url)
        assert args.generation_kwargs == {"min_new_tokens": 2}
        RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset()).train()
        sent = [body for method, path, body, _ in sglang.calls if path == "/generate"]
        assert sent and all(p["min_new_tokens"] == 2 for p in sent[0]["sampling_params"])


# ------------------------------------------------------------------ 8. aborted items are never trained on
def test_aborted_items_are_sent_again_then_refused():
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
def test_incomplete_dump_is_not_sent_to_the_server(tiny_model, tmp_path):
    def copy_model(tmp):
        for name in ("config.json", "model.safetensors"):
            shutil.copy(tiny_model / name, tmp)

    dump = write_weight_dir(tmp_path / "step-1", copy_model)
    with FakeSGLang() as sglang:  # loads whatever tensors a directory holds (weight_updater.py ~174-255)
        client = SGLangClient(sglang.url)
        client.update_weights_from_disk(str(dump), "1")
        (dump / "model.safetensors").write_bytes(b"truncated")
        with pytest.raises(IncompleteDumpError, match=rf"not asking .* to load an incomplete dump: .*model.safetensors has 9 bytes, {MANIFEST}"):
            client.update_weights_from_disk(str(dump), "2")
        (dump / "model.safetensors").unlink()
        with pytest.raises(IncompleteDumpError, match="model.safetensors listed in manifest.json is missing"):
            client.update_weights_from_disk(str(dump), "3")
        assert sglang.paths().count("/update_weights_from_disk") == 1 and sglang.weight_version == "1"
        client.update_weights_from_disk(str(tiny_model), "default")  # a plain directory (no manifest) is sent as it is


# ------------------------------------------------------------------ 11. prompts that do not fit the context
def test_prompt_over_the_context_length_refused_before_sending(tiny_model, tmp_path):
    from datasets import Dataset

    long = "word " * 200
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": long if i == 2 else f"{i} + {i}?"}]}
                                 for i in range(8)])
    with BuiltinServer(str(tiny_model), extra_args=("--context-length", "96")) as srv:
        args = tiny_config(tmp_path, max_steps=1, beta=0.0, weight_sync_steps=0, generation_url=srv.url,
                           shuffle_dataset=False, per_device_train_batch_size=8, num_generations=2)  # prompts 0-3
        trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=dataset)
        assert trainer.remote_generation.context_length == 96
        with pytest.raises(ValueError, match=r"prompt 2 of this batch \(\d+ tokens: 'user word word .* word assistant'\) plus "
                                             r"max_completion_length=8 does not fit the generation server's context "
                                             r"length of 96 tokens"):
            trainer.train()
        assert SGLangClient(srv.url).server_info()["sequences_generated"] == 0  # nothing was sent
    with FakeSGLang(context_length=1024) as sglang:  # null in /server_info: the model's max_position_embeddings
        args = tiny_config(tmp_path, beta=0.0, generation_url=sglang.url, weight_sync_steps=0)
        trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=dataset)
        generation = trainer.remote_generation
        assert generation.context_length == 2048
        generation.context_length = 64  # as if SGLang had been started with --context-length 64
        with pytest.raises(ValueError, match="prompt 0 of this batch \\(60 tokens"):
            generation.generate([[5] * 60] * 2, 2)
        with generation.later_turns():  # a turn after a tool call: asked for what fits (TRL cuts it to the budget)
            (completion,) = generation.generate([[5] * 60], 1)
        assert len(completion.token_ids) == 4 and sglang.calls[-1][2]["sampling_params"][0]["max_new_tokens"] == 4
