"""Reference log-probs requested ahead: `ReferencePrefetch.send` posts a batch's sequences to the reference server on
a background thread the moment its completions exist; `collect` hands the answer to TRL's reference hook, or asks
again when the reference was reloaded in between (a reference sync, or a restarted server given its weights back).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from open_r1_ext.sglang_client import SGLangClient

logger = logging.getLogger(__name__)


@dataclass
class Prefetched:
    sequences: list[list[int]]
    epoch: int  # `ReferencePrefetch.epoch` when it was sent
    future: Future


class ReferencePrefetch:
    """Reference requests sent ahead on one background thread, and claimed by the sequences TRL scores.

    `epoch` counts reference reloads like a sequence lock: odd while one is under way (`reloading()`), so a prefetch
    is used only if it was sent at an even epoch that is still current, i.e. no reload began since it was sent.
    `sent`, `used` and `discarded` count prefetches (a discarded one was asked again).

    Args:
        client (`SGLangClient`): the reference server.
        timed (`Callable[[str], ContextManager]`): times a block as a part of the step (`StepTimer.part`).
        depth (`int`): how many unclaimed prefetches are kept (the oldest is dropped beyond).
    """

    def __init__(self, client: SGLangClient, timed, depth: int):
        self.client = client
        self.timed = timed
        self.epoch = 0
        self.sent = self.used = self.discarded = 0
        self._pending: deque[Prefetched] = deque(maxlen=depth)
        self._lock = threading.Lock()
        self._executor: Optional[ThreadPoolExecutor] = None
        self._unmatched_warned = False

    def send(self, sequences: list[list[int]]) -> None:
        """Ask for the log-probs of `sequences` now (any thread)."""
        epoch = self.epoch  # read before the request leaves: a reload that starts later invalidates it
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="open_r1_ext-reference")
            future = self._executor.submit(self._request, sequences)
            self._pending.append(Prefetched(sequences, epoch, future))
            self.sent += 1

    def _request(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        with self.timed("reference"):
            return self.client.ref_logprobs(sequences)

    def collect(self, sequences: list[list[int]], check_weights: Callable[[], None]) -> list[torch.Tensor]:
        """The log-probs of `sequences`: the prefetched answer if one was sent for them and no reload began since,
        else asked now; a prefetch that failed raises its error. `check_weights()` runs once a prefetch is answered,
        before it is judged (it may reload a restarted server, which invalidates what that server answered before)."""
        entry = self._claim(sequences)
        # a failed prefetch raises here: it spent the whole retry budget (or pool wait), asking again would double it
        scored = entry.future.result() if entry is not None else None
        check_weights()
        if scored is not None and entry.epoch == self.epoch and entry.epoch % 2 == 0:
            self.used += 1
            return scored
        if entry is not None:
            self.discarded += 1
            if scored is not None:
                logger.info("the reference was reloaded after this batch's prefetch: asking for its log-probs again")
        return self.client.ref_logprobs(sequences)

    def _claim(self, sequences: list[list[int]]) -> Optional[Prefetched]:
        with self._lock:
            for entry in self._pending:
                if entry.sequences == sequences:
                    self._pending.remove(entry)
                    return entry
            unmatched = bool(self._pending)
        if unmatched and not self._unmatched_warned:
            self._unmatched_warned = True
            logger.warning("no reference prefetch matches the sequences TRL scores: asking for them now "
                           "(prefetch_reference saves nothing for this run)")
        return None

    @contextmanager
    def reloading(self) -> Iterator[None]:
        """Around a reload of the reference server's weights: what was prefetched before it is not used after it."""
        self.epoch += 1
        try:
            yield
        finally:
            self.epoch += 1

    def close(self) -> None:
        """Drop what was not claimed and stop the thread (a later `send` starts a new one)."""
        with self._lock:
            executor, self._executor = self._executor, None
            for entry in self._pending:
                entry.future.cancel()
            self._pending.clear()
        if executor is not None:
            executor.shutdown(wait=True)
