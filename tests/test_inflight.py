"""In-flight weight updates (#23) against real servers: groups train as they complete, the staleness bound holds (too
stale groups are dropped and sent again, never trained), completions span weight versions, a server restarted between
two syncs has its weights restored (built-in servers); a run learns the demo task (the demo recipe on its built-in
server, and in-process on real SGLang); a run stopped mid-way resumes without losing or doubling a group, and a
replica killed while paused loses nothing (each on the built-in server and on real SGLang 0.5.23 on the CPU,
`any_server`); over the network, a replica killed mid-broadcast loses nothing and a single server killed so stops
training with a checkpoint (built-in servers). (A plain in-flight run on both servers:
tests/test_pause_generation.py.)"""

import json
import re
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Optional

import pytest
import torch
from transformers import TrainerCallback

from open_r1_ext import RemoteGRPOTrainer, weight_broadcast
from open_r1_ext.launch.local_server import BuiltinServer
from open_r1_ext.launch.run_status import staleness
from open_r1_ext.protocol import sampling_params
from open_r1_ext.sglang_client import ServerError, SGLangClient
from open_r1_ext.trainer.inflight import STATE_FILE, InFlightGeneration
from open_r1_ext.trainer.weight_sync import WeightSyncError
from tests.helpers import (arithmetic_prompts, engine_at, restore_default_weights, server_like, tiny_config,
                           tiny_dataset)
from tests.slurm_helpers import RECIPE, REPO
from tests.test_async import low_ids
from tests.weight_buckets import before_broadcast, stop_process


def rollouts(output_dir) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "rollouts.jsonl").read_text().splitlines()]


def trained_positions(entries) -> Counter:
    return Counter((e["epoch"], *e["group"]) for e in entries if not e.get("dropped"))


def in_flight_config(output_dir, url, **overrides):
    settings = dict(max_steps=8, per_device_train_batch_size=8, num_generations=4, max_completion_length=32,
                    generation_url=url, async_generation=True, in_flight_updates=True, beta=0.0,
                    generation_kwargs={"ignore_eos": True})
    return tiny_config(output_dir, **{**settings, **overrides})


def shape_groups(trainer: RemoteGRPOTrainer, short: int = 4, held: Optional[threading.Event] = None,
                 held_batches: int = 0, shorts_first: int = 0) -> None:
    """Shape the workload so that groups complete out of order: the first prompt of every generation batch samples
    `max_completion_length` tokens (`ignore_eos`), the others `short`; with `held`, the first prompts of the first
    `held_batches` batches are sent only once `held` is set; with `shorts_first`, the first prompts of the first
    `shorts_first` batches only once the other groups of those batches are complete (which request a busy server
    takes first is then the test's, not the sender threads' race)."""
    generation = trainer.remote_generation
    split, sample = generation.split_groups, generation._sample
    shorts_left = [shorts_first * (generation.groups_per_batch - 1)]
    shorts_done, counted = threading.Event(), threading.Lock()
    if not shorts_left[0]:
        shorts_done.set()

    def shaped(rows, epoch, batch):
        groups = split(rows, epoch, batch)
        for group in groups[1:]:
            group.sampling = {**group.sampling, "max_new_tokens": short}
        return groups

    def late(group, done):
        first = group.index == 0
        if first and held is not None and group.batch < held_batches:
            held.wait(timeout=120)
        if first and group.batch < shorts_first:
            shorts_done.wait(timeout=120)
        sample(group, done)
        if not first and 0 <= group.batch < shorts_first:
            with counted:
                shorts_left[0] -= 1
                if shorts_left[0] == 0:
                    shorts_done.set()

    generation.split_groups, generation._sample = shaped, late


