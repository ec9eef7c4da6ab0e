"""Recipes: every shipped one validates; each kind of mistake is caught with the file, key and fix; new-recipe."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from open_r1_ext.cli import main as cli_main
from open_r1_ext.config.recipe import RecipeError, load_recipe
from open_r1_ext.launch.slurm_plan import ShellVar, SlurmPlan, shell_join
from open_r1_ext.train import servers
from tests.helpers import REPO, SHIPPED_RECIPES


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


def test_every_shipped_recipe_validates_and_passes_the_preflight(capsys, monkeypatch):
    """As the README's install leaves them (.venv with tensorboard, .venv-sglang): every SGLang server's interpreter
    imports the supported SGLang, every report_to integration is installed; the hub downloads are warnings only.
    `validate` runs in this process (`cli.main`, from the repository as a user would): a CLI process would spend
    ~5 s of CPU importing TRL again."""
    assert len(SHIPPED_RECIPES) >= 5
    monkeypatch.chdir(REPO)
    code = cli_main(["validate", "--preflight", *map(str, SHIPPED_RECIPES)])
    result = capsys.readouterr()
    assert code == 0, result.err
    assert sum(line.endswith(" trainer process(es))") for line in result.out.splitlines()) == len(SHIPPED_RECIPES)
    for path in SHIPPED_RECIPES:
        recipe = load_recipe(path)
        for role, spec in recipe.servers.specs().items():
            engine = "sglang (sglang 0.5.23)" if spec.engine == "sglang" else "open_r1_ext (open_r1_ext"
            assert f"{path}: servers.{role}.python: ok: {spec.interpreter()} imports {engine}" in result.out, role


def test_real_model_recipes_say_what_they_need():
    for path in SHIPPED_RECIPES:
        first = path.read_text().splitlines()[:3]
        assert any(line.startswith("# Needs:") for line in first), path


SGLANG = {"engine": "sglang", "resources": {"nodes": 1, "gpus_per_node": 1}}
CPU_SGLANG = {"engine": "sglang", "device": "cpu", "resources": {"nodes": 1, "gpus_per_node": 0}}

BAD = [
    # (what to change, expected key, expected message)
    (lambda r: r["model"].update(dtyp="float32"), "model.dtyp", "did you mean 'dtype'"),
    (lambda r: r["trainer"].update(learning_rat=1e-3), "trainer.learning_rat", "did you mean 'learning_rate'"),
    (lambda r: r.update(trainr={}), "trainr", "did you mean 'trainer'"),
    (lambda r: r["trainer"].update(max_steps="ten"), "trainer.max_steps", "expected an integer"),
    (lambda r: r["servers"]["generation"].update(tp_size="4"), "servers.generation.tp_size", "expected an integer"),
    (lambda r: r["model"].update(name_or_path="./no/such/model"), "model.name_or_path", "does not exist"),
    (lambda r: r["data"].update(dataset="./missing.jsonl"), "data.dataset", "does not exist"),
    (lambda r: r["trainer"].update(per_device_train_batch_size=3), "trainer.num_generations", "not divisible by num_generations=4"),
    (lambda r: r["trainer"].update(num_generations=1, per_device_train_batch_size=8), "trainer.num_generations", "at least 2"),
    (lambda r: r["servers"].update(generation=SGLANG | {"tp_size": 4, "resources": {"gpus_per_node": 2}}, reference=SGLANG),
     "servers.generation.tp_size", "needs more GPUs"),
    (lambda r: r["servers"]["generation"].update(SGLANG), "servers.reference", "give the reference a server of its own"),
    (lambda r: (r["servers"].update(generation=SGLANG, reference=SGLANG), r["sync"].update(sync_ref_model=True, ref_model_mixup_alpha=0.5)),
     "sync.ref_model_mixup_alpha", "cannot mix"),
    (lambda r: r["servers"]["generation"].update(engine="openai"), "servers.generation.url", "already running"),
    (lambda r: r["servers"]["generation"].update(engine="vllm"), "servers.generation.engine", "not one of builtin, sglang, openai"),
    (lambda r: r["servers"].update(reference={"engine": "openai", "url": "http://h:1"}), "servers.reference.engine",
     "cannot give reference log-probs"),
    (lambda r: r["servers"].update(generation={"engine": "openai", "url": "http://h:1"}), "servers.reference",
     "cannot give reference log-probs"),
    (lambda r: r["servers"].update(generation="local"), "servers.reference", "generation: local runs none"),
    (lambda r: r["servers"].update(reference="none"), "servers.reference", "needs a reference"),
    (lambda r: (r["servers"].update(reference={}), r["trainer"].update(beta=0.0)), "servers.reference", "set reference: none"),
    (lambda r: r["servers"].update(generation="local", reference="local"), "servers", "no server plays a role"),
    (lambda r: r["servers"].update(reference="sideways"), "servers.reference",
     "'sideways' is not one of generation, local, none, or a server spec"),
    (lambda r: r["servers"].update(reference={"url": "node-3:30001"}), "servers.reference.url", "give a base URL"),
    (lambda r: r["servers"]["generation"].update(tp_size=2), "servers.generation.tp_size", "one device of one node"),
    (lambda r: r["servers"]["generation"]["resources"].update(nodes=0), "servers.generation.resources.nodes",
     "must be >= 1, got 0"),
    (lambda r: r["servers"].update(generaton={}), "servers.generaton", "did you mean 'generation'"),
    (lambda r: r["sync"].update(ref_model_sync_epochs="half"), "sync.ref_model_sync_epochs", "expected an integer or a number"),
    (lambda r: r["rewards"].append({"name": "nosuch"}), "rewards[2].name", "unknown reward 'nosuch'"),
    (lambda r: r["sync"].update(ref_model_sync_epochs=1.5, sync_ref_model=True), "sync.ref_model_sync_epochs", "a float must lie in (0, 1)"),
    (lambda r: r["sync"].update(weight_sync_stepz=2), "sync.weight_sync_stepz", "did you mean 'weight_sync_steps'"),
    (lambda r: r["trainer"].update(weight_sync_steps=2), "trainer.weight_sync_steps", "belongs in the sync: section"),
    (lambda r: r.pop("data"), "data", "missing section"),
    (lambda r: r["slurm"].update(trainer={"gpus_per_node": 2, "processes_per_node": 4}),
     "slurm.trainer.processes_per_node", "4 processes on 2 GPU(s) a node: each rank takes the GPU of its local index"),
    # values TRL would take and fail on (or silently ignore) later
    (lambda r: r["trainer"].update(learning_rate=0.0), "trainer.learning_rate", "must be > 0, got 0.0"),
    (lambda r: r["trainer"].update(learning_rate=-1e-3), "trainer.learning_rate", "must be > 0"),
    (lambda r: r["trainer"].update(learning_rate=float("inf")), "trainer.learning_rate", "must be > 0, got inf"),
    (lambda r: r["trainer"].update(per_device_train_batch_size=0), "trainer.per_device_train_batch_size", "must be > 0"),
    (lambda r: r["trainer"].update(gradient_accumulation_steps=-1), "trainer.gradient_accumulation_steps", "must be > 0"),
    (lambda r: r["trainer"].update(max_steps=0), "trainer.max_steps", "or -1 to train num_train_epochs"),
    (lambda r: r.setdefault("sync", {}).update(bucket_mb=0), "sync.bucket_mb", "must be > 0 (MB per shard"),
    (lambda r: r["trainer"].update(max_retries=-1), "trainer.max_retries", "must be >= 0"),
    (lambda r: r["trainer"].update(max_completion_length=0), "trainer.max_completion_length", "must be > 0"),
    (lambda r: r["trainer"].update(save_steps=0), "trainer.save_steps", "remove it for the default (500)"),
    (lambda r: r["trainer"].update(temperature=0.0), "trainer.temperature", "must be > 0"),
    (lambda r: r["trainer"].update(top_p=1.5), "trainer.top_p", "in (0, 1]"),
    (lambda r: r["trainer"].update(max_completion_length=4096), "trainer.max_completion_length",
     "leaves no room for a prompt in the context of"),  # the tiny model's max_position_embeddings: 2048
    (lambda r: r["servers"]["generation"].update(port=0), "servers.generation.port", "must be >= 1"),
    (lambda r: r["servers"]["generation"].update(port=70000), "servers.generation.port", "must be <= 65535"),
    (lambda r: r["servers"].update(generation={"port": 65535}, reference={}), "servers.reference.port", "outside 1-65535"),
    (lambda r: r["servers"]["generation"].update(dp_size=0), "servers.generation.dp_size", "must be >= 1"),
    (lambda r: r["servers"].update(generation={"engine": "sglang", "resources": {"gpus_per_node": 0}}, reference="local"),
     "servers.generation.resources.gpus_per_node", "set servers.generation.device: cpu (SGLang on the CPU: for tests"),
    (lambda r: r["servers"].update(generation=CPU_SGLANG | {"dp_size": 2}, reference="local"),
     "servers.generation.tp_size", "SGLang on the CPU (for tests and small models) runs with tp_size 1 and dp_size 1"),
    (lambda r: r["servers"].update(generation=CPU_SGLANG | {"resources": {"nodes": 2, "gpus_per_node": 0}}, reference="local"),
     "servers.generation.resources.nodes", "2: SGLang on the CPU runs on one node"),
    (lambda r: r["servers"].update(generation=CPU_SGLANG | {"deterministic": True}, reference="local"),
     "servers.generation.deterministic", "SGLang on the CPU has no deterministic mode"),
    (lambda r: r["servers"]["generation"].update(device="cuda"), "servers.generation.resources.gpus_per_node",
     "0: device: cuda needs a GPU"),
    (lambda r: r["servers"]["generation"].update(device="tpu"), "servers.generation.device", "'tpu' is not one of cpu, cuda"),
    (lambda r: r["servers"]["generation"].update(python="./no/such/venv/bin/python"), "servers.generation.python",
     "./no/such/venv/bin/python is not an executable file; give the python of a venv that has the builtin server"),
    (lambda r: r["servers"].update(reference={"url": "http://r:1", "python": "python3"}), "servers.reference.python",
     "a server already running at url (http://r:1) is not started by the launchers: remove python"),
    (lambda r: r["data"].update(dataset=str(REPO / "README.md")), "data.dataset", "unsupported file type"),
    (lambda r: r["data"].update(prompt_column="question"), "data.prompt_column",
     "'question' is not a column of"),
    (lambda r: r["rewards"].append("a:b:c"), "rewards[2].name", "is not a reference package.module:function"),
    (lambda r: r["servers"]["generation"].update(extra_args=["--api-key", "k"]), "servers.generation.extra_args",
     "keep it off the command line"),
    (lambda r: r["servers"]["generation"].update(extra_args=["--config=mine.yaml"]), "servers.generation.extra_args",
     "set servers.api_key instead"),
    (lambda r: r["rewards"].append("no_such_module_h14:f"), "rewards[2].name", "cannot be imported"),
    # what SGLang 0.5.23 refuses (issue 21): sampling ranges, a key it would read as a flag, LoRA it cannot serve
    (lambda r: (r["servers"].update(generation=SGLANG, reference=SGLANG), r["trainer"].update(repetition_penalty=2.5)),
     "trainer.repetition_penalty", "must be in (0, 2] (1.0: no penalty) with generation on a server"),
    (lambda r: r["trainer"].update(generation_kwargs={"top_k": 0}), "trainer.generation_kwargs.top_k", "(0 is refused)"),
    (lambda r: r["trainer"].update(generation_kwargs={"frequency_penalty": -3}), "trainer.generation_kwargs.frequency_penalty",
     "must be in [-2, 2]"),
    (lambda r: r["trainer"].update(generation_kwargs={"min_tokens": 17}), "trainer.generation_kwargs.min_tokens",
     "must be at most max_new_tokens (16)"),
    (lambda r: r["servers"].update(api_key="-abc"), "servers.api_key", "starts with '-'"),
    (lambda r: (r["model"].update(use_peft=True, lora_target_modules=["q_proj", "fc1"])), "model.lora_target_modules",
     "'fc1': not a module the generation server can adapt"),
    (lambda r: (r["model"].update(use_peft=True), r["servers"].update(generation=SGLANG | {"dp_size": 2, "resources": {
        "gpus_per_node": 2}}, reference="local")), "servers.generation.dp_size", "loads LoRA adapters only with dp_size 1"),
    (lambda r: r["trainer"].update(max_completion_length=2042), "trainer.max_completion_length",
     "a server takes prompt + completion of at most 2041 tokens of it"),
]


@pytest.mark.parametrize("change,key,message", BAD, ids=[b[1] + ":" + b[2][:20] for b in BAD])
def test_each_kind_of_mistake_is_named(tmp_path, tiny_recipe, change, key, message):
    change(tiny_recipe)
    path = write(tmp_path, tiny_recipe)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert (key, ) == tuple(k for k, m in err.value.problems if message in m)[:1], err.value
    assert str(path) in str(err.value)


REPLACED = [
    # (old key given, what is reported, what replaced it)
    ("server.layout=separate", "server.layout", "replaced by servers.reference"),
    ("server.ref_url=http://h:1", "server.ref_url", "replaced by servers.reference: {url: URL}"),
    ("server.port=31000", "server.port", "moved to servers.generation.port"),
    ("server.reference=false", "server.reference", "`false` is `reference: local`"),
    ("server.generation=false", "server.generation", "`false` is `generation: local`"),
    ("server.api_key=k", "server.api_key", "moved to servers.api_key"),
    ("slurm.server={nodes: 1}", "slurm.server", "moved to servers.generation.resources"),
]


@pytest.mark.parametrize("override,key,message", REPLACED, ids=[r[1] for r in REPLACED])
def test_old_keys_say_what_replaced_them(tmp_path, tiny_recipe, override, key, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(write(tmp_path, tiny_recipe), [override])
    assert [(k, m) for k, m in err.value.problems if k == key and message in m], err.value
    assert len(err.value.problems) == 1, err.value  # the old key alone, not also as an unknown one


def test_validate_cli_exits_non_zero_naming_file_and_key(tmp_path, tiny_recipe, capsys):
    """In this process (`cli.main`; the exit status of the command's process: test_validate_answers_each_broken_...)."""
    tiny_recipe["trainer"]["learning_rat"] = 1e-3
    path = write(tmp_path, tiny_recipe)
    assert cli_main(["validate", str(path)]) == 1
    assert f"{path}: trainer.learning_rat: unknown key (did you mean 'learning_rate'?)" in capsys.readouterr().err


def test_not_yaml_and_not_a_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="no such file"):
        load_recipe(tmp_path / "missing.yaml")


