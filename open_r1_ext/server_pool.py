"""A pool of server replicas behind the client surface the trainer uses (`SGLangClient`'s), for generation that
scales past one server.

Replicas come from a static list of URLs and/or an address directory (`<run_dir>/replicas/<role>/<name>.addr`, one
`host:port` line each, written by a server job once healthy and removed when it stops), rescanned at most every
`RESCAN_INTERVAL` seconds. A batch is spread over the replicas by least outstanding tokens, the `n` samples of one
prompt on one replica (its prefix cache); a replica that fails within its short retry budget is dropped and its part
re-sent to the others; a joiner (or a dropped replica that answers again) is first brought to the pool's weights and
LoRA adapters. One `SGLangClient` per replica does the HTTP. No TRL here.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, TypeVar, Union

from open_r1_ext.protocol import Completion, is_partial
from open_r1_ext.sglang_client import (BUSY, DEFAULT_BACKOFF_FACTOR, DEFAULT_MAX_BATCH_TOKENS, DEFAULT_REQUEST_TIMEOUT,
                                       DEFAULT_SERVER_WAIT_TIMEOUT, DOWN, HEALTHY, AbortedRequestError, ServerError,
                                       ServerRequestError, SGLangClient)
from open_r1_ext.wait_progress import WaitProgress

if TYPE_CHECKING:
    import torch

    from open_r1_ext.named_tensors import AdapterTensors

    # where a LoRA adapter comes from: its directory (`/load_lora_adapter`), or its tensors
    # (`/load_lora_adapter_from_tensors`)
    AdapterSource = Union[str, AdapterTensors]

logger = logging.getLogger(__name__)
T = TypeVar("T")

# A replica's retry budget: 2 retries (urllib3's back-off of 0 and 1 s) then it is dropped and its work re-sent to
# the others; the pool as a whole waits for replicas up to its `wait_timeout` (the trainer's `server_wait_timeout`).
REPLICA_MAX_RETRIES = 2
RESCAN_INTERVAL = 2.0  # seconds between two scans of the address directory (and re-probes of dropped replicas)
MAX_ROUNDS = 20  # times a part of one batch is sent before the pool gives up on it
HEALTH_TIMEOUT = 2.0  # seconds a probe of a joiner's /health may take
ADDRESS_SUFFIX = ".addr"
JOINING, SERVING, DROPPED = "joining", "serving", "dropped"


class NoReplicaError(ServerError):
    """Fewer than `min_replicas` replicas served within the pool's wait; the message names the ones lost."""


class _Behind(ServerError):
    """A replica answered from other weights than the pool's: it is caught up and its part sent elsewhere."""


@dataclass(frozen=True)
class _Weights:
    """The pool's weights: its last successful `update_weights_from_disk` call, replayed to every joiner; or, with
    `path` None, weights the trainer pushed over the network (`begin_push`), which a joiner waits to be sent."""

    path: Optional[str]
    version: Optional[str]
    extra: dict = field(default_factory=dict)

    @property
    def pushed(self) -> bool:
        return self.path is None


class Replica:
    """One server of the pool: its client, state, confirmed weight version, loaded adapters and tokens in flight."""

    def __init__(self, name: str, url: str, client: SGLangClient):
        self.name, self.url, self.client = name, url, client
        self.state = JOINING
        self.version: Optional[str] = None  # the weight version it last confirmed
        self.adapters: dict[str, AdapterSource] = {}  # LoRA adapters it loaded: name -> where from
        self.outstanding = 0  # tokens of the requests in flight to it
        self.reason: Optional[str] = None  # why it was dropped
        self.behind = False  # answered without the weights the trainer pushed: waits to be sent them
        self.join: Optional[Future] = None
        self.lock = threading.Lock()  # one weight operation at a time

    def __str__(self) -> str:
        return self.url if self.name == self.url else f"{self.name} ({self.url})"


