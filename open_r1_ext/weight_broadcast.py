"""Weight sync over the network: the trainer's main process broadcasts the policy to SGLang-protocol servers with
SGLang 0.5.23's distributed weight update (`/init_weights_update_group`, then per update `/begin_weight_update`,
one `/update_weights_from_distributed` per bucket, `/end_weight_update`), NCCL between GPUs, gloo otherwise. The
trainer's `weight_sync` feeds it the buckets of its one bucket walk (or, with in-flight updates, copies of them
`stage`d in host memory, broadcast from another thread); the built-in server forms its side of a group
with `weight_update_group` and unpacks buckets with `unflatten`. No TRL here.

Design (measured figures: docs/benchmarks.md, *Weight sync over the network*):
- Topology: one group per server (world size 1 + its TP size, the trainer rank 0), all held by one broadcaster
  process; each bucket goes to every server's group at once. A group spanning all replicas (one broadcast reaching
  every one) would have to be formed again, by every replica, whenever one joins, restarts or dies, and one dead
  member fails everyone's update; per-server groups keep a fault, a joiner or a restart to its own server, as the
  replica pool's rules want. On this CPU (gloo) the spanning group was no faster (1.00-1.65 × per-server groups, six
  runs of tools/bench_sync.py); what per-server groups give up is the trainer's upload at scale (N servers, N
  copies; NCCL pipelines one broadcast through a spanning group).
- Buckets: SGLang's `flattened_bucket`: a bucket's tensors (the dump's walk, `sync.bucket_mb`, one gathered at a
  time under ZeRO-3) copied back to back into one uint8 buffer, one broadcast each (half the time of a broadcast
  per tensor on SGLang). In a bucket the tensors go by element size, largest first, so that each starts aligned to
  its type (SGLang refuses an unaligned one).
- Bounded in time: the collectives run in a child process (`python -m open_r1_ext.weight_broadcast`) that holds the
  groups and broadcasts from a buffer it shares with the trainer (a shared-memory file on CPU, a CUDA IPC buffer on
  a GPU). Its groups time out after `timeout_s`, and every request to it has a deadline (`timeout_s` +
  `DEADLINE_MARGIN_S`): past it the trainer kills it, and its groups with it (an NCCL collective cannot be
  interrupted in-process; a killed peer's sockets close, which ends a server's receive at once). HTTP calls have the
  same bound and are never retried (an update without its broadcast means nothing). A killed trainer takes the
  child with it (PR_SET_PDEATHSIG), so a server never waits on a client that is gone.
- Faults: a server that dies or stalls fails its own group (its error names it) and the others go on; a trainer
  that dies leaves the server on its old weights with its session open: the next `prepare` of that server closes
  the session, destroys the group and forms a new one (also after a restart, seen by its weight version); a group
  that cannot form (an address the server cannot reach, a closed port) ends in `timeout_s` with a message naming
  the address (an address that is not this machine's is refused before the server is asked); `dp_size > 1` is
  refused before anything is sent (SGLang asserts on it: HTTP 500).
- Versions: every bucket but the last is sent with `weight_version: "<N>-partial"`, the last with `N`. A server
  whose update stopped half-way holds mixed weights and says so: `N-partial` is no step number, so nothing samples
  from it until a whole update reaches it.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional, Sequence
from urllib.parse import urlsplit

import torch

from open_r1_ext.protocol import DEFAULT_WEIGHT_VERSION, is_partial, partial_version
from open_r1_ext.sglang_client import ServerError, ServerRequestError, SGLangClient

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0  # `sync.distributed_timeout`: a group's formation, one bucket's broadcast, an HTTP call
DEADLINE_MARGIN_S = 10.0  # beyond a collective's own timeout, before the trainer kills the broadcaster
BACKENDS = ("auto", "gloo", "nccl")
GROUP_PREFIX = "open_r1_ext:"


class WeightBroadcastError(ServerError):
    """A distributed weight update could not be made; the message names the server(s) and the cause."""


def group_name_for(url: str) -> str:
    """The name of the trainer's group with the server at `url`: stable across trainer restarts, so that a new trainer
    destroys the group a dead one left on the server before forming its own."""
    return GROUP_PREFIX + url.split("://", 1)[-1].rstrip("/")


def weight_update_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                        backend: str, timeout_s: float, store: Optional[torch.distributed.Store] = None):
    """A torch.distributed process group outside the default one, formed as SGLang forms its side
    (`sglang/srt/utils/common.py` `init_custom_process_group` ~2859: a TCP rendezvous at `master_address:master_port`,
    its store prefixed by `group_name`), so that SGLang, the built-in server and the trainer meet. Rank 0 (the
    trainer) passes the `store` it hosts; the others connect to it."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store, rank, world_size = next(rendezvous(f"tcp://{_host(master_address)}:{master_port}", rank, world_size,
                                                  timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_group(group) -> None:
    """Forget a group formed by `weight_update_group` (its name can be used again)."""
    torch.distributed.destroy_process_group(group)


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


