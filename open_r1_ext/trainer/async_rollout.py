"""Overlap generation with training: a look-ahead over the trainer's batches and a one-thread rollout queue.

`LookaheadIterator` wraps an epoch's batch iterator and reads `depth` generation batches ahead, announcing each
new one; `RolloutQueue` runs, in submission order on one background thread per rank, the generation requests
for those batches and the servers' weight reloads. FIFO order is the staleness bound: a batch announced while
step N trains is generated after the reload of the weights of step N - depth, and weight reloads always fall
between two generation batches.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional


class LookaheadIterator:
    """Yields the batches of `source` unchanged while reading ahead; `announce(batch)` sees each batch early.

    Only every `period`-th batch is announced (TRL reuses one generation batch for `steps_per_generation x
    num_iterations` consecutive steps), up to `depth` announced batches beyond the one being trained.
    """

    def __init__(self, source: Iterator, announce: Callable[[Any], None], depth: int, period: int):
        self.source = source
        self.announce = announce
        self.depth = depth
        self.period = period
        self.buffer: deque = deque()
        self.read = 0  # batches read from source so far
        self.exhausted = False

    def __iter__(self) -> "LookaheadIterator":
        return self

    def __next__(self):
        self._fill(ahead=self.depth * self.period + 1)
        if not self.buffer:
            raise StopIteration
        return self.buffer.popleft()

    def _fill(self, ahead: int) -> None:
        while not self.exhausted and len(self.buffer) < ahead:
            try:
                batch = next(self.source)
            except StopIteration:
                self.exhausted = True
                return
            if self.read % self.period == 0:
                self.announce(batch)
            self.read += 1
            self.buffer.append(batch)


class RolloutQueue:
    """One background thread running generation and reload jobs in order; generation results are keyed by prompts."""

    def __init__(self):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="open_r1_ext-rollout")
        self._pending: dict[tuple, Future] = {}

    def submit(self, job: Callable[[], Any]) -> Future:
        return self._executor.submit(job)

    def submit_generation(self, key: tuple, job: Callable[[], Any]) -> None:
        if key not in self._pending:
            self._pending[key] = self.submit(job)

    def take(self, key: tuple) -> Optional[Future]:
        """The announced generation for these prompts, if any (each is taken once)."""
        return self._pending.pop(key, None)

    def shutdown(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._executor.shutdown(wait=True)


def prompts_key(prompt_ids) -> tuple:
    return tuple(tuple(int(t) for t in ids) for ids in prompt_ids)
