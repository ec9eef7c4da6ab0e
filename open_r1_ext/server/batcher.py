"""Server-side request batching and scheduling for the built-in server.

HTTP handlers submit work and await a future; one worker thread runs it all. Sampling is continuously batched: the
sequences being sampled form one `DecodeBatch`, new requests join it at the next step boundary and leave once done,
and scoring requests run between two decode steps. When the worker is idle, the first request waits only for those
the HTTP layer has announced (`expect()`) and not yet handed in: a lone request starts at once.

Weight updates and other exclusive calls go through the same queue and, as SGLang's writer-preferring model-update
lock, wait for the sequences being sampled to finish while the requests queued after them wait for the call. SGLang's
`/pause_generation` (`pause(mode)`: `abort`, `retract` or `in_place`) stops sampling at the next step boundary: no
request runs until `resume()`, but calls (a reload) run at once; retracted sequences are prefilled again on resume
with the weights then served, in-place ones go on with their KV cache. A batch of requests that fails to start is
started again one request at a time, so an error reaches only the request that caused it.
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

from open_r1_ext.protocol import PAUSE_MODES
from open_r1_ext.server.engine import DecodeBatch, GenerationTask, ModelEngine

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Work:
    kind: str  # "score" | "generate" | "call" (exclusive) | "read" (between two steps) | "pause" | "continue"
    payload: Any
    future: Future
    left: int = 0  # "generate": its tasks still sampling


_WAKE = _Work("wake", None, Future())  # queued when the last announced request is done: re-check the window
_CONTROL = ("pause", "continue")


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
    """Runs an engine's work on one thread: continuous batching of sampling, scoring between decode steps, exclusive
    calls (weight updates) between sequences, and SGLang's pause and continue."""

    def __init__(self, engine: ModelEngine, max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, max_batch_seqs: int = 256):
        self.engine = engine
        self.max_wait = max_wait_ms / 1000.0
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self._queue: queue.Queue[_Work | None] = queue.Queue()
        self._held: deque[_Work] = deque()  # taken from the queue, not run yet (in arrival order)
        self._arriving = 0  # requests announced by `expect()` and not done yet
        self._arriving_lock = threading.Lock()
        self._decoding = DecodeBatch(engine)
        self._work_of: dict[GenerationTask, _Work] = {}
        self._paused: Optional[str] = None  # the mode of the pause in force
        self._retracted: list[GenerationTask] = []  # retracted by a pause, prefilled again on resume
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
        """Run `fn` alone on the worker thread (e.g. a weight reload): after the requests queued before it, once no
        sequence is being sampled (at once while paused); the requests queued after it wait for it."""
        return self.submit("call", fn)

    def call_between_steps(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the worker thread between two decode steps (work that changes nothing the sequences under way
        use: a read of the weights, a LoRA adapter loaded beside theirs)."""
        return self.submit("read", fn)

    def pause(self, mode: str) -> Future:
        """SGLang's `/pause_generation`: from the next step boundary on, nothing is sampled or scored until `resume()`
        (calls still run). `abort` ends the sequences under way and the requests queued before it (finish reason
        `abort`); `retract` keeps them and drops their KV cache (prefilled again on resume, with the weights then
        served); `in_place` keeps them with their KV cache. Resolves once in force."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode {mode!r}: one of {', '.join(PAUSE_MODES)}")
        return self.submit("pause", mode)

    def resume(self) -> Future:
        """SGLang's `/continue_generation` (a no-op when not paused)."""
        return self.submit("continue", None)

    def holds_kv(self) -> bool:
        """Whether sequences paused `in_place` keep a KV cache of the weights they began with (a snapshot: exact on the
        worker thread, e.g. in a call)."""
        return self._paused == "in_place" and bool(self._decoding)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---------------------------------------------------------------- worker
    def _loop(self) -> None:
        # OpenMP and MKL keep their thread count per OS thread: without this, this worker's matmuls would use every
        # core whatever `--num-threads` (torch.set_num_threads in the main thread) says.
        torch.set_num_threads(torch.get_num_threads())
        while self._take():
            self._run_held()
            if self._decoding and not self._paused:
                self._step()

    def _take(self) -> bool:
        """Move what is queued to `_held`. With nothing to run (no sampling under way, nothing held that may run),
        first block for an item, and for a request wait up to `max_wait` for those already being received. False
        once closed."""
        if not (self._decoding and not self._paused) and (self._paused or not self._held):
            item = self._queue.get()
            if item is None:
                return False
            if item is not _WAKE:
                self._held.append(item)
                if not self._paused and item.kind not in ("call", *_CONTROL):
                    self._collect_window()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            if item is not _WAKE:
                self._held.append(item)

    def _collect_window(self) -> None:
        """Wait up to `max_wait` for the requests announced and still being received, while they keep coming."""
        deadline = time.monotonic() + self.max_wait
        while len(self._held) < self.max_batch_seqs:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (not self._arriving and self._queue.empty()):
                return
            try:
                item = self._queue.get(timeout=remaining)
            except queue.Empty:
                return
            if item is None:
                self._queue.put(None)  # seen by the next `_take`
                return
            if item is not _WAKE:
                self._held.append(item)
                if item.kind in ("call", *_CONTROL):
                    return

    def _run_held(self) -> None:
        """Run what can run now, in arrival order: runs of requests are started together; a call waits for the
        sampling under way (and holds back what came after it); while paused only calls and control items run."""
        pending: list[_Work] = []  # requests to start together
        kept: deque[_Work] = deque()
        while self._held:
            work = self._held.popleft()
            if work.kind in _CONTROL:
                self._start(pending)
                pending = []
                self._control(work)
            elif work.kind == "call":
                self._start(pending)
                pending = []
                if self._decoding and not self._paused:  # as SGLang's writer lock: after the sampling under way
                    kept.append(work)
                    kept.extend(self._held)
                    self._held.clear()
                    break
                self._run_call(work)
            elif self._paused:
                kept.append(work)
            else:
                pending.append(work)
        self._start(pending)
        self._held = kept + self._held

    def _control(self, work: _Work) -> None:
        if work.kind == "pause":
            mode = work.payload
            self._paused = mode
            if mode == "retract":
                self._retracted += self._decoding.retract()
            elif mode == "abort":  # the sequences under way, and the requests queued before the pause
                self._finish(self._decoding.abort(self._decoding.retract() + self._retracted))
                self._retracted = []
                queued = [w for w in self._held if w.kind == "generate"]
                for request in queued:
                    self._held.remove(request)
                    for task in request.payload:
                        task.abort()
                self._admit(queued)
        else:
            self._paused = None
            retracted, self._retracted = self._retracted, []
            if retracted:
                self._guard_step(lambda: self._finish(self._decoding.add(retracted, resume=True)), retracted)
        work.future.set_result(None)

    def _start(self, works: list[_Work]) -> None:
        """Start requests together: scoring now, sampling by joining the decode batch, reads now."""
        if not works:
            return
        self.batches_run += 1
        scores = [w for w in works if w.kind == "score"]
        if scores:
            self._guarded(scores, self._score_all)
        generations = [w for w in works if w.kind == "generate"]
        if generations:
            self._admit(generations)
        for work in works:
            if work.kind == "read":
                self._run_call(work)

    def _admit(self, works: list[_Work], resume: bool = False) -> None:
        """The requests' tasks join the decode batch (prefilled now); if that fails, each request is tried alone."""
        tasks = [t for w in works for t in w.payload]
        if not tasks:
            for work in works:
                work.future.set_result(work.payload)
            return
        for work in works:
            work.left = len(work.payload)
            for task in work.payload:
                self._work_of[task] = work
        self.sequences_generated += len(tasks)
        try:
            self._finish(self._decoding.add(tasks, resume=resume))
        except Exception as err:  # noqa: BLE001 - handed to the request that caused it
            if len(works) > 1:
                logger.warning("starting %d requests together failed (%s: %s); starting each alone", len(works),
                               type(err).__name__, err)
                self.sequences_generated -= len(tasks)
                for work in works:
                    self._admit([work], resume)
                return
            logger.exception("request failed")
            self._fail(works[0], err)

    def _step(self) -> None:
        self._guard_step(lambda: self._finish(self._decoding.step()), list(self._decoding.tasks))

    def _guard_step(self, run: Callable[[], None], tasks: list[GenerationTask]) -> None:
        """A decode step (or a resume's prefill) for `tasks`; should it fail, their requests get the error."""
        try:
            run()
        except Exception as err:  # noqa: BLE001 - handed to the requests of the batch
            logger.exception("a decode step failed")
            self._decoding.retract()
            self.engine.live_tasks.difference_update(tasks)
            for work in {self._work_of[t] for t in tasks if t in self._work_of}:
                self._fail(work, err)

    def _finish(self, done: list[GenerationTask]) -> None:
        """Tasks that finished: a request whose tasks all did is answered."""
        for task in done:
            work = self._work_of.pop(task, None)
            if work is None:
                continue
            work.left -= 1
            if work.left == 0 and not work.future.done():
                work.future.set_result(work.payload)

    def _fail(self, work: _Work, err: BaseException) -> None:
        for task in work.payload:
            self._work_of.pop(task, None)
        self.engine.live_tasks.difference_update(work.payload)
        if not work.future.done():
            work.future.set_exception(err)

    def _run_call(self, work: _Work) -> None:
        try:
            work.future.set_result(work.payload())
        except Exception as err:  # noqa: BLE001 - handed to the waiting request
            work.future.set_exception(err)

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