# ------------------------------------------------------------------------------------------------ buckets
@dataclass(frozen=True)
class BucketLayout:
    """A bucket's tensors in the order they lie in the flat buffer (largest element size first: each aligned)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    nbytes: int


def layout_of(tensors: dict[str, torch.Tensor]) -> BucketLayout:
    names = sorted(tensors, key=lambda n: -tensors[n].element_size())  # stable: the walk's order within a size
    offsets, offset = [], 0
    for name in names:
        offsets.append(offset)
        offset += tensors[name].numel() * tensors[name].element_size()
    return BucketLayout(names, [dtype_name(tensors[n].dtype) for n in names], [list(tensors[n].shape) for n in names],
                        offsets, offset)


def flatten_into(buffer: torch.Tensor, tensors: dict[str, torch.Tensor], layout: BucketLayout) -> None:
    """Copy the tensors into `buffer` (uint8) at their offsets."""
    for name, offset in zip(layout.names, layout.offsets):
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        buffer[offset : offset + size].view(tensor.dtype).view(tensor.shape).copy_(tensor)


@dataclass(frozen=True)
class StagedBucket:
    """A bucket flattened into memory of its own (`stage`), to be broadcast later (`WeightUpdate.send_staged`)."""

    layout: BucketLayout
    flat: torch.Tensor  # uint8, CPU


def stage(tensors: dict[str, torch.Tensor]) -> StagedBucket:
    """A copy of a bucket's tensors, flattened into host memory as a broadcast lays them out."""
    layout = layout_of(tensors)
    flat = torch.empty(layout.nbytes, dtype=torch.uint8)
    flatten_into(flat, tensors, layout)
    return StagedBucket(layout, flat)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """`"bfloat16"` -> `torch.bfloat16`; `ValueError` for a name that is no torch dtype."""
    dtype = getattr(torch, name, None) if name.isidentifier() and not name.startswith("_") else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype")
    return dtype


def empty_bucket(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], device: torch.device,
                 reuse: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """The uint8 buffer a flattened bucket is received into (`reuse` when it is large enough and on `device`), and each
    tensor as a view of it (as SGLang's `FlattenedTensorBucket.empty`, with its checks: no negative dimension, each
    tensor aligned to its type)."""
    views, offset = [], 0
    for name, dtype_text, shape in zip(names, dtypes, shapes):
        dtype = torch_dtype(dtype_text)
        if any(dim < 0 for dim in shape):
            raise ValueError(f"Negative dimension in received tensor {name}: {list(shape)}")
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        size = int(torch.Size(shape).numel()) * dtype.itemsize
        views.append((name, offset, size, dtype, list(shape)))
        offset += size
    fits = reuse is not None and reuse.numel() >= offset and reuse.device == torch.device(device)
    buffer = reuse if fits else torch.empty(offset, dtype=torch.uint8, device=device)
    return buffer, [(name, buffer[start : start + size].view(dtype).view(shape)) for name, start, size, dtype, shape in views]


