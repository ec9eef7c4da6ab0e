"""Adapter-only LoRA sync (#16 item 3): a PEFT policy's weight sync ships its adapter alone, as a PEFT directory
that peft and the servers load; the server samples with it by name, and the reference is the server's base model."""

import json
import logging
import signal
import threading
import time
from pathlib import Path

import peft
import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.config.recipe import RecipeError, load_recipe
from open_r1_ext.launch.local_server import BuiltinServer
from open_r1_ext.protocol import sampling_params
from open_r1_ext.sglang_client import ServerRequestError, SGLangClient
from open_r1_ext.trainer.weight_sync import ADAPTER_CONFIG, ADAPTER_FILE, WeightSync
from open_r1_ext.weight_files import MANIFEST, check_manifest, read_weight_dir
from tests.helpers import LORA_FLAGS, loaded_adapters, reward_len, tiny_config, tiny_dataset, unload_adapters
from tests.test_zero3 import launch


def trained_lora(model_path: Path, **config) -> peft.PeftModel:
    """A LoRA policy as after some training: its adapter's B matrices are no longer zero."""
    torch.manual_seed(0)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_path),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    return model.eval()


PROMPT = [1, 5, 9, 20, 3, 7, 11]
# with tests/test_inflight_lora.py on one pytest-xdist worker, which starts their LoRA server once (lora_builtin_server)
pytestmark = pytest.mark.xdist_group("lora-server")


@pytest.fixture()
def lora_server(lora_builtin_server):
    """The LoRA server the modules share, without the adapters a test loaded, afterwards (a run keeps its newest ones
    loaded)."""
    yield lora_builtin_server
    unload_adapters(lora_builtin_server.url)


class ServerMatchesPolicy(TrainerCallback):
    """After each step's sync (it runs after `WeightSyncCallback`): the server's sampling log-probs with the step's
    adapter equal the trainer's policy (LoRA applied: the merged weights), its reference log-probs the base model's
    (the adapter disabled), and the previous adapter is unloaded: `/v1/models` lists the step's adapter alone (both
    servers). Records the largest differences.

    `sglang`: on the built-in server a request naming the previous adapter must also be refused; SGLang would load an
    unloaded adapter again from its path for such a request (`tokenizer_manager.py` `_resolve_lora_path`; the trainer
    never names one)."""

    def __init__(self, trainer, url: str, sglang: bool = False):
        self.trainer, self.client, self.sglang = trainer, SGLangClient(url), sglang
        self.policy_diff, self.reference_diff, self.adapter_effect, self.checked = 0.0, 0.0, 0.0, []

    def on_step_end(self, args, state, control, **kwargs):
        name, model = f"policy-v{state.global_step}", self.trainer.model
        (completion,), = self.client.generate([PROMPT], sampling_params(6, temperature=1.0), lora_path=name)
        ids = torch.tensor([PROMPT + completion.token_ids])
        with torch.no_grad():
            policy = model(ids).logits.log_softmax(-1)[0, len(PROMPT) - 1:-1].gather(-1, ids[0, len(PROMPT):, None])
            with model.disable_adapter():
                base = model(ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])
        sampled = torch.tensor(completion.logprobs)
        self.policy_diff = max(self.policy_diff, (policy[:, 0] - sampled).abs().max().item())
        self.adapter_effect = max(self.adapter_effect, (policy - base[len(PROMPT) - 1:]).abs().max().item())
        reference = self.client.ref_logprobs([ids[0].tolist()])[0]
        self.reference_diff = max(self.reference_diff, (base[:, 0] - reference).abs().max().item())
        loaded = loaded_adapters(self.client)
        assert loaded == [name], loaded
        if not self.sglang and state.global_step > 1:
            with pytest.raises(ServerRequestError, match=f"policy-v{state.global_step - 1}"):
                self.client.generate([PROMPT], sampling_params(2), lora_path=f"policy-v{state.global_step - 1}")
        self.checked.append(state.global_step)


def lora_trainer(tiny_model: Path, output_dir: Path, url: str, **settings) -> RemoteGRPOTrainer:
    args = tiny_config(output_dir, generation_url=url, ref_model_url=url, learning_rate=0.05, **settings)
    return RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset(),
                             peft_config=peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))


