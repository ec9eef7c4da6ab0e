"""Where each optimizer step's wall time goes, logged as TRL metrics (`timing/*`, `background/*`, `step_wall_time`).

`StepTimer.part(name)` times a block. On the training thread the parts are exclusive (a part nested in another is
subtracted from it), so the `timing/*` of a step are disjoint and add up to nearly its `step_wall_time`; on any other
thread (the rollout and reference threads) the block ran beside the step and is logged as `background/<name>`.
`StepTimingCallback` closes each step after the weight sync and appends its totals to `trainer._metrics["train"]`.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from typing import Iterator

from transformers import TrainerCallback

# The parts of a step on the training thread (docs/design.md: "The step time's parts").
PARTS = ("generate", "rollout_wait", "group_wait", "reference_send", "reference_wait", "rewards", "train", "dump",
         "stage", "reload_wait", "seal_wait")


class StepTimer:
    """Per-step totals of named parts: exclusive on the training thread, plain durations elsewhere (thread-safe)."""

    def __init__(self, parts: tuple[str, ...]):
        self.parts = parts  # logged every step, 0 when a step had none
        self._lock = threading.Lock()
        self._owner = threading.get_ident()
        self._stack: list[list[float]] = []  # [start, seconds of nested parts] per open part of the training thread
        self._totals: dict[str, float] = defaultdict(float)
        self._background: dict[str, float] = defaultdict(float)
        self._step_start = time.perf_counter()

    def start(self) -> None:
        """The training thread begins its first step now (`on_train_begin`)."""
        self._owner = threading.get_ident()
        self._stack.clear()
        with self._lock:
            self._totals.clear()
            self._background.clear()
        self._step_start = time.perf_counter()

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        if threading.get_ident() != self._owner:
            try:
                yield
            finally:
                with self._lock:
                    self._background[name] += time.perf_counter() - start
            return
        frame = [start, 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            elapsed = time.perf_counter() - start
            self._totals[name] += elapsed - frame[1]
            if self._stack:
                self._stack[-1][1] += elapsed

    def time_calls(self, obj, method: str, name: str) -> None:
        """Time every call of `obj.<method>` as the part `name` (for objects that know nothing of steps)."""
        call = getattr(obj, method)

        @functools.wraps(call)
        def timed(*args, **kwargs):
            with self.part(name):
                return call(*args, **kwargs)

        setattr(obj, method, timed)

    def end_step(self) -> dict[str, float]:
        """The step's metrics (and a new step starts): `timing/<part>` for every part, `background/<name>` for what ran
        beside it, `step_wall_time` from the end of the previous step."""
        now = time.perf_counter()
        with self._lock:
            background, self._background = dict(self._background), defaultdict(float)
        metrics = {f"timing/{name}": self._totals.get(name, 0.0) for name in self.parts}
        metrics.update({f"background/{name}": seconds for name, seconds in sorted(background.items())})
        metrics["step_wall_time"] = now - self._step_start
        self._totals.clear()
        self._step_start = now
        return metrics


class StepTimingCallback(TrainerCallback):
    """Starts the timer with training and, after every other step-end callback of ours (the weight sync), logs the
    step's parts through TRL's metrics, which `log()` averages over `logging_steps` and hands to `report_to`. The
    optimizer step counts as `train`."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._optimizer_step = ExitStack()

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.step_timer.start()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._optimizer_step.enter_context(self.trainer.step_timer.part("train"))

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._optimizer_step.close()

    def on_step_end(self, args, state, control, **kwargs):
        metrics = self.trainer._metrics["train"]
        for name, seconds in self.trainer.step_timer.end_step().items():
            metrics[name].append(seconds)


def describe_step_time(logs: dict) -> str:
    """`  1.23 s: train 0.70 generate 0.40 dump 0.05` for the per-step line: the step's wall time and its parts of at
    least 5 ms, longest first ('' without timings)."""
    if "step_wall_time" not in logs:
        return ""
    parts = sorted(((seconds, key[len("timing/"):]) for key, seconds in logs.items()
                    if key.startswith("timing/") and seconds is not None and seconds >= 0.005), reverse=True)
    return f"  {logs['step_wall_time']:.2f} s:" + "".join(f" {name} {seconds:.2f}" for seconds, name in parts)
