"""Start and stop a built-in server as a child process, on a free port, with its log in a file.

Used by `make demo`, the local launcher and the tests: `with BuiltinServer(model_path) as server: server.url`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from open_r1_ext.sglang_client import SGLangClient, ServerError
from open_r1_ext.wait_progress import WaitProgress


def die_with_parent() -> None:
    """In a child between fork and exec: SIGTERM when the parent thread that started it ends (PR_SET_PDEATHSIG)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class BuiltinServer:
    """`python -m open_r1_ext.server` in a subprocess; `start()` returns once `/health` answers."""

    def __init__(
        self,
        model_path: str,
        port: Optional[int] = None,
        host: str = "127.0.0.1",
        log_path: Optional[str] = None,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 120.0,
        deterministic: bool = False,
    ):
        self.model_path = str(model_path)
        self.host = host
        self.port = port or free_port(host)
        self.log_path = Path(log_path) if log_path else None
        # `--enable-deterministic-inference`: the server honours `sampling_seed` (seeded samples are reproducible)
        self.extra_args = tuple(extra_args) + (("--enable-deterministic-inference",) if deterministic else ())
        self.startup_timeout = startup_timeout
        self.process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "open_r1_ext.server", "--model-path", self.model_path,
                "--host", self.host, "--port", str(self.port), "--log-level", "warning", *self.extra_args]

    def start(self) -> "BuiltinServer":
        """Start the server and wait for /health. Started from the main thread, the server gets SIGTERM when this
        process dies, however it dies (even SIGKILL): an embedded server never outlives its trainer. (From another
        thread it would die with that thread, so there it is left to `stop()`.)"""
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        on_main_thread = threading.current_thread() is threading.main_thread()
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                        preexec_fn=die_with_parent if on_main_thread else None)
        client = SGLangClient(self.url)
        deadline = time.monotonic() + self.startup_timeout
        where = f"; see {self.log_path}" if self.log_path else ""
        with WaitProgress(f"the built-in server at {self.url}/health to start{where}", self.startup_timeout) as waiting:
            while not client.is_healthy(timeout=2.0):
                code = self.process.poll()
                if code is not None:
                    raise ServerError(f"built-in server for {self.model_path} exited with code {code} while starting{where}")
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServerError(f"built-in server for {self.model_path} not healthy after {self.startup_timeout:.0f} s{where}")
                time.sleep(0.25)
                waiting.update()
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, sig)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> "BuiltinServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
