"""Benchmark dynamic sampling (`dynamic_sampling`, DAPO) against plain GRPO on a task where most groups teach nothing;
prints a markdown table.

The task: the tiny model (random weights, a vocabulary of 300) on the arithmetic prompts, rewarded 1.0 for a
completion (16 tokens at most) that holds the token `2` (id 20) at least once, else 0.0: a sparse reward that the
random policy earns in ~5% of its completions (27 of 512 sampled at temperature 1), so ~80% of its groups of 4 are
all-0 (no learning signal), and once it has learned the token most groups are all-1. Each run trains on one built-in
server (deterministic sampling; each run's trainer loads its initial weights into it first), 16 completions (4
groups) per step, learning rate 0.02 (`--learning-rate`), no reference (beta 0), with vs without dynamic sampling
(its defaults; `--max-oversampling`), the same seeds for both, each with synchronous generation, `async_generation`
and `in_flight_updates` (whose groups complete in an order that timing decides: its runs vary); 3 seeds, medians.

Per run: the optimizer steps and the wall time until the policy's success rate (the mean reward of every completion
generated for a step, filtered ones included, so both sides measure the same thing), averaged over the last 3 steps,
reaches `THRESHOLD`; the generation time per step the training thread waits for (`timing/generate`,
`timing/rollout_wait` and `timing/group_wait`: with async generation a batch and its oversampling are generated
ahead, in flight the batch's groups, and the extra rounds at the step) and the time of its generation requests on any
thread (`timing/generate` and `background/generate`; not in flight, where each group is a request of its own and
untimed); the generation rounds per step, and the share of steps generated in one round with what those waited
(beside the plain side's every step: what the generation costs where the oversampling fills the batch at once); the
share of informative groups in the trained batches (with filtering `dynamic_sampling/informative_share`, without it
1 - TRL's `frac_reward_zero_std`); and the groups generated per group trained (1.0 without filtering). A run that
does not reach the threshold within `MAX_STEPS` counts as `MAX_STEPS` (said in the table).

Targets (issue 35): >= 1.5x fewer optimizer steps to the threshold, at <= 1.3x the generation time per step.

    python tools/bench_dynamic_sampling.py [--quick] [--json FILE] [--learning-rate LR] [--max-oversampling X]

`--quick` (under a minute on 2 CPU cores) runs one seed for 2 steps per side: it checks the harness only. `--json
FILE` writes every figure under a stable key, e.g. `dynamic_sampling.steps_ratio`,
`dynamic_sampling.filtered.generation_s_per_step`, `dynamic_sampling.filtered.one_round_generation_s_per_step` (absent
for a side with no step of one round), `dynamic_sampling.one_round_generation_ratio`,
`dynamic_sampling.plain.informative_share`, and the async and in-flight sides' under `dynamic_sampling.async.` and
`dynamic_sampling.inflight.`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (arithmetic_prompts, header, machine_facts, markdown_table, model_dir,  # noqa: E402
                          verdict, write_json)

TARGET_TOKEN = 20  # "2" in the tiny model's vocabulary
THRESHOLD = 0.8  # the policy's success rate (3-step mean) that ends a run
WINDOW = 3
MAX_STEPS = 40
LEARNING_RATE = 0.02
SEEDS = (0, 1, 2)
STEPS_TARGET, GENERATION_TARGET = 1.5, 1.3
MODES = {"": {}, "async.": dict(async_generation=True),
         "inflight.": dict(async_generation=True, in_flight_updates=True)}  # side name prefix: generation settings
MODE_LABELS = {"": "", "async.": ", async generation", "inflight.": ", in-flight updates"}
SIDES = {f"{mode}{name}": (filtering, mode) for mode in MODES for name, filtering in (("plain", False),
                                                                                         ("filtered", True))}
WAIT_PARTS = ("timing/generate", "timing/rollout_wait", "timing/group_wait")  # the training thread waiting for it


def holds_target(completion_ids, **kwargs) -> list[float]:
    """1.0 for a completion that holds the target token, else 0.0."""
    return [1.0 if TARGET_TOKEN in ids else 0.0 for ids in completion_ids]


def waited(step: dict) -> float:
    """The seconds a logged step's training thread waited for generation."""
    return sum(step.get(part, 0.0) for part in WAIT_PARTS)