# ------------------------------------------------------------------------------------ the broadcaster process
class Broadcaster:
    """The child process that holds the trainer's groups and broadcasts a shared buffer over them; every call has a
    deadline, past which the child is killed (`WeightBroadcastError`, all groups gone). Thread-safe: one call at a
    time."""

    def __init__(self, device: torch.device, timeout_s: float):
        self.device, self.timeout_s = device, timeout_s
        self.process: Optional[subprocess.Popen] = None
        self.buffer: Optional[torch.Tensor] = None
        self.groups: set[str] = set()
        self.lock = threading.RLock()
        self._send: Optional[Connection] = None
        self._recv: Optional[Connection] = None

    def _start(self) -> None:
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        on_main_thread = threading.current_thread() is threading.main_thread()
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "open_r1_ext.weight_broadcast", str(to_child), str(from_child)],
            pass_fds=(to_child, from_child), stdin=subprocess.DEVNULL, env=env,
            preexec_fn=_die_with_parent if on_main_thread else None)
        os.close(to_child)
        os.close(from_child)
        self._send, self._recv = Connection(from_parent, readable=False), Connection(to_parent, writable=False)
        self.buffer, self.groups = None, set()

    def start(self) -> None:
        """Start the child process unless it runs (every call does)."""
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                self._start()

    def call(self, *message: Any, deadline_s: Optional[float] = None) -> Any:
        """Send `message`, return the child's answer (raising its error as `WeightBroadcastError`)."""
        with self.lock:
            self.start()
            self._send.send(message)
            return self.answer(message[0], deadline_s)

    def answer(self, what: str, deadline_s: Optional[float] = None, abort: Optional[Callable[[], str]] = None) -> Any:
        """The child's next answer, within the deadline; `abort()` (polled) returning a message gives up at once."""
        limit = self.timeout_s + DEADLINE_MARGIN_S if deadline_s is None else deadline_s
        end = time.monotonic() + limit
        try:
            while not (ready := self._recv.poll(min(0.2, max(0.0, end - time.monotonic())))):
                if time.monotonic() >= end or (abort is not None and abort()):
                    break
            reply = self._recv.recv() if ready else None
        except (EOFError, OSError):
            code = self.process.wait()
            self.process, self.buffer, self.groups = None, None, set()
            raise WeightBroadcastError(f"the weight broadcaster process died (exit code {code}) during {what}") from None
        if reply is None:
            self.kill()
            raise WeightBroadcastError(f"the weight broadcaster did not finish {what} within {limit:.0f} s "
                                       "(sync.distributed_timeout + margin): killed it, with its groups")
        status, value = reply
        if status == "error":
            raise WeightBroadcastError(value)
        return value

    def ensure_buffer(self, nbytes: int) -> torch.Tensor:
        """The shared buffer, at least `nbytes` long (a new one is handed to the child when it is smaller)."""
        with self.lock:
            self.start()
            if self.buffer is None or self.buffer.numel() < nbytes:
                size = max(nbytes, 1 << 20)
                self.buffer = None
                if self.device.type == "cpu":
                    self.buffer = self._shared_file_buffer(size)
                else:
                    import torch.multiprocessing  # noqa: F401 - the reductions that send a CUDA tensor as an IPC handle

                    self.buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
                    self.call("buffer", ("tensor", self.buffer, None))
            return self.buffer

    def _shared_file_buffer(self, size: int) -> torch.Tensor:
        """A buffer both processes map: a file in /dev/shm (else the temporary directory), removed once both did."""
        where = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix="open_r1_ext-weights-", dir=where)
        try:
            os.ftruncate(fd, size)
            buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            self.call("buffer", ("file", path, size))
        finally:
            os.close(fd)
            os.unlink(path)
        return buffer

    def kill(self) -> None:
        with self.lock:
            if self.process is not None and self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self.process, self.buffer, self.groups = None, None, set()

    def close(self) -> None:
        with self.lock:
            if self.process is not None and self.process.poll() is None:
                self._send.close()
                try:
                    self.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            self.process, self.buffer, self.groups = None, None, set()


