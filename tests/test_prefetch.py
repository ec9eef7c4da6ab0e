"""Reference prefetch and the step-time breakdown, against a real built-in server on the tiny model: a prefetched
reference equals one asked for when TRL wants it (sync and async mode, across a reference reload), and every step's
`timing/*` parts are logged and add up to its wall time."""

import threading

import pytest
import torch

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.sglang_client import SGLangClient
from open_r1_ext.trainer.remote_trainer import remote_completion_logps
from tests.helpers import restore_default_weights, reward_len, tiny_config, tiny_dataset

PARTS = {
    "sync": ["generate", "reference_send", "reference_wait", "rewards", "train", "dump", "reload_wait", "seal_wait"],
    "async": ["rollout_wait", "reference_wait", "rewards", "train", "dump", "reload_wait", "seal_wait"],
}


def train_and_record(tiny_model, server, output_dir, mode, prefetch):
    """Train 4 steps; returns the trainer, each batch's reference log-probs and scored sequences (input ids, mask,
    completion width), and the threads that sent reference requests.
    In async mode the reference is re-synced after step 2, once the batch of step 3 is generated and its reference
    prefetched (the test waits for the rollout thread first): that prefetch predates the reload."""
    args = tiny_config(output_dir, max_steps=4, generation_url=server.url, ref_model_url=f"{server.url}/ref",
                       async_generation=mode == "async", prefetch_reference=prefetch,
                       **(dict(sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=1.0)
                          if mode == "async" else {}))
    trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
    batches, requests = [], []
    loss, ref_logprobs, sync_weights = trainer._compute_loss, trainer.ref_client.ref_logprobs, trainer.sync_weights

    def recorded_loss(model, inputs):  # the reference log-probs TRL's loss read (prefetched: collected in the loss)
        result = loss(model, inputs)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        batches.append((inputs["ref_per_token_logps"].clone(), ids, mask, inputs["completion_ids"].size(1)))
        return result

    def counted_ref_logprobs(sequences):  # a spy: the real request, counted
        requests.append(threading.current_thread() is threading.main_thread())
        return ref_logprobs(sequences)

    def sync_after_rollouts(generation_due, references):
        if references:  # the next batch is generated and its reference request sent before the reload
            with trainer.step_timer.part("reload_wait"):  # this test's wait, a part of the step like the reload
                trainer.remote_generation.rollouts.submit(lambda: None).result()
        sync_weights(generation_due, references)

    trainer._compute_loss = recorded_loss
    trainer.ref_client.ref_logprobs = counted_ref_logprobs
    trainer.sync_weights = sync_after_rollouts
    trainer.train()
    restore_default_weights(server.url, tiny_model)
    restore_default_weights(f"{server.url}/ref", tiny_model)
    return trainer, batches, requests