def test_groups_train_as_they_complete_within_the_staleness_bound(tiny_model, server, tmp_path):
    # 8 prompts in flight, 2 a step: while the long first groups of the first batches generate, the short ones of
    # four batches make three steps, and three weight syncs pause, reload and continue those long generations
    args = in_flight_config(tmp_path, server.url, max_weight_staleness=1, max_completion_length=256,
                            max_prompts_in_flight=8)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=low_ids, args=args, train_dataset=tiny_dataset(64))
    assert isinstance(trainer.remote_generation, InFlightGeneration)
    shape_groups(trainer)
    trainer.train()
    log = rollouts(tmp_path)
    trained = [e for e in log if not e.get("dropped")]
    assert [e["step"] for e in trained] == [step for step in range(1, 9) for _ in range(2)]  # 2 groups a step
    assert all(e["staleness"] <= 1 for e in trained), trained  # counted from the oldest token
    assert all(e["staleness"] == e["step"] - 1 - min(e["versions"]) for e in log)
    dropped = [e for e in log if e.get("dropped")]
    assert dropped and all(e["staleness"] > 1 for e in dropped)  # too stale: never trained, sent again
    assert max(trained_positions(log).values()) == 1  # a dropped group, sent again, trains once
    # groups trained in the order they completed: the short ones of later batches before the long first ones
    assert any(e["group"][0] > later["group"][0] for i, e in enumerate(trained) for later in trained[i + 1:])
    # completions under way at a sync went on with the new weights: groups spanning several versions
    assert any(len(e["versions"]) > 1 for e in log)
    assert SGLangClient(server.url).weight_version() == "8"
    status = staleness(tmp_path)
    assert status["step"] == 8 and status["max"] <= 1 and status["dropped"] == sum(1 for e in log if e.get("dropped"))
    parts = [h for h in trainer.state.log_history if "step_wall_time" in h]
    assert all("timing/group_wait" in h and "timing/rollout_wait" not in h for h in parts)
    assert any(h.get("background/paused", 0) > 0 and h.get("background/reload", 0) > 0 for h in parts)
    restore_default_weights(server.url, tiny_model)


# Off-policy by a step (as async_generation alone), it learns later than the demo, and later still on a busy machine
# (the samples, so the few early rewards that start it, follow the timing). At the demo's learning rate (0.02) the
# reward, once up, fell back to ~0 in 2 runs of 4 (2026-12-05, beside other runs), one of them still there at step 60
# (a suite run failed on it); at 0.01 it took off at step 16-20 and was ~1 by step 40 in 3 runs of 3.
LEARN_STEPS = 60
IN_FLIGHT_LEARNING_RATE = 0.01  # README, In-flight weight updates: halve a learning rate tuned for synchronous runs


