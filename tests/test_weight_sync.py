"""Weight sync against a real built-in server: exact reloads, atomic dumps, pruning, reference sync schedule."""

import errno
import json
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest
import requests
import torch
from transformers import TrainerCallback

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.config.grpo_config import RemoteGRPOConfig
from open_r1_ext.server_pool import NoReplicaError, ServerPool
from open_r1_ext.sglang_client import SGLangClient, ServerRequestError
from open_r1_ext.trainer.weight_sync import SyncTarget, WeightDumpError, WeightSync, WeightSyncError, epochs_crossed
from open_r1_ext.weight_files import check_manifest, read_weight_dir, seal_weight_dir, write_weight_dir
from tests.helpers import model_variant, restore_default_weights, reward_len, tiny_config, tiny_dataset, tiny_settings

FIXED_BATCH = [[5, 17, 42, 99, 3, 250, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(autouse=True)
def server_back_to_default(request, tiny_model):
    """After a test that used the module's server, put its start-up weights back (even when the test failed), so
    one failure does not cascade into the next tests."""
    yield
    if "server" in request.fixturenames:
        restore_default_weights(request.getfixturevalue("server").url, tiny_model)


class CompareAfterSync(TrainerCallback):
    """After each step's sync, the server's log-probs of a fixed batch vs the trainer's current policy."""

    def __init__(self, trainer, client):
        self.trainer, self.client, self.diffs = trainer, client, []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        remote = self.client.ref_logprobs(FIXED_BATCH)
        policy = self.trainer.accelerator.unwrap_model(self.trainer.model)
        with torch.no_grad():
            for seq, got in zip(FIXED_BATCH, remote):
                ids = torch.tensor([seq])
                want = torch.log_softmax(policy(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
                self.diffs.append((state.global_step, (want - got).abs().max().item()))


def test_each_sync_makes_the_server_exact_and_prunes(tiny_model, server, tmp_path):
    args = tiny_config(tmp_path, max_steps=10, generation_url=server.url, ref_model_url=f"{server.url}/ref",
                       keep_last_dumps=3, learning_rate=5e-3)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    compare = CompareAfterSync(trainer, SGLangClient(server.url))
    dumps_seen = []

    class CountDumps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            trainer.weight_sync.wait_durable()  # pruning follows the seal, on the background thread
            dumps_seen.append(sorted(p.name for p in (tmp_path / "weights").iterdir()))

    trainer.add_callback(compare)
    trainer.add_callback(CountDumps())
    trainer.train()
    assert [step for step, _ in compare.diffs[::2]] == list(range(1, 11))
    assert max(diff for _, diff in compare.diffs) < 1e-5
    assert SGLangClient(server.url).weight_version() == "10"
    # the policy really moved: the server's new weights differ from the reference slot's
    ref = SGLangClient(f"{server.url}/ref").ref_logprobs(FIXED_BATCH)[0]
    assert (ref - SGLangClient(server.url).ref_logprobs(FIXED_BATCH)[0]).abs().max() > 1e-3
    assert [len(names) for names in dumps_seen] == [1, 2, 3, 3, 3, 3, 3, 3, 3, 3]
    assert dumps_seen[-1] == ["step-10", "step-8", "step-9"]
    log = [json.loads(line) for line in (tmp_path / "weight_sync.jsonl").read_text().splitlines()]
    assert [e["weight_version"] for e in log] == [str(i) for i in range(1, 11)]
    restore_default_weights(server.url, tiny_model)


DUMPER = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from safetensors.torch import save_file
    from open_r1_ext.weight_files import write_weight_dir
    def slow(tmp):
        save_file({"w": torch.zeros(4)}, str(tmp / "model-00001-of-00002.safetensors"))
        print("half", flush=True)
        time.sleep(60)
    write_weight_dir(Path(sys.argv[1]), slow)
""")


def test_dump_killed_half_way_is_never_loaded(tiny_model, server, tmp_path):
    target = tmp_path / "step-7"
    proc = subprocess.Popen([sys.executable, "-c", DUMPER, str(target)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "half"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not target.exists()  # never published
    (partial,) = tmp_path.glob(".step-7.tmp-*")
    client = SGLangClient(server.url, max_retries=0)
    for path in (target, partial):
        with pytest.raises(ServerRequestError, match="no such directory|unfinished weight dump"):
            client.update_weights_from_disk(str(path), weight_version="7")
    assert client.weight_version() == "default"
    # the next good dump of the same step replaces the leftovers and loads
    write_weight_dir(target, lambda tmp: [shutil.copy(p, tmp) for p in tiny_model.iterdir() if p.is_file()])
    assert client.update_weights_from_disk(str(target), weight_version="7")["success"]
    assert client.weight_version() == "7"
    # a published dump cut short afterwards is refused by its manifest's sizes (checked on every reload)
    shutil.copytree(target, tmp_path / "step-8")
    with open(tmp_path / "step-8" / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ServerRequestError, match="has 1000 bytes, manifest.json says"):  # the client's own check
        client.update_weights_from_disk(str(tmp_path / "step-8"), weight_version="8")
    raw = requests.post(f"{server.url}/update_weights_from_disk",  # the server's, for a client that does not check
                        json={"model_path": str(tmp_path / "step-8"), "weight_version": "8"}, timeout=60)
    assert raw.status_code == 400 and "has 1000 bytes, manifest.json says" in raw.text, raw.text
    assert client.weight_version() == "7"
    restore_default_weights(server.url, tiny_model)


def test_restoring_a_damaged_or_unsealed_dump_is_refused(tiny_model, server, tmp_path):
    """Restoring a logged dump (on resume, after a server restart) checks its checksums first, whatever the server:
    a crash before the fsync can leave a published dump with damaged files of the right size."""
    sync = WeightSync(SimpleNamespace(num_processes=1, is_main_process=True), str(tmp_path), 2, str(tmp_path / "log"), [])
    client = SGLangClient(server.url, max_retries=0)
    target = write_weight_dir(tmp_path / "step-3", lambda tmp: [shutil.copy(p, tmp) for p in tiny_model.iterdir() if p.is_file()])
    logged = SyncTarget("reference", client, version="ref-3", path=target, step=3)
    with pytest.raises(WeightSyncError, match="never sealed"):
        sync.repush(logged)
    seal_weight_dir(target)
    with open(target / "model.safetensors", "r+b") as f:  # same size, other bytes in the tensor data
        f.seek(-64, 2)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(WeightSyncError, match="cannot restore the reference server's weights: .*does not match its xxh3_128 checksum"):
        sync.repush(logged)
    assert client.weight_version() == "default"


def copied_dump(tiny_model, path):
    """A published (unsealed) dump of the tiny model's weights and config."""
    return write_weight_dir(path, lambda tmp: [shutil.copy(tiny_model / name, tmp)
                                               for name in ("config.json", "model.safetensors")])


def damage_keeping_size(dump) -> None:
    """Other bytes at the end of the shard's tensor data, its size kept (what a crash before the fsync can leave
    behind a published name): only the checksums tell."""
    with open(dump / "model.safetensors", "r+b") as f:
        f.seek(-64, 2)
        f.write(b"\x00\x01\x02\x03")


def load_requests(server) -> int:
    """The reloads a server (SGLang or built-in) was asked for: its access log's `POST /update_weights_from_disk`."""
    return sum("POST /update_weights_from_disk" in line for line in server.log_path.read_text(errors="replace").splitlines())


def test_a_logged_dump_damaged_since_is_never_handed_to_a_restored_server(any_server, tiny_model, tmp_path):
    """Restoring a server's weights from its last logged dump (`WeightSync.repush`: a restarted server, the reference
    on resume) verifies the dump's checksums first: one damaged since is refused with an error naming the dump, and
    the server, SGLang or built-in, is never asked to load it and keeps its weights (SGLang's scheduler dies on a
    damaged safetensors file)."""
    client = SGLangClient(any_server.url, max_retries=0)
    dump = copied_dump(tiny_model, tmp_path / "step-3")
    seal_weight_dir(dump)
    damage_keeping_size(dump)
    sync = WeightSync(SimpleNamespace(num_processes=1, is_main_process=True), str(tmp_path), 2, str(tmp_path / "log"), [])
    reloads = load_requests(any_server)
    with pytest.raises(WeightSyncError, match=rf"cannot restore the generation server's weights: {re.escape(str(dump))}: "
                                              r"file model.safetensors does not match its xxh3_128 checksum"):
        sync.repush(SyncTarget("generation", client, version="3", path=dump, step=3))
    assert load_requests(any_server) == reloads
    assert client.weight_version() == "default" and client.is_healthy()


def test_a_sealed_dump_damaged_since_is_never_replayed_to_a_replica(any_server, tiny_model, tmp_path):
    """A pool replays its last dump to a replica that lost it (restarted; here put back on its start-up weights). By
    then the dump is sealed, and every reload of a sealed dump verifies its checksums first: damaged since, the
    replica (SGLang or built-in) is never asked to load it, keeps its weights, and is dropped, the pool's error
    naming the dump."""
    client = SGLangClient(any_server.url, max_retries=0)
    dump = copied_dump(tiny_model, tmp_path / "step-1")
    pool = ServerPool([any_server.url], replica_max_retries=0, wait_timeout=2.0)
    try:
        pool.update_weights_from_disk(str(dump), weight_version="1")  # just written, not sealed yet: loaded
        assert client.weight_version() == "1"
        seal_weight_dir(dump)
        damage_keeping_size(dump)
        restore_default_weights(any_server.url, tiny_model)  # the replica lost the pool's weights
        reloads = load_requests(any_server)
        with pytest.raises(NoReplicaError, match=rf"not asking {re.escape(any_server.url)}/update_weights_from_disk to "
                                                 rf"load an incomplete dump: {re.escape(str(dump))}: file "
                                                 r"model.safetensors does not match its xxh3_128 checksum"):
            pool.weight_version()
        assert load_requests(any_server) == reloads
        assert client.weight_version() == "default" and client.is_healthy()
    finally:
        pool.close()


def test_sync_is_logged_only_once_its_dump_is_durable(tiny_model, server, tmp_path, monkeypatch):
    """The seal (checksums, fsync) runs in the background after the server reloaded; the log entry (what a resume
    trusts) waits for it, and a failed fsync stops the next sync with the file named."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from open_r1_ext.trainer import weight_sync as weight_sync_module

    gate, flushed = threading.Event(), []

    def gated_seal(path):
        assert gate.wait(60)
        seal_weight_dir(path)
        flushed.append(path.name)

    monkeypatch.setattr(weight_sync_module, "seal_weight_dir", gated_seal)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    log = tmp_path / "weight_sync.jsonl"
    target = SyncTarget("generation", SGLangClient(server.url, max_retries=0))
    sync = WeightSync(Accelerator(cpu=True), str(tmp_path / "weights"), 2, str(log), [target])
    try:
        assert sync.sync(model, 1, [target]) is None
        assert target.client.weight_version() == "1"  # reloaded before the dump reached the disk ...
        assert flushed == [] and not log.exists()  # ... and not logged until it has
        # a server restart now (simulated: it went back to its start-up weights) re-pushes once the seal is done
        restore_default_weights(server.url, tiny_model)
        outcome = []
        repush = threading.Thread(target=lambda: outcome.append(sync.repush(target) or "reloaded"))
        repush.start()
        repush.join(timeout=1.0)
        assert repush.is_alive() and target.client.weight_version() == "default"
        gate.set()
        repush.join(timeout=60)
        assert outcome == ["reloaded"] and target.client.weight_version() == "1"
        sync.wait_durable()
        assert flushed == ["step-1"]
        assert [json.loads(line)["weight_version"] for line in log.read_text().splitlines()] == ["1"]
        check_manifest(tmp_path / "weights" / "step-1", checksums=True)

        def failing_seal(path):
            raise OSError(errno.EIO, "fsync failed: Input/output error", str(path / "model-00001-of-00001.safetensors"))

        monkeypatch.setattr(weight_sync_module, "seal_weight_dir", failing_seal)
        assert sync.sync(model, 2, [target]) is None  # published and reloaded; its fsync fails in the background
        with pytest.raises(WeightDumpError, match=r"did not reach the disk .*Input/output error.*"
                                                  r"step-2/model-00001-of-00001.safetensors(.|\n)*Stopping at step 3"):
            sync.dump(model, 3)
        assert not (tmp_path / "weights" / "step-3").exists()
        assert [json.loads(line)["weight_version"] for line in log.read_text().splitlines()] == ["1"]
    finally:
        gate.set()
        restore_default_weights(server.url, tiny_model)


def hf_epochs(steps_in_epoch: int, grad_accum: int, epochs: int):
    """The `state.epoch` values transformers sets at each optimizer step (Trainer._inner_training_loop)."""
    values = []
    for epoch in range(epochs):
        for step in range(steps_in_epoch):
            if (step + 1) % grad_accum == 0 or step + 1 == steps_in_epoch:
                values.append(epoch + (step + 1) / steps_in_epoch)
    return values


@pytest.mark.parametrize(
    "steps_in_epoch,grad_accum,every,expected",
    [
        (8, 1, 0.25, [2, 4, 6, 8, 10, 12, 14, 16]),
        (8, 1, 0.5, [4, 8, 12, 16]),
        (8, 1, 1, [8, 16]),
        (8, 1, 2, [16]),
        (8, 2, 0.25, [1, 2, 3, 4, 5, 6, 7, 8]),  # 4 optimizer steps per epoch
        (8, 2, 0.5, [2, 4, 6, 8]),
        (8, 2, 1, [4, 8]),
        (6, 4, 0.5, [1, 2, 3, 4]),  # 6 micro-steps, accum 4: optimizer steps at micro 4 and 6 (epoch end)
        (10, 1, 0.25, [3, 5, 8, 10, 13, 15, 18, 20]),  # boundaries at 2.5, 5, 7.5, 10: the first step at/after each
    ],
)
def test_ref_model_sync_epochs_fires_on_the_right_steps(steps_in_epoch, grad_accum, every, expected):
    epochs = hf_epochs(steps_in_epoch, grad_accum, epochs=2)
    fired, previous = [], 0.0
    for step, epoch in enumerate(epochs, start=1):
        if epochs_crossed(previous, epoch, every):
            fired.append(step)
        previous = epoch
    assert fired == expected


@pytest.mark.parametrize("bad,message", [
    (dict(ref_model_sync_epochs=1.5), "a float must lie in"),
    (dict(ref_model_sync_epochs=0.0), "a float must lie in"),
    (dict(ref_model_sync_epochs=0), "an int must be >= 1"),
    (dict(ref_model_sync_epochs=1, ref_model_sync_steps=10), "give exactly one"),
])
def test_ref_model_sync_config_errors(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        RemoteGRPOConfig(**tiny_settings(tmp_path, sync_ref_model=True, **bad))


def test_remote_reference_sync_every_half_epoch(tiny_model, server, tmp_path):
    # 8 prompts x 4 generations / 4 per step = 8 optimizer steps per epoch; every 0.5 epoch = steps 4 and 8
    args = tiny_config(tmp_path, max_steps=8, ref_model_url=f"{server.url}/ref", sync_ref_model=True,
                       ref_model_sync_epochs=0.5, ref_model_mixup_alpha=1.0, learning_rate=5e-3)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset(8))
    trainer.train()
    log = [json.loads(line) for line in (tmp_path / "weight_sync.jsonl").read_text().splitlines()]
    assert [(e["role"], e["step"]) for e in log] == [("reference", 4), ("reference", 8)]
    ref = SGLangClient(f"{server.url}/ref")
    assert ref.weight_version() == "ref-8"
    # the reference now is the policy of step 8
    policy = trainer.accelerator.unwrap_model(trainer.model)
    ids = torch.tensor([FIXED_BATCH[0]])
    with torch.no_grad():
        want = torch.log_softmax(policy(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(ref.ref_logprobs(FIXED_BATCH[:1])[0], want, atol=1e-5, rtol=0)
    restore_default_weights(ref.base_url, tiny_model)


def test_soft_reference_update_mixes_on_the_builtin_server(tiny_model, other_tiny_model, server, tmp_path):
    from transformers import AutoModelForCausalLM

    ref = SGLangClient(f"{server.url}/ref")
    ref.update_weights_from_disk(str(other_tiny_model), weight_version="mix", mixup_alpha=0.25)
    a = AutoModelForCausalLM.from_pretrained(tiny_model)
    b = AutoModelForCausalLM.from_pretrained(other_tiny_model)
    with torch.no_grad():
        for pa, pb in zip(a.parameters(), b.parameters()):
            pa.mul_(0.75).add_(pb, alpha=0.25)
        ids = torch.tensor([FIXED_BATCH[0]])
        want = torch.log_softmax(a(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(ref.ref_logprobs(FIXED_BATCH[:1])[0], want, atol=1e-5, rtol=0)
    restore_default_weights(ref.base_url, tiny_model)


def test_failed_reload_stops_training_unless_staleness_allows(tiny_model, tmp_path):
    from open_r1_ext.launch.local_server import BuiltinServer
    from open_r1_ext.trainer.weight_sync import WeightSyncError

    # a server whose model has other shapes: it generates, but cannot load the trainer's weights
    narrow = model_variant(tiny_model, tmp_path / "narrow", intermediate_size=96)
    with BuiltinServer(str(narrow), extra_args=("--no-ref-slot",)) as srv:
        args = tiny_config(tmp_path / "strict", max_steps=3, generation_url=srv.url, beta=0.0)
        trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
        with pytest.raises(WeightSyncError, match=r"did not take the new weights: .*step-1.*shape.*\n.*Stopping at step 1"):
            trainer.train()
        args = tiny_config(tmp_path / "lenient", max_steps=3, generation_url=srv.url, beta=0.0, max_weight_staleness=5)
        trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
        trainer.train()
        assert trainer.state.global_step == 3


@pytest.fixture()
def small_disk(tmp_path):
    """A 600 kB tmpfs: room for one dump of the tiny model (~380 kB), not two. Mounting needs root (as `make test`
    has for its SLURM cluster); elsewhere the test is skipped."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_during_a_dump_stops_with_a_checkpoint_and_removes_the_partial_dump(tiny_model, server, tmp_path,
                                                                                        small_disk):
    """A real ENOSPC (safetensors raises its own SafetensorError): one line naming the path and the cause, a
    checkpoint at the failing step, nothing half-written left on the full disk; the same run then resumes."""
    settings = dict(max_steps=4, generation_url=server.url, keep_last_dumps=2, save_strategy="steps", save_steps=10)
    args = tiny_config(tmp_path / "run", sync_dir=str(small_disk), **settings)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    with pytest.raises(WeightDumpError) as caught:
        trainer.train()
    first = str(caught.value).splitlines()[0]
    assert first.startswith(f"could not write the weight dump {small_disk / 'step-2'} (model-00001-of-00001.safetensors, "
                            "rank 0): no space left on device (SafetensorError:"), first
    assert sorted(p.name for p in small_disk.iterdir()) == ["step-1"]  # the partial step-2 is gone
    assert (tmp_path / "run" / "checkpoint-2").is_dir()
    # with room again, the same command resumes from that checkpoint
    args = tiny_config(tmp_path / "run", sync_dir=str(tmp_path / "weights"), **settings)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 4 and SGLangClient(server.url).weight_version() == "4"


def test_a_lora_policy_dumps_its_merged_weights_without_touching_the_model(tiny_model, tmp_path):
    """PEFT: each layer merged in its bucket (base + delta, computed aside) under the base model's names, as
    `merge_and_unload` gives them (peft is a test dependency, not a runtime one)."""
    import copy

    import peft
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)  # a trained adapter: the merged weights differ from the base
    before = {name: param.clone() for name, param in model.named_parameters()}
    sync = WeightSync(Accelerator(cpu=True), str(tmp_path), 0, str(tmp_path / "log"), [], bucket_mb=0.02)
    dumped = read_weight_dir(sync.dump(model, 1))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    want.pop("lm_head.weight")  # tied to the embeddings: stored once, as save_pretrained does
    assert sorted(dumped) == sorted(want) and all(torch.equal(dumped[k], want[k]) for k in want)
    assert any(not torch.equal(dumped[k], v) for k, v in read_weight_dir(tiny_model).items())
    assert all(torch.equal(before[name], param) for name, param in model.named_parameters())