def logged_steps(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_prefetched_reference_equals_the_one_asked_for_and_steps_are_timed(tiny_model, server, tmp_path, mode):
    asked, asked_batches, asked_requests = train_and_record(tiny_model, server, tmp_path / "asked", mode, prefetch=False)
    fetched, fetched_batches, fetched_requests = train_and_record(tiny_model, server, tmp_path / "fetched", mode,
                                                                  prefetch=True)
    assert asked.reference_prefetch is None and asked_requests == [True] * 4  # asked for by TRL's hook
    assert len(fetched_batches) == len(asked_batches) == 4
    for (got, *scored), (want, *_) in zip(fetched_batches, asked_batches):
        assert not torch.isnan(got).any() and torch.equal(got, want)
    assert [(h["loss"], h["kl"]) for h in logged_steps(fetched)] == [(h["loss"], h["kl"]) for h in logged_steps(asked)]
    assert logged_steps(fetched)[-1]["kl"] > 0

    prefetch = fetched.reference_prefetch
    main_thread_requests = sum(fetched_requests)
    if mode == "sync":
        assert (prefetch.sent, prefetch.used, prefetch.discarded, main_thread_requests) == (4, 4, 0, 0)
    else:
        # batch 3 was prefetched before the reference reload after step 2: discarded, and asked again by the hook
        assert (prefetch.used, prefetch.discarded, main_thread_requests) == (3, 1, 1)
        # ... and rightly: the old reference (the server's start-up weights, restored) scores batch 3 otherwise
        got, ids, mask, width = fetched_batches[2]
        assert not torch.equal(remote_completion_logps(SGLangClient(f"{server.url}/ref"), ids, mask, width), got)

    for trainer in (asked, fetched):
        walls, timed = [], []
        for step, logs in enumerate(logged_steps(trainer), start=1):
            parts = {name: logs[f"timing/{name}"] for name in PARTS[mode]
                     if name != "reference_send" or trainer is fetched}
            assert not [k for k in logs if k.startswith("timing/") and k[len("timing/"):] not in parts]
            assert all(seconds >= 0 for seconds in parts.values()), parts
            positive = ["reference_wait", "rewards", "train", "dump", "generate" if mode == "sync" else "rollout_wait"]
            if mode == "sync" or step in (2, 4):  # the generation server reloads (sync) / the reference (async)
                positive.append("reload_wait")
            assert all(parts[name] > 0 for name in positive if name != "rollout_wait" or step == 1), parts
            walls.append(logs["step_wall_time"])
            timed.append(sum(parts.values()))
            assert timed[-1] <= walls[-1], (walls[-1], parts)  # disjoint parts
        # untimed: the loop between the parts (announcing the next batch, clipping, logging), tens of ms at most a step;
        # over the run's steps, as one step beside busy neighbours was seen to lose 65 ms to the scheduler there
        assert sum(walls) - max(0.2 * sum(walls), 0.05 * len(walls)) <= sum(timed), (walls, timed)
    background = [h.get("background/reference", 0.0) for h in logged_steps(fetched)]
    assert sum(background) > 0 and not any("background/reference" in h for h in logged_steps(asked))
    if mode == "async":  # a generation is logged in the step it ends in (one may run on past a short step)
        generated = [h.get("background/generate", 0.0) for h in logged_steps(fetched)]
        assert generated[0] > 0 and sum(value > 0 for value in generated) >= 3, generated


def test_prefetch_after_trl_generates_locally_with_truncated_completions_masked(tiny_model, server, tmp_path, caplog):
    """TRL generating on the trainer (the bench_trainer set-up): the request leaves after its generation; with
    `mask_truncated_completions` a truncated completion's row is its prompt alone, as TRL then scores it."""
    runs = {}
    for prefetch in (True, False):
        args = tiny_config(tmp_path / str(prefetch), max_steps=2, ref_model_url=f"{server.url}/ref",
                           mask_truncated_completions=True, prefetch_reference=prefetch)
        trainer = RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=reward_len, args=args, train_dataset=tiny_dataset())
        trainer.train()
        runs[prefetch] = trainer
    prefetch = runs[True].reference_prefetch
    assert (prefetch.sent, prefetch.used, prefetch.discarded) == (2, 2, 0)
    assert "no reference prefetch matches" not in caplog.text
    assert [(h["loss"], h["kl"]) for h in logged_steps(runs[True])] == [(h["loss"], h["kl"]) for h in logged_steps(runs[False])]
    assert any(h["completions/clipped_ratio"] > 0 for h in logged_steps(runs[True]))  # some rows were prompts alone
    for logs in logged_steps(runs[True]):
        assert logs["timing/generate"] > 0 and logs["timing/reference_send"] > 0 and "timing/dump" not in logs


def test_the_step_line_shows_the_wall_time_and_its_longest_parts(capsys):
    from transformers import TrainerState

    from open_r1_ext.train import StepPrinter

    logs = {"reward": 0.41, "kl": 0.0021, "loss": 0.0134, "step_wall_time": 0.524, "timing/generate": 0.15,
            "timing/train": 0.31, "timing/seal_wait": 0.0001, "background/reference": 0.2}
    StepPrinter().on_log(None, TrainerState(global_step=3, max_steps=10), None, logs=logs)
    assert capsys.readouterr().out == "step    3/10  reward 0.4100  kl 0.0021  loss 0.0134  0.52 s: train 0.31 generate 0.15\n"