@pytest.mark.timeout(180)  # without the restore, the groups are sampled from the initial weights again, forever
@pytest.mark.parametrize("damaged", [False, True], ids=["restored", "dump-damaged"])
def test_groups_sampled_by_a_restarted_server_restore_its_weights_and_are_sampled_again(tiny_model, server, tmp_path,
                                                                                           caplog, damaged):
    """The server killed (SIGKILL) and started again between two syncs, so that it serves its initial weights: the
    groups of step 5, held back until then, are sampled from weights older than those they were sent at. The step
    that takes them gives the server its last confirmed weights again, drops them as too stale and sends them again.
    With that dump damaged meanwhile, the restore fails and training stops at the next group, naming why."""
    args = in_flight_config(tmp_path, server.url, max_weight_staleness=1, max_prompts_in_flight=2)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=low_ids, args=args, train_dataset=tiny_dataset(64))
    generation, restarted, sent_at = trainer.remote_generation, threading.Event(), []
    sample = generation._sample

    def after_the_restart(group, done):
        if group.batch == 4 and group.attempt == 0:
            sent_at.append(group.sent_at)
            restarted.wait(timeout=120)
        sample(group, done)

    class Restart(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 4:  # after the sync of step 4 (a callback before this one); batch 4's groups sent
                for update in list(generation._updates):
                    update.result()
                if damaged:  # once sealed (logged), as a crash would find it; damage during a seal: test_weight_files
                    trainer.weight_sync.wait_durable()
                    (tmp_path / "weights" / "step-4" / "model-00001-of-00001.safetensors").write_bytes(b"damaged")
                server.stop(signal.SIGKILL)
                server.start()
                restarted.set()

    generation._sample = after_the_restart
    trainer.add_callback(Restart())
    try:
        with caplog.at_level("WARNING", logger="open_r1_ext"):
            if damaged:
                with pytest.raises(WeightSyncError, match=r"lost its weights \(restarted\?\) and could not be given "
                                                          r"them again: .*step-4"):
                    trainer.train()
                assert trainer.state.global_step == 4
                return
            trainer.train()
        assert restarted.is_set() and sent_at and min(sent_at) >= 1  # sent at weights the restarted server lost
        assert "older than the weights" in caplog.text and "lost weight_version 4 (restarted?): reloading" in caplog.text
        log = rollouts(tmp_path)
        dropped = [e for e in log if e.get("dropped")]
        assert dropped and {e["step"] for e in dropped} == {5} and all(e["versions"] == [0] for e in dropped), dropped
        trained = [e for e in log if not e.get("dropped")]
        assert all(e["staleness"] <= 1 for e in trained) and max(trained_positions(log).values()) == 1
        assert [e["step"] for e in trained] == [step for step in range(1, 9) for _ in range(2)]
        assert SGLangClient(server.url).weight_version() == "8"
    finally:
        restore_default_weights(server.url, tiny_model)


def test_the_demo_recipe_learns_with_in_flight_updates(tiny_model, tmp_path):
    """`make demo`'s recipe with `sync.in_flight_updates` (and its embedded built-in server), as a user runs it, at half
    its learning rate."""
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "open_r1_ext.train", "--config", RECIPE,
                             "--set", f"model.name_or_path={tiny_model}", "--set", f"trainer.output_dir={run_dir}",
                             "--set", "sync.async_generation=true", "--set", "sync.in_flight_updates=true",
                             "--set", f"trainer.max_steps={LEARN_STEPS}",
                             "--set", f"trainer.learning_rate={IN_FLIGHT_LEARNING_RATE}"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rewards = [e["reward"] for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward" in e]
    assert len(rewards) == LEARN_STEPS and sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.4, rewards
    log = rollouts(run_dir)
    assert max(trained_positions(log).values()) == 1 and sum(trained_positions(log).values()) == LEARN_STEPS * 2
    assert all(e["staleness"] <= 1 for e in log if not e.get("dropped"))
    assert "group_wait" in result.stdout  # the step lines say where the time went
    status = subprocess.run([sys.executable, "-m", "open_r1_ext.cli", "status", str(run_dir)], capture_output=True,
                            text=True, timeout=120)
    assert re.search(rf"^staleness [01] step\(s\) at step {LEARN_STEPS} \(max 1\); "
                     r"in flight: its groups from weights [\d, ]+; \d+ group\(s\) dropped as too stale \(sent again\) so far$",
                     status.stdout, re.MULTILINE), status.stdout


DIGITS = range(18, 28)  # the tiny tokenizer's "0".."9"


def digit_reward(completion_ids, **kwargs):
    """The fraction of completion tokens that are digits: the demo's task (`target_token`, one digit) made ten times
    denser. SGLang's CPU backend ignores `sampling_seed`, so each run samples anew: at the demo's ~0.3% start one run
    in ~10 found too few rewarded tokens to take off within 40 steps; at ~3% it took off at step 7-15 in 5 runs."""
    return [sum(t in DIGITS for t in ids) / max(1, len(ids)) for ids in completion_ids]


SGLANG_LEARN_STEPS = 30  # reward ~1 at step 30 in 5 runs out of 5 (alone); the assertion asks for +0.4


def test_a_tiny_run_with_in_flight_updates_learns_on_real_sglang(shared_sglang, tiny_model, tmp_path):
    """A task the tiny model learns, in-flight against real SGLang on the CPU: every step's weights paused into the
    generations under way. (The demo recipe itself, with its built-in server, is the test above.)"""
    args = in_flight_config(tmp_path, shared_sglang.url, max_steps=SGLANG_LEARN_STEPS, max_completion_length=16,
                            learning_rate=2e-2, lr_scheduler_type="constant", max_weight_staleness=1,
                            generation_kwargs={})
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=digit_reward, args=args,
                                train_dataset=arithmetic_prompts(64))
    try:
        trainer.train()
        rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h and "loss" in h]
        assert len(rewards) == SGLANG_LEARN_STEPS and sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.4, rewards
        log = rollouts(tmp_path)
        assert max(trained_positions(log).values()) == 1 and sum(trained_positions(log).values()) == SGLANG_LEARN_STEPS * 2
        assert all(e["staleness"] <= 1 for e in log if not e.get("dropped"))
        assert any(len(e["versions"]) > 1 for e in log)  # completions went on across a weight update
        assert SGLangClient(shared_sglang.url).weight_version() == str(SGLANG_LEARN_STEPS)
    finally:
        restore_default_weights(shared_sglang.url, tiny_model)