def run(model: Path, url: str, out: Path, seed: int, filtering: bool, max_steps: int, learning_rate: float,
        mode: str = "", max_oversampling: Optional[float] = None) -> dict:
    """One training run generating on the server at `url` (its trainer gives it the initial weights first: the
    server reports another run's); what the table reports for it."""
    from transformers import TrainerCallback

    from open_r1_ext import RemoteGRPOConfig, RemoteGRPOTrainer

    success: dict[int, list[float]] = defaultdict(list)  # step -> the reward of every completion generated for it

    def holds_target_recorded(completion_ids, trainer_state, **kwargs) -> list[float]:
        rewards = holds_target(completion_ids)
        success[trainer_state.global_step + 1].extend(rewards)
        return rewards

    holds_target_recorded.__name__ = "holds_target"
    reached: dict[str, float] = {}

    class StopAtThreshold(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            reached["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            rates = [statistics.fmean(success[s]) for s in range(max(1, state.global_step - WINDOW + 1),
                                                                  state.global_step + 1)]
            if len(rates) == WINDOW and statistics.fmean(rates) >= THRESHOLD:
                reached.update(step=state.global_step, wall_s=time.perf_counter() - reached["start"])
                control.should_training_stop = True

    args = RemoteGRPOConfig(
        output_dir=str(out), per_device_train_batch_size=16, num_generations=4, max_completion_length=16,
        max_steps=max_steps, learning_rate=learning_rate, beta=0.0, temperature=1.0, logging_steps=1, seed=seed,
        report_to=[], use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, generation_url=url,
        dynamic_sampling=filtering, **MODES[mode],
        **({} if max_oversampling is None else {"dynamic_sampling_max_oversampling": max_oversampling}))
    trainer = RemoteGRPOTrainer(model=str(model), reward_funcs=holds_target_recorded, args=args,
                                train_dataset=arithmetic_prompts(64), callbacks=[StopAtThreshold()])
    trainer.train()
    wall_s = time.perf_counter() - reached["start"]
    steps = [h for h in trainer.state.log_history if "step_wall_time" in h]
    one_round = [h for h in steps if h.get("dynamic_sampling/rounds", 1.0) == 1.0]  # every step of the plain side
    if filtering:
        share = statistics.fmean(h["dynamic_sampling/informative_share"] for h in steps)
        cost = (sum(h["dynamic_sampling/groups_generated"] for h in steps)
                / max(1.0, sum(h["dynamic_sampling/groups_kept"] for h in steps)))
    else:
        share, cost = statistics.fmean(1.0 - h["frac_reward_zero_std"] for h in steps), 1.0
    return {"steps": reached.get("step", max_steps), "reached": "step" in reached,
            "wall_s": reached.get("wall_s", wall_s),
            "generation_s_per_step": statistics.fmean(waited(h) for h in steps),
            "one_round_steps": len(one_round) / len(steps),
            "one_round_generation_s_per_step": statistics.fmean(waited(h) for h in one_round) if one_round else None,
            "requests_s_per_step": None if "in_flight_updates" in MODES[mode] else statistics.fmean(
                h.get("timing/generate", 0.0) + h.get("background/generate", 0.0) for h in steps),
            "rounds_per_step": statistics.fmean(h.get("dynamic_sampling/rounds", 1.0) for h in steps),
            "informative_share": share, "groups_generated_per_kept": cost}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, 2 steps per side: checks the harness only")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--learning-rate", type=float, default=LEARNING_RATE, help="of both sides' runs")
    parser.add_argument("--max-oversampling", type=float,
                        help="dynamic_sampling_max_oversampling of the filtered runs (default: the field's)")
    options = parser.parse_args()
    seeds, max_steps = (SEEDS[:1], 2) if options.quick else (SEEDS, MAX_STEPS)
    facts = machine_facts(options.quick)
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    from open_r1_ext.launch.local_server import BuiltinServer

    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(Path(tmp), "tiny")
        with BuiltinServer(str(model), deterministic=True, extra_args=("--no-ref-slot",)) as server:
            for seed in seeds:
                for side, (filtering, mode) in SIDES.items():  # same seed, side by side
                    results[side].append(run(model, server.url, Path(tmp) / f"{side}-{seed}", seed, filtering,
                                             max_steps, options.learning_rate, mode, options.max_oversampling))
    figures = dict(facts)
    for side, runs in results.items():
        for key in ("steps", "wall_s", "generation_s_per_step", "requests_s_per_step", "rounds_per_step",
                    "one_round_steps", "one_round_generation_s_per_step", "informative_share",
                    "groups_generated_per_kept"):
            if values := [r[key] for r in runs if r[key] is not None]:  # of the runs that have it
                figures[f"dynamic_sampling.{side}.{key}"] = statistics.median(values)
        figures[f"dynamic_sampling.{side}.reached"] = sum(r["reached"] for r in runs)
    for mode in MODES:
        plain, filtered = (f"dynamic_sampling.{mode}{side}." for side in ("plain", "filtered"))
        figures[f"dynamic_sampling.{mode}steps_ratio"] = figures[plain + "steps"] / figures[filtered + "steps"]
        figures[f"dynamic_sampling.{mode}wall_ratio"] = figures[plain + "wall_s"] / figures[filtered + "wall_s"]
        figures[f"dynamic_sampling.{mode}generation_ratio"] = (figures[filtered + "generation_s_per_step"]
                                                               / figures[plain + "generation_s_per_step"])
        if filtered + "one_round_generation_s_per_step" in figures:
            figures[f"dynamic_sampling.{mode}one_round_generation_ratio"] = (
                figures[filtered + "one_round_generation_s_per_step"] / figures[plain + "generation_s_per_step"])
    figures.update({"dynamic_sampling.seeds": len(seeds), "dynamic_sampling.max_steps": max_steps,
                    "dynamic_sampling.threshold": THRESHOLD, "dynamic_sampling.learning_rate": options.learning_rate,
                    "dynamic_sampling.max_oversampling": options.max_oversampling or "default"})
    print(header(facts))
    print(f"seeds {list(seeds)}, medians; learning rate {options.learning_rate}; dynamic_sampling_max_oversampling "
          f"{options.max_oversampling or 'default'}; threshold: success rate >= "
          f"{THRESHOLD} over {WINDOW} steps, at most {max_steps} steps (runs that reached it: "
          + ", ".join(f"{side} {figures[f'dynamic_sampling.{side}.reached']}/{len(seeds)}" for side in SIDES) + ")")
    rows = [(label, *(f"{figures[name]:{fmt}}" if (name := f"dynamic_sampling.{side}.{key}") in figures else "-"
                      for side in SIDES))
            for label, key, fmt in (("optimizer steps to the threshold", "steps", "g"),
                                    ("wall time to the threshold (s)", "wall_s", ".1f"),
                                    ("generation time per step (s): waited for it", "generation_s_per_step", ".3f"),
                                    ("generation time per step (s): its requests", "requests_s_per_step", ".3f"),
                                    ("generation rounds per step", "rounds_per_step", ".2f"),
                                    ("steps generated in one round", "one_round_steps", ".0%"),
                                    ("generation time per step of one round (s): waited for it",
                                     "one_round_generation_s_per_step", ".3f"),
                                    ("informative groups per trained batch", "informative_share", ".0%"),
                                    ("groups generated per group trained", "groups_generated_per_kept", ".2f"))]
    print(markdown_table(("measurement", *(f"{'dynamic sampling' if filtering else 'plain GRPO'}{MODE_LABELS[mode]}"
                                           for filtering, mode in SIDES.values())), rows))
    ratios = []
    for mode, label in MODE_LABELS.items():
        steps, generation, wall = (figures[f"dynamic_sampling.{mode}{key}"]
                                   for key in ("steps_ratio", "generation_ratio", "wall_ratio"))
        ratios += [(f"steps, plain / filtered{label}", f"{steps:.2f}", f">= {STEPS_TARGET}",
                    verdict(steps >= STEPS_TARGET)),
                   (f"generation time per step, filtered / plain{label}", f"{generation:.2f}",
                    f"<= {GENERATION_TARGET}", verdict(generation <= GENERATION_TARGET)),
                   (f"wall time to the threshold, plain / filtered{label}", f"{wall:.2f}", "-", "-")]
        one_round = figures.get(f"dynamic_sampling.{mode}one_round_generation_ratio")
        if one_round is not None:
            ratios.append((f"generation time per step of one round, filtered / plain{label}", f"{one_round:.2f}",
                           "-", "-"))
    print(markdown_table(("measurement", "value", "target", "met"), ratios))
    if options.json:
        write_json(options.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
