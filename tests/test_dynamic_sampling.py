"""Dynamic sampling (DAPO, `dynamic_sampling`) against real servers: every trained group's rewards spread, each batch
is full, the remote reference scores the kept groups only, a batch whose groups are all uniform stops after
`dynamic_sampling_max_rounds`. The reward makes half the prompts' groups uniform by construction (a dataset column),
and a step's rounds draw each prompt once before any twice, the batch's own last (so the default 4 rounds always find
the 2 informative groups a batch of 8 prompts needs): no assertion rests on sampling luck."""

import json
import math
import os
import subprocess
import sys
import zlib

import pytest
from datasets import Dataset

from open_r1_ext import RemoteGRPOTrainer
from open_r1_ext.config.grpo_config import RemoteGRPOConfig
from open_r1_ext.config.recipe import RecipeError, load_recipe
from open_r1_ext.launch.run_plot import SAMPLING_PANEL, plot_run
from open_r1_ext.launch.run_status import format_status, run_status
from open_r1_ext.train import MetricsLog, StepPrinter
from tests.helpers import REPO, restore_default_weights, tiny_config
from tests.slurm_helpers import RECIPE

GROUP = 4  # num_generations
ROWS = 8  # per_device_train_batch_size: two groups per step


def prompts(uniform_every: int, n: int = 8) -> Dataset:
    """`n` prompts; those whose index is a multiple of `uniform_every` get the same reward for every completion."""
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
                               "uniform": i % uniform_every == 0} for i in range(n)])


def spread_unless_uniform(completion_ids, uniform, log_extra=None, **kwargs):
    """1.0 for every completion of a uniform prompt; else a number drawn from the completion's tokens (distinct
    completions of 8 random tokens get distinct numbers). Logs a column of the completions table (TRL's `log_extra`)."""
    if log_extra is not None:
        log_extra("uniform", list(uniform))
    return [1.0 if flat else zlib.crc32(repr(list(ids)).encode()) % 1000 / 1000
            for ids, flat in zip(completion_ids, uniform)]


class RecordingTrainer(RemoteGRPOTrainer):
    """Records what TRL trained in each generation batch (its own `_logs`: the batch's prompts and advantages), the
    prompts each training step generated for (one per group, every round), and the sequences the reference server
    scored."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained: list[tuple[list[str], list[float]]] = []
        self.generated: dict[int, list[str]] = {}
        self.requests: dict[int, list[int]] = {}  # step -> the groups of each round's generation request
        self.scored: list[int] = []
        client, ref_logprobs = self.ref_client, self.ref_client.ref_logprobs

        def counted(sequences, *pargs, **kw):  # the real call to the reference server, counted
            self.scored.append(len(sequences))
            return ref_logprobs(sequences, *pargs, **kw)

        client.ref_logprobs = counted
        self.read_ahead: list[tuple[int, bool]] = []  # async generation: (groups, generated ahead) of each request
        if self.args.async_generation and not self.args.in_flight_updates:
            queue = self.remote_generation.rollouts
            take = queue.take

            def recorded(key):
                found = take(key)
                self.read_ahead.append((len(key) // self.num_generations, found is not None))
                return found

            queue.take = recorded

    def _generate(self, prompts):
        if self.model.training and self.dynamic_sampling._sampled is None:  # a round's (not TRL's for the kept batch)
            self.generated.setdefault(self.state.global_step, []).extend(
                p[-1]["content"] for p in prompts[::self.num_generations])
            self.requests.setdefault(self.state.global_step, []).append(len(prompts) // self.num_generations)
        return super()._generate(prompts)

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.trained.append(([p[-1]["content"] for p in self._logs["prompt"]], output["advantages"].tolist()))
        return output


def groups_of(batch: tuple[list[str], list[float]]) -> list[tuple[set, list[float]]]:
    texts, advantages = batch
    return [(set(texts[i:i + GROUP]), advantages[i:i + GROUP]) for i in range(0, len(texts), GROUP)]


def logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def train(tiny_model, server, tmp_path, dataset, generation=None, **settings) -> RecordingTrainer:
    """A run generating on `generation` (default: `server`) with its reference on the built-in `server`'s slot."""
    generation_url = (generation or server).url
    args = tiny_config(tmp_path, **{"per_device_train_batch_size": ROWS, "num_generations": GROUP,
                                    "generation_url": generation_url, "ref_model_url": f"{server.url}/ref", **settings})
    trainer = RecordingTrainer(model=str(tiny_model), reward_funcs=spread_unless_uniform, args=args,
                               train_dataset=dataset, callbacks=[MetricsLog(), StepPrinter()])
    try:
        trainer.train()
    finally:
        restore_default_weights(generation_url, tiny_model)
    return trainer