def test_overrides_apply_and_are_validated(tmp_path, tiny_recipe):
    path = write(tmp_path, tiny_recipe)
    recipe = load_recipe(path, ["trainer.max_steps=3", "servers.generation.port=31000"])
    assert recipe.trainer["max_steps"] == 3 and recipe.servers.generation.port == 31000
    with pytest.raises(RecipeError, match="trainer.max_steps: expected an integer"):
        load_recipe(path, ["trainer.max_steps=three"])
    with pytest.raises(RecipeError, match="section.key=value"):
        load_recipe(path, ["max_steps"])
    assert load_recipe(path, ["trainer.save_strategy=no"]).trainer["save_strategy"] == "no"  # YAML's `no` is false


def test_recipe_flows_into_the_trainer_config(tmp_path, tiny_recipe):
    tiny_recipe["sync"].update(sync_ref_model=True, ref_model_sync_epochs=0.25)
    recipe = load_recipe(write(tmp_path, tiny_recipe))
    gen, ref = recipe.role_urls("http://h:1", None)
    assert (gen, ref) == ("http://h:1", "http://h:1/ref")  # built-in, shared: the reference is the /ref slot
    config = recipe.trainer_config(generation_url=gen, ref_model_url=ref)
    assert config.generation_url == gen and config.ref_model_url == ref and config.beta == 0.04
    assert config.ref_model_sync_epochs == 0.25 and config.reward_weights == [1.0, 0.5]
    assert config.model_init_kwargs["dtype"] == "float32"


