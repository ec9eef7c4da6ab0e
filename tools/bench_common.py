"""Helpers shared by the benchmarks in tools/ (and the tests): machine facts, the models and prompts they run on,
side-by-side timing, the machine's parallel speed-up, the table and the JSON file.

Each benchmark prints `header(facts)` above a `markdown_table(...)` and, with `--json FILE`, writes `write_json`.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence, TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_model import make_tiny_model  # noqa: E402

T = TypeVar("T")

MIB = 1 << 20


def machine_facts(quick: bool) -> dict:
    """What the figures depend on: cores, threads, load, versions; keys `machine.*` and `config.quick`."""
    import transformers

    return {
        "machine.cpu_cores": os.cpu_count(),
        "machine.torch_threads": torch.get_num_threads(),
        "machine.load_average_1m": os.getloadavg()[0],
        "machine.platform": platform.platform(),
        "machine.python": platform.python_version(),
        "machine.torch": torch.__version__,
        "machine.transformers": transformers.__version__,
        "config.quick": quick,
    }


def header(facts: dict) -> str:
    """The lines printed above a benchmark's table."""
    return (
        f"cores: {facts['machine.cpu_cores']}, torch threads: {facts['machine.torch_threads']}, "
        f"torch {facts['machine.torch']}, transformers {facts['machine.transformers']}, "
        f"python {facts['machine.python']}, {facts['machine.platform']}\n"
        f"load average at start: {facts['machine.load_average_1m']:.2f}; quick: {facts['config.quick']}"
    )


def model_dir(root: Path, size: str) -> Path:
    """`root/size`, built with `make_tiny_model` (seed 0) unless a build of that size is already there."""
    out = root / size
    info = out / "tiny_model.json"
    if not (info.exists() and json.loads(info.read_text()).get("size") == size):
        make_tiny_model(out, seed=0, size=size)
    return out


def arithmetic_prompts(n: int):
    """`n` chat prompts "What is i + i?": the training data of the benchmarks and tests."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(n)])


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(met: bool) -> str:
    return "yes" if met else "no"


def write_json(path: Path, figures: dict) -> None:
    """Write `figures`, a flat dict under stable keys such as `trainer.stock.peak_rss_bytes`."""
    path.write_text(json.dumps(figures, indent=2) + "\n")


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rounds(parts: Sequence[Callable[[], T]], repeats: int) -> list[list[T]]:
    """Run every part once per round, `repeats` rounds, the order rotated by one each round so that drift in machine
    load hits every part; each part's results in round order."""
    results: list[list[T]] = [[] for _ in parts]
    order = list(enumerate(parts))
    for rep in range(repeats):
        for index, part in order[rep % len(order):] + order[:rep % len(order)]:
            results[index].append(part())
    return results


def alternate(baseline: Callable[[], object], ours: Callable[[], object], repeats: int) -> tuple[list[float], list[float]]:
    """Time both `repeats` times, swapping which goes first each round so drift in machine load hits both."""
    baseline_s, ours_s = rounds([lambda: timed(baseline), lambda: timed(ours)], repeats)
    return baseline_s, ours_s


def _spin(work: str) -> float:
    """Seconds of one single-threaded CPU-bound loop: `cache`, matmuls of a matrix that fits in the caches (pure
    compute); `stream`, a decode step's shape, 32 rows through weights far larger than the caches (the 100M test
    model's MLP matrices, 226 MB), so memory bandwidth is shared as between two servers that generate."""
    torch.set_num_threads(1)
    if work == "stream":
        weights, rows, rounds = [torch.randn(768, 3072) for _ in range(24)], torch.randn(32, 768), 15
    else:
        weights, rows, rounds = [torch.randn(384, 384)], torch.randn(384, 384), 300
    start = time.perf_counter()
    for _ in range(rounds):
        for weight in weights:
            rows @ weight
    return time.perf_counter() - start


@functools.cache
def _spin_workers():
    """The two processes `parallel_speedup` times, started once per benchmark: a start re-imports the benchmark's
    module in each (`spawn`), seconds of CPU that a pool per measurement paid each round. Ended at exit."""
    import multiprocessing

    return multiprocessing.get_context("spawn").Pool(2)


def parallel_speedup(work: str = "cache") -> float:
    """(2 x one job alone) / (two jobs at once), the jobs `_spin(work)`: 2.0 on two free cores (and, for `stream`,
    enough memory bandwidth for both), 1.0 when they time-share one."""
    alone = _spin(work)
    together = max(_spin_workers().map(_spin, [work, work]))
    return 2 * alone / together