def assert_informative_full_batches(trainer, batches: int) -> None:
    uniform = {f"What is {i} + {i}?" for i in range(0, 8, 2)}
    assert len(trainer.trained) == batches
    for batch in trainer.trained:
        assert len(batch[0]) == ROWS  # full, as without filtering
        for texts, advantages in groups_of(batch):
            assert len(texts) == 1 and not texts & uniform, texts
            assert any(abs(a) > 1e-3 for a in advantages), advantages


def assert_rounds_sized_by_share(trainer, needed: int, most: int) -> None:
    """One generation request a round (in flight: the batch's groups, then one a round), and each step's extra rounds
    asked for the groups still missing over the informative share that step's rounds had found so far (all of `most`
    when they had found none), at most `most` groups; some step had one."""
    assert [len(sizes) for sizes in trainer.requests.values()] == logged(trainer, "dynamic_sampling/rounds")
    uniform = {f"What is {i} + {i}?" for i in range(0, 8, 2)}
    extra_rounds = 0
    for step, sizes in trainer.requests.items():
        texts, found, generated = iter(trainer.generated[step]), 0, 0
        for size in sizes:
            if generated:
                share = found / generated
                assert size == (min(math.ceil((needed - found) / share), most) if share else most), (step, sizes)
                extra_rounds += 1
            found += sum(next(texts) not in uniform for _ in range(size))
            generated += size
    assert extra_rounds, trainer.requests


def test_trains_only_informative_groups_with_the_reference_for_them_alone(tiny_model, server, tmp_path, capsys):
    trainer = train(tiny_model, server, tmp_path, prompts(uniform_every=2), max_steps=3, dynamic_sampling=True)
    assert_informative_full_batches(trainer, batches=3)
    assert logged(trainer, "frac_reward_zero_std") == [0.0, 0.0, 0.0]  # TRL's own count of the trained batch
    assert logged(trainer, "dynamic_sampling/groups_kept") == [2.0, 2.0, 2.0]
    generated = logged(trainer, "dynamic_sampling/groups_generated")
    assert sum(generated) > 6 and logged(trainer, "dynamic_sampling/informative_share") == [1.0, 1.0, 1.0]
    # the first round's request holds the batch's 2 groups and their oversampling (after a step that filtered some
    # groups: more than 2)
    assert any(requests[0] > 2 for requests in trainer.requests.values()), trainer.requests
    assert_rounds_sized_by_share(trainer, needed=2, most=4)  # the default oversampling bound: 2x the batch's groups
    # a step's rounds draw each of the 8 prompts once before any twice: a filtered group's prompt is not drawn again
    for step, texts in trainer.generated.items():
        assert len(set(texts)) == min(len(texts), 8), (step, texts)
    # the reference server scored each step's 8 trained sequences, none of the groups filtered out
    assert trainer.scored == [ROWS] * 3
    assert list(trainer._logs["extra"]["uniform"]) == [False] * ROWS  # the reward's column: the trained rows' values
    # metrics.jsonl, the step line, status and plot show the groups
    step_line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step    3/3")][0]
    assert f"groups 2/{generated[-1]:g} kept in " in step_line
    status = run_status(tmp_path)["dynamic_sampling"]
    assert status["step"] == 3 and status["groups_kept"] == 2.0 and status["groups_generated"] == generated[-1]
    assert f"sampling  step 3: kept 2 of {generated[-1]:g} groups generated" in format_status(run_status(tmp_path))
    assert SAMPLING_PANEL in plot_run(tmp_path, tmp_path / "plot.png")