def test_new_recipe_copies_for_another_model(tmp_path, capsys):
    """In this process (`cli.main`; the command's process start is the validate tests'): a CLI process spends ~5 s of
    CPU importing TRL for the recipe's schema, which this module has imported already."""
    out = tmp_path / "recipes/Llama-3.1-8B-Instruct/grpo/config_zero2.yaml"
    source = str(REPO / "recipes/Qwen2.5-7B-Instruct/grpo/config_zero2.yaml")
    assert cli_main(["new-recipe", "--from", source, "--model", "meta-llama/Llama-3.1-8B-Instruct", str(out)]) == 0
    assert f"wrote {out} (model meta-llama/Llama-3.1-8B-Instruct)" in capsys.readouterr().out
    text = out.read_text()
    assert "meta-llama/Llama-3.1-8B-Instruct" in text and "Qwen/Qwen2.5-7B-Instruct" not in text
    assert text.startswith("# Llama-3.1-8B-Instruct, GRPO")  # comments are kept for the user to edit
    recipe = load_recipe(out)
    assert recipe.model.name_or_path == "meta-llama/Llama-3.1-8B-Instruct"
    assert recipe.output_dir == "runs/Llama-3.1-8B-Instruct-grpo"
    assert recipe.sync["sync_dir"] == "runs/Llama-3.1-8B-Instruct-grpo/weights"
    result = cli("new-recipe", "--from", source, "--model", "x/y", str(out))  # a process: said before TRL loads
    assert (result.returncode, result.stderr) == (2, f"{out} exists; pass --force to overwrite\n")  # no overwrite
    assert out.read_text() == text


