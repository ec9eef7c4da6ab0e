"""Benchmark: async generation vs sync (seconds per step), and in-flight weight updates vs one-step async on a
long-tailed workload (trained completion tokens per second), each side by side in one run.

The trainer (this process) and a built-in server (a subprocess) each get one CPU thread, so on a 2-core machine
generation and training can really overlap, as they do on separate allocations of a cluster.

Part 1, async vs sync (issue #13), on completions of one length. What perfect overlap could reach, from the sync
run's own step-time parts (`timing/*`): async mode runs two chains beside each other, the rollout thread's (generate,
then the server's reload of the new weights, in order on one server) and the training thread's (rewards,
forward/backward/optimizer, the dump). A step cannot be shorter than the longer chain, so the best ratio is
max(generate + reload_wait, the rest) / sync step. Overlap also needs cores that really compute in parallel: each
round measures how much faster two single-threaded CPU-bound processes finish together than one after the other
(`speedup`), and the ratio cannot beat 1 / speedup either.
Target (issue #13): async / sync <= 1.08 x that best ratio (the median over the rounds of a run).

Part 2, in-flight updates (issues #23, #34), on a long-tailed workload: one completion in eight (those whose
sampling seed is a multiple of 8) is eight times longer than the rest, all `ignore_eos`. Five sides: sync, one-step
async (`async_generation`: a batch generated whole while the previous one trains) and in-flight (`in_flight_updates`:
groups go to training as they complete, weight syncs pause and continue the generation under way), the last two also
with `transport: distributed` (gloo; nothing written to disk). Each side's figure is trained completion tokens per
second (the completions of the timed steps over their wall time); per sync, the training thread's seconds (the dump,
or over the network the policy staged in memory, and waiting for a reload or a broadcast: each runs on the update
thread) and the seconds the servers stand paused.
Targets: `speedup_vs_one_step` = in-flight / one-step async >= 1.25, and the same over the network
(`distributed_speedup_vs_one_step`), the medians over the rounds of a run; `distributed_sync_vs_disk` (the training
thread's seconds per sync, distributed / disk) <= 1.0.

The machine is shared, so each round measures every side once, in an order rotated from round to round, and the
figures are medians over the rounds (with their spread).

    python tools/bench_async.py [--quick] [--json FILE] [--rounds N] [--part async|in-flight|both]
        [--prompts-in-flight N]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (arithmetic_prompts, header, machine_facts, markdown_table, model_dir,  # noqa: E402
                          parallel_speedup, verdict, write_json)
from bench_common import rounds as bench_rounds  # noqa: E402

TARGET_OVER_BEST = 1.08  # async / sync at most this many times the best ratio of the same round
TARGET_SPEEDUP_VS_ONE_STEP = 1.25  # in-flight / one-step async, trained completion tokens per second
LONG_EVERY, LONG_FACTOR = 8, 8  # part 2: one completion in LONG_EVERY is LONG_FACTOR times longer
TAIL_PROMPTS = 1  # part 2: prompts (groups of 8 completions) per step: generation is most of a sync step, as with
# long generations on GPUs (with 2 the tiny model's training is as long as its generation here)
IN_FLIGHT_STALENESS = 4  # part 2's in-flight side: a long completion spans a few steps; one-step async keeps 1
BUSY_SPEEDUP = 1.5  # below this, two cores are not free: the host is too busy for the comparison to say much
SKIPPED_STEPS = 2  # warm-up: the first step, and async's first batch (generated before training starts)


def measure(model: Path, url: str, out: Path, mode: str, steps: int, completion_length: int,
            long_tail: bool = False, prompts_in_flight: Optional[int] = None, transport: str = "disk") -> dict:
    """Train `steps` steps in `mode` (`sync`, `async`, `in-flight`) with weight syncs over `transport` (`disk`, or
    `distributed`: gloo); the median wall seconds per step and of each `timing/*` part, and the trained completion
    tokens per second (all after the first `SKIPPED_STEPS` steps). With `long_tail`, the long-tailed workload of part 2
    (`completion_length` the long completions' length)."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    from open_r1_ext import RemoteGRPOConfig, RemoteGRPOTrainer

    dataset = arithmetic_prompts(256 if long_tail else 64)
    shape = dict(per_device_train_batch_size=8 * TAIL_PROMPTS, num_generations=8) if long_tail else dict(
        per_device_train_batch_size=16, num_generations=4)
    in_flight = dict(in_flight_updates=True, max_weight_staleness=IN_FLIGHT_STALENESS,
                     max_prompts_in_flight=prompts_in_flight) if mode == "in-flight" else {}
    args = RemoteGRPOConfig(
        output_dir=str(out), max_completion_length=completion_length, max_steps=steps, beta=0.0, learning_rate=1e-4,
        bf16=False, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0,
        generation_url=url, async_generation=mode != "sync", **shape, **in_flight, transport=transport,
        distributed_backend="gloo",
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
    with long_tailed(completion_length // LONG_FACTOR) if long_tail else contextlib.nullcontext():
        trainer.train()
    per_step = [b - a for a, b in zip(ends, ends[1:])][SKIPPED_STEPS - 1:]
    logged = [h for h in trainer.state.log_history if "step_wall_time" in h][SKIPPED_STEPS:]
    parts = {key for h in logged for key in h if key.startswith(("timing/", "background/", "inflight/"))}
    completions = args.per_device_train_batch_size * args.steps_per_generation
    tokens = sum(h["completions/mean_length"] * completions for h in logged)
    return {"seconds_per_step": statistics.median(per_step), "tokens_per_s": tokens / sum(per_step),
            "mean_completion_length": tokens / (completions * len(logged)),
            **{key: statistics.median(h.get(key, 0.0) for h in logged) for key in sorted(parts)},
            **({"inflight/dropped_groups_total": sum(h.get("inflight/dropped_groups", 0.0) for h in logged)}
               if mode == "in-flight" else {})}


@contextlib.contextmanager
def long_tailed(short: int):
    """Part 2's workload: every `/generate` item whose sampling seed is a multiple of `LONG_EVERY` asks for
    `short x LONG_FACTOR` new tokens, the others for `short` (the trainer seeds every sample, in every mode)."""
    from open_r1_ext import sglang_client

    original = sglang_client.generate_request

    def shaped(prompts, sampling, lora_path=None):
        lengths = [short * LONG_FACTOR if p.get("sampling_seed", 1) % LONG_EVERY == 0 else short for p in sampling]
        return original(prompts, [{**p, "max_new_tokens": n} for p, n in zip(sampling, lengths)], lora_path)

    sglang_client.generate_request = shaped
    try:
        yield
    finally:
        sglang_client.generate_request = original


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


def async_part(model: Path, url: str, tmp: Path, rounds: int, steps: int, completion_length: int) -> dict:
    """Part 1: sync and async side by side, `rounds` times; prints its table, returns its `async.*` figures."""
    from open_r1_ext.sglang_client import SGLangClient

    per_round, parts = [], {}
    for index in range(rounds):
        speedup = parallel_speedup()
        results = {}
        for mode in ("sync", "async") if index % 2 == 0 else ("async", "sync"):
            SGLangClient(url).update_weights_from_disk(str(model), weight_version="default")
            results[mode] = measure(model, url, tmp / f"{mode}-{index}", mode, steps, completion_length)
        per_round.append(round_figures(results["sync"], results["async"], speedup))
        parts = {mode: {k: v for k, v in r.items() if "/" in k} for mode, r in results.items()}

    median = {key: statistics.median(r[key] for r in per_round) for key in per_round[0]}
    met = median["ratio_over_best"] <= TARGET_OVER_BEST  # the run's figure: the median of its rounds
    print(f"Part 1: tiny model, 16 completions x {completion_length} tokens per step, {steps} steps per mode and round "
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
    return {
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


# part 2's sides: name -> (mode, transport, its key in the figures)
IN_FLIGHT_SIDES = {
    "sync": ("sync", "disk", "sync"),
    "one-step async": ("async", "disk", "one_step"),
    "in-flight": ("in-flight", "disk", "in_flight"),
    "one-step async, distributed": ("async", "distributed", "one_step_distributed"),
    "in-flight, distributed": ("in-flight", "distributed", "in_flight_distributed"),
}
# a sync's cost to the training thread (the dump, or the policy staged in memory for a broadcast; waiting for a reload
# or a broadcast) and how long the generation servers stand paused for it (on the update thread, around a reload or a
# broadcast)
SYNC_PARTS = ("timing/dump", "timing/stage", "timing/reload_wait")
PAUSED_PART = "background/paused"


def ratios(results: dict, over: str, under: str) -> list[float]:
    """Per round, the trained completion tokens/s of side `over` / side `under`."""
    return [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(results[over], results[under])]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def in_flight_part(model: Path, url: str, tmp: Path, rounds: int, steps: int, long_length: int,
                   prompts_in_flight: Optional[int] = None) -> dict:
    """Part 2: sync, one-step async and in-flight on the long-tailed workload, the last two also with `transport:
    distributed` (gloo), each once per round in a rotated order; prints its tables, returns its `inflight.*` figures."""
    from open_r1_ext.sglang_client import SGLangClient

    runs = itertools.count()
    bound = prompts_in_flight or max(2, IN_FLIGHT_STALENESS) * TAIL_PROMPTS  # the trainer's default when None

    def side(mode: str, transport: str):
        def run() -> dict:
            SGLangClient(url).update_weights_from_disk(str(model), weight_version="default")
            return measure(model, url, tmp / f"tail-{mode}-{transport}-{next(runs)}", mode, steps, long_length,
                           long_tail=True, prompts_in_flight=prompts_in_flight, transport=transport)
        return run

    *measured, speedups_machine = bench_rounds([*(side(mode, transport) for mode, transport, _ in
                                                  IN_FLIGHT_SIDES.values()), parallel_speedup], rounds)
    results = dict(zip(IN_FLIGHT_SIDES, measured))
    machine = statistics.median(speedups_machine)
    speedups = ratios(results, "in-flight", "one-step async")
    distributed_speedups = ratios(results, "in-flight, distributed", "one-step async, distributed")
    distributed_vs_disk = ratios(results, "in-flight, distributed", "in-flight")
    median = {name: statistics.median(r["tokens_per_s"] for r in runs) for name, runs in results.items()}
    sync_s = {name: statistics.median(sum(r.get(part, 0.0) for part in SYNC_PARTS) for r in runs)
              for name, runs in results.items()}
    paused_s = {name: statistics.median(r.get(PAUSED_PART, 0.0) for r in runs)
                for name, runs in results.items() if IN_FLIGHT_SIDES[name][0] == "in-flight"}
    sync_ratio = sync_s["in-flight, distributed"] / sync_s["in-flight"]
    speedup, distributed_speedup = statistics.median(speedups), statistics.median(distributed_speedups)
    met = speedup >= TARGET_SPEEDUP_VS_ONE_STEP
    distributed_met = distributed_speedup >= TARGET_SPEEDUP_VS_ONE_STEP
    short = long_length // LONG_FACTOR
    print(f"Part 2: tiny model, {8 * TAIL_PROMPTS} completions ({TAIL_PROMPTS} prompt(s) x 8) per step, one completion "
          f"in {LONG_EVERY} {long_length} tokens long, the rest {short} (ignore_eos); {steps} steps per side and round (the first "
          f"{SKIPPED_STEPS} not timed), {rounds} round(s) in rotated order; in-flight with max_weight_staleness="
          f"{IN_FLIGHT_STALENESS} and max_prompts_in_flight={bound}{'' if prompts_in_flight else ' (the default)'}, "
          "one-step async with 1")
    for name, runs in results.items():
        last = runs[-1]
        print(f"  {name}: trained completions {statistics.median(r['mean_completion_length'] for r in runs):.1f} tokens "
              f"long on average, a step {statistics.median(r['seconds_per_step'] for r in runs):.3f} s (medians)")
        print(f"  last round, {name} step parts (median s): "
              + ", ".join(f"{key} {value:.4f}" for key, value in last.items() if "/" in key and value >= 0.0005))
    rows = [[f"trained completion tokens/s (round {i + 1} of {rounds})",
             *(f"{results[name][i]['tokens_per_s']:.0f}" for name in IN_FLIGHT_SIDES), f"{s:.2f}", f"{d:.2f}",
             f">= {TARGET_SPEEDUP_VS_ONE_STEP}", f"{verdict(s >= TARGET_SPEEDUP_VS_ONE_STEP)}, "
             f"{verdict(d >= TARGET_SPEEDUP_VS_ONE_STEP)}"] for i, (s, d) in enumerate(zip(speedups, distributed_speedups))]
    if rounds > 1:
        rows.append(["median of the rounds", *(f"{median[name]:.0f}" for name in IN_FLIGHT_SIDES), spread(speedups),
                     spread(distributed_speedups), f">= {TARGET_SPEEDUP_VS_ONE_STEP}",
                     f"{verdict(met)}, {verdict(distributed_met)}"])
    print(f"  two single-threaded CPU-bound processes ran {machine:.2f}x as fast as one after the other (median; rounds "
          + ", ".join(f"{x:.2f}" for x in speedups_machine) + ")")
    if machine < BUSY_SPEEDUP:
        print(f"WARNING: the host is busy (speedup {machine:.2f} < {BUSY_SPEEDUP}): generation and training cannot run "
              "side by side as on separate allocations; rerun on a quiet machine")
    print(markdown_table(["measurement", *IN_FLIGHT_SIDES, "in-flight / one-step", "the same, distributed",
                          "target", "met"], rows))
    print(markdown_table(
        ["in-flight, per sync (medians)", "disk", "distributed", "distributed / disk", "target", "met"],
        [["the training thread's (s): dump or stage + waiting for the reload or broadcast", f"{sync_s['in-flight']:.4f}",
          f"{sync_s['in-flight, distributed']:.4f}", f"{sync_ratio:.2f}", "<= 1.0", verdict(sync_ratio <= 1.0)],
         ["the generation servers paused (s)", f"{paused_s['in-flight']:.4f}", f"{paused_s['in-flight, distributed']:.4f}",
          f"{paused_s['in-flight, distributed'] / paused_s['in-flight']:.2f}", "-", "-"],
         ["trained completion tokens/s, median (rounds)", f"{median['in-flight']:.0f}",
          f"{median['in-flight, distributed']:.0f}", spread(distributed_vs_disk), "-", "-"]]))
    return {
        **{f"inflight.{key}_tokens_per_s": median[name] for name, (_, _, key) in IN_FLIGHT_SIDES.items()},
        **{f"inflight.round_{key}_tokens_per_s": [r["tokens_per_s"] for r in results[name]]
           for name, (_, _, key) in IN_FLIGHT_SIDES.items()},
        **{f"inflight.{key}_{figure}": statistics.median(r[figure] for r in results[name])
           for name, (_, _, key) in IN_FLIGHT_SIDES.items() for figure in ("seconds_per_step", "mean_completion_length")},
        **{f"inflight.{key}_sync_s": sync_s[name] for name, (_, _, key) in IN_FLIGHT_SIDES.items()},
        **{f"inflight.{IN_FLIGHT_SIDES[name][2]}_paused_s": value for name, value in paused_s.items()},
        "inflight.speedup_vs_one_step": speedup,
        "inflight.round_speedup_vs_one_step": speedups,
        "inflight.speedup_min": min(speedups), "inflight.speedup_max": max(speedups),
        "inflight.distributed_speedup_vs_one_step": distributed_speedup,
        "inflight.round_distributed_speedup_vs_one_step": distributed_speedups,
        "inflight.distributed_vs_disk": statistics.median(distributed_vs_disk),
        "inflight.round_distributed_vs_disk": distributed_vs_disk,
        "inflight.distributed_sync_vs_disk": sync_ratio, "inflight.distributed_sync_met": sync_ratio <= 1.0,
        "inflight.in_flight_vs_sync": median["in-flight"] / median["sync"],
        "inflight.target": TARGET_SPEEDUP_VS_ONE_STEP, "inflight.met": met, "inflight.distributed_met": distributed_met,
        "inflight.rounds": rounds,
        "inflight.max_weight_staleness": IN_FLIGHT_STALENESS, "inflight.max_prompts_in_flight": bound,
        "inflight.default_bound": prompts_in_flight is None,
        "inflight.machine_parallel_speedup": machine, "inflight.round_machine_parallel_speedup": speedups_machine,
        "inflight.host_busy": machine < BUSY_SPEEDUP,
        **{f"inflight.last_round.{key}.{part}": value for name, (_, _, key) in IN_FLIGHT_SIDES.items()
           for part, value in results[name][-1].items() if "/" in part},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of fewer steps (about a minute)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    parser.add_argument("--completion-length", type=int, default=48, help="part 1's completions")
    parser.add_argument("--long-length", type=int, default=128,
                        help=f"part 2's long completions (the others: this / {LONG_FACTOR})")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of each part; default 3, 1 with --quick")
    parser.add_argument("--part", choices=("async", "in-flight", "both"), default="both")
    parser.add_argument("--prompts-in-flight", type=int, default=None,
                        help="part 2's in-flight side: max_prompts_in_flight (the trainer's default here: "
                             f"{max(2, IN_FLIGHT_STALENESS)}, max_weight_staleness batches' worth)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = args.rounds or (1 if args.quick else 3)
    facts = machine_facts(args.quick)

    from open_r1_ext.launch.local_server import BuiltinServer

    figures = {}
    print(header(facts))
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(Path(tmp), "tiny")
        with BuiltinServer(str(model), extra_args=("--no-ref-slot", "--num-threads", "1")) as server:
            if args.part in ("async", "both"):
                figures.update(async_part(model, server.url, Path(tmp), rounds, 4 if args.quick else 14,
                                          args.completion_length))
            if args.part in ("in-flight", "both"):
                figures.update(in_flight_part(model, server.url, Path(tmp), rounds, 4 if args.quick else 64,
                                              args.long_length // 2 if args.quick else args.long_length,
                                              args.prompts_in_flight))
    if args.json:
        write_json(Path(args.json), {**facts, **figures})


if __name__ == "__main__":
    main()