def test_in_flight_updates_over_the_network_pause_broadcast_and_continue(any_server, tiny_model, tmp_path):
    """`transport: distributed`: each sync stages the policy in memory, and the update thread pauses the server
    (retract), broadcasts the weights and continues it, so the long groups under way go on with the new weights
    (unpaused, SGLang and the built-in server would let them end before the update: no group would span versions).
    4 prompts in flight, 2 a step: step 1 takes the short groups, steps 2 and 3 long groups (256 tokens, ~2 s; a step
    ~0.5 s) sent once those were complete, before the first sync. Nothing is dumped; the server ends on the last
    step's weights."""
    args = in_flight_config(tmp_path, any_server.url, max_steps=3, max_weight_staleness=2, max_completion_length=256,
                            max_prompts_in_flight=4, transport="distributed", bucket_mb=0.05)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=low_ids, args=args, train_dataset=tiny_dataset(64))
    shape_groups(trainer, shorts_first=2)
    trainer.train()
    log = rollouts(tmp_path)
    trained = [e for e in log if not e.get("dropped")]
    assert [e["step"] for e in trained] == [1, 1, 2, 2, 3, 3] and max(trained_positions(log).values()) == 1
    assert all(e["staleness"] == e["step"] - 1 - min(e["versions"]) <= 2 for e in trained), trained
    assert any(len(e["versions"]) > 1 for e in log), log  # generations under way went on across a broadcast
    steps = [h for h in trainer.state.log_history if "inflight/versions_per_group" in h]
    assert [h["remote/staleness"] for h in steps] == [max(e["staleness"] for e in trained if e["step"] == h["step"])
                                                      for h in steps]
    assert [h["inflight/versions_per_group"] for h in steps] == [
        sum(len(e["versions"]) for e in trained if e["step"] == h["step"]) / 2 for h in steps]
    # the training thread stages the policy; the broadcast of a sync runs beside the next step (on the update thread),
    # which a sync waits for before staging again: each step but the first has its predecessor's pause
    assert all(h["timing/stage"] > 0 for h in steps) and ["background/paused" in h for h in steps] == [False, True, True]
    syncs = [json.loads(line) for line in (tmp_path / "weight_sync.jsonl").read_text().splitlines()]
    assert [(e["step"], e["path"]) for e in syncs] == [(1, None), (2, None), (3, None)]
    assert not (tmp_path / "weights").exists() and SGLangClient(any_server.url).weight_version() == "3"