G, R = "http://g:1", "http://r:2"  # the URLs the launchers pass for the server jobs they started
PLACEMENTS = [
    # (servers, beta, server jobs started, the trainer's (generation_url, ref_model_url))
    ({"reference": "generation"}, 0.04, ["server"], (G, f"{G}/ref")),  # the built-in server's second slot
    ({"generation": SGLANG, "reference": "generation"}, 0.0, ["server"], (G, None)),  # beta 0: no reference used
    ({"reference": "local"}, 0.04, ["server"], (G, None)),  # TRL builds it on the trainer
    ({"reference": "none"}, 0.0, ["server"], (G, None)),
    ({"reference": {}}, 0.04, ["server", "ref-server"], (G, R)),  # a server of its own, started by the launchers
    ({"reference": {"url": "http://r:9"}}, 0.04, ["server"], (G, "http://r:9")),  # already running: no job
    ({"generation": "local", "reference": SGLANG}, 0.04, ["ref-server"], (None, R)),
    ({"generation": {"engine": "openai", "url": "http://g:9"}, "reference": {"engine": "sglang", "url": "http://r:9"}},
     0.04, [], ("http://g:9", "http://r:9")),
]


@pytest.mark.parametrize("placement,beta,jobs,urls", PLACEMENTS, ids=[str(p[0]) for p in PLACEMENTS])
def test_each_reference_placement(tmp_path, tiny_recipe, placement, beta, jobs, urls):
    tiny_recipe["servers"].update(placement)
    tiny_recipe["trainer"]["beta"] = beta
    recipe = load_recipe(write(tmp_path, tiny_recipe))
    plan = SlurmPlan(recipe)
    assert plan.server_roles == jobs
    given = {"server": G, "ref-server": R}
    with servers(recipe, *(given[role] if role in jobs else None for role in ("server", "ref-server"))) as found:
        config = recipe.trainer_config(*found)
    assert (config.generation_url, config.ref_model_url) == urls
    if placement.get("generation") == "local":
        assert config.generation_url is None  # TRL generates on the trainer