def test_an_adapter_dump_is_what_peft_saves_and_loads(tiny_model, tmp_path):
    """The dump (buckets smaller than one tensor) holds the adapter alone, under `save_pretrained`'s names, with its
    config and a manifest; peft loads it into the base model and gives the policy's logits; the policy is untouched."""
    model = trained_lora(tiny_model)
    before = {name: param.clone() for name, param in model.named_parameters()}
    sync = WeightSync(Accelerator(cpu=True), str(tmp_path / "weights"), 0, str(tmp_path / "log"), [],
                      bucket_mb=0.001, adapter_only=True)
    path = sync.dump(model, 3)
    assert path == tmp_path / "weights" / "step-3"
    assert sorted(p.name for p in path.iterdir()) == sorted([ADAPTER_FILE, ADAPTER_CONFIG, MANIFEST])
    check_manifest(path, checksums=False)
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / ADAPTER_FILE))
    dumped = read_weight_dir(path)
    assert sorted(dumped) == sorted(saved) and all(torch.equal(dumped[k], saved[k]) for k in saved)
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["inference_mode"] and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == sorted(json.loads((tmp_path / "saved" / ADAPTER_CONFIG).read_text())["target_modules"])
    # a few percent of the model's bytes
    full = sum(t.numel() * t.element_size() for t in read_weight_dir(tiny_model).values())
    assert sum(t.numel() * t.element_size() for t in dumped.values()) < 0.2 * full
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(path)).eval()
    ids = torch.tensor([[1, 5, 9, 20, 3, 7]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-6)
    assert all(torch.equal(before[name], param) for name, param in model.named_parameters())


def test_zero3_lora_on_two_processes_syncs_adapters_equal_to_the_unsharded_one(tiny_model, lora_server, tmp_path):
    """DeepSpeed ZeRO-3, 2 gloo processes, every LoRA parameter partitioned, async generation against the built-in
    server: each sync loads the step's adapter, each process's rollout thread switches to it in its own queue (a
    process naming an adapter the server does not hold fails), the newest two stay loaded (max_weight_staleness 1);
    an adapter dump gathered in buckets of 1 kB equals the adapter gathered whole, and peft loads it."""
    result = launch(tiny_model, tmp_path, "lora", lora_server.url)
    assert result.returncode == 0, result.stderr[-5000:]
    log = [json.loads(line) for line in (tmp_path / "weight_sync.jsonl").read_text().splitlines()]
    assert [(e["step"], e["weight_version"]) for e in log] == [(1, "1"), (2, "2"), (3, "3")]
    rollouts = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rollouts] == [1, 2, 3] and max(r["staleness"] for r in rollouts) <= 1
    # each batch of both processes sampled with one adapter, the same one: the processes switch at the same place
    by_rank = [json.loads((tmp_path / f"versions-{rank}.json").read_text()) for rank in (0, 1)]
    assert by_rank[0] == by_rank[1] and len(by_rank[0]) == 3 and all(len(v) == 1 for v in by_rank[0])
    assert by_rank[0][-1] != by_rank[0][0]  # an adapter, after the base model
    client = SGLangClient(lora_server.url)
    for name in ("policy-v3", "policy-v2"):
        client.generate([PROMPT], sampling_params(2), lora_path=name)
    with pytest.raises(ServerRequestError, match="policy-v1"):
        client.generate([PROMPT], sampling_params(2), lora_path="policy-v1")
    report = json.loads((tmp_path / "zero3.json").read_text())
    assert report["local_numel"] == 0 < report["full_numel"] and report["buckets"] > 4
    dump = Path(report["path"])
    check_manifest(dump, checksums=False)
    dumped, whole = read_weight_dir(dump), load_file(str(tmp_path / "whole.safetensors"))
    assert sorted(dumped) == sorted(whole) and all(torch.equal(dumped[k], whole[k]) for k in whole)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in dumped.items())  # it trained
    peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(dump))

def test_a_lora_run_samples_from_its_adapters_and_scores_with_the_base_model(tiny_model, lora_server, tmp_path):
    """A tiny run with a PEFT policy against one built-in server: each sync loads the step's adapter (`policy-vN`),
    with which the server samples as the trainer's policy; the reference is the server's base model; the dumps are
    adapters; resumed from a checkpoint (the server still up, holding the run's last adapter), the run reloads the
    checkpoint's adapter and goes on."""
    trainer = lora_trainer(tiny_model, tmp_path, lora_server.url, max_steps=3, save_strategy="steps", save_steps=2)
    assert trainer.weight_sync.adapter_only and trainer.ref_model.client.base_url == lora_server.url
    check = ServerMatchesPolicy(trainer, lora_server.url)
    trainer.add_callback(check)
    trainer.train()
    assert check.checked == [1, 2, 3] and check.policy_diff <= 1e-5 and check.reference_diff <= 1e-5
    assert check.adapter_effect > 1e-3  # the adapters trained: sampling with the base model would not pass
    log = [json.loads(line) for line in (tmp_path / "weight_sync.jsonl").read_text().splitlines()]
    assert [(e["step"], e["weight_version"]) for e in log] == [(1, "1"), (2, "2"), (3, "3")]
    dump = Path(log[-1]["path"])
    assert sorted(p.name for p in dump.iterdir()) == sorted([ADAPTER_FILE, ADAPTER_CONFIG, MANIFEST])
    check_manifest(dump, checksums=True)
    rollouts = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [(r["step"], r["weight_version"]) for r in rollouts] == [(1, 0), (2, 1), (3, 2)]  # staleness 0

    resumed = lora_trainer(tiny_model, tmp_path, lora_server.url, max_steps=4, save_strategy="no")
    check = ServerMatchesPolicy(resumed, lora_server.url)
    resumed.add_callback(check)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert check.checked == [3, 4] and check.policy_diff <= 1e-5 and check.reference_diff <= 1e-5
    rollouts = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [(r["step"], r["weight_version"]) for r in rollouts][-2:] == [(3, 2), (4, 3)]  # the checkpoint's adapter


