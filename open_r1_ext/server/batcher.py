"""Server-side request batching for the built-in server.

HTTP handlers submit work and await a future; one worker thread collects what arrives within a short window,
runs all scoring in padded forwards and all sampling in one decode loop, then hands each caller its slice. The
window only waits for requests the HTTP layer has announced (`expect()`) and not yet handed in: a lone request
starts at once.
Weight updates go through the same queue, so batches in flight finish on the old weights first. A batch that fails
is run again one request at a time, so an error reaches only the request that caused it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from open_r1_ext.server.engine import GenerationTask, ModelEngine

logger = logging.getLogger(__name__)


@dataclass
class _Work:
    kind: str  # "score" | "generate" | "call"
    payload: Any
    future: Future


_WAKE = _Work("wake", None, Future())  # queued when the last announced request is done: re-check the window


class Arrival:
    """A request the HTTP layer is still receiving: a batch being collected waits for its work until `done()`."""

    def __init__(self, batcher: "Batcher"):
        self._batcher = batcher
        self._open = True

    def done(self) -> None:
        """Its work is queued (or it has none); idempotent."""
        if self._open:
            self._open = False
            self._batcher._arrived()


# `python -m open_r1_ext.server --max-batch-wait-ms / --max-batch-tokens` default to these.
DEFAULT_MAX_WAIT_MS = 5.0
DEFAULT_MAX_BATCH_TOKENS = 32768


class Batcher:
    """Runs an engine's work on one thread, batching concurrent score and generate requests."""

    def __init__(self, engine: ModelEngine, max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, max_batch_seqs: int = 256):
        self.engine = engine
        self.max_wait = max_wait_ms / 1000.0
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self._queue: queue.Queue[_Work | None] = queue.Queue()
        self._held: deque[_Work] = deque()
        self._arriving = 0  # requests announced by `expect()` and not done yet
        self._arriving_lock = threading.Lock()
        self.batches_run = 0
        self.sequences_generated = 0
        self.sequences_scored = 0
        self._thread = threading.Thread(target=self._loop, name="open_r1_ext-batcher", daemon=True)
        self._thread.start()

    def submit(self, kind: str, payload: Any) -> Future:
        future: Future = Future()
        self._queue.put(_Work(kind, payload, future))
        return future

    def score(self, sequences: list[list[int]], adapters: Optional[list[Optional[str]]] = None) -> Future:
        """Log-probs of `sequences`, each with its LoRA adapter from `adapters` (default: the base model)."""
        return self.submit("score", (sequences, adapters or [None] * len(sequences)))

    def generate(self, tasks: list[GenerationTask]) -> Future:
        return self.submit("generate", tasks)

    def expect(self) -> Arrival:
        """Announce a request on its way: until its `Arrival.done()`, a batch being collected waits for it (at most
        `max_wait_ms`). With none announced, a batch takes what is queued and starts."""
        with self._arriving_lock:
            self._arriving += 1
        return Arrival(self)

    def _arrived(self) -> None:
        with self._arriving_lock:
            self._arriving -= 1
            last = self._arriving == 0
        if last:
            self._queue.put(_WAKE)

    def call_exclusive(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` alone on the worker thread, after the batches queued before it (e.g. a weight reload)."""
        return self.submit("call", fn)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---------------------------------------------------------------- worker
    def _next(self, timeout: float | None = None) -> _Work | None:
        if self._held:
            return self._held.popleft()
        return self._queue.get(timeout=timeout)

    def _loop(self) -> None:
        # OpenMP and MKL keep their thread count per OS thread: without this, this worker's matmuls would use every
        # core whatever `--num-threads` (torch.set_num_threads in the main thread) says.
        torch.set_num_threads(torch.get_num_threads())
        while True:
            first = self._next()
            if first is None:
                return
            if first is _WAKE:
                continue
            if first.kind == "call":
                self._run_call(first)
                continue
            batch = [first]
            deadline = time.monotonic() + self.max_wait
            while len(batch) < self.max_batch_seqs:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (not self._arriving and self._queue.empty()):
                    break  # the window is over, or nothing more is on its way
                try:
                    item = self._next(timeout=remaining)
                except queue.Empty:
                    break
                if item is _WAKE:
                    continue
                if item is None or item.kind == "call":
                    self._held.append(item)  # type: ignore[arg-type]
                    break
                batch.append(item)
            self._run_batch(batch)

    def _run_call(self, work: _Work) -> None:
        try:
            work.future.set_result(work.payload())
        except Exception as err:  # noqa: BLE001 - handed to the waiting request
            work.future.set_exception(err)

    def _run_batch(self, batch: list[_Work]) -> None:
        self.batches_run += 1
        scores = [w for w in batch if w.kind == "score"]
        gens = [w for w in batch if w.kind == "generate"]
        if scores:
            self._guarded(scores, self._score_all)
        if gens:
            self._guarded(gens, self._generate_all)

    def _guarded(self, works: list[_Work], run: Callable[[list[_Work]], list[Any]]) -> None:
        """Run `works` as one batch; if it fails, run each request alone, so only the one that fails gets its error."""
        try:
            results = run(works)
        except Exception as err:  # noqa: BLE001 - handed to the request that caused it
            if len(works) > 1:
                logger.warning("a batch of %d requests failed (%s: %s); running each alone", len(works), type(err).__name__, err)
                for w in works:
                    self._guarded([w], run)
                return
            logger.exception("request failed")
            works[0].future.set_exception(err)
            return
        for w, result in zip(works, results):
            w.future.set_result(result)

    def _score_all(self, works: list[_Work]) -> list[list[list[float]]]:
        sequences = [seq for w in works for seq in w.payload[0]]
        adapters = [adapter for w in works for adapter in w.payload[1]]
        self.sequences_scored += len(sequences)
        scored: list[list[float]] = []
        for start, stop in _spans_by_tokens(sequences, self.max_batch_tokens):
            scored.extend(self.engine.score(sequences[start:stop], adapters[start:stop]))
        results, start = [], 0
        for w in works:
            results.append(scored[start : start + len(w.payload[0])])
            start += len(w.payload[0])
        return results

    def _generate_all(self, works: list[_Work]) -> list[list[GenerationTask]]:
        tasks = [t for w in works for t in w.payload]
        self.engine.generate(tasks)
        self.sequences_generated += len(tasks)
        return [w.payload for w in works]


def _spans_by_tokens(sequences: list[list[int]], budget: int):
    """Consecutive `(start, stop)` groups whose padded size (rows x longest) stays within `budget` (at least one row
    each)."""
    start, longest = 0, 0
    for i, seq in enumerate(sequences):
        new_longest = max(longest, len(seq))
        if i > start and new_longest * (i - start + 1) > budget:
            yield start, i
            start, new_longest = i, len(seq)
        longest = new_longest
    if start < len(sequences):
        yield start, len(sequences)