class ServerPool:
    """Several SGLang-protocol servers (SGLang or built-in) used as one client.

    Args:
        urls (`Sequence[str]`, *optional*): replicas given by URL (a static pool), each named by its URL.
        directory (`str` or `None`, *optional*): an address directory: each `<name>.addr` file (one `host:port` line)
            is a replica named `<name>` (e.g. its SLURM job id); a new file is a joiner, a removed one a leaver.
        route (`str`, *optional*, defaults to `""`): appended to each address read from `directory`, e.g. `/ref` for
            the built-in server's reference slot.
        min_replicas (`int`, *optional*, defaults to `1`): below this many serving replicas the pool waits for
            replicas to (re)join, up to `wait_timeout` seconds, then raises `NoReplicaError` naming the lost ones.
        wait_timeout (`float`, *optional*, defaults to `900.0`): see `min_replicas`.
        role (`str`, *optional*, defaults to `"generation"`): named in messages.
        replica_max_retries (`int`, *optional*, defaults to `2`): retries of a call to one replica (connection errors,
            5xx) before the replica is dropped.
        api_key, admin_api_key, request_timeout, max_batch_tokens, max_concurrency: each replica's `SGLangClient`
            settings.

    Examples:
        ```python
        >>> pool = ServerPool(["http://node-3:30000", "http://node-4:30000"])
        >>> pool.wait_until_healthy(timeout=600)
        >>> pool.generate([[1, 2, 3], [4, 5]], {"max_new_tokens": 4}, n=2, seeds=[0, 1, 2, 3])
        [[Completion(...), Completion(...)], [Completion(...), Completion(...)]]
        >>> pool.served_by()  # the replica that sampled each prompt's n completions
        ['http://node-3:30000', 'http://node-4:30000']
        >>> pool.update_weights_from_disk("/shared/run/weights/step-10", weight_version="10")
        {'success': True, 'message': '2 replica(s) loaded ...', 'replicas': {...: '10', ...: '10'}}
        >>> ServerPool(directory="/shared/run/replicas/server", min_replicas=2)  # replicas that come and go
        ```
    """

    def __init__(
        self,
        urls: Sequence[str] = (),
        directory: Optional[str] = None,
        route: str = "",
        min_replicas: int = 1,
        wait_timeout: float = DEFAULT_SERVER_WAIT_TIMEOUT,
        role: str = "generation",
        replica_max_retries: int = REPLICA_MAX_RETRIES,
        api_key: Optional[str] = None,
        admin_api_key: Optional[str] = None,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_concurrency: int = 8,
    ):
        if not urls and directory is None:
            raise ValueError("ServerPool: give replica URLs, an address directory, or both")
        if min_replicas < 1:
            raise ValueError(f"ServerPool: min_replicas={min_replicas}: must be >= 1")
        self.urls = [url.rstrip("/") for url in urls]
        self.directory = Path(directory) if directory is not None else None
        self.route = route
        self.min_replicas = min_replicas
        self.wait_timeout = wait_timeout
        self.role = role
        self._client_settings = dict(api_key=api_key, admin_api_key=admin_api_key, request_timeout=request_timeout,
                                     max_retries=replica_max_retries, backoff_factor=DEFAULT_BACKOFF_FACTOR,
                                     max_batch_tokens=max_batch_tokens, max_concurrency=max_concurrency)
        self._replicas: dict[str, Replica] = {}
        self._weights: Optional[_Weights] = None
        self._adapters: dict[str, AdapterSource] = {}  # the LoRA adapters every replica holds, in load order
        self._updating = 0  # weight operations in progress (replicas are then between two versions)
        self._lock = threading.RLock()
        self._scanned_at = -math.inf
        self._started = False
        self._jobs = ThreadPoolExecutor(max_workers=4, thread_name_prefix="open_r1_ext-pool")
        self._placement = threading.local()
        # called while the pool waits for replicas, when the trainer pushes weights: it may push them to the replicas
        # `behind()` from the waiting thread (the trainer decides whether it can, there and then)
        self.push_hook: Optional[Callable[[], None]] = None

    # ------------------------------------------------------------ membership
    @property
    def base_url(self) -> str:
        """A description for messages: `pool of 2 replicas (http://a:1, http://b:2)`."""
        with self._lock:
            live = [r.url for r in self._replicas.values() if r.state != DROPPED]
        where = f" from {self.directory}" if self.directory is not None else ""
        return f"pool of {len(live)} replica(s){where} ({', '.join(live) or 'none serving'})"

    def replicas(self) -> dict[str, str]:
        """Every replica the pool knows, by name: its state (`joining`, `serving`, `dropped`)."""
        with self._lock:
            return {r.name: r.state for r in self._replicas.values()}

    def replicas_at(self, version: Optional[str]) -> list[str]:
        """The serving replicas that confirmed weight version `version`."""
        with self._lock:
            return [r.name for r in self._replicas.values() if r.state == SERVING and r.version == version]

    def replicas_holding(self, lora_name: str) -> list[str]:
        """The serving replicas that loaded the LoRA adapter `lora_name`."""
        with self._lock:
            return [r.name for r in self._replicas.values() if r.state == SERVING and lora_name in r.adapters]

    def served_by(self) -> Optional[list[str]]:
        """The replica that sampled each prompt's completions in the last `generate` call of this thread."""
        return getattr(self._placement, "names", None)

    def _addresses(self) -> dict[str, str]:
        """`{name: url}`: the static URLs (named by themselves) and the address directory's files."""
        found = {url: url for url in self.urls}
        if self.directory is not None:
            found.update({name: url + self.route for name, url in read_addresses(self.directory).items()})
        return found

    def _refresh(self, force: bool = False) -> None:
        """Rescan the addresses (at most every `RESCAN_INTERVAL` s unless `force`): leavers go, joiners and dropped
        replicas are probed (in the background) and caught up; a serving replica on other weights is caught up."""
        now = time.monotonic()
        with self._lock:
            due = force or now - self._scanned_at >= RESCAN_INTERVAL
            if due:
                self._scanned_at = now
        started = []
        if due:
            found = self._addresses()
            with self._lock:
                for name, replica in list(self._replicas.items()):
                    if found.get(name) != replica.url:
                        del self._replicas[name]
                        logger.warning("%s replica %s left the pool (its address file is gone)", self.role, replica)
                for name, url in found.items():
                    if name not in self._replicas:
                        replica = Replica(name, url, SGLangClient(url, **self._client_settings))
                        self._replicas[name] = replica
                        started.append(self._start_join(replica))
                for replica in self._replicas.values():  # dropped or busy: probed again
                    if replica.state in (DROPPED, JOINING) and (replica.join is None or replica.join.done()):
                        self._start_join(replica)
        with self._lock:
            if not self._updating:
                for replica in self._replicas.values():
                    if replica.state == SERVING and not self._current(replica):
                        replica.state = JOINING
                        self._start_join(replica)
            first, self._started = not self._started, True
        if first and started:  # the pool's first look: every replica given is probed before any work is placed
            wait(started, timeout=HEALTH_TIMEOUT + 1.0)

    def _start_join(self, replica: Replica) -> Future:
        replica.join = self._jobs.submit(self._join, replica)
        return replica.join

    def _join(self, replica: Replica) -> None:
        """Probe `replica` and bring it to the pool's weights and adapters; then it serves. One that does not answer
        is dropped; one that is busy (SGLang's `/health` waits behind a long reload, e.g. another trainer process
        catching it up, then answers 503) stays in the pool, joining, and is probed again at the next rescan. One this
        pool paused is probed on `/model_info` (`SGLangClient.probe`; its `/health` would hang until the pool continues
        it, which it waits for) and caught up while paused (SGLang reloads at once then)."""
        found = replica.client.probe(timeout=HEALTH_TIMEOUT)
        if found != HEALTHY:
            with self._lock:
                if found == BUSY and replica.state != DROPPED:
                    replica.state, replica.reason = JOINING, "busy (/health did not answer 200: reloading or starting?)"
                elif replica.state != DROPPED:
                    replica.state, replica.reason, replica.behind = DROPPED, replica.reason or "does not answer /health", False
            return
        returning = replica.state == DROPPED
        try:
            self._catch_up(replica, returning)
        except ServerError as err:
            self._drop(replica, err)

    def _catch_up(self, replica: Replica, returning: bool) -> None:
        """Replay the pool's last weight update and its loaded adapters on `replica`, until they are the pool's.
        Weights the trainer pushed are not replayed: a replica without them stays joining until it is sent them."""
        while True:
            with self._lock:
                weights, adapters = self._weights, dict(self._adapters)
            if weights is not None and weights.pushed:
                reported = replica.client.weight_version()
                with self._lock:
                    replica.version = reported
                    if self._weights != weights or self._replicas.get(replica.name) is not replica:
                        continue
                    if reported != weights.version:
                        replica.state, replica.behind = JOINING, True
                        return
                    joined = replica.state != SERVING
                    replica.state, replica.reason, replica.behind = SERVING, None, False
                    serving = sum(r.state == SERVING for r in self._replicas.values())
                break
            with replica.lock:
                if weights is not None:
                    reported = replica.client.weight_version()
                    if weights.version is None or reported != weights.version:
                        replica.client.update_weights_from_disk(weights.path, weight_version=weights.version,
                                                                **weights.extra)
                        reported = replica.client.weight_version()
                    if weights.version is not None and reported != weights.version:
                        raise ServerRequestError(f"{replica.url} reports weight_version {reported!r} after loading "
                                                 f"{weights.path}, expected {weights.version!r}", 400)
                    replica.version = reported
                if returning:  # what it holds is unknown (restarted?): load the pool's adapters afresh
                    replica.adapters = {}
                for name in [n for n in replica.adapters if n not in adapters]:
                    replica.client.unload_lora_adapter(name)
                    del replica.adapters[name]
                for name, source in adapters.items():
                    if not _same_adapter(replica.adapters.get(name), source):
                        if returning or name in replica.adapters:
                            _ignore_refusal(replica.client.unload_lora_adapter, name)
                        load_adapter(replica.client, name, source)
                        replica.adapters[name] = source
            with self._lock:
                if self._replicas.get(replica.name) is not replica:
                    return  # it left the pool meanwhile
                if self._weights == weights and self._adapters == adapters:
                    joined = replica.state != SERVING
                    replica.state, replica.reason = SERVING, None
                    serving = sum(r.state == SERVING for r in self._replicas.values())
                    break
        if joined:
            at = "" if weights is None else f" at weight_version {replica.version}"
            logger.info("%s replica %s joined the pool%s: %d serving", self.role, replica, at, serving)

    def _current(self, replica: Replica) -> bool:
        """Whether `replica` holds the pool's weights and adapters (else it is not served from)."""
        weights = self._weights
        return ((weights is None or weights.version is None or replica.version == weights.version)
                and all(_same_adapter(replica.adapters.get(name), source) for name, source in self._adapters.items()))

    def _drop(self, replica: Replica, error: BaseException) -> None:
        with self._lock:
            if replica.state == DROPPED:
                return
            replica.state, replica.reason, replica.behind = DROPPED, _short(error), False
            serving = sum(r.state == SERVING for r in self._replicas.values())
        logger.warning("%s replica %s dropped from the pool: %s; %d serving (min_replicas %d)", self.role, replica,
                       replica.reason, serving, self.min_replicas)

    def _ready(self) -> list[Replica]:
        with self._lock:
            return [r for r in self._replicas.values() if r.state == SERVING and self._current(r)]

    def _serving(self, timeout: Optional[float] = None, progress: bool = True) -> list[Replica]:
        """The replicas work may go to now: at least `min_replicas`, waited for up to `timeout` (default the pool's
        `wait_timeout`) with a progress line, else `NoReplicaError` naming the replicas lost."""
        self._refresh()
        ready = self._ready()
        if len(ready) >= self.min_replicas:
            return ready
        timeout = self.wait_timeout if timeout is None else timeout
        start = time.monotonic()
        logger.warning("%s: %d of min_replicas %d serving; waiting up to %.0f s for replicas to (re)join%s", self.role,
                       len(ready), self.min_replicas, timeout, self._lost_text())
        where = [*self.urls, *([f"address files in {self.directory}"] if self.directory is not None else [])]
        with WaitProgress(f"{self.role} replicas ({', '.join(where)})", timeout, enabled=progress) as waiting:
            while len(ready) < self.min_replicas:
                if time.monotonic() - start > timeout:
                    raise NoReplicaError(
                        f"{self.role} servers: {len(ready)} of min_replicas {self.min_replicas} serving after waiting "
                        f"{timeout:.0f} s{self._lost_text()}. Start replacements (their address files go to "
                        f"{self.directory or 'the URLs given'}), or lower min_replicas.")
                if self.push_hook is not None:
                    self.push_hook()
                time.sleep(0.2)
                self._refresh()
                ready = self._ready()
                waiting.update(f"{len(ready)} of min_replicas {self.min_replicas} serving")
        return ready

    def _lost_text(self) -> str:
        with self._lock:
            lost = [f"{r}: {r.reason or r.state}" for r in self._replicas.values() if r.state != SERVING]
        if self.directory is not None and not self._replicas:
            return f"; no address file in {self.directory}"
        return f"; lost: {'; '.join(lost)}" if lost else ""

    # ------------------------------------------------------------ health
    def wait_until_healthy(self, timeout: float = 600.0, poll_interval: float = 1.0, progress: bool = True,
                           route: str = "/health") -> None:
        """Block until `min_replicas` replicas answer and hold the pool's weights; `NoReplicaError` after `timeout` s.
        (`poll_interval` and `route` are `SGLangClient`'s; the pool probes each replica's `/health`.)"""
        self._serving(timeout=timeout, progress=progress)

    def is_healthy(self, timeout: float = 5.0, route: str = "/health") -> bool:
        """Whether at least `min_replicas` replicas answer `route` now (one probe each, no waiting); one whose
        connection is refused or reset is gone: dropped. A replica this pool paused is asked `/model_info` instead of
        `/health` (`SGLangClient.probe`: SGLang's `/health` hangs while paused), so a pause is not taken for a loss."""
        self._refresh()
        found = self._each_ready(lambda client: client.probe(timeout=timeout, route=route))
        with self._lock:
            gone = [self._replicas[name] for name, state in found.items() if state == DOWN and name in self._replicas]
        for replica in gone:
            self._drop(replica, ServerError(f"{replica.url}: no connection (refused or reset)"))
        return sum(state == HEALTHY for state in found.values()) >= self.min_replicas

    def check_sampling(self, sampling: dict) -> None:
        """`SGLangClient.check_sampling` on every replica ready to serve: the first refusal raises."""
        self._serving()
        self._each_ready(lambda client: client.check_sampling(sampling))

    # ------------------------------------------------------------ metadata
    def model_info(self) -> dict:
        return self._any(lambda client: client.model_info())

    def server_info(self) -> dict:
        return self._any(lambda client: client.server_info())

    def sequence_limit(self) -> Optional[int]:
        """The smallest `sequence_limit` a serving replica reports (None: none reports one)."""
        self._serving()
        lengths = [n for n in self._each_ready(lambda client: client.sequence_limit()).values() if n is not None]
        return min(lengths) if lengths else None

    def weight_version(self) -> Optional[str]:
        """The weight version every serving replica reports (asked now; a replica that lost the pool's weights, e.g.
        restarted, is caught up and not served from until it holds them). Replicas that disagree before the pool
        loaded any weights: `"name: version, ..."`, which is no version (a caller's check then reloads)."""
        self._serving()
        reported = self._each_ready(lambda client: client.weight_version())
        with self._lock:
            for replica in self._replicas.values():
                if replica.name in reported:
                    replica.version = reported[replica.name]
        ready = self._serving()
        versions = {r.version for r in ready}
        if len(versions) == 1:
            return versions.pop()
        return ", ".join(f"{r.name}: {r.version}" for r in ready)

    # ------------------------------------------------------------ the work
    def generate(self, prompts: Sequence[Sequence[int]], sampling: dict, n: int = 1,
                 seeds: Optional[Sequence[int]] = None, lora_path: Optional[str] = None, keep_aborted: bool = False,
                 any_version: bool = False) -> list[list[Completion]]:
        """`SGLangClient.generate` over the pool: each prompt's `n` samples on one replica, the prompts spread by
        least outstanding tokens; `served_by()` then names the replica of each prompt. A replica that answers from
        other weights than the pool's is caught up and its part sent elsewhere, unless `any_version` (in-flight
        updates: a completion may span the weights of several syncs, and its caller judges each by its versions)."""
        prompts = [list(map(int, p)) for p in prompts]
        if seeds is not None and len(seeds) != len(prompts) * n:
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts) * n} samples")
        max_new = int(sampling.get("max_new_tokens", 128))

        def send(replica: Replica, part: list[int]) -> list[list[Completion]]:
            part_seeds = None if seeds is None else [seeds[i * n + k] for i in part for k in range(n)]
            groups = replica.client.generate([prompts[i] for i in part], sampling, n=n, seeds=part_seeds,
                                           lora_path=lora_path, keep_aborted=keep_aborted)
            weights = self._weights
            if any(is_partial(c.weight_version) for group in groups for c in group) or (
                    not any_version and weights is not None and weights.version is not None
                    and any(c.weight_version not in (None, weights.version) for group in groups for c in group)):
                raise _Behind(f"{replica.url} sampled from other weights than {weights.version if weights else 'its own'}")
            return groups

        groups, names = self._spread([(len(p) + max_new) * n for p in prompts], send)
        self._placement.names = names
        return groups

    def ref_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """`SGLangClient.ref_logprobs` over the pool, the sequences spread by least outstanding tokens."""
        sequences = [list(s) for s in sequences]
        scored, _ = self._spread([len(s) for s in sequences],
                                 lambda replica, part: replica.client.ref_logprobs([sequences[i] for i in part]))
        return scored

    def _spread(self, costs: list[int], send: Callable[[Replica, list[int]], list[T]]) -> tuple[list[T], list[str]]:
        """Run `send(replica, indices)` on parts of the work units (sized `costs`, in tokens), in parallel across
        the replicas; the parts of a replica that fails are sent again to the others. Results in input order, and
        the name of the replica that answered each unit."""
        results: list[Any] = [None] * len(costs)
        names: list[str] = [""] * len(costs)
        pending, rounds = list(range(len(costs))), 0
        while pending:
            rounds += 1
            if rounds > MAX_ROUNDS:  # replicas that keep failing or answering from other weights, never settling
                raise ServerError(f"{self.role} servers: {len(pending)} part(s) of a batch failed on every replica "
                                  f"tried, {MAX_ROUNDS} times{self._lost_text()}")
            plan = self._assign(pending, costs, self._serving())
            pending = []

            def run(replica: Replica, part: list[int]) -> list[T]:
                try:
                    return send(replica, part)
                finally:
                    with self._lock:
                        replica.outstanding -= sum(costs[i] for i in part)

            if len(plan) == 1:
                outcomes = [(replica, part, _outcome(run, replica, part)) for replica, part in plan]
            else:
                with ThreadPoolExecutor(max_workers=len(plan), thread_name_prefix="open_r1_ext-pool-send") as threads:
                    futures = [(replica, part, threads.submit(_outcome, run, replica, part)) for replica, part in plan]
                outcomes = [(replica, part, future.result()) for replica, part, future in futures]
            refusal = None
            for replica, part, (answer, error) in outcomes:
                if error is None:
                    for i, result in zip(part, answer):
                        results[i], names[i] = result, replica.name
                elif isinstance(error, (ServerRequestError, AbortedRequestError)):
                    refusal = refusal or error  # the request itself is wrong: no other replica would take it
                else:
                    if isinstance(error, _Behind):
                        logger.warning("%s replica %s: %s; catching it up, its part goes to the others", self.role,
                                       replica, error)
                        with self._lock:
                            if replica.state == SERVING:
                                replica.state = JOINING
                                self._start_join(replica)
                    else:
                        self._drop(replica, error)
                    pending += part
            if refusal is not None:
                raise refusal
        return results, names

    def _assign(self, units: list[int], costs: list[int], replicas: list[Replica]) -> list[tuple[Replica, list[int]]]:
        """Each unit (largest first) to the replica with the fewest outstanding tokens, counting what this call gave
        it; each replica's units in input order. Its outstanding tokens grow by its share until `send` returns."""
        shares: dict[str, list[int]] = {}
        with self._lock:
            load = {r.name: r.outstanding for r in replicas}
            for unit in sorted(units, key=lambda i: -costs[i]):
                name = min(load, key=lambda k: (load[k], k))
                load[name] += costs[unit]
                shares.setdefault(name, []).append(unit)
            by_name = {r.name: r for r in replicas}
            plan = [(by_name[name], sorted(part)) for name, part in shares.items()]
            for replica, part in plan:
                replica.outstanding += sum(costs[i] for i in part)
        return plan

    # ------------------------------------------------------------ weights and adapters
    def update_weights_from_disk(self, model_path: str, weight_version: Optional[str] = None, **extra: Any) -> dict:
        """Every serving replica loads `model_path` (in parallel) and confirms `weight_version`; a replica that does
        not answer is dropped (it catches up when it is back), one that refuses raises `ServerRequestError` naming it.
        The call is replayed to each replica that joins later."""

        def load(client: SGLangClient) -> Optional[str]:
            client.update_weights_from_disk(model_path, weight_version=weight_version, **extra)
            reported = client.weight_version()
            if weight_version is not None and reported != str(weight_version):
                raise ServerRequestError(f"{client.base_url} reports weight_version {reported!r} after loading "
                                         f"{model_path}, expected {weight_version!r}", 400)
            return reported

        confirmed = self._on_every_replica(load, lambda replica, version: setattr(replica, "version", version))
        with self._lock:
            self._weights = _Weights(str(model_path), None if weight_version is None else str(weight_version), extra)
        self._serving()  # replicas lost on the way: wait for them to come back (with these weights)
        return {"success": True, "message": f"{len(confirmed)} replica(s) loaded {model_path}", "replicas": confirmed}

    def pause_generation(self, mode: str = "retract") -> dict:
        """`SGLangClient.pause_generation` on every serving replica at once; one that does not answer is dropped (its
        requests in flight fail and are sent to the others)."""
        answers = self._on_every_replica(lambda client: client.pause_generation(mode), lambda replica, _: None)
        return {"message": f"{len(answers)} replica(s) paused ({mode})", "status": "ok", "replicas": sorted(answers)}

    def continue_generation(self) -> dict:
        """`SGLangClient.continue_generation` on every serving replica and every one this pool paused, whatever its
        state since (one caught up meanwhile, or dropped but alive, would stay paused for good otherwise), at once (a
        replica that was not paused: a no-op there); one that does not answer is dropped."""
        answers = self._on_every_replica(lambda client: client.continue_generation(), lambda replica, _: None,
                                         paused_too=True)
        return {"message": f"{len(answers)} replica(s) continued", "status": "ok", "replicas": sorted(answers)}

    def expect_weights(self, model_path: Optional[str], weight_version: Optional[str] = None, **extra: Any) -> None:
        """Take an update another process's pool made (the main trainer process's) as this pool's weights: no
        request is sent, but a replica not at `weight_version` is caught up (replaying it; `model_path` None: the
        weights were pushed, and it waits for them) before it serves here."""
        with self._lock:
            self._weights = _Weights(None if model_path is None else str(model_path),
                                     None if weight_version is None else str(weight_version), extra)

    # ------------------------------------------------------------ weights pushed over the network
    def begin_push(self, only: Optional[Sequence[str]] = None) -> dict[str, SGLangClient]:
        """For weights the caller sends itself (a broadcast, `weight_broadcast`): the replicas to send them to now,
        every serving or joining one (or those named in `only`), `{name: client}`. `end_push` must follow."""
        self._refresh()
        with self._lock:
            self._updating += 1
            return {r.name: r.client for r in self._replicas.values()
                    if r.state in (SERVING, JOINING) and (only is None or r.name in only)}

    def end_push(self, outcomes: dict[str, Optional[ServerError]], weight_version: str, whole: bool = True) -> dict:
        """Record what `begin_push` sent: a replica that took `weight_version` serves it; one that failed is dropped
        (it waits for the next push once it answers again), one that refused raises `ServerRequestError` naming
        it. `whole`: these are the pool's weights from now on (a sync), else a catch-up to the pool's version."""
        refused, confirmed = [], {}
        try:
            with self._lock:
                if whole:
                    self._weights = _Weights(None, str(weight_version))
                for name, error in outcomes.items():
                    replica = self._replicas.get(name)
                    if replica is not None and error is None:
                        replica.version, replica.state, replica.reason = str(weight_version), SERVING, None
                        replica.behind = False
                        confirmed[name] = str(weight_version)
            for name, error in outcomes.items():
                replica = self._replicas.get(name)
                if replica is None or error is None:
                    continue
                if isinstance(error, ServerRequestError):
                    refused.append((replica, error))
                self._drop(replica, error)
        finally:
            with self._lock:
                self._updating -= 1
        if refused:
            raise ServerRequestError(f"{len(refused)} of {len(outcomes)} {self.role} replica(s) refused: "
                                     + "; ".join(f"{r.name}: {e}" for r, e in refused), 400)
        return {"success": True, "message": f"{len(confirmed)} replica(s) took {weight_version}", "replicas": confirmed}

    def behind(self) -> list[str]:
        """The replicas that answer but wait for pushed weights (joiners, restarted or dropped replicas)."""
        self._refresh()
        with self._lock:
            if self._weights is None or not self._weights.pushed:
                return []
            return [r.name for r in self._replicas.values() if r.state == JOINING and r.behind]

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """Every serving replica loads the adapter (replayed to each replica that joins later)."""
        return self._load_everywhere(lora_name, lora_path)

    def load_lora_adapter_from_tensors(self, lora_name: str, adapter: AdapterTensors) -> dict:
        """Every serving replica loads the adapter sent as tensors (kept here, and sent again to each replica that
        joins later)."""
        return self._load_everywhere(lora_name, adapter)

    def _load_everywhere(self, lora_name: str, source: AdapterSource) -> dict:
        answers = self._on_every_replica(lambda client: load_adapter(client, lora_name, source),
                                         lambda replica, _: replica.adapters.__setitem__(lora_name, source))
        with self._lock:
            self._adapters[lora_name] = source
        return {"success": True, "message": f"{len(answers)} replica(s) loaded adapter {lora_name}", "replicas": answers}

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """Every serving replica unloads the adapter."""
        answers = self._on_every_replica(lambda client: client.unload_lora_adapter(lora_name),
                                         lambda replica, _: replica.adapters.pop(lora_name, None))
        with self._lock:
            self._adapters.pop(lora_name, None)
        return {"success": True, "message": f"{len(answers)} replica(s) unloaded adapter {lora_name}", "replicas": answers}

    def _on_every_replica(self, call: Callable[[SGLangClient], T], record: Callable[[Replica, T], None],
                          paused_too: bool = False) -> dict[str, T]:
        """`call` on every serving replica (`paused_too`: and every one this pool paused) at once, each under its lock
        and `record`ed there; replicas that do not answer are dropped; refusals raise one `ServerRequestError` naming
        each refusing replica."""
        self._serving()
        with self._lock:
            replicas = [r for r in self._replicas.values() if r.state == SERVING or (paused_too and r.client.paused)]
            self._updating += 1

        def one(replica: Replica) -> T:
            with replica.lock:
                answer = call(replica.client)
                record(replica, answer)
                return answer

        try:
            with ThreadPoolExecutor(max_workers=max(1, len(replicas)), thread_name_prefix="open_r1_ext-pool-load") as threads:
                outcomes = [(replica, threads.submit(_outcome, one, replica)) for replica in replicas]
            answers, refused = {}, []
            for replica, future in outcomes:
                answer, error = future.result()
                if error is None:
                    answers[replica.name] = answer
                elif isinstance(error, ServerRequestError):
                    refused.append((replica, error))
                else:
                    self._drop(replica, error)
        finally:
            with self._lock:
                self._updating -= 1
        if refused:
            first = refused[0][1]
            if len(refused) == len(replicas):  # the same request refused everywhere: its own error (and class)
                first.args = (f"every {self.role} replica refused ({', '.join(r.name for r, _ in refused)}): {first}",)
                raise first
            raise ServerRequestError(f"{len(refused)} of {len(replicas)} {self.role} replica(s) refused: "
                                     + "; ".join(f"{r.name}: {e}" for r, e in refused), first.status_code, first.detail)
        return answers

    # ------------------------------------------------------------ helpers
    def _any(self, call: Callable[[SGLangClient], T]) -> T:
        """`call` on one serving replica; one that does not answer is dropped and the next one asked."""
        while True:
            replica = self._serving()[0]
            try:
                return call(replica.client)
            except ServerRequestError:
                raise
            except ServerError as err:
                self._drop(replica, err)

    def _each_ready(self, call: Callable[[SGLangClient], T]) -> dict[str, T]:
        """`call` on every replica ready to serve, at once: `{name: answer}`; one that does not answer is dropped."""
        replicas = self._ready()
        with ThreadPoolExecutor(max_workers=max(1, len(replicas)), thread_name_prefix="open_r1_ext-pool-ask") as threads:
            outcomes = [(replica, threads.submit(_outcome, call, replica.client)) for replica in replicas]
        answers = {}
        for replica, future in outcomes:
            answer, error = future.result()
            if error is None:
                answers[replica.name] = answer
            elif isinstance(error, ServerRequestError):
                raise error
            else:
                self._drop(replica, error)
        return answers

    def close(self) -> None:
        """Stop the background probes (a pool is not used after this)."""
        self._jobs.shutdown(wait=False, cancel_futures=True)