class RestartServer(TrainerCallback):
    """After optimizer step `step` (and its sync): kill the server (SIGKILL) and start it again on the same port,
    without the adapters it held."""

    def __init__(self, server: BuiltinServer, step: int):
        self.server, self.step, self.restarted = server, step, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.server.stop(signal.SIGKILL)
            self.restarted = BuiltinServer(self.server.model_path, port=self.server.port,
                                           log_path=str(self.server.log_path), extra_args=self.server.extra_args).start()


def test_a_restarted_server_gets_the_adapter_again_and_async_keeps_the_adapters_in_flight(tiny_model, tmp_path, caplog):
    """The server restarts after step 2's sync, losing its adapters: the next batch, naming policy-v2, is refused
    naming it; the trainer loads it again and samples with it. Then, with async generation (one step of look-ahead),
    the adapters the batches read ahead may name (the newest two) stay loaded, older ones are unloaded."""
    server = BuiltinServer(str(tiny_model), log_path=str(tmp_path / "server.log"), extra_args=("--no-ref-slot", *LORA_FLAGS))
    restart = RestartServer(server.start(), step=2)
    try:
        trainer = lora_trainer(tiny_model, tmp_path / "run", server.url, max_steps=3, save_strategy="steps",
                               save_steps=3)
        check = ServerMatchesPolicy(trainer, server.url)
        trainer.add_callback(check)  # before the restart: step 2 is checked on the server that loaded it
        trainer.add_callback(restart)
        with caplog.at_level(logging.WARNING, logger="open_r1_ext.trainer.generation"):
            trainer.train()
        assert "policy-v2" in caplog.text and "loading it again" in caplog.text
        assert check.checked == [1, 2, 3] and check.policy_diff <= 1e-5 and check.reference_diff <= 1e-5
        rollouts = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
        assert [(r["step"], r["weight_version"]) for r in rollouts] == [(1, 0), (2, 1), (3, 2)]

        resumed = lora_trainer(tiny_model, tmp_path / "run", server.url, max_steps=6, async_generation=True)
        resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
        rollouts = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
        assert [r["staleness"] for r in rollouts][3:] and max(r["staleness"] for r in rollouts[3:]) <= 1
        client = SGLangClient(server.url)
        for version, loaded in ((6, True), (5, True), (4, False), (3, False)):
            try:
                client.generate([PROMPT], sampling_params(2), lora_path=f"policy-v{version}")
                held = True
            except ServerRequestError:
                held = False
            assert held == loaded, version
    finally:
        server.stop()
        if restart.restarted is not None:
            restart.restarted.stop()


def test_over_the_network_adapters_go_in_the_request_and_a_restarted_server_is_sent_them_again(tiny_model, tmp_path,
                                                                                                 caplog):
    """`transport: distributed` with a PEFT policy: each sync sends the step's adapter in the request
    (`/load_lora_adapter_from_tensors`), nothing is written to `sync_dir`, and the server samples with it as the
    trainer's policy. The server restarts after step 2's sync, losing it: the next batch, naming policy-v2, is refused,
    and the main process sends the adapter it kept again. Then async generation keeps the newest two adapters."""
    server = BuiltinServer(str(tiny_model), log_path=str(tmp_path / "server.log"), extra_args=("--no-ref-slot", *LORA_FLAGS))
    restart = RestartServer(server.start(), step=2)
    try:
        trainer = lora_trainer(tiny_model, tmp_path / "run", server.url, max_steps=3, save_strategy="steps",
                               save_steps=3, transport="distributed")
        assert trainer.weight_sync.adapter_only and trainer.remote_generation.target.distributed
        check = ServerMatchesPolicy(trainer, server.url)
        trainer.add_callback(check)
        trainer.add_callback(restart)
        with caplog.at_level(logging.WARNING):
            trainer.train()
        assert "lost the adapter of weight_version 2" in caplog.text and "sending it again" in caplog.text
        assert check.checked == [1, 2, 3] and check.policy_diff <= 1e-5 and check.reference_diff <= 1e-5
        assert check.adapter_effect > 1e-3  # the adapters trained: sampling with the base model would not pass
        log = [json.loads(line) for line in (tmp_path / "run" / "weight_sync.jsonl").read_text().splitlines()]
        assert [(e["step"], e["weight_version"], e["path"]) for e in log] == [(1, "1", None), (2, "2", None), (3, "3", None)]
        assert not (tmp_path / "run" / "weights").exists()  # no dump: sync_dir was never made
        rollouts = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
        assert [(r["step"], r["weight_version"]) for r in rollouts] == [(1, 0), (2, 1), (3, 2)]

        resumed = lora_trainer(tiny_model, tmp_path / "run", server.url, max_steps=6, async_generation=True,
                               transport="distributed")
        # the batches read ahead take long, so that each step's sync (sent from the training thread) lands while one
        # is sampled with the adapter before it: that batch is one step stale, not a server that lost its weights
        client, sample = resumed.remote_generation.client, resumed.remote_generation.client.generate

        def slow(*args, **kwargs):
            answer = sample(*args, **kwargs)
            if threading.current_thread() is not threading.main_thread():
                time.sleep(1.0)
            return answer

        client.generate = slow
        resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
        rollouts = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
        assert [r["staleness"] for r in rollouts][3:] and max(r["staleness"] for r in rollouts[3:]) <= 1
        assert sorted(loaded_adapters(SGLangClient(server.url))) == ["policy-v5", "policy-v6"]
        assert not (tmp_path / "run" / "weights").exists()
    finally:
        server.stop()
        if restart.restarted is not None:
            restart.restarted.stop()