@pytest.mark.timeout(180)  # without the catch-up of a partial server, its groups are dropped and sent again forever
def test_groups_sampled_after_a_broadcast_stopped_half_way_are_never_trained(server, tiny_model, tmp_path,
                                                                             monkeypatch):
    """The first sync's broadcaster stalls in bucket 2 (SIGSTOP, an injected fault) and is killed at its deadline: the
    server, paused, took bucket 1 and reports `1-partial`; continued, the long groups under way finish on those mixed
    weights. They are dropped (`partial`) and sent again, the server is sent whole weights at the next batch, and the
    run goes on (the sync's failure is within `max_weight_staleness`)."""
    monkeypatch.setattr(weight_broadcast, "DEADLINE_MARGIN_S", 1.0)
    args = in_flight_config(tmp_path, server.url, max_steps=3, max_weight_staleness=2, max_completion_length=256,
                            max_prompts_in_flight=4, transport="distributed", bucket_mb=0.05, distributed_timeout=3)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=low_ids, args=args, train_dataset=tiny_dataset(64))
    shape_groups(trainer, shorts_first=2)
    generation, partial, sampled_partly = trainer.remote_generation, threading.Event(), set()
    sample = generation._sample

    def watched(group, done):
        sample(group, done)
        if group.partial():
            sampled_partly.add((group.epoch, group.batch, group.index, group.attempt + 1))
            partial.set()

    class AfterTheFailedSync(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # (after the sync, a callback before this one)
            if state.global_step == 1:
                assert partial.wait(timeout=120), "no group was sampled from the partial weights"

    generation._sample = watched
    trainer.add_callback(AfterTheFailedSync())
    try:
        with before_broadcast(2, stop_process):
            trainer.train()
        log = rollouts(tmp_path)
        dropped = {(e["epoch"], *e["group"], e["sent"]) for e in log if e.get("partial")}
        assert sampled_partly and sampled_partly == dropped and all(e["dropped"] for e in log if e.get("partial"))
        trained = [e for e in log if not e.get("dropped")]
        assert not {(e["epoch"], *e["group"], e["sent"]) for e in trained} & sampled_partly
        assert [e["step"] for e in trained] == [1, 1, 2, 2, 3, 3] and max(trained_positions(log).values()) == 1
        assert SGLangClient(server.url).weight_version() == "3"
    finally:
        restore_default_weights(server.url, tiny_model)


class StopAt(TrainerCallback):
    """SIGTERM during optimizer step `step`: a checkpoint at its end, then `train()` returns (as `open-r1-ext train`
    stops on SIGTERM); `saved` is set once the checkpoint is written."""

    def __init__(self, trainer, step):
        self.trainer, self.step, self.saved = trainer, step, threading.Event()

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step - 1:
            self.trainer.stop_signal._handle(signal.SIGTERM, None)

    def on_save(self, args, state, control, **kwargs):
        self.saved.set()


EPOCH_STEPS = 32  # 64 prompts, 2 a step


def test_a_run_stopped_mid_way_resumes_without_losing_or_doubling_a_group(any_server, tiny_model, tmp_path):
    """What is checked is which groups trained when, not what they sampled: it holds on SGLang too, whose CPU backend
    has no deterministic mode (it ignores `sampling_seed`)."""
    assert engine_at(any_server.url) == any_server.engine

    def trainer_for(max_steps):
        args = in_flight_config(tmp_path, any_server.url, max_steps=max_steps, max_weight_staleness=10,
                                save_strategy="steps", save_steps=100, max_prompts_in_flight=16)
        return RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=low_ids, args=args, train_dataset=tiny_dataset(64))

    first = trainer_for(EPOCH_STEPS)
    stop = StopAt(first, 5)
    first.add_callback(stop)
    # the first prompts of the first 5 batches are still on their way when the checkpoint of step 5 is written, while
    # the short groups of later batches train: groups of the batches the loader skips on resume are not trained yet,
    # groups of the batches it reads again are
    shape_groups(first, held=stop.saved, held_batches=5)
    first.train()
    assert first.state.global_step == 5
    before = rollouts(tmp_path)
    state = torch.load(tmp_path / "checkpoint-5" / STATE_FILE.format(rank=0), weights_only=False)
    assert state["global_step"] == 5 and state["trained"] == 5  # the data loader resumes after 5 generation batches
    redraw = {(b, i) for b, i, _ in state["redraw"]}
    skip = {tuple(p) for p in state["skip"]}
    # the held groups are among those to draw again; which others were still on their way at the checkpoint depends
    # on the order the server finished them in (a busy machine once left a short group of batch 1 unfinished)
    assert {(b, 0) for b in range(5)} <= redraw and all(b < 5 for b, _ in redraw), state
    assert skip and all(b >= 5 for b, _ in skip), state
    trained_before = {(b, i) for _, b, i in trained_positions(before)}
    assert skip <= trained_before and not redraw & trained_before

    second = trainer_for(EPOCH_STEPS)
    shape_groups(second)
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == EPOCH_STEPS
    after = rollouts(tmp_path)[len(before):]
    # over the whole epoch, every prompt's group trained exactly once: none lost, none doubled
    counts = trained_positions(before) + trained_positions(after)
    assert counts == Counter({(0, b, i): 1 for b in range(EPOCH_STEPS) for i in range(2)}), counts
    trained_after = {(b, i) for _, b, i in trained_positions(after)}
    assert redraw <= trained_after and not skip & trained_after  # drawn again / not again


