"""Stopping on SIGTERM (SLURM's time limit and `scancel`): the step in flight finishes, a checkpoint is saved and
training ends, so a resumed run redoes no step.

The signal handler only records the signal; `StopOnSignal`, a transformers callback, turns it into `TrainerControl`'s
`should_save` and `should_training_stop` at the end of the optimizer step (TRL's own loop then saves and stops),
agreed by every rank first: one rank stopping alone would leave the others waiting at a collective. Further
SIGTERMs change nothing (under SLURM a cancelled step's processes may get it twice: from slurmstepd, and forwarded by
srun); what bounds the stop is SLURM's own SIGKILL, `KillWait` seconds (30 by default) after the first.
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

import torch
from transformers import TrainerCallback


class StopOnSignal(TrainerCallback):
    """Save a checkpoint and stop at the end of the step during which SIGTERM arrived. `install()` / `uninstall()`
    around training (main thread only); afterwards `stopped_at` is the step of that checkpoint, or None."""

    def __init__(self, accelerator, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)):
        self.accelerator = accelerator
        self.signals = signals
        self.received: Optional[str] = None  # the signal's name, once one arrived
        self.stopped_at: Optional[int] = None
        self._previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.signals}

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        self.received = self.received or signal.Signals(signum).name

    def on_step_end(self, args, state, control, **kwargs):
        if self._agreed():
            control.should_save = control.should_training_stop = True
            self.stopped_at = state.global_step

    def _agreed(self) -> bool:
        """Whether any rank got the signal (one all-reduce per step when several processes train)."""
        if self.accelerator.num_processes == 1:
            return self.received is not None
        flag = torch.tensor([0 if self.received is None else 1], device=self.accelerator.device)
        if int(self.accelerator.reduce(flag, reduction="sum").item()) == 0:
            return False
        self.received = self.received or "SIGTERM (on another rank)"
        return True
