"""Benchmark a pool of two built-in server replicas against one; prints a markdown table.

Two comparisons, each measured side by side in one run on the same two server processes (a pool of one is the
first replica alone), in rounds whose order rotates (which side goes first changes each round); medians are reported:

1. Generation throughput (completion tokens/s): `ServerPool.generate` of P prompts x n samples, each group of n on
   one replica, through a pool of two replicas vs a pool of one. Each server runs one torch thread. The bound is
   this machine's own parallel speed-up for two CPU-bound processes of the servers' kind (`parallel_speedup("stream")`:
   two one-thread loops of decode-shaped matmuls, 32 rows through weights far larger than the caches, at once vs
   one alone), measured in every round beside the two generations (on a shared host it moves from round to round);
   each round's speed-up is divided by its own bound. Target: the median of those ratios >= 0.85. The same ratio
   against the pure-compute bound (`parallel_speedup("cache")`, matmuls that fit in the caches) is reported beside
   it: decoding reads every weight once per step, so two servers also share the memory bandwidth. A third side
   does the pool's work without it (half the prompts to each server, a plain `SGLangClient` each, on two threads):
   pool / plain says what the pool itself costs.
2. Weight sync: `update_weights_from_disk` of one dump (the same files each time) to two replicas at once vs to one;
   target: two / one <= 1.2.

Sampling is seeded with `ignore_eos`, so every completion has the same length and both sides do the same work.

    python tools/bench_pool.py [--quick] [--json FILE] [--model-dir DIR]

`--quick` (about half a minute on 2 CPU cores) uses the tiny model, fewer prompts, one round: it checks the harness
only. `--json FILE` writes `pool.generate.{one_tokens_per_s,two_tokens_per_s,speedup,bound,ratio_to_bound,ratio_min,ratio_max,target,met}`,
`pool.generate.{cache_bound,ratio_to_cache_bound,direct_tokens_per_s,pool_vs_direct}`,
`pool.sync.{one_s,two_s,ratio,target,met}`, the timed samples (`*.one_samples_s`, `*.two_samples_s`,
`pool.generate.direct_samples_s`), the rounds' bounds (`pool.generate.bound_samples`, `cache_bound_samples`) and
`machine.*` / `config.*`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (alternate, header, machine_facts, markdown_table, model_dir, parallel_speedup,  # noqa: E402
                          rounds, timed, verdict, write_json)

from open_r1_ext.launch.local_server import BuiltinServer  # noqa: E402
from open_r1_ext.server_pool import ServerPool  # noqa: E402
from open_r1_ext.sglang_client import SGLangClient, served_vocabulary  # noqa: E402

GENERATE_TARGET = 0.85  # of the machine's parallel speed-up
SYNC_TARGET = 1.2


@dataclass(frozen=True)
class Setup:
    """The model, the generation workload and the repeats."""

    size: str
    prompts: int
    n: int
    prompt_len: int
    max_new_tokens: int
    repeats: int


FULL = Setup(size="100m", prompts=16, n=4, prompt_len=32, max_new_tokens=32, repeats=5)
QUICK = Setup(size="tiny", prompts=8, n=4, prompt_len=16, max_new_tokens=16, repeats=1)


def measure(models_root: Path, work: Path, setup: Setup) -> dict:
    """Both comparisons on two built-in servers of the same model, one torch thread each."""
    path = model_dir(models_root, setup.size)
    work.mkdir(parents=True, exist_ok=True)
    server_args = ("--dtype", "float32", "--no-ref-slot", "--num-threads", "1", "--weight-dirs", str(work))
    with BuiltinServer(str(path), extra_args=server_args) as first, BuiltinServer(str(path), extra_args=server_args) as second:
        one, two = ServerPool([first.url]), ServerPool([first.url, second.url])
        figures = generation_figures(one, two, [SGLangClient(first.url), SGLangClient(second.url)], setup)
        figures.update(sync_figures(one, two, path, work, setup.repeats))
    return figures


def generation_figures(one: ServerPool, two: ServerPool, direct: list[SGLangClient], setup: Setup) -> dict:
    vocab_size = served_vocabulary(one.model_info())[0]
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab_size, (setup.prompts, setup.prompt_len), generator=generator).tolist()
    seeds = list(range(setup.prompts * setup.n))
    sampling = {"max_new_tokens": setup.max_new_tokens, "temperature": 1.0, "ignore_eos": True}
    tokens = setup.prompts * setup.n * setup.max_new_tokens

    def check(groups: list[list]) -> None:
        produced = sum(len(c.token_ids) for group in groups for c in group)
        if produced != tokens:
            raise RuntimeError(f"generate returned {produced} tokens, expected {tokens}")

    def generate(pool: ServerPool) -> None:
        check(pool.generate(prompts, sampling, n=setup.n, seeds=seeds))

    def generate_direct() -> None:
        """The pool's work without the pool: half the prompts to each server, a plain client each, on two threads."""
        def half(client: SGLangClient, part: range) -> list[list]:
            part_seeds = [seeds[i * setup.n + k] for i in part for k in range(setup.n)]
            return client.generate([prompts[i] for i in part], sampling, n=setup.n, seeds=part_seeds)

        middle = setup.prompts // 2
        with ThreadPoolExecutor(max_workers=2) as threads:
            answers = threads.map(half, direct, [range(middle), range(middle, setup.prompts)])
            check([group for groups in answers for group in groups])

    generate(one), generate(two)  # warm-up of both replicas
    one_s, two_s, direct_s, machine = rounds(
        [lambda: timed(lambda: generate(one)), lambda: timed(lambda: generate(two)), lambda: timed(generate_direct),
         lambda: (parallel_speedup("stream"), parallel_speedup("cache"))], setup.repeats)
    bounds, cache_bounds = [stream for stream, _ in machine], [cache for _, cache in machine]
    ratios = [one / two / bound for one, two, bound in zip(one_s, two_s, bounds)]
    cache_ratios = [one / two / bound for one, two, bound in zip(one_s, two_s, cache_bounds)]
    one_rate, two_rate = tokens / statistics.median(one_s), tokens / statistics.median(two_s)
    ratio = statistics.median(ratios)
    return {"pool.generate.one_tokens_per_s": one_rate, "pool.generate.two_tokens_per_s": two_rate,
            "pool.generate.speedup": two_rate / one_rate, "pool.generate.completion_tokens": tokens,
            "pool.generate.bound": statistics.median(bounds), "pool.generate.ratio_to_bound": ratio,
            "pool.generate.ratio_min": min(ratios), "pool.generate.ratio_max": max(ratios),
            "pool.generate.cache_bound": statistics.median(cache_bounds),
            "pool.generate.ratio_to_cache_bound": statistics.median(cache_ratios),
            "pool.generate.direct_tokens_per_s": tokens / statistics.median(direct_s),
            "pool.generate.pool_vs_direct": statistics.median(direct / two for direct, two in zip(direct_s, two_s)),
            "pool.generate.target": GENERATE_TARGET, "pool.generate.met": ratio >= GENERATE_TARGET,
            "pool.generate.one_samples_s": one_s, "pool.generate.two_samples_s": two_s,
            "pool.generate.direct_samples_s": direct_s,
            "pool.generate.bound_samples": bounds, "pool.generate.cache_bound_samples": cache_bounds}