def test_num_iterations_trains_each_group_that_many_times_and_checkpoints_between_batches(server, tiny_model,
                                                                                          tmp_path):
    """`num_iterations: 2` at TRL's defaults (steps_per_generation = gradient_accumulation_steps): each generation
    batch of in-flight groups trains over two optimizer steps; the checkpoint of step 2 falls between two batches and
    the resumed run trains the next batch, no group twice across it."""
    def trainer_for(max_steps):
        args = in_flight_config(tmp_path, server.url, max_steps=max_steps, num_iterations=2, max_weight_staleness=2,
                                save_strategy="steps", save_steps=2, max_completion_length=8)
        trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=low_ids, args=args,
                                    train_dataset=tiny_dataset(16))
        generate, generated_at = trainer._generate_and_score_completions, []

        def recorded(inputs):
            generated_at.append(trainer.state.global_step)
            return generate(inputs)

        trainer._generate_and_score_completions = recorded
        return trainer, generated_at

    first, generated_first = trainer_for(2)
    first.train()
    second, generated_second = trainer_for(4)
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == 4
    assert generated_first == [0] and generated_second == [2]  # a batch generated every 2 steps, trained at both
    log = rollouts(tmp_path)
    assert [e["step"] for e in log if not e.get("dropped")] == [1, 1, 3, 3]  # 2 groups a batch, taken at its 1st step
    assert set(trained_positions(log).values()) == {1}  # no group taken twice, across the checkpoint neither
    assert SGLangClient(server.url).weight_version() == "4"
    restore_default_weights(server.url, tiny_model)


def test_a_replica_killed_while_paused_loses_no_group(any_server, tiny_model, tmp_path):
    """A pool of `any_server` (a) and a second server of its kind (b): at the first sync after step 2 at which b holds
    requests and has sampled a group that trained, b is killed (SIGKILL, SGLang's scheduler and detokenizer with it)
    once both are paused, before the reload. The pool drops it and sends its groups to a: every group trains once. The
    run stops 4 steps after the kill (which pause that is depends on timing), at most 16."""
    def at_the_pause(pool, kill_if_due, monkeypatch):
        pause = pool.pause_generation

        def pause_then_kill(mode="retract"):
            answer = pause(mode)
            if kill_if_due():  # both replicas paused, b holding requests mid-generation: it goes away before the reload
                assert len(answer["replicas"]) == 2
            return answer

        pool.pause_generation = pause_then_kill

    check_replica_killed_while_paused(any_server, tiny_model, tmp_path, at_the_pause)


