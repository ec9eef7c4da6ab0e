"""Benchmark: seconds per GRPO step with async generation vs sync, side by side in one run.

The trainer (this process) and a built-in server (a subprocess) each get one CPU thread, so on a 2-core machine
generation and training can really overlap, as they do on separate allocations of a cluster. Completions are
long enough that generation and training are comparable shares of a sync step (the output shows the shares).

What perfect overlap could reach, from the sync run's own step-time parts (`timing/*`): async mode runs two chains
beside each other, the rollout thread's (generate, then the server's reload of the new weights, in order on one
server) and the training thread's (rewards, forward/backward/optimizer, the dump). A step cannot be shorter than the
longer chain, so the best ratio is max(generate + reload_wait, the rest) / sync step. Overlap also needs cores that
really compute in parallel: each round measures how much faster two single-threaded CPU-bound processes finish
together than one after the other (`speedup`), and the ratio cannot beat 1 / speedup either.
Target (issue #13): async / sync <= 1.08 x that best ratio (the median over the rounds of a run).

The machine is shared, so the rounds alternate the order of the two modes (sync first, then async first, ...), each
round measures its own speedup and best ratio, and the figures are medians over the rounds.

    python tools/bench_async.py [--quick] [--json FILE] [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (arithmetic_prompts, header, machine_facts, markdown_table, model_dir,  # noqa: E402
                          parallel_speedup, verdict, write_json)

TARGET_OVER_BEST = 1.08  # async / sync at most this many times the best ratio of the same round
BUSY_SPEEDUP = 1.5  # below this, two cores are not free: the host is too busy for the comparison to say much
SKIPPED_STEPS = 2  # warm-up: the first step, and async's first batch (generated before training starts)


def measure(model: Path, url: str, out: Path, async_generation: bool, steps: int, completion_length: int) -> dict:
    """Train `steps` steps; the median wall seconds per step and of each `timing/*` part (after the first two)."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    from open_r1_ext import RemoteGRPOConfig, RemoteGRPOTrainer

    dataset = arithmetic_prompts(64)
    args = RemoteGRPOConfig(
        output_dir=str(out), per_device_train_batch_size=16, num_generations=4, max_completion_length=completion_length,
        max_steps=steps, beta=0.0, learning_rate=1e-4, bf16=False, use_cpu=True, report_to=[], save_strategy="no",
        disable_tqdm=True, logging_steps=1, seed=0, generation_url=url, async_generation=async_generation,
        generation_kwargs={"ignore_eos": True, "stop_token_ids": []},  # full-length completions: a steady step cost
    )
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

    def reward(completion_ids, **kwargs):
        return [sum(t < 100 for t in ids) / len(ids) for ids in completion_ids]

    trainer = RemoteGRPOTrainer(model=str(model), reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.remove_callback(PrinterCallback)  # the per-step log lines (logging_steps=1 for the parts)
    trainer.add_callback(Clock())
    trainer.train()
    per_step = [b - a for a, b in zip(ends, ends[1:])][SKIPPED_STEPS - 1:]
    logged = [h for h in trainer.state.log_history if "step_wall_time" in h][SKIPPED_STEPS:]
    parts = {key for h in logged for key in h if key.startswith(("timing/", "background/"))}
    return {"seconds_per_step": statistics.median(per_step),
            **{key: statistics.median(h.get(key, 0.0) for h in logged) for key in sorted(parts)}}


def round_figures(sync: dict, overlapped: dict, speedup: float) -> dict:
    """One round's ratio and the best this round's sync parts and speedup allow (see the module docstring)."""
    step = sync["seconds_per_step"]
    generation_share = sync["timing/generate"] / step
    rollout_chain = (sync["timing/generate"] + sync.get("timing/reload_wait", 0.0)) / step
    best = min(1.0, max(rollout_chain, 1 - rollout_chain, 1 / speedup))  # (a busy host can make speedup < 1)
    ratio = overlapped["seconds_per_step"] / step
    return {"sync": step, "async": overlapped["seconds_per_step"], "ratio": ratio, "best": best,
            "ratio_over_best": ratio / best, "speedup": speedup, "generation_share": generation_share,
            "rollout_chain_share": rollout_chain}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of fewer steps (under a minute)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    parser.add_argument("--completion-length", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=None, help="rounds of (sync, async); default 3, 1 with --quick")
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = 6 if args.quick else 14
    rounds = args.rounds or (1 if args.quick else 3)
    facts = machine_facts(args.quick)

    from open_r1_ext.launch.local_server import BuiltinServer
    from open_r1_ext.sglang_client import SGLangClient

    per_round, parts = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(Path(tmp), "tiny")
        with BuiltinServer(str(model), extra_args=("--no-ref-slot", "--num-threads", "1")) as server:
            for index in range(rounds):
                speedup = parallel_speedup()
                results = {}
                for mode in ("sync", "async") if index % 2 == 0 else ("async", "sync"):
                    SGLangClient(server.url).update_weights_from_disk(str(model), weight_version="default")
                    results[mode] = measure(model, server.url, Path(tmp) / f"{mode}-{index}", mode == "async", steps,
                                            args.completion_length)
                per_round.append(round_figures(results["sync"], results["async"], speedup))
                parts = {mode: {k: v for k, v in r.items() if "/" in k} for mode, r in results.items()}

    median = {key: statistics.median(r[key] for r in per_round) for key in per_round[0]}
    met = median["ratio_over_best"] <= TARGET_OVER_BEST  # the run's figure: the median of its rounds
    figures = {
        "async.machine_parallel_speedup": median["speedup"],
        "async.best_ratio_on_this_machine": median["best"],
        "async.sync_seconds_per_step": median["sync"],
        "async.async_seconds_per_step": median["async"],
        "async.sync_generation_share": median["generation_share"],
        "async.sync_rollout_chain_share": median["rollout_chain_share"],
        "async.ratio": median["ratio"],
        "async.ratio_over_best": median["ratio_over_best"],
        "async.target_over_best": TARGET_OVER_BEST,
        "async.met": met,
        "async.rounds_met": sum(r["ratio_over_best"] <= TARGET_OVER_BEST for r in per_round),
        "async.rounds": rounds,
        "async.host_busy": median["speedup"] < BUSY_SPEEDUP,
        **{f"async.round_{key}": [r[key] for r in per_round] for key in ("ratio", "best", "ratio_over_best", "speedup")},
        **{f"async.last_round.{mode}.{key}": value for mode, found in parts.items() for key, value in found.items()},
    }
    print(header(facts))
    print(f"tiny model, 16 completions x {args.completion_length} tokens per step, {steps} steps per mode and round "
          f"(the first {SKIPPED_STEPS} not timed), {rounds} round(s); sync step = {median['generation_share']:.0%} "
          f"generation, {median['rollout_chain_share'] - median['generation_share']:.0%} the server's reload, the "
          f"rest training; two single-threaded CPU-bound processes run {median['speedup']:.2f}x as fast as one after "
          "the other here (medians over the rounds)")
    for mode, found in parts.items():
        print(f"  last round, {mode} step parts (median s): "
              + ", ".join(f"{key} {value:.4f}" for key, value in found.items() if value >= 0.0005))
    rows = [[f"seconds per step (round {i + 1} of {rounds})", f"{r['sync']:.3f}", f"{r['async']:.3f}", f"{r['ratio']:.3f}",
             f"{r['best']:.3f}", f"{r['ratio_over_best']:.3f}", f"<= {TARGET_OVER_BEST}",
             verdict(r["ratio_over_best"] <= TARGET_OVER_BEST)] for i, r in enumerate(per_round)]
    if rounds > 1:
        rows.append(["median of the rounds", f"{median['sync']:.3f}", f"{median['async']:.3f}", f"{median['ratio']:.3f}",
                     f"{median['best']:.3f}", f"{median['ratio_over_best']:.3f}", f"<= {TARGET_OVER_BEST}",
                     verdict(met)])
    if median["speedup"] < BUSY_SPEEDUP:
        print(f"WARNING: the host is busy (speedup {median['speedup']:.2f} < {BUSY_SPEEDUP}): two cores are not free, "
              "so overlap cannot show here and the best ratio says little; rerun on a quiet machine")
    print(markdown_table(["measurement", "sync", "async", "async / sync", "best possible here", "ratio / best",
                          "target", "met"], rows))
    if args.json:
        write_json(Path(args.json), {**facts, **figures})


if __name__ == "__main__":
    main()