def read_addresses(directory: Path) -> dict[str, str]:
    """`{name: URL}` of the replicas advertised in an address directory: each `<name>.addr` file's `host:port` line
    (the launchers' server jobs write them; `open-r1-ext status` and the trainer job read them too)."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    found = {}
    for entry in entries:
        if not entry.name.endswith(ADDRESS_SUFFIX) or entry.name.startswith("."):
            continue  # a temporary file of an atomic write
        try:
            address = Path(entry.path).read_text().strip()
        except OSError:  # removed between the listing and the read: a leaver
            continue
        if address:
            url = address if "://" in address else f"http://{address}"
            found[entry.name[: -len(ADDRESS_SUFFIX)]] = url.rstrip("/")
    return found


def _outcome(fn: Callable[..., T], *args: Any) -> tuple[Optional[T], Optional[ServerError]]:
    """`(fn(*args), None)`, or `(None, error)` for a `ServerError`: a replica's failure, judged by the caller."""
    try:
        return fn(*args), None
    except ServerError as err:
        return None, err


def _short(error: BaseException) -> str:
    """An error's first line, a connection error's cause alone (`... [Errno 111] Connection refused`), not urllib3's
    whole retry story."""
    text = str(error).splitlines()[0]
    cause = re.search(r"\[Errno -?\d+\] [^'\")]+", text)
    return f"{text.split(': ', 1)[0]}: {cause.group(0)}" if cause and "no answer" in text else text


def _same_adapter(held: Optional[AdapterSource], source: AdapterSource) -> bool:
    """Whether a replica holds the adapter `source`: the same directory, or the very tensors sent."""
    return held is source or (isinstance(source, str) and held == source)


def load_adapter(client: Union[SGLangClient, ServerPool], name: str, source: AdapterSource) -> dict:
    """Load the adapter `source` (a directory, or `AdapterTensors`) under `name` on one server (or every replica of a
    pool)."""
    if isinstance(source, str):
        return client.load_lora_adapter(name, source)
    return client.load_lora_adapter_from_tensors(name, source)


def _ignore_refusal(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except ServerRequestError:
        pass