@pytest.mark.parametrize("mode", [
    dict(async_generation=True),
    dict(async_generation=True, in_flight_updates=True),
    dict(per_device_train_batch_size=GROUP, gradient_accumulation_steps=2, num_iterations=2, max_steps=4),
], ids=["async", "in-flight", "num_iterations"])
def test_overlapped_generation_and_reused_batches_train_informative_groups(tiny_model, server, tmp_path, mode):
    trainer = train(tiny_model, server, tmp_path, prompts(uniform_every=2), **{"max_steps": 2, **mode},
                    dynamic_sampling=True)
    batches = 2  # with num_iterations=2, each generation batch trains two optimizer steps
    assert_informative_full_batches(trainer, batches=batches)
    assert trainer.scored == [ROWS] * batches
    assert_rounds_sized_by_share(trainer, needed=2, most=4)
    if mode.get("in_flight_updates"):  # the extra rounds took refills generated in flight: none on this thread
        steps = [h for h in trainer.state.log_history if "step_wall_time" in h]
        assert [h["timing/generate"] for h in steps] == [0.0, 0.0] and any(h["dynamic_sampling/rounds"] > 1
                                                                           for h in steps), steps
        refills = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()
                   if '"refill"' in line]
        assert len(refills) == sum(logged(trainer, "dynamic_sampling/groups_generated")) - 2 * batches
        taken = [tuple(e["group"]) for e in refills]  # in the order they completed
        assert len(set(taken)) == len(taken) and all(batch == -1 for batch, _ in taken), taken  # each its own seeds


def test_async_generation_sends_a_batch_read_ahead_with_its_oversampling(tiny_model, server, tmp_path):
    """With `async_generation` a batch read ahead goes in one request with the prompts that oversample it (their
    number from the informative share known then: after a batch that filtered some groups, more than the batch's 2
    groups), and its step takes it generated."""
    trainer = train(tiny_model, server, tmp_path, prompts(uniform_every=2), max_steps=3, async_generation=True,
                    dynamic_sampling=True)
    assert_informative_full_batches(trainer, batches=3)
    assert any(groups > 2 and ahead for groups, ahead in trainer.read_ahead), trainer.read_ahead