def test_a_reference_server_listens_next_to_the_generation_server(tmp_path, tiny_recipe, tiny_model):
    tiny_recipe["servers"]["reference"] = {"dtype": "float32", "resources": {"gpus_per_node": 0}}
    path = write(tmp_path, tiny_recipe)
    node, head = ShellVar("SLURM_NODEID"), ShellVar("HEAD_NODE")
    plan = SlurmPlan(load_recipe(path, ["servers.generation.port=31000"]))
    assert (plan.port("server"), plan.port("ref-server")) == (31000, 31001)
    assert plan.resources("ref-server").gpus_per_node == 0
    # the reference lives elsewhere, so neither built-in server holds a second copy of the model
    assert all(f"--port {plan.port(role)} --dtype float32 --no-ref-slot --weight-dirs" in shell_join(plan.server_command(role, node, head))
               for role in ("server", "ref-server"))
    plan = SlurmPlan(load_recipe(path, ["servers.reference.port=32000"]))
    assert plan.port("ref-server") == 32000
    shared = SlurmPlan(load_recipe(write(tmp_path, dict(tiny_recipe, servers={"generation": {}}))))
    assert "--no-ref-slot" not in shared.server_command("server", node, head)  # reference: generation by default


def _broken_recipes(folder: Path, good: str) -> dict[str, str]:
    """Recipe files that each break one rule no type check sees, by name, with the key each must be refused under."""
    good_raw = yaml.safe_load(good)
    cases = {
        "duplicate-key": (good + "\ntrainer:\n  output_dir: elsewhere\n", "trainer"),
        "latin-1": (good.replace("Think step", "Th\xe9nk step"), "(file)"),
        "import-fails": (None, "rewards[0].name"),
        "list-top-level": ("- model\n- data\n", "(top level)"),
        "bad-yaml": ("model: {name_or_path: [\n", "(yaml)"),
        "slurm-time": (None, "slurm.time"),
    }
    import_fails = dict(good_raw, rewards=["boom_on_import_h14:reward"])
    slurm_time = dict(good_raw, slurm=dict(good_raw["slurm"], time="soon"))
    expected = {}
    for name, (text, key) in cases.items():
        path = folder / f"{name}.yaml"
        raw = {"import-fails": import_fails, "slurm-time": slurm_time}.get(name)
        data = (text if raw is None else yaml.safe_dump(raw)).encode("latin-1" if name == "latin-1" else "utf-8")
        path.write_bytes(data)
        expected[str(path)] = key
    return expected


