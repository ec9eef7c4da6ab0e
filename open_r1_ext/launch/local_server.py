"""Start and stop a server as a child process, on a free port, with its log in a file: the built-in server, or real
SGLang on this machine's CPU; once it has ended, the shared-memory files it left in /dev/shm are removed.

Used by `make demo`, the local launcher and the tests: `with BuiltinServer(model_path) as server: server.url`,
`with SGLangServer(model_path, python=".venv-sglang/bin/python") as server: ...`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import psutil

from open_r1_ext.sglang_client import SGLangClient, ServerError
from open_r1_ext.wait_progress import WaitProgress


def die_with_parent() -> None:
    """In a child between fork and exec: SIGTERM when the parent thread that started it ends (PR_SET_PDEATHSIG)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_FREE_PORT = 20000  # `free_port` picks from here up to the kernel's ephemeral range
# A port chosen free and bound seconds later (the server's own, by `free_port`; SGLang's `nccl_port`, which it picks
# itself in 22000-29999) may be taken meanwhile by another process choosing the same way: seen once in a run of the
# tests, SGLang's scheduler failing with EADDRINUSE. A server that exits at start-up saying so is launched again.
PORT_TAKEN = "address already in use"  # what the built-in server (uvicorn) and SGLang (its TCPStore) log then
PORT_RACE_RETRIES = 2


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, below the kernel's ephemeral range (`ip_local_port_range`, where every process's
    outgoing connections take their local ports): the server binds it seconds later (SGLang 20-30 s after its
    launch), and a port of that range may be some connection's by then (seen in a test run: SGLang's `address already
    in use`, after which it hangs). Random, so that processes looking at once rarely pick the same; the kernel's
    choice if that range leaves no room below it."""
    first_ephemeral = int(EPHEMERAL_PORTS.read_text().split()[0]) if EPHEMERAL_PORTS.exists() else 32768
    candidates = range(LOWEST_FREE_PORT, first_ephemeral)
    for port in random.SystemRandom().sample(candidates, min(100, len(candidates))) or [0]:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise OSError(f"no free port on {host} among 100 tried in {candidates.start}-{candidates.stop - 1}")


SHARED_MEMORY = Path("/dev/shm")
PROCESS_EXIT_WAIT_S = 10.0  # how long the server's processes may take to go once its first process ended
ORPHANS = ("sem.mp-*", "sglang_loads_*.shm")  # what a SIGKILLed SGLang leaves in /dev/shm (its locks, its load report)
ORPHAN_AGE_S = 60.0  # an unheld file of those kinds older than this is an orphan (`remove_orphaned_shared_memory`)


class SharedMemoryFiles:
    """The files in /dev/shm of one server's processes: noted while they run (`note`), removed once every one of them
    is gone (`remove`). A SIGKILLed SGLang leaves its `sem.mp-*` (a multiprocessing lock) and `sglang_loads_*.shm`
    there (its own unlink paths never run), and they pile up until /dev/shm is full. Only the files one of the
    server's processes maps or holds open are noted (by inode: glibc maps a semaphore under the temporary name it
    created it with, then links it to its `sem.*` name), so another process's files are never touched."""

    def __init__(self):
        self.files: dict[str, int] = {}  # path -> inode
        self.processes: dict[int, psutil.Process] = {}

    def note(self, pid: int) -> None:
        """Note process `pid` and its descendants, and the /dev/shm files they map or hold open now."""
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(pid)
            for process in [root, *root.children(recursive=True)]:
                self.processes[process.pid] = process
        held = held_inodes(self.processes)
        self.files.update({entry.path: entry.inode() for entry in os.scandir(SHARED_MEMORY) if entry.inode() in held})

    def remove(self) -> list[str]:
        """Once every noted process is gone (waited for up to `PROCESS_EXIT_WAIT_S`), remove the noted files still
        there (the same inode: not a new file of the same name); the paths removed."""
        deadline = time.monotonic() + PROCESS_EXIT_WAIT_S
        while any(map(_running, self.processes.values())):
            if time.monotonic() > deadline:
                return []  # still running: its files are in use
            time.sleep(0.1)
        removed = []
        for path, inode in self.files.items():
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == inode:
                    os.unlink(path)
                    removed.append(path)
        self.files, self.processes = {}, {}
        return removed


def held_inodes(pids) -> set[int]:
    """The inodes of the /dev/shm files that processes `pids` map or hold open (those that can be read)."""
    device, held = os.stat(SHARED_MEMORY).st_dev, set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(f"{SHARED_MEMORY}/"):
                    held.add(int(fields[4]))
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    found = os.stat(fd.path)
                    if found.st_dev == device:
                        held.add(found.st_ino)
    return held