def test_in_flight_on_real_sglang_trains_informative_groups(tiny_model, server, shared_sglang, tmp_path):
    trainer = train(tiny_model, server, tmp_path, prompts(uniform_every=2), generation=shared_sglang, max_steps=2,
                    async_generation=True, in_flight_updates=True, dynamic_sampling=True)
    assert_informative_full_batches(trainer, batches=2)
    assert trainer.scored == [ROWS] * 2


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "in-flight"])
def test_two_trainer_processes_share_out_the_kept_groups(tiny_model, server, tmp_path, in_flight):
    """Each of two processes trains one group per step (accelerate launch, CPU, gloo: this module run as a script);
    in flight, each keeps its own refills in flight, and every process's refills taken are logged."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    try:
        result = subprocess.run([*launcher, "-m", "tests.test_dynamic_sampling", str(tiny_model), server.url,
                                 str(tmp_path), str(in_flight)], capture_output=True, text=True, timeout=600, env=env,
                                cwd=REPO)
    finally:
        restore_default_weights(server.url, tiny_model)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank-{i}.json").read_text()) for i in range(2)]
    uniform = {f"What is {i} + {i}?" for i in range(0, 8, 2)}
    for step in range(2):
        trained = [rank["trained"][step] for rank in ranks]
        assert trained[0][0] == trained[1][0]  # the batch both processes trained (TRL gathers its prompts)
        local = [set(trained[r][0][r * GROUP:(r + 1) * GROUP]) for r in range(2)]
        assert all(len(texts) == 1 and not texts & uniform for texts in local), local
        advantages = [rank["trained"][step][1] for rank in ranks]  # each its own group, of the same size
        assert all(len(a) == GROUP and any(abs(x) > 1e-3 for x in a) for a in advantages)
        assert advantages[0] != advantages[1]
    assert [rank["scored"] for rank in ranks] == [[GROUP] * 2] * 2  # each process's reference: its kept group
    if in_flight:
        refills = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()
                   if '"refill"' in line]
        generated = ranks[0]["groups_generated"]  # every process's groups of each step (2 a step from the data)
        assert len(refills) == sum(generated) - 2 * 2 > 0, (refills, generated)
        assert {e["process"] for e in refills} == {0, 1}


def test_resumed_run_trains_the_batch_the_uninterrupted_one_did(tiny_model, server, tmp_path):
    settings = dict(max_steps=3, dynamic_sampling=True, save_strategy="steps", save_steps=2)
    whole = train(tiny_model, server, tmp_path / "whole", prompts(uniform_every=2), **settings)
    assert_informative_full_batches(whole, batches=3)
    args = tiny_config(tmp_path / "whole", per_device_train_batch_size=ROWS, num_generations=GROUP,
                       generation_url=server.url, ref_model_url=f"{server.url}/ref", **settings)
    resumed = RecordingTrainer(model=str(tiny_model), reward_funcs=spread_unless_uniform, args=args,
                               train_dataset=prompts(uniform_every=2))
    try:
        resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    finally:
        restore_default_weights(server.url, tiny_model)
    assert resumed.trained[0][0] == whole.trained[2][0]  # the same prompts (refills included), in the same order
    assert resumed.trained[0][1] == pytest.approx(whole.trained[2][1], abs=1e-5)


def test_all_uniform_groups_stop_after_the_last_round_and_train_a_full_batch(tiny_model, server, tmp_path):
    trainer = train(tiny_model, server, tmp_path, prompts(uniform_every=1), max_steps=2, dynamic_sampling=True,
                    dynamic_sampling_max_rounds=1, dynamic_sampling_max_oversampling=1.0)
    assert [len(batch[0]) for batch in trainer.trained] == [ROWS, ROWS]
    assert logged(trainer, "dynamic_sampling/rounds") == [2.0, 2.0]  # the first and the one extra round
    assert logged(trainer, "dynamic_sampling/groups_kept") == [0.0, 0.0]
    assert logged(trainer, "dynamic_sampling/groups_generated") == [4.0, 4.0]
    assert logged(trainer, "dynamic_sampling/informative_share") == [0.0, 0.0]


@pytest.mark.parametrize("settings, problem", [
    (dict(dynamic_sampling_min_std=-0.1), "dynamic_sampling_min_std=-0.1: must be >= 0"),
    (dict(dynamic_sampling_max_rounds=-1), "dynamic_sampling_max_rounds=-1: must be >= 0"),
    (dict(dynamic_sampling_max_oversampling=0.5), "dynamic_sampling_max_oversampling=0.5: must be >= 1"),
])
def test_config_refuses_what_filtering_cannot_do(tmp_path, settings, problem):
    with pytest.raises(ValueError, match=problem):
        RemoteGRPOConfig(**{**dict(output_dir=str(tmp_path), num_generations=GROUP, per_device_train_batch_size=ROWS,
                                   report_to=[], use_cpu=True), **settings})


def test_trainer_refuses_an_unknown_reward_and_an_iterable_dataset(tiny_model, server, tmp_path):
    def build(dataset, **settings):
        args = tiny_config(tmp_path, per_device_train_batch_size=ROWS, num_generations=GROUP, generation_url=server.url,
                           dynamic_sampling=True, **settings)
        RemoteGRPOTrainer(model=str(tiny_model), reward_funcs=spread_unless_uniform, args=args, train_dataset=dataset)

    with pytest.raises(ValueError, match="dynamic_sampling_reward='nope' names no reward function of this run: choose "
                                         "one of spread_unless_uniform"):
        build(prompts(uniform_every=2), dynamic_sampling_reward="nope")
    with pytest.raises(ValueError, match="dynamic_sampling=True needs a map-style training set"):
        build(prompts(uniform_every=2).to_iterable_dataset())


def test_recipe_names_a_reward_that_is_not_there():
    load_recipe(REPO / RECIPE, ["trainer.dynamic_sampling=true", "trainer.dynamic_sampling_reward=target_token"])
    with pytest.raises(RecipeError, match=r"trainer.dynamic_sampling_reward: 'nope' is none of the rewards "
                                          r"\(target_token, accuracy\)"):
        load_recipe(REPO / RECIPE, ["trainer.dynamic_sampling=true", "trainer.dynamic_sampling_reward=nope"])


if __name__ == "__main__":  # a trainer process of test_two_trainer_processes_share_out_the_kept_groups
    model, url, output_dir, in_flight = sys.argv[1:5]
    args = tiny_config(output_dir, per_device_train_batch_size=GROUP, num_generations=GROUP, generation_url=url,
                       ref_model_url=f"{url}/ref", max_steps=2, dynamic_sampling=True,
                       **(dict(async_generation=True, in_flight_updates=True) if in_flight == "True" else {}))
    ranked = RecordingTrainer(model=model, reward_funcs=spread_unless_uniform, args=args,
                              train_dataset=prompts(uniform_every=2))
    ranked.train()
    with open(os.path.join(output_dir, f"rank-{ranked.accelerator.process_index}.json"), "w") as f:
        json.dump({"trained": ranked.trained, "scored": ranked.scored,
                   "groups_generated": logged(ranked, "dynamic_sampling/groups_generated")}, f)