def test_a_replica_killed_while_paused_mid_broadcast_loses_no_group(server, tiny_model, tmp_path, monkeypatch):
    """As above over the network (`transport: distributed`, buckets of 50 kB), on built-in servers: b is killed while
    the servers stand paused for the update thread's broadcast, between its first and second bucket. b's group fails
    alone; the pool drops b, a takes the whole update and b's groups, nothing is written to the sync directory."""
    def mid_broadcast(pool, kill_if_due, monkeypatch):
        send = weight_broadcast.WeightUpdate.send_flat

        def kill_then_send(self, index, layout, fill):
            if index == 1:
                kill_if_due()
            send(self, index, layout, fill)

        monkeypatch.setattr(weight_broadcast.WeightUpdate, "send_flat", kill_then_send)

    try:
        check_replica_killed_while_paused(server, tiny_model, tmp_path, mid_broadcast, monkeypatch,
                                          transport="distributed", bucket_mb=0.05)
        assert not (tmp_path / "weights").exists()
    finally:
        SGLangClient(server.url).continue_generation()
        restore_default_weights(server.url, tiny_model)


def check_replica_killed_while_paused(a, tiny_model, tmp_path, arm_kill, monkeypatch=None, **settings) -> None:
    """The run of the two tests above; `arm_kill(pool, kill_if_due, monkeypatch)` places the kill."""
    with server_like(a, log_path=tmp_path / "b.log") as b:
        assert engine_at(a.url) == engine_at(b.url) == a.engine
        # b warmed up, as a is by earlier tests: a fresh server's first generation is its slowest, and under load b
        # could still hold its first groups at the kill, having sampled none that trained (1 run in 5 with 3 busy loops)
        SGLangClient(b.url).generate([[1, 5, 9]], sampling_params(48, ignore_eos=True))
        args = in_flight_config(tmp_path, [a.url, b.url], max_steps=16, max_weight_staleness=2,
                                max_completion_length=48, **settings)
        trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=low_ids, args=args,
                                    train_dataset=tiny_dataset(64))
        generation = trainer.remote_generation
        pool, log_groups = generation.client, generation._log_groups
        killed, trained_from = [], set()

        def log_and_note(groups, step):  # the replicas of the groups taken for training so far
            trained_from.update(group.replica for group in groups)
            log_groups(groups, step)

        def kill_if_due() -> bool:
            # the tokens of b's requests in flight, read from the pool's private counter: killed with none, b would
            # lose nothing and the test would not test what it says. Which replica's groups complete first is the
            # machine's timing (under load a 2-step wait was not always enough for b's): the kill waits for one.
            held = pool._replicas[b.url].outstanding
            if trainer.state.global_step >= 2 and not killed and held > 0 and b.url in trained_from:
                killed.append(trainer.state.global_step)
                b.stop(signal.SIGKILL)
                return True
            return False

        class StopAfterTheKill(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):  # after the step's sync, which may have killed b
                control.should_training_stop = bool(killed) and state.global_step == killed[0] + 4

        arm_kill(pool, kill_if_due, monkeypatch)
        generation._log_groups = log_and_note
        trainer.add_callback(StopAfterTheKill())
        trainer.train()
        assert killed, "b held no request at any pause after step 2 and a trained group from it: nothing was killed"
        last = killed[0] + 4
        assert trainer.state.global_step == last
        assert pool.replicas()[b.url] == "dropped" and pool.replicas()[a.url] == "serving"
        log = rollouts(tmp_path)
        counts = trained_positions(log)
        assert max(counts.values()) == 1 and sum(counts.values()) == last * 2  # nothing lost, nothing drawn twice
        trained = [e for e in log if not e.get("dropped")]
        assert b.url in {e["replica"] for e in trained}
        # groups completed later (at most the bound of 4 were waiting when it died) all came from the replica left
        assert {e["replica"] for e in trained if e["step"] > killed[0] + 2} == {a.url}
        assert SGLangClient(a.url).weight_version() == str(last)


