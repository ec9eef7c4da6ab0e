"""Benchmark: seconds per GRPO step with async generation vs sync, side by side in one run.

The trainer (this process) and a built-in server (a subprocess) each get one CPU thread, so on a 2-core machine
generation and training can really overlap, as they do on separate allocations of a cluster. Completions are
long enough that generation and training are comparable shares of a sync step (the table shows both shares).
Target: async / sync <= 0.65, i.e. close to max(generation, training) rather than their sum. Overlap needs two
cores that really compute in parallel, so the run also measures how much faster two single-threaded CPU-bound
processes finish together than one after the other, and prints the best ratio this machine allows.

    python tools/bench_async.py [--quick] [--json FILE]
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

from bench_common import (arithmetic_prompts, header, machine_facts, markdown_table, model_dir, verdict,  # noqa: E402
                          write_json)

TARGET = 0.65


def measure(model: Path, url: str, out: Path, async_generation: bool, steps: int, completion_length: int) -> dict:
    """Train `steps` steps; return the median wall seconds per step (after the first two) and the generation share."""
    from transformers import TrainerCallback

    from open_r1_ext import RemoteGRPOConfig, RemoteGRPOTrainer

    dataset = arithmetic_prompts(64)
    args = RemoteGRPOConfig(
        output_dir=str(out), per_device_train_batch_size=16, num_generations=4, max_completion_length=completion_length,
        max_steps=steps, beta=0.0, learning_rate=1e-4, bf16=False, use_cpu=True, report_to=[], save_strategy="no",
        disable_tqdm=True, logging_steps=1000, seed=0, generation_url=url, async_generation=async_generation,
        generation_kwargs={"ignore_eos": True, "stop_token_ids": []},  # full-length completions: a steady step cost
    )
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

    def reward(completion_ids, **kwargs):
        return [sum(t < 100 for t in ids) / len(ids) for ids in completion_ids]

    trainer = RemoteGRPOTrainer(model=str(model), reward_funcs=reward, args=args, train_dataset=dataset)
    waits: list[float] = []
    generate = trainer._generate_single_turn

    def timed(*a, **k):  # time the trainer spends waiting for completions
        start = time.perf_counter()
        result = generate(*a, **k)
        waits.append(time.perf_counter() - start)
        return result

    trainer._generate_single_turn = timed
    trainer.add_callback(Clock())
    trainer.train()
    per_step = [b - a for a, b in zip(ends, ends[1:])][1:]  # drop the first two steps (warm-up, empty queue)
    return {"seconds_per_step": statistics.median(per_step), "generation_wait": statistics.median(waits[2:])}


def _spin(_) -> float:
    torch.set_num_threads(1)
    a = torch.randn(384, 384)
    start = time.perf_counter()
    for _ in range(300):
        a @ a
    return time.perf_counter() - start


def parallel_speedup() -> float:
    """(2 x one job alone) / (two jobs at once): 2.0 on two free cores, 1.0 when they time-share one."""
    import multiprocessing

    alone = _spin(0)
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        together = max(pool.map(_spin, [0, 1]))
    return 2 * alone / together


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (under a minute)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    parser.add_argument("--completion-length", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = 6 if args.quick else 14
    facts = machine_facts(args.quick)
    speedup = parallel_speedup()

    from open_r1_ext.sglang_client import SGLangClient
    from open_r1_ext.launch.local_server import BuiltinServer

    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(Path(tmp), "tiny")
        results = {}
        with BuiltinServer(str(model), extra_args=("--no-ref-slot", "--num-threads", "1")) as server:
            for mode in ("sync", "async"):
                SGLangClient(server.url).update_weights_from_disk(str(model), weight_version="default")
                results[mode] = measure(model, server.url, Path(tmp) / mode, mode == "async", steps, args.completion_length)

    sync, overlapped = results["sync"]["seconds_per_step"], results["async"]["seconds_per_step"]
    gen_share = results["sync"]["generation_wait"] / sync
    ratio = overlapped / sync
    # perfect overlap on this machine: the longer phase, or both phases' work spread over `speedup` cores
    best = max(gen_share, 1 - gen_share, 1 / speedup)
    figures = {
        "async.machine_parallel_speedup": speedup,
        "async.best_ratio_on_this_machine": best,
        "async.sync_seconds_per_step": sync,
        "async.async_seconds_per_step": overlapped,
        "async.sync_generation_share": gen_share,
        "async.ratio": ratio,
    }
    print(header(facts))
    print(f"tiny model, 16 completions x {args.completion_length} tokens per step, {steps} steps per mode; "
          f"sync step = {gen_share:.0%} generation, {1 - gen_share:.0%} training")
    print(f"two single-threaded CPU-bound processes run {speedup:.2f}x as fast as one after the other here, so perfect "
          f"overlap could reach a ratio of {best:.2f} on this machine")
    print(markdown_table(
        ["measurement", "sync", "async", "ratio", "best possible here", "target", "met"],
        [["seconds per step", f"{sync:.3f}", f"{overlapped:.3f}", f"{ratio:.2f}", f"{best:.2f}", f"<= {TARGET}",
          verdict(ratio <= TARGET)]],
    ))
    if args.json:
        write_json(Path(args.json), {**facts, **figures})


if __name__ == "__main__":
    main()