def test_validate_answers_each_broken_recipe_with_one_line(tmp_path, tiny_recipe):
    """A directory of broken recipes: each gets exactly one `FILE: key:` line, the exit status is 1, no traceback."""
    (tmp_path / "boom_on_import_h14.py").write_text("raise RuntimeError('the module is broken')\n")
    folder = tmp_path / "broken"
    folder.mkdir()
    expected = _broken_recipes(folder, yaml.safe_dump(tiny_recipe, sort_keys=False))
    result = cli("validate", *sorted(expected), cwd=tmp_path)  # cwd: where the user's reward module lives
    assert result.returncode == 1
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.startswith(str(folder))]
    for path, key in expected.items():
        mine = [line for line in lines if line.startswith(f"{path}: ")]
        assert len(mine) == 1 and mine[0].startswith(f"{path}: {key}: "), (path, result.stderr)
    assert "RuntimeError: the module is broken" in result.stderr
    assert "not UTF-8 text (byte 0xe9 on line" in result.stderr
    assert "given twice (lines" in result.stderr


def test_a_job_step_refuses_a_recipe_without_output_dir_in_one_line(tmp_path, tiny_recipe, capsys):
    """A job step reads its recipe unchecked (`load_recipe(checked=False)`), but a server job submitted by hand with a
    recipe that has no run directory still gets the recipe's one line, not a traceback."""
    from open_r1_ext.launch import jobs

    del tiny_recipe["trainer"]["output_dir"]
    path = write(tmp_path, tiny_recipe)
    with pytest.raises(RecipeError, match="trainer.output_dir: required"):
        load_recipe(path, checked=False)
    assert jobs.main(["server", str(path)]) == 2
    assert f"{path}: trainer.output_dir: required" in capsys.readouterr().err