def _die_with_parent() -> None:
    """In the child between fork and exec: SIGKILL when the trainer's main thread ends (PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def _child_main(read_fd: int, write_fd: int) -> None:
    """The broadcaster: answers the parent's messages until its pipe closes. Messages: `("buffer", spec)`, `("form",
    name, port, world_size, backend, timeout_s, device)` (answers the port it listens on, then the outcome),
    `("broadcast", names, nbytes)` (answers `{name: error or None}`), `("drop", name)`."""
    import torch.multiprocessing  # noqa: F401 - registers the reductions a CUDA buffer arrives through

    receive, send = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    groups: dict[str, Any] = {}
    buffer: Optional[torch.Tensor] = None
    while True:
        try:
            message = receive.recv()
        except (EOFError, OSError):
            return
        op = message[0]
        try:
            if op == "buffer":
                kind, value, size = message[1]
                buffer = torch.from_file(value, shared=True, size=size, dtype=torch.uint8) if kind == "file" else value
                send.send(("ok", None))
            elif op == "form":
                _, name, port, world_size, backend, timeout_s, device = message
                if name in groups:
                    destroy_group(groups.pop(name))
                if device is not None:
                    torch.cuda.set_device(device)
                timeout = datetime.timedelta(seconds=timeout_s)
                store = torch.distributed.TCPStore("0.0.0.0", port, world_size, is_master=True, timeout=timeout,
                                                   wait_for_workers=False)
                send.send(("ok", store.port))
                groups[name] = weight_update_group("", store.port, 0, world_size, name, backend, timeout_s, store=store)
                send.send(("ok", None))
            elif op == "broadcast":
                _, names, nbytes = message
                view = buffer[:nbytes]
                works, errors = {}, {}
                for name in names:
                    try:
                        works[name] = torch.distributed.broadcast(view, src=0, group=groups[name], async_op=True)
                    except Exception as err:  # noqa: BLE001 - reported per group
                        errors[name] = f"{type(err).__name__}: {err}"
                for name, work in works.items():
                    try:
                        work.wait()
                    except Exception as err:  # noqa: BLE001
                        errors[name] = f"{type(err).__name__}: {err}"
                if view.is_cuda:
                    torch.cuda.current_stream().synchronize()  # the buffer may be refilled once we answer
                for name in errors:  # a group that failed once is not used again
                    groups.pop(name, None)
                send.send(("ok", {name: errors.get(name) for name in names}))
            elif op == "drop":
                group = groups.pop(message[1], None)
                if group is not None:
                    destroy_group(group)
                send.send(("ok", None))
            else:
                send.send(("error", f"unknown message {op!r}"))
        except Exception as err:  # noqa: BLE001 - the parent gets the error and names the server
            try:
                send.send(("error", f"{type(err).__name__}: {err}"))
            except OSError:
                return


# ------------------------------------------------------------------------------------------- the servers
@dataclass
class _Server:
    """What the trainer knows of one server's side of the transport."""

    client: SGLangClient
    group_name: str
    tp_size: int = 1
    version: Optional[str] = None  # what this transport's last whole update made it report


class WeightBroadcast:
    """Sends the policy to servers over torch.distributed; the trainer's main process holds one.

    Args:
        backend (`str`): `"gloo"` or `"nccl"` (`resolve_backend` turns `"auto"` into one of them).
        device (`torch.device`): where the shared buffer lives (a CUDA device for NCCL, the CPU for gloo).
        timeout_s (`float`, *optional*, defaults to `300.0`): bound of a group's formation, of each bucket's
            broadcast and of each HTTP call.
        master_address (`str` or `None`, *optional*): the address the servers reach this process at; default: the
            address of the interface this machine reaches each server through.
        port (`int`, *optional*, defaults to `0`): the first port the groups listen on (one per server); 0 takes
            free ports.

    Example:
        ```python
        >>> sender = WeightBroadcast("gloo", torch.device("cpu"))
        >>> update = sender.update([SGLangClient("http://node-3:30000")], version="12", buckets=2)
        >>> for index, tensors in enumerate(buckets_of_the_policy):   # dicts of CPU tensors
        ...     update.send(index, tensors)
        >>> update.finish()
        {'http://node-3:30000': None}
        ```
    """

    def __init__(self, backend: str, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S,
                 master_address: Optional[str] = None, port: int = 0):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r}: gloo or nccl")
        self.backend, self.timeout_s = backend, timeout_s
        self.master_address, self.port = master_address, port
        self.broadcaster = Broadcaster(device, timeout_s)
        self.servers: dict[str, _Server] = {}
        self._ports_used: set[int] = set()

    def update(self, clients: Sequence[SGLangClient], version: str, buckets: int) -> "WeightUpdate":
        """Open an update of `clients` to `version`, sent in `buckets` buckets (see `WeightUpdate`)."""
        return WeightUpdate(self, clients, version, buckets)

    def close(self) -> None:
        self.broadcaster.close()

    # ---------------------------------------------------------------- one server
    def prepare(self, client: SGLangClient) -> _Server:
        """Make `client`'s server ready for an update: its group formed (again, if the server restarted or a
        previous update failed), its session open."""
        server = self.servers.get(client.base_url)
        if server is None:
            server = self.servers[client.base_url] = _Server(client, group_name_for(client.base_url))
            info = client.server_info()
            dp_size, server.tp_size = int(info.get("dp_size") or 1), int(info.get("tp_size") or 1)
            if dp_size > 1:
                del self.servers[client.base_url]
                raise ServerRequestError(
                    f"{client.base_url} runs dp_size {dp_size}: SGLang refuses distributed weight updates with data "
                    "parallelism; set sync.transport: disk, or serve with dp_size 1 (replicas: N for more servers)", 400)
        if server.group_name not in self.broadcaster.groups or _lost_group(client.weight_version(), server.version):
            self._form(server)  # (a killed broadcaster took every group with it)
        answer = self._post(server, "/begin_weight_update", {})
        if not answer.get("success"):
            if "already open" not in str(answer.get("message")):
                raise ServerRequestError(f"{client.base_url}/begin_weight_update: {answer.get('message')}", 400)
            self._post(server, "/end_weight_update", {})  # a session a dead trainer left open
            answer = self._post(server, "/begin_weight_update", {})
            if not answer.get("success"):
                raise ServerRequestError(f"{client.base_url}/begin_weight_update: {answer.get('message')}", 400)
        return server

    def _form(self, server: _Server) -> None:
        """Form the group with `server` (after closing what a dead trainer may have left on it)."""
        from open_r1_ext.protocol import init_weights_update_group_request

        client = server.client
        self._post(server, "/end_weight_update", {})  # a session left open: closed (else 400, ignored)
        self._post(server, "/destroy_weights_update_group", {"group_name": server.group_name})  # likewise
        address = self.master_address or address_towards(client.base_url)
        _check_local(address)
        world_size = 1 + server.tp_size
        device = self.broadcaster.device.index if self.broadcaster.device.type == "cuda" else None
        self.drop(server)
        with self.broadcaster.lock:
            port = self.broadcaster.call("form", server.group_name, self._next_port(), world_size, self.backend,
                                         self.timeout_s, device, deadline_s=30.0)
            try:
                body = init_weights_update_group_request(address, port, 1, world_size, server.group_name, self.backend)
                thread = ThreadPoolExecutor(1, thread_name_prefix="open_r1_ext-init-group")
                answer = thread.submit(self._post, server, "/init_weights_update_group", body)
                thread.shutdown(wait=False)  # a server that never answers is not waited for past the deadline
                try:
                    self.broadcaster.answer("forming the group", abort=lambda: _refusal(answer))
                except WeightBroadcastError as err:
                    raise WeightBroadcastError(
                        f"could not form the weight-update group with {client.base_url} at {address}:{port} "
                        f"({self.backend}, sync.distributed_timeout {self.timeout_s:.0f} s): {_refusal(answer) or err}. "
                        "The server must reach this address and port (sync.distributed_master_address, "
                        "sync.distributed_port; a firewall?)") from None
                reply = _answer(answer, self.timeout_s + DEADLINE_MARGIN_S)
                if not reply.get("success"):
                    raise WeightBroadcastError(f"{client.base_url} could not join the weight-update group at "
                                               f"{address}:{port}: {reply.get('message')}")
            except BaseException:
                self.broadcaster.kill()  # its rendezvous may still wait (every group goes: formed again when used)
                raise
        self.broadcaster.groups.add(server.group_name)
        server.version = None
        logger.info("weight-update group with %s formed (%s, %s:%d)", client.base_url, self.backend, address, port)

    def _next_port(self) -> int:
        if not self.port:
            return 0
        port = self.port
        while port in self._ports_used:
            port += 1
        self._ports_used.add(port)
        return port

    def _post(self, server: _Server, route: str, body: dict) -> dict:
        """POST without retries, bounded by the timeout: `{success, message}` (a 400 is an answer too)."""
        return server.client.post_once(route, body, timeout=self.timeout_s + DEADLINE_MARGIN_S)

    def drop(self, server: _Server) -> None:
        """After a failure involving `server`: its group is formed again before its next update."""
        if server.group_name in self.broadcaster.groups:
            self.broadcaster.groups.discard(server.group_name)
            if self.broadcaster.process is not None:
                try:
                    self.broadcaster.call("drop", server.group_name, deadline_s=10.0)
                except WeightBroadcastError as err:
                    logger.warning("weight broadcaster: dropping the group of %s: %s", server.client.base_url, err)


class WeightUpdate:
    """One update of several servers to one weight version: `send(index, tensors)` per bucket, then `finish()`. A
    server that fails on the way is left out of the rest (its error kept); the others go on."""

    def __init__(self, sender: WeightBroadcast, clients: Sequence[SGLangClient], version: str, buckets: int):
        self.sender, self.version, self.buckets = sender, str(version), buckets
        self.live: dict[str, _Server] = {}
        self.failed: dict[str, ServerError] = {}
        self._threads = ThreadPoolExecutor(max_workers=max(1, len(clients)), thread_name_prefix="open_r1_ext-bcast")
        for _ in range(2):  # a failed formation kills the broadcaster: those prepared before it are prepared again
            for client in clients:
                if client.base_url in self.failed or (client.base_url in self.live and self._ready(client.base_url)):
                    continue
                try:
                    self.live[client.base_url] = sender.prepare(client)
                except ServerError as err:
                    self._fail(client.base_url, err, sender.servers.get(client.base_url))
        for url in [url for url in self.live if not self._ready(url)]:
            self._fail(url, WeightBroadcastError("its group was lost while others were formed"), self.live[url])

    def _ready(self, url: str) -> bool:
        return self.live[url].group_name in self.sender.broadcaster.groups

    def _fail(self, url: str, error: ServerError, server: Optional[_Server]) -> None:
        self.live.pop(url, None)
        self.failed[url] = error if isinstance(error, ServerRequestError) else WeightBroadcastError(
            f"{url}: the weight update to {self.version} failed: {error}")
        if server is not None:
            self.sender.drop(server)
        logger.warning("weight update to %s: %s", self.version, self.failed[url])

    def send(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        """Broadcast bucket `index` (of `buckets`) to every server still in the update."""
        if tensors:
            layout = layout_of(tensors)
            self.send_flat(index, layout, lambda buffer: flatten_into(buffer, tensors, layout))

    def send_staged(self, index: int, bucket: StagedBucket) -> None:
        """`send` of a bucket flattened beforehand (`stage`)."""
        self.send_flat(index, bucket.layout, lambda buffer: buffer[: bucket.layout.nbytes].copy_(bucket.flat))

    def send_flat(self, index: int, layout: BucketLayout, fill: Callable[[torch.Tensor], None]) -> None:
        """Broadcast bucket `index`, laid out as `layout` and written into the shared buffer by `fill`."""
        from open_r1_ext.protocol import update_weights_from_distributed_request

        if not self.live:
            return
        sender, last = self.sender, index == self.buckets - 1
        with sender.broadcaster.lock:
            try:
                buffer = sender.broadcaster.ensure_buffer(layout.nbytes)
            except WeightBroadcastError as err:
                for url, server in list(self.live.items()):
                    self._fail(url, err, server)
                return
            fill(buffer)
            if buffer.is_cuda:
                torch.cuda.current_stream().synchronize()
            version = self.version if last else partial_version(self.version)
            answers: dict[str, Future] = {}
            for url, server in self.live.items():
                body = update_weights_from_distributed_request(layout.names, layout.dtypes, layout.shapes,
                                                               server.group_name, version, flush_cache=last)
                answers[url] = self._threads.submit(sender._post, server, "/update_weights_from_distributed", body)
            groups = {server.group_name: url for url, server in self.live.items()}
            try:
                outcome = sender.broadcaster.call("broadcast", list(groups), layout.nbytes)
            except WeightBroadcastError as err:
                outcome = {name: str(err) for name in groups}
            for name, url in groups.items():
                server, error = self.live[url], outcome.get(name)
                reply = _answer(answers[url], sender.timeout_s + 2 * DEADLINE_MARGIN_S)
                if error is None and not reply.get("success"):
                    error = f"the server answered: {reply.get('message')}"
                elif error is not None and reply.get("message"):
                    error = f"{error} (the server answered: {reply.get('message')})"
                if error is not None:
                    self._fail(url, WeightBroadcastError(f"bucket {index + 1}/{self.buckets}: {error}"), server)

    def finish(self) -> dict[str, Optional[ServerError]]:
        """Close each server's session; `{url: None}` for those that took the whole update, the error for others."""
        for url, server in list(self.live.items()):
            answer = self.sender._post(server, "/end_weight_update", {})
            if answer.get("success"):
                server.version = self.version
            else:
                self._fail(url, WeightBroadcastError(f"/end_weight_update: {answer.get('message')}"), server)
        self._threads.shutdown(wait=False)
        return {**{url: None for url in self.live}, **self.failed}


def _answer(future: Future, timeout: float) -> dict:
    """An HTTP answer from a thread: the server's `{success, message}`, or one that says why there was none."""
    try:
        return future.result(timeout=timeout)
    except ServerError as err:
        return {"success": False, "message": str(err)}
    except Exception as err:  # noqa: BLE001 - a timeout of the wait itself
        return {"success": False, "message": f"no answer: {type(err).__name__} {err}"}


def _refusal(future: Future) -> str:
    """What a server answered to a group formation it could not join (empty while it has not answered, or joined)."""
    if not future.done():
        return ""
    reply = _answer(future, 0)
    return "" if reply.get("success") else str(reply.get("message"))


def _lost_group(reported: Optional[str], sent: Optional[str]) -> bool:
    """Whether a server's weight version says it no longer holds the group the trainer formed with it: it restarted
    (its start-up version) or an update stopped half-way. (Weights another client loaded leave the group alone; a
    restart with a `--weight-version` of its own fails its next broadcast at once, and the group is formed again.)"""
    return reported != sent and (reported in (None, DEFAULT_WEIGHT_VERSION) or is_partial(reported))


def address_towards(url: str) -> str:
    """The address of this machine's interface that reaches the host of `url` (what that host sees us as)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family[0], socket.SOCK_DGRAM) as probe:
            probe.connect(family[4])  # UDP: no packet is sent, the kernel picks the route
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _check_local(address: str) -> None:
    """`address` must lead to this machine (the groups listen on every interface): checked with a listening socket
    of our own before a server is asked to connect there."""
    try:
        with socket.create_server(("", 0)) as listener:
            socket.create_connection((address, listener.getsockname()[1]), timeout=5.0).close()
    except OSError as err:
        raise WeightBroadcastError(
            f"sync.distributed_master_address {address}: not an address of this machine ({err}); give one that the "
            "servers can reach") from None


def resolve_backend(backend: str, trainer_device: torch.device, server_devices: Sequence[Optional[str]]) -> str:
    """`"auto"`: NCCL when the trainer is on a CUDA device and no server says it runs elsewhere, else gloo."""
    if backend != "auto":
        return backend
    on_gpus = trainer_device.type == "cuda" and all(d is None or str(d).startswith("cuda") for d in server_devices)
    return "nccl" if on_gpus else "gloo"


if __name__ == "__main__":
    _child_main(int(sys.argv[1]), int(sys.argv[2]))