def remove_orphaned_shared_memory(min_age_s: float = ORPHAN_AGE_S) -> list[str]:
    """The files of SGLang's kinds (`ORPHANS`) in /dev/shm that no process maps or holds open, owned by this user and
    older than `min_age_s` (a file is mapped within moments of its making): what servers SIGKILLed before anyone
    could remove their files left (a job's task SIGKILLed by SLURM after its `KillWait`, a trainer SIGKILLed with its
    embedded server). Run as a server starts; the paths removed."""
    uid, now, orphans = os.getuid(), time.time(), {}
    for pattern in ORPHANS:
        for path in SHARED_MEMORY.glob(pattern):
            with contextlib.suppress(FileNotFoundError):
                found = path.stat()
                if found.st_uid == uid and now - found.st_mtime > min_age_s:
                    orphans[found.st_ino] = path
    if not orphans:
        return []
    held, removed = held_inodes(psutil.pids()), []
    for inode, path in orphans.items():
        with contextlib.suppress(OSError):  # gone meanwhile, or a read-only /dev/shm: a sweep never stops a start
            if inode not in held and path.stat().st_ino == inode:
                path.unlink()
                removed.append(str(path))
    return removed


def _running(process: psutil.Process) -> bool:
    """Whether `process` (the same one: psutil checks its start time) still runs; a zombie holds no memory."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class LocalServer:
    """A server process on this machine; `start()` returns once `/health` answers. Subclasses give its `command()`,
    its `env` and its `name` (for messages)."""

    name = "server"
    engine = ""  # "builtin" or "sglang": which protocol implementation it is
    env: dict[str, str] = {}

    def __init__(
        self,
        model_path: str,
        port: Optional[int] = None,
        host: str = "127.0.0.1",
        log_path: Optional[str] = None,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 120.0,
    ):
        self.model_path = str(model_path)
        self.host = host
        self.port = port or free_port(host)
        self._port_chosen = port is None  # here: another one may be chosen if it is taken before the server binds it
        self.log_path = Path(log_path) if log_path else None
        self.extra_args = tuple(extra_args)
        self.startup_timeout = startup_timeout
        self.process: Optional[subprocess.Popen] = None
        self.shared_memory = SharedMemoryFiles()
        self._launched_at = 0.0
        self._log_start = 0  # the log's size when the process was launched

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> "LocalServer":
        """Start the server and wait for /health (`launch`, then `wait_until_healthy`)."""
        return self.launch().wait_until_healthy()

    def _lost_a_port(self) -> bool:
        """Whether the process ended and its log, since its launch, says a port it binds was taken."""
        if self.process is None or self.process.poll() is None or self.log_path is None:
            return False
        with open(self.log_path, "rb") as log:
            log.seek(self._log_start)
            return PORT_TAKEN in log.read().decode(errors="replace").lower()

    def launch(self) -> "LocalServer":
        """Start the server's process, not waiting for it. Started from the main thread, the server gets SIGTERM when
        this process dies, however it dies (even SIGKILL): an embedded server never outlives its trainer. (From
        another thread it would die with that thread, so there it is left to `stop()`.)"""
        remove_orphaned_shared_memory()
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self._log_start = self.log_path.stat().st_size if self.log_path else 0
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        on_main_thread = threading.current_thread() is threading.main_thread()
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                        preexec_fn=die_with_parent if on_main_thread else None)
        self._launched_at = time.monotonic()
        return self

    def wait_until_healthy(self) -> "LocalServer":
        """Wait until the launched server answers /health: `ServerError` (naming its log) once it exits, or after
        `startup_timeout` seconds from its launch. One that ends at start-up because a port it was to bind was taken
        meanwhile (its log says `PORT_TAKEN`) is launched again, up to `PORT_RACE_RETRIES` times, on a new port when
        its port was chosen here: its `url` is the one to use once this returns."""
        relaunched = 0
        while True:
            try:
                return self._wait_for_health()
            except ServerError:
                if relaunched == PORT_RACE_RETRIES or not self._lost_a_port():
                    raise
            relaunched += 1
            self.stop()  # it ended: its shared-memory files removed
            old, self.port = self.port, free_port(self.host) if self._port_chosen else self.port
            print(f"the {self.name} on port {old} found a port it binds taken at start-up (another process chose it "
                  f"meanwhile): launching it again on port {self.port}", file=sys.stderr, flush=True)
            self.launch()

    def _wait_for_health(self) -> "LocalServer":
        client = SGLangClient(self.url)
        deadline = self._launched_at + self.startup_timeout
        where = f"; see {self.log_path}" if self.log_path else ""
        with WaitProgress(f"the {self.name} at {self.url}/health to start{where}", self.startup_timeout) as waiting:
            while not client.is_healthy(timeout=2.0):
                code = self.process.poll()
                if code is not None:
                    raise ServerError(f"{self.name} for {self.model_path} exited with code {code} while starting{where}")
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServerError(f"{self.name} for {self.model_path} not healthy after {self.startup_timeout:.0f} s{where}")
                time.sleep(0.25)
                waiting.update()
        self.shared_memory.note(self.process.pid)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Send `sig` to the server's process group (SIGKILL after 15 s), then remove the shared-memory files its
        processes left (also when it had ended already, e.g. killed from outside)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.shared_memory.note(self.process.pid)
            os.killpg(self.process.pid, sig)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.shared_memory.remove()

    def __enter__(self) -> "LocalServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class BuiltinServer(LocalServer):
    """`python -m open_r1_ext.server`; `deterministic` adds `--enable-deterministic-inference` (the server then
    honours `sampling_seed`: seeded samples are reproducible)."""

    name = "built-in server"
    engine = "builtin"

    def __init__(self, model_path: str, *args, deterministic: bool = False, **kwargs):
        super().__init__(model_path, *args, **kwargs)
        self.extra_args += ("--enable-deterministic-inference",) if deterministic else ()

    def command(self) -> list[str]:
        return [sys.executable, "-m", "open_r1_ext.server", "--model-path", self.model_path,
                "--host", self.host, "--port", str(self.port), "--log-level", "warning", *self.extra_args]


# SGLang 0.5.23 on a CPU: the environment and flags it needs there (see docs/protocol.md, "SGLang on the CPU"); the one
# place they live, for the test runner below and for a recipe's `device: cpu` (`slurm_plan.server_command`).
# SGLANG_USE_CPU_ENGINE: without it SGLang does not treat the machine as a CPU platform. The other two: on SIGTERM
# SGLang sleeps 5 s "to let GPU activity settle" before py-spy and CUDA core dumps (tokenizer_manager.py ~3485), which
# has nothing to dump on a CPU: a stop took 5.9 s, 0.8 s without.
SGLANG_CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
                  "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
SGLANG_CPU_MAX_TOTAL_TOKENS = 8192  # KV-cache tokens; unbounded, SGLang sizes the cache from free RAM (~15 GB)


def sglang_cpu_args(max_total_tokens: int = SGLANG_CPU_MAX_TOTAL_TOKENS, lora: bool = False) -> list[str]:
    """The flags that run SGLang on a CPU: torch-native attention (the only CPU backend without Intel AMX), a bounded
    KV cache, and `--sleep-on-idle` (without it the idle scheduler polls in a busy loop, a whole core per server:
    measured 100% of a core idle, 0.6% with it); with `lora`, torch-native LoRA kernels (its default, csgmv, is
    Triton's: GPU only)."""
    lora_backend = ["--lora-backend", "torch_native"] if lora else []
    return ["--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", str(max_total_tokens),
            "--sleep-on-idle", *lora_backend]


class SGLangServer(LocalServer):
    """Real SGLang (`python -m sglang.launch_server`) on this machine's CPU, run by `python`: the interpreter of a
    venv that has SGLang (its pins differ from this project's; `make sglang-venv` builds `.venv-sglang`). For tests and
    small models. It takes 15-35 s to start and stops within ~10 s of SIGTERM."""

    name = "SGLang server"
    engine = "sglang"
    env = SGLANG_CPU_ENV

    def __init__(self, model_path: str, *args, python: str, max_total_tokens: int = SGLANG_CPU_MAX_TOTAL_TOKENS,
                 startup_timeout: float = 240.0, **kwargs):
        super().__init__(model_path, *args, startup_timeout=startup_timeout, **kwargs)
        self.python, self.max_total_tokens = str(python), max_total_tokens

    def command(self) -> list[str]:
        cpu_args = sglang_cpu_args(self.max_total_tokens, lora="--enable-lora" in self.extra_args)
        return [self.python, "-m", "sglang.launch_server", "--model-path", self.model_path, "--host", self.host,
                "--port", str(self.port), *cpu_args, *self.extra_args]


class CommandServer(LocalServer):
    """A server whose whole command line is given (a run's server as its recipe says, from
    `slurm_plan.server_command`: what `open-r1-ext train` embeds), listening on `port` on this machine."""

    def __init__(self, command: list[str], name: str, model_path: str, port: int, env: Optional[dict] = None, **kwargs):
        super().__init__(model_path, port=port, **kwargs)
        self.words, self.name, self.env = list(command), name, dict(env or {})

    def command(self) -> list[str]:
        return self.words
