"""Progress of a long wait (a server's `/health`, a pool's replicas): tqdm's bar where the output is a terminal (or a
notebook), and where it is a file (a SLURM log) one line every `LINE_INTERVAL_S` seconds naming what is awaited,
instead of a bar redrawn every second. Used by `sglang_client`, `server_pool` and `launch/local_server.py`.
"""

from __future__ import annotations

import sys
import time
from datetime import datetime
from typing import Optional, TextIO

import tqdm.auto
import tqdm.std

LINE_INTERVAL_S = 10.0  # seconds between two lines of a wait written to a file
DELAY_S = 2.0  # nothing is shown before: a server that answers at once prints nothing


class WaitProgress:
    """Elapsed time of one wait, on `stream` (default: stderr, as tqdm).

    Examples:
        >>> with WaitProgress("http://node-3:30000/health", timeout=900) as progress:
        ...     while not healthy():
        ...         time.sleep(1.0)
        ...         progress.update()
        [12:00:02] waiting for http://node-3:30000/health (2 s of at most 900 s)
        [12:00:12] waiting for http://node-3:30000/health (12 s of at most 900 s)

    On a terminal the same wait is one line redrawn in place, `waiting for http://node-3:30000/health: 00:12 of at
    most 900 s`, erased when it ends.
    `enabled=False` shows nothing (the processes of a multi-process trainer but the first).
    """

    def __init__(self, what: str, timeout: float, enabled: bool = True, stream: Optional[TextIO] = None):
        self.what, self.timeout, self.enabled = what, timeout, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.monotonic()
        self.next_line = DELAY_S
        self.bar: Optional[tqdm.std.tqdm] = None

    def __enter__(self) -> "WaitProgress":
        if self.enabled and interactive(self.stream):
            self.bar = tqdm.auto.tqdm(total=None, desc=f"waiting for {self.what}", unit="s", leave=False,
                                      delay=DELAY_S, file=self.stream,
                                      bar_format=f"{{desc}}: {{elapsed}} of at most {self.timeout:.0f} s{{postfix}}")
        return self

    def update(self, status: str = "") -> None:
        """Show the time waited so far (and `status`, e.g. `1 of 2 serving`): the bar's count, or a line once
        `LINE_INTERVAL_S` seconds have passed since the last one."""
        elapsed = time.monotonic() - self.start
        if self.bar is not None:
            if status:
                self.bar.set_postfix_str(status, refresh=False)
            self.bar.update(round(elapsed - self.bar.n))
        elif self.enabled and elapsed >= self.next_line:
            detail = f"; {status}" if status else ""
            line = (f"[{datetime.now():%H:%M:%S}] waiting for {self.what} ({elapsed:.0f} s of at most "
                    f"{self.timeout:.0f} s{detail})")
            self.stream.write(line + "\n")  # one write: two waits on two threads (servers started together) never
            self.stream.flush()  # share a line, as print's separate write of the newline let them
            while self.next_line <= elapsed:
                self.next_line += LINE_INTERVAL_S

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def interactive(stream: TextIO) -> bool:
    """Whether a bar can be redrawn in place: a terminal, or a notebook (where tqdm.auto draws a widget)."""
    if any(cls.__module__ == "tqdm.notebook" for cls in tqdm.auto.tqdm.__mro__):
        return True
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-like stream without a terminal behind it
        return False
