"""Recipes: every shipped one validates; each kind of mistake is caught with the file, key and fix; new-recipe."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from open_r1_ext.launch.recipe import RecipeError, load_recipe

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(REPO.glob("recipes/*/grpo/*.yaml")) + [REPO / "recipes/tiny/grpo.yaml"]


def cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "open_r1_ext.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.fixture()
def tiny_recipe(tmp_path, tiny_model):
    """The tiny recipe as a dict, pointing at the session's tiny model."""
    raw = yaml.safe_load((REPO / "recipes/tiny/grpo.yaml").read_text())
    raw["model"]["name_or_path"] = str(tiny_model)
    raw["data"]["dataset"] = str(REPO / raw["data"]["dataset"])
    return raw


def write(tmp_path, raw) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_every_shipped_recipe_validates():
    assert len(SHIPPED) >= 5
    result = cli("validate", *map(str, SHIPPED))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": ok") == len(SHIPPED)


def test_real_model_recipes_say_what_they_need():
    for path in SHIPPED:
        first = path.read_text().splitlines()[:3]
        assert any(line.startswith("# Needs:") for line in first), path


BAD = [
    # (what to change, expected key, expected message)
    (lambda r: r["model"].update(dtyp="float32"), "model.dtyp", "did you mean 'dtype'"),
    (lambda r: r["trainer"].update(learning_rat=1e-3), "trainer.learning_rat", "did you mean 'learning_rate'"),
    (lambda r: r.update(trainr={}), "trainr", "did you mean 'trainer'"),
    (lambda r: r["trainer"].update(max_steps="ten"), "trainer.max_steps", "expected an integer"),
    (lambda r: r["server"].update(tp_size="4"), "server.tp_size", "expected an integer"),
    (lambda r: r["model"].update(name_or_path="./no/such/model"), "model.name_or_path", "does not exist"),
    (lambda r: r["data"].update(dataset="./missing.jsonl"), "data.dataset", "does not exist"),
    (lambda r: r["trainer"].update(per_device_train_batch_size=3), "trainer.num_generations", "not divisible by num_generations=4"),
    (lambda r: r["trainer"].update(num_generations=1, per_device_train_batch_size=8), "trainer.num_generations", "at least 2"),
    (lambda r: (r["server"].update(engine="sglang", tp_size=4, layout="separate"), r["slurm"]["server"].update(gpus_per_node=2)),
     "server.tp_size", "needs more GPUs"),
    (lambda r: r["server"].update(engine="sglang"), "server.layout", "use layout: separate"),
    (lambda r: (r["server"].update(engine="sglang", layout="separate"), r["sync"].update(sync_ref_model=True, ref_model_mixup_alpha=0.5)),
     "sync.ref_model_mixup_alpha", "cannot mix"),
    (lambda r: r["trainer"].update(min_p=0.1), "trainer.min_p", "built-in server does not support"),
    (lambda r: r["server"].update(engine="openai"), "server.url", "already running"),
    (lambda r: r["server"].update(engine="vllm"), "server.engine", "not one of builtin, sglang, openai"),
    (lambda r: r["rewards"].append({"name": "nosuch"}), "rewards[2].name", "unknown reward 'nosuch'"),
    (lambda r: r["sync"].update(ref_model_sync_epochs=1.5, sync_ref_model=True), "trainer", "a float must lie in (0, 1)"),
    (lambda r: r["sync"].update(weight_sync_stepz=2), "sync.weight_sync_stepz", "did you mean 'weight_sync_steps'"),
    (lambda r: r["trainer"].update(weight_sync_steps=2), "trainer.weight_sync_steps", "belongs in the sync: section"),
    (lambda r: r.pop("data"), "data", "missing section"),
]


@pytest.mark.parametrize("change,key,message", BAD, ids=[b[1] + ":" + b[2][:20] for b in BAD])
def test_each_kind_of_mistake_is_named(tmp_path, tiny_recipe, change, key, message):
    change(tiny_recipe)
    path = write(tmp_path, tiny_recipe)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert (key, ) == tuple(k for k, m in err.value.problems if message in m)[:1], err.value
    assert str(path) in str(err.value)


def test_validate_cli_exits_non_zero_naming_file_and_key(tmp_path, tiny_recipe):
    tiny_recipe["trainer"]["learning_rat"] = 1e-3
    path = write(tmp_path, tiny_recipe)
    result = cli("validate", str(path))
    assert result.returncode == 1
    assert f"{path}: trainer.learning_rat: unknown key (did you mean 'learning_rate'?)" in result.stderr


def test_not_yaml_and_not_a_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="no such file"):
        load_recipe(tmp_path / "missing.yaml")


def test_overrides_apply_and_are_validated(tmp_path, tiny_recipe):
    path = write(tmp_path, tiny_recipe)
    recipe = load_recipe(path, ["trainer.max_steps=3", "server.port=31000"])
    assert recipe.trainer["max_steps"] == 3 and recipe.server.port == 31000
    with pytest.raises(RecipeError, match="trainer.max_steps: expected an integer"):
        load_recipe(path, ["trainer.max_steps=three"])
    with pytest.raises(RecipeError, match="section.key=value"):
        load_recipe(path, ["max_steps"])


def test_recipe_flows_into_the_trainer_config(tmp_path, tiny_recipe):
    tiny_recipe["sync"].update(sync_ref_model=True, ref_model_sync_epochs=0.25)
    recipe = load_recipe(write(tmp_path, tiny_recipe))
    gen, ref = recipe.role_urls("http://h:1", None)
    assert (gen, ref) == ("http://h:1", "http://h:1/ref")  # built-in, shared: the reference is the /ref slot
    config = recipe.trainer_config(generation_url=gen, ref_model_url=ref)
    assert config.generation_url == gen and config.ref_model_url == ref and config.beta == 0.04
    assert config.ref_model_sync_epochs == 0.25 and config.reward_weights == [1.0, 0.5]
    assert config.model_init_kwargs["dtype"] == "float32"


def test_new_recipe_copies_for_another_model(tmp_path):
    out = tmp_path / "recipes/Llama-3.1-8B-Instruct/grpo/config_zero2.yaml"
    result = cli("new-recipe", "--from", "recipes/Qwen2.5-7B-Instruct/grpo/config_zero2.yaml",
                 "--model", "meta-llama/Llama-3.1-8B-Instruct", str(out))
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert "meta-llama/Llama-3.1-8B-Instruct" in text and "Qwen/Qwen2.5-7B-Instruct" not in text
    assert text.startswith("# Llama-3.1-8B-Instruct, GRPO")  # comments are kept for the user to edit
    recipe = load_recipe(out)
    assert recipe.model.name_or_path == "meta-llama/Llama-3.1-8B-Instruct"
    assert recipe.output_dir == "runs/Llama-3.1-8B-Instruct-grpo"
    assert recipe.sync["sync_dir"] == "runs/Llama-3.1-8B-Instruct-grpo/weights"
    assert cli("new-recipe", "--from", "recipes/Qwen2.5-7B-Instruct/grpo/config_zero2.yaml",
               "--model", "x/y", str(out)).returncode == 2  # no silent overwrite