def test_a_lora_recipe_starts_its_generation_server_for_adapters(tiny_model):
    """`model.use_peft`: the generation server's command gets the LoRA flags (rank, modules; `all` for `all-linear`),
    the built-in one no `/ref` slot, and the reference in an SGLang generation server is its base model."""
    from open_r1_ext.launch.slurm_plan import ShellVar, SlurmPlan
    from tests.slurm_helpers import RECIPE, REPO

    items = [f"model.name_or_path={tiny_model}", "model.use_peft=true", "model.lora_r=8", "model.lora_target_modules=all-linear"]
    plan = SlurmPlan(load_recipe(REPO / RECIPE, items), items)
    command = [str(w) for w in plan.server_command("server", 0, ShellVar("HEAD_NODE"))]
    assert "--no-ref-slot" in command and " ".join(command).count("--enable-lora --max-lora-rank 8 --lora-target-modules all ") == 1
    assert plan.recipe.role_urls("http://node-1:30000", None) == ("http://node-1:30000", "http://node-1:30000")
    sglang = "{engine: sglang, resources: {gpus_per_node: 1}}"
    items += [f"servers.generation={sglang}", "model.lora_target_modules=[q_proj, v_proj]"]
    plan = SlurmPlan(load_recipe(REPO / RECIPE, items), items)  # reference: generation on SGLang: valid with use_peft
    command = " ".join(str(w) for w in plan.server_command("server", 0, ShellVar("HEAD_NODE")))
    assert "-m sglang.launch_server" in command and "--enable-lora --max-lora-rank 8 --lora-target-modules q_proj v_proj" in command
    assert plan.recipe.model.peft_config().target_modules == {"q_proj", "v_proj"}
    one = load_recipe(REPO / RECIPE, [*items, "model.lora_target_modules=[q_proj]"])  # TRL would make it a regex
    assert one.model.peft_config().target_modules == {"q_proj"}
    with pytest.raises(RecipeError, match="servers.reference: an SGLang server holds one model"):
        load_recipe(REPO / RECIPE, [*items, "model.use_peft=false"])



@pytest.mark.parametrize("settings, lora, message", [
    (dict(sync_ref_model=True, ref_model_url="http://127.0.0.1:9"), {}, "sync_ref_model=True with a PEFT policy"),
    (dict(generation_url="http://127.0.0.1:9"), dict(use_dora=True), "plain LoRA adapters, not this LoraConfig"),
])
def test_what_adapter_sync_refuses_before_training(tiny_model, tmp_path, settings, lora, message):
    """A reference sync (the reference is the base model: TRL refuses it too) and adapters no server loads (DoRA)."""
    with pytest.raises(ValueError, match=message):
        RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=tiny_config(tmp_path, **settings),
                          train_dataset=tiny_dataset(), peft_config=peft.LoraConfig(r=4, target_modules="all-linear", **lora))


def test_a_generation_server_without_lora_is_refused_at_start(tiny_model, server, tmp_path):
    """The built-in server started without --enable-lora (its /server_info says so): refused before training,
    naming the flags, not after a first failed sync."""
    with pytest.raises(ValueError, match="does not load LoRA adapters of rank 4 .* start it with --enable-lora "
                                         "--max-lora-rank 4"):
        lora_trainer(tiny_model, tmp_path, server.url)