@pytest.mark.parametrize("overrides,message", [
    (dict(async_generation=False), "needs async_generation=True"),
    (dict(generation_backend="openai"), "needs generation_backend='sglang'"),
    (dict(steps_per_generation=3, gradient_accumulation_steps=2), "optimizer steps and generation batches to line up"),
    (dict(num_iterations=2, save_strategy="steps", save_steps=3), "a checkpoint must fall between two batches"),
    (dict(num_iterations=2, save_strategy="steps", save_steps=2, max_steps=3), "max_steps=3 would stop"),
    (dict(max_prompts_in_flight=1), "at least the prompts of one generation batch"),
])
def test_in_flight_config_errors(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        in_flight_config(tmp_path, "http://x:1", **overrides)


def test_the_default_bound_is_a_batch_per_step_of_staleness_allowed(tmp_path):
    """`max_prompts_in_flight` unset: `max_weight_staleness` generation batches' prompts, at least two batches' (a
    group read now is trained about that many steps later); what is set is kept."""
    from open_r1_ext.trainer.generation import prompts_in_flight

    groups = 8 // 4  # per_device_train_batch_size / num_generations
    assert prompts_in_flight(in_flight_config(tmp_path, "http://x:1")) == 2 * groups  # staleness 0 -> 1
    assert prompts_in_flight(in_flight_config(tmp_path, "http://x:1", max_weight_staleness=4)) == 4 * groups
    assert prompts_in_flight(in_flight_config(tmp_path, "http://x:1", max_weight_staleness=4, steps_per_generation=2,
                                              gradient_accumulation_steps=2)) == 4 * 2 * groups
    assert prompts_in_flight(in_flight_config(tmp_path, "http://x:1", max_prompts_in_flight=3)) == 3
    assert prompts_in_flight(in_flight_config(tmp_path, "http://x:1", in_flight_updates=False)) == 0


def test_a_single_server_killed_mid_broadcast_stops_training_with_a_checkpoint(tiny_model, tmp_path, monkeypatch):
    """In-flight over the network with one server of its own: killed (SIGKILL) while paused for the sync of step 2,
    between the first and the second bucket. The broadcast fails, the groups it held fail, and training stops with a
    message naming the server and a checkpoint to resume from, as a failed in-flight reload does (README, failure
    behaviour)."""
    doomed = BuiltinServer(str(tiny_model), log_path=str(tmp_path / "server.log")).start()
    killed = []
    send = weight_broadcast.WeightUpdate.send_flat

    def kill_then_send(self, index, layout, fill):
        if index == 1 and self.version == "2" and not killed:
            killed.append(doomed.process.pid)
            doomed.stop(signal.SIGKILL)
        send(self, index, layout, fill)

    monkeypatch.setattr(weight_broadcast.WeightUpdate, "send_flat", kill_then_send)
    args = in_flight_config(tmp_path, doomed.url, max_steps=8, max_weight_staleness=1, transport="distributed",
                            bucket_mb=0.05, max_retries=1, request_timeout=10)
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=low_ids, args=args, train_dataset=tiny_dataset(64))
    try:
        with pytest.raises(ServerError) as failed:
            trainer.train()
    finally:
        doomed.stop()
    message = str(failed.value)
    assert killed and doomed.url in message, message
    stopped = re.search(r"Training stopped at step (\d+)\. A checkpoint to resume from is in (\S+):", message)
    assert stopped and 2 <= int(stopped.group(1)) <= 3, message
    assert (Path(stopped.group(2)) / "trainer_state.json").is_file()
    assert not (tmp_path / "weights").exists()