def sync_figures(one: ServerPool, two: ServerPool, path: Path, work: Path, repeats: int) -> dict:
    """The same dump (the model's own files, copied under the servers' allowed weight directory) reloaded each time."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    dump = work / "dump"
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).save_pretrained(dump)
    version = iter(range(1_000_000))

    def reload(pool: ServerPool) -> None:
        pool.update_weights_from_disk(str(dump), weight_version=str(next(version)))

    reload(one), reload(two)  # warm-up: the page cache holds the dump for both sides
    one_s, two_s = alternate(lambda: reload(one), lambda: reload(two), repeats)
    ratio = statistics.median(two_s) / statistics.median(one_s)
    return {"pool.sync.one_s": statistics.median(one_s), "pool.sync.two_s": statistics.median(two_s),
            "pool.sync.ratio": ratio, "pool.sync.target": SYNC_TARGET, "pool.sync.met": ratio <= SYNC_TARGET,
            "pool.sync.one_samples_s": one_s, "pool.sync.two_samples_s": two_s}


def table(f: dict, setup: Setup) -> str:
    workload = f"{setup.prompts} prompts x {setup.n} samples x {setup.max_new_tokens} tokens, {setup.size} model"
    return markdown_table(
        ("measurement", "one replica", "two replicas", "ratio", "target", "met"),
        [(f"generation, completion tokens/s ({workload}, median of {setup.repeats} rounds); machine bound "
          f"{f['pool.generate.bound']:.2f} for decode-shaped work, {f['pool.generate.cache_bound']:.2f} for "
          "pure compute (medians of the rounds' bounds)",
          f"{f['pool.generate.one_tokens_per_s']:,.0f}", f"{f['pool.generate.two_tokens_per_s']:,.0f}",
          f"speed-up {f['pool.generate.speedup']:.2f}; per round, speed-up / bound: median "
          f"{f['pool.generate.ratio_to_bound']:.2f} ({f['pool.generate.ratio_min']:.2f}-{f['pool.generate.ratio_max']:.2f}); "
          f"against pure compute {f['pool.generate.ratio_to_cache_bound']:.2f}; two plain clients without the pool "
          f"{f['pool.generate.direct_tokens_per_s']:,.0f} tokens/s (pool / plain, per round: "
          f"{f['pool.generate.pool_vs_direct']:.2f})",
          f">= {GENERATE_TARGET:g} of bound", verdict(f["pool.generate.met"])),
         (f"weight sync of one dump, s (median of {setup.repeats})", f"{f['pool.sync.one_s']:.3f}",
          f"{f['pool.sync.two_s']:.3f}", f"{f['pool.sync.ratio']:.2f}", f"<= {SYNC_TARGET:g}",
          verdict(f["pool.sync.met"]))],
    )


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, fewer prompts, one round")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    parser.add_argument("--model-dir", type=Path, default=None, help="build the models here (and reuse them) instead of a temp dir")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    setup = QUICK if args.quick else FULL
    started = time.perf_counter()
    torch.set_num_threads(1)
    facts = machine_facts(args.quick)
    with tempfile.TemporaryDirectory(prefix="bench_pool-") as tmp:
        figures = measure(args.model_dir or Path(tmp) / "models", Path(tmp) / "work", setup)
    facts.update({"machine.load_average_1m_end": os.getloadavg()[0], "wall_s": time.perf_counter() - started})
    print(header(facts))
    print(f"load average at end: {facts['machine.load_average_1m_end']:.2f}; one torch thread per server; "
          f"wall time: {facts['wall_s']:.1f} s")
    print()
    print(table(figures, setup))
    if args.json is not None:
        write_json(args.json, {**facts, **figures})


if __name__ == "__main__":
    main()
