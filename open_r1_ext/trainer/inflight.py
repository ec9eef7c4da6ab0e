"""In-flight weight updates (`in_flight_updates`): generation that never waits for a weight sync.

`InFlightGeneration` keeps up to `max_prompts_in_flight` prompts per trainer process read from the data and not yet
trained, each prompt's group of `num_generations` completions one request to the generation servers, and hands TRL's
training loop (`batches()`, read by `get_batch_samples`) the groups in the order they complete. A weight sync pauses
every server (`/pause_generation` mode `retract`), gives it the new weights and continues: the completions under way go
on with them. With dumps the main process's update thread pauses, reloads and continues; with `transport: distributed`
the broadcast is sent at the sync, the servers paused around it. A group's staleness counts from its oldest token; a
group too stale for the step that would take it, or with tokens from an update that stopped half-way (`<N>-partial`),
is dropped and its prompt sent again. The groups read but not trained at a checkpoint are saved with it (`save_state`)
and drawn again on resume (`resume_from`). With `dynamic_sampling`, refill groups (prompts it draws, not the data's)
are kept in flight beside them for its extra rounds (`keep_refills`, `refill_batch`).

With adapter-only LoRA sync a request samples with the adapter it named (`lora_path`) to its end: SGLang resolves the
name to an adapter once, when it receives the request, and a retracted request keeps it. So a sync loads the new
adapter under a new name (`policy-v<N>`), aborts every request under way (`/pause_generation` mode `abort`, then
continue), and each completion aborted is sent again from its tokens so far (appended to its prompt, its budget less
those) under the new adapter. Its tokens keep the version of the adapter that sampled them (`weight_versions` spans),
so staleness counts as with full weights: from a group's oldest token, never the version it ended with. Letting the old
requests finish under the old adapter instead would leave a long completion a whole completion behind (dropped as too
stale over and over) for the same compute: an abort costs what a retract does, the prompt and tokens so far
prefilled again with the new weights. The newest two adapters stay loaded (`adapters_in_use`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from accelerate.utils import gather_object

from open_r1_ext.protocol import Completion, is_partial
from open_r1_ext.server_pool import ServerPool
from open_r1_ext.sglang_client import ABORT_RETRIES, AbortedRequestError, ServerError
from open_r1_ext.trainer.generation import (AsyncRemoteGeneration, RemoteGeneration, batch_groups, prompts_in_flight,
                                            prompts_key, refills_in_flight, sampling_seeds, version_number)
from open_r1_ext.trainer.weight_sync import WeightSyncError

logger = logging.getLogger(__name__)
PAUSE_MODE = "retract"  # SGLang's mode that keeps the requests under way and recomputes their KV with the new weights
STATE_FILE = "in_flight_rollouts_rank{rank}.pt"  # in a checkpoint: the groups read and not trained, per process


@dataclass(eq=False)
class Group:
    """One prompt's group: where the sampler put it (`epoch`, generation batch `batch` of the epoch, `index` in it),
    its rows as the data loader gave them (the example, `num_generations` times), its prompt's token ids and sampling
    settings, how often it was sent, and once sampled its completions and the replica that sampled them (or the
    error)."""

    epoch: int
    batch: int
    index: int
    rows: list
    prompt_ids: list[int]
    sampling: dict
    attempt: int = 0
    sent_at: int = 0  # the version the servers were confirmed at when it was sent
    completions: Optional[list[Completion]] = None
    replica: Optional[str] = None
    error: Optional[BaseException] = None

    @property
    def position(self) -> tuple[int, int]:
        return self.batch, self.index

    def versions(self) -> list[int]:
        """The weight versions (step numbers) its tokens were drawn with, oldest first."""
        return sorted({version_number(v) for c in self.completions or () for v in c.versions})

    def partial(self) -> bool:
        """Whether some of its tokens were drawn from weights an update reached only in part (`<N>-partial`)."""
        return any(is_partial(v) for c in self.completions or () for v in c.versions)


class InFlightGeneration(AsyncRemoteGeneration):
    """Generation with in-flight weight updates (see the module docstring and `RemoteGRPOConfig.in_flight_updates`).

    Its rollout queue (`AsyncRemoteGeneration.rollouts`, one thread) runs the weight updates in order; a pool of sender
    threads runs one request per group."""

    def __init__(self, trainer, client, weight_sync):
        super().__init__(trainer, client, weight_sync)
        args = trainer.args
        self.groups_per_batch = batch_groups(args)
        self.bound = prompts_in_flight(args)
        self.period = args.steps_per_generation * args.num_iterations
        self._senders: Optional[ThreadPoolExecutor] = None
        self._batches: Optional[InFlightBatches] = None
        self._formed: Optional[tuple[tuple, list[Completion]]] = None  # the batch handed to TRL, for `generate`
        self._updates: deque[Future] = deque()  # weight updates queued or running (main process)
        self._update_error: Optional[str] = None
        self._restore_error: Optional[str] = None  # a server that lost its weights could not be given them again
        self._newest_dump = -1  # an update of an older dump than this is skipped: the newer one replaces it
        self._resume_state: Optional[dict] = None
        self._starting = False
        self._dropped: list[dict] = []  # the rollouts.jsonl entries of the groups dropped since the last batch
        self._refills_done: queue.Queue[Group] = queue.Queue()  # dynamic sampling's refill groups, complete
        self._refills_out = 0  # refill groups sent and not taken
        self._refills_sent = 0
        self.closing = False

    # ------------------------------------------------------------------ the training loop's side
    def batches(self, epoch_iterator: Iterator) -> Iterator:
        if self._batches is None or self._batches.source is not epoch_iterator:
            self._batches = InFlightBatches(self, epoch_iterator, int(self.trainer.state.epoch or 0),
                                            self._take_resume_state())
        return self._batches

    def generate(self, prompt_ids: list[list[int]], num_generations: int) -> list[Completion]:
        """The completions of the batch `batches()` just formed; any other prompts (evaluation, the turns of TRL's tool
        loop after a tool call) are sampled now."""
        formed, self._formed = self._formed, None
        if formed is None:
            return RemoteGeneration.generate(self, prompt_ids, num_generations)
        if formed[0] != prompts_key(prompt_ids):
            raise RuntimeError("in_flight_updates: TRL asked for other prompts than those of the batch it was handed "
                               "(this trl version does not fit RemoteGRPOTrainer; set in_flight_updates=False)")
        return formed[1]

    def next_batch(self, batches: "InFlightBatches") -> Optional[list]:
        """Training thread: the rows of the next complete groups (a generation batch's worth), or None once the epoch's
        groups are all trained. Their completions wait in `_formed` for `generate`."""
        self.ensure_weights()
        step = self.trainer.state.global_step
        self._wait_for_weights(step)
        with self.trainer.step_timer.part("group_wait"):
            groups = batches.take(step)
        if groups is None:
            return None
        prompt_ids, completions = self._form(groups)
        self._log_groups(groups, step)
        self.trainer.prefetch_reference(prompt_ids, [c.token_ids for c in completions])
        return [row for g in groups for row in g.rows]

    def _form(self, groups: list[Group]) -> tuple[list, list[Completion]]:
        """Leave the completions of `groups` for `generate`; their prompts' ids and completions, TRL's layout."""
        completions = [c for g in groups for c in g.completions]
        prompt_ids = [g.prompt_ids for g in groups for _ in range(len(g.completions))]
        self._formed = (prompts_key(prompt_ids), completions)
        return prompt_ids, completions

    # ------------------------------------------------------------------ dynamic sampling's refills
    def keep_refills(self, count: int, draw: Callable[[int], list]) -> None:
        """Dynamic sampling: keep `count` refill groups sent or complete beside the data's, their rows (TRL's layout)
        drawn by `draw(groups)`, so that an extra round finds them generated (`refill_batch`)."""
        if count <= self._refills_out:
            return
        for group in self.split_groups(draw(count - self._refills_out), int(self.trainer.state.epoch or 0), -1):
            group.index, self._refills_sent = self._refills_sent, self._refills_sent + 1  # its seeds' own salt
            self._refills_out += 1
            self.send(group, self._refills_done)

    def refill_batch(self, count: int, draw: Callable[[int], list]) -> list:
        """Training thread, an extra round of dynamic sampling: the rows of `count` complete refill groups fresh
        enough for this step (more drawn and sent first if fewer are out; a stale one sent again), waited for as
        `timing/group_wait`; their completions wait in `_formed` for `generate`. Each is logged in `rollouts.jsonl`
        with `"refill": true` (its `group` is `[-1, n]`: the n-th refill this run sent)."""
        step = self.trainer.state.global_step
        self.keep_refills(count, draw)
        chosen: list[Group] = []
        with self.trainer.step_timer.part("group_wait"):
            while len(chosen) < count:
                group = self._refills_done.get()
                if not self.trainable(group, step):
                    self.send(group, self._refills_done)
                    continue
                self._refills_out -= 1
                chosen.append(group)
        self._form(chosen)
        self._append_rollouts([{**self._entry(g, step, step - g.versions()[0]), "refill": True} for g in chosen])
        return [row for g in chosen for row in g.rows]

    def trainable(self, group: Group, step: int) -> bool:
        """Whether a complete group can be trained at `step`: its error is raised; one that must be dropped (`stale`)
        is logged so and counted as sent once more, for its caller to send again."""
        if group.error is not None:
            raise group.error
        staleness = self.stale(group, step)
        if staleness is None:
            return True
        self.log_drop(group, step, staleness)
        group.attempt += 1
        return False

    def stale(self, group: Group, step: int) -> Optional[int]:
        """The group's staleness at `step` (the step its training would start from) if it must be dropped: it exceeds
        `max_weight_staleness`, or some tokens came from a broadcast that stopped half-way (`Group.partial`); else
        None. A group sampled from weights older than the server was confirmed at (it restarted and lost them) has the
        servers' weights restored: a dump reloaded on the update thread (once that failed, training stops here), or
        with `transport: distributed` the weights sent now, as to a server that holds partial ones
        (`RemoteGeneration._restore`, which stops training if they cannot be)."""
        if self._restore_error is not None:
            raise WeightSyncError(self._restore_error)
        versions = group.versions()
        staleness = step - versions[0]
        lost, partial = versions[-1] < group.sent_at, group.partial()
        if self.target.distributed and (lost or partial):
            self._restore()  # sent now (or by the main process meanwhile), else `WeightSyncError`
        elif lost and self.trainer.accelerator.is_main_process:
            logger.warning("generation server sampled a group from weights %d, older than the weights %s it was given "
                           "(restarted?): restoring them", versions[-1], self.target.version)
            self._updates.append(self.rollouts.submit(self._restore_dump))
        return staleness if partial or staleness > self.trainer.args.max_weight_staleness else None

    def split_groups(self, rows: list, epoch: int, batch: int) -> list[Group]:
        """A generation batch of the data loader (each example `num_generations` times in a row) as groups."""
        n = self.trainer.num_generations
        examples = rows[::n]
        for index, example in enumerate(examples):
            if any(row != example for row in rows[index * n:(index + 1) * n]):
                raise RuntimeError(f"in_flight_updates: the data loader's batch {batch} does not hold each example "
                                   f"{n} times in a row (TRL's RepeatSampler layout), so its groups cannot be told apart")
        prompt_ids, _, _ = self.trainer._tokenize_prompts([example["prompt"] for example in examples])
        sampling = self._fitting(prompt_ids, self._sampling_params())
        return [Group(epoch, batch, index, rows[index * n:(index + 1) * n], list(ids), sampling)
                for index, ids in enumerate(prompt_ids)]

    def send(self, group: Group, done: "queue.Queue[Group]") -> None:
        """Sample `group` on a sender thread; it is put in `done` when it has its completions (or an error)."""
        if self._senders is None:
            self.rollouts  # noqa: B018 - its queue, made now, keeps the GIL switch interval short for the senders too
            self._senders = ThreadPoolExecutor(max_workers=self.bound + refills_in_flight(self.trainer.args),
                                               thread_name_prefix="open_r1_ext-inflight")
        group.completions, group.replica, group.error = None, None, None
        group.sent_at = version_number(self.target.version)
        self._senders.submit(self._sample, group, done)

    def _sample(self, group: Group, done: "queue.Queue[Group]") -> None:
        """One request for the group's completions; what the server aborted (not when closing) is sent again, as the
        client does for other requests."""
        n, rank = self.trainer.num_generations, self.trainer.accelerator.process_index
        seeds = sampling_seeds(self.trainer.args.seed, group.batch, "train", rank, n,
                               f"in-flight {group.epoch}/{group.index}/{group.attempt}")
        extra = {"any_version": True} if isinstance(self.client, ServerPool) else {}
        try:
            if self.target is not None and self.target.adapter:
                group.completions = self._sample_with_adapters(group, seeds, extra)
            else:
                group.completions = self._sample_group(group, seeds, extra)
            group.replica = (self.client.served_by() or [None])[0] if extra else None
        except BaseException as err:  # noqa: BLE001 - handed to the training thread, which raises it
            group.error = err
        finally:
            done.put(group)

    def _sample_group(self, group: Group, seeds: list[int], extra: dict) -> list[Completion]:
        """Full-weight sync: the group's completions, the request sent again whole if the server aborted it."""
        for attempt in range(ABORT_RETRIES + 1):
            (completions,) = self.client.generate([group.prompt_ids], group.sampling, n=len(seeds), seeds=seeds,
                                                  keep_aborted=True, **extra)
            if self.closing or all(c.finish_reason != "abort" for c in completions):
                return completions
            logger.warning("generation server aborted a group's request (attempt %d/%d): sending it again",
                           attempt + 1, ABORT_RETRIES + 1)
        raise self._aborted_too_often()

    def _aborted_too_often(self) -> AbortedRequestError:
        return AbortedRequestError(f"{self.client.base_url}/generate aborted a group's request {ABORT_RETRIES + 1} "
                                   "times; its partial output is not trained on. See the server's log.")

    def _sample_with_adapters(self, group: Group, seeds: list[int], extra: dict) -> list[Completion]:
        """Adapter-only LoRA (see the module docstring): the group's completions, each aborted one continued from its
        tokens so far under the newest adapter, until none is aborted. An abort with no newer adapter to continue
        with (not a sync's) counts as the client's retries do (`ABORT_RETRIES`)."""
        completions = self._sample_with_adapter([group.prompt_ids], group.sampling, len(seeds), seeds,
                                                keep_aborted=True, **extra)
        retries, rounds = 0, 0
        while not self.closing:
            aborted = [i for i, c in enumerate(completions) if c.finish_reason == "abort"]
            if not aborted:
                break
            if all(completions[i].weight_version == self.target.version for i in aborted):
                retries += 1
                if retries > ABORT_RETRIES:
                    raise self._aborted_too_often()
                logger.warning("generation server aborted a group's request (attempt %d/%d): continuing it",
                               retries, ABORT_RETRIES + 1)
            rounds += 1
            for length in sorted({len(completions[i].token_ids) for i in aborted}):
                items = [i for i in aborted if len(completions[i].token_ids) == length]
                budget = group.sampling["max_new_tokens"] - length
                if budget <= 0:  # aborted at its last token
                    for i in items:
                        completions[i] = replace(completions[i], finish_reason="length")
                    continue
                sampling = {**group.sampling, "max_new_tokens": budget}
                if "min_new_tokens" in sampling:
                    sampling["min_new_tokens"] = max(0, sampling["min_new_tokens"] - length)
                salt = f"in-flight {group.epoch}/{group.index}/{group.attempt}/continued {rounds}/{length}"
                more = sampling_seeds(self.trainer.args.seed, group.batch, "train",
                                      self.trainer.accelerator.process_index, len(items), salt)
                tails = self._sample_with_adapter([group.prompt_ids + completions[i].token_ids for i in items],
                                                  sampling, 1, more, keep_aborted=True, **extra)
                for i, tail in zip(items, tails):
                    completions[i] = continued(completions[i], tail)
        return completions

    # ------------------------------------------------------------------ weight updates
    def ensure_weights(self) -> None:
        """As `RemoteGeneration`'s, with a sync made then (on resume, nothing in flight yet) synchronous."""
        self._starting = True
        try:
            super().ensure_weights()
        finally:
            self._starting = False

    def sync_weights(self, step: int, references) -> None:
        """Dump now; the reference servers reload now; the generation servers pause, reload and continue on the update
        thread (main process) while generation and training go on. With `transport: distributed`, the policy is
        staged in host memory now and broadcast on the update thread, the servers paused around it
        (`_sync_over_the_network`); an adapter is sent now (`_send_adapter`)."""
        if self._starting:
            return RemoteGeneration.sync_weights(self, step, references)
        self._newest_dump = step
        super().sync_weights(step, references)  # AsyncRemoteGeneration's: queues `_push_logged` on the rollout thread
        if self.last_push is not None:
            self._updates.append(self.last_push)
            self.last_push = None

    def _push_logged(self, path: Path, step: int) -> None:
        """Update thread: pause every generation server (retract), reload `path`, continue; an adapter is loaded
        beside the one in use, then the requests under way aborted (see the module docstring). A newer dump queued
        behind makes this one pointless: skipped. A failure is kept for `_wait_for_weights` to report."""
        if step < self._newest_dump:
            return
        timer = self.trainer.step_timer
        try:
            if self.target.adapter:  # loaded beside the adapter in use, the requests under way going on meanwhile
                with timer.part("reload"):
                    self.weight_sync.push_and_confirm([self.target], path, step, retire=False)
                self._abort_in_flight(f"to continue them with the adapter of step {step}",
                                      lambda: self.weight_sync.retire_adapters(self.target))
            else:
                with timer.part("paused"), self._servers_paused(), timer.part("reload"):  # standing still meanwhile
                    self.weight_sync.push_and_confirm([self.target], path, step)
            self._record_update(step, None)
        except ServerError as err:  # WeightSyncError among them
            self._record_update(step, err, log=True)

    def _sync_over_the_network(self, step: int) -> None:
        """`transport: distributed`, every rank: the policy's buckets staged in host memory (`WeightSync.stage`, the
        dump's walk without the writes: `timing/stage`), and the broadcast queued on the update thread, the servers
        paused around it, as a dump's reload (`_broadcast_logged`): training goes on meanwhile. One staged copy at a
        time: a sync whose previous broadcast still runs waits for it first (`timing/reload_wait`). An adapter is sent
        from this thread (`_send_adapter`)."""
        if self.target.adapter:
            return super()._sync_over_the_network(step)
        main = self.trainer.accelerator.is_main_process
        if main:
            with self.trainer.step_timer.part("reload_wait"):
                while self._updates:
                    self._updates.popleft().result()
        staged = self.weight_sync.stage(self.trainer.model)
        self.weight_sync.share_state([self.target])
        if main:
            self._updates.append(self.rollouts.submit(lambda: self._broadcast_logged(staged, step)))

    def _broadcast_logged(self, staged: list, step: int) -> None:
        """Update thread: pause every generation server (retract), broadcast the staged policy, continue. A failure
        is kept for `_wait_for_weights` to report; the staged copy is let go at the end."""
        timer = self.trainer.step_timer

        def broadcast() -> Optional[str]:
            with timer.part("reload"):
                return self.weight_sync.send_staged(staged, step, self.target)

        try:
            with timer.part("paused"):
                error = self._while_paused(broadcast)
        finally:
            staged.clear()
        self._record_update(step, error, log=True)

    def _servers_behind(self) -> list[str]:
        """As `RemoteGeneration`'s, but none while a weight update runs on the update thread: a server it has paused
        mid-broadcast says `<N>-partial` until it ends (one it fails is seen at the next batch)."""
        if any(not update.done() for update in self._updates):
            return []
        return super()._servers_behind()

    def _abort_in_flight(self, why: str, while_paused: Optional[Callable[[], None]] = None) -> None:
        """Main process: abort every request the generation servers have under way (each answers with its partial
        output; the client sends other requests again whole, e.g. the reference's on a LoRA server, which serves its
        base model), and run `while_paused` before they continue: the old adapters unloaded then wait for no request
        (the built-in server's unload waits for all its sampling under way). One the servers do not abort (an error,
        logged) ends as it was sent."""
        try:
            with self._servers_paused("abort"):
                if while_paused is not None:
                    while_paused()
        except ServerError as err:
            logger.warning("could not abort the generation in flight %s: %s", why, err)

    @contextlib.contextmanager
    def _servers_paused(self, mode: str = PAUSE_MODE) -> Iterator[None]:
        """Main process, around a weight update: every generation server paused (`mode`; `PAUSE_MODE`: the requests
        under way keep their tokens and go on with the new weights), and continued after the block, also when it
        failed."""
        client = self.target.client
        client.pause_generation(mode)
        try:
            yield
        finally:
            client.continue_generation()

    def _send(self, step: int, only: Optional[list[str]] = None, collective: bool = True) -> Optional[str]:
        """`transport: distributed`, sent from this thread: a catch-up (`catch_up`: a sync of its own, or to the servers
        that lost the weights) with the generation servers paused around it, as a reload; the main process's training
        thread waits for it all (`timing/reload_wait`). SGLang takes a distributed update at once while paused, its
        cache flushed with the retracted requests waiting. A server that does not answer the pause fails the
        broadcast too, which the main process enters all the same (a collective). A failed sync is kept for
        `_wait_for_weights` to report. A LoRA adapter goes in the request instead, loaded beside the one in use, then
        the requests under way aborted, as after an adapter dump's load (`_push_logged`)."""
        send = super()._send
        if self.target.adapter:
            return self._send_adapter(step, collective)
        if not self.trainer.accelerator.is_main_process:
            return send(step, only, collective)
        with self.trainer.step_timer.part("reload_wait"):
            error = self._while_paused(lambda: send(step, only, collective))
        if only is None:
            self._record_update(step, error)
        return error

    def _while_paused(self, send: Callable[[], Optional[str]]) -> Optional[str]:
        """Main process: `send()`'s outcome, the generation servers paused around it (`_servers_paused`). A server
        that does not answer the pause fails the broadcast too, which is made all the same (in a catch-up the other
        processes enter it: a collective)."""
        sent: list[Optional[str]] = []  # the broadcast's outcome, once it ran
        try:
            with self._servers_paused():
                sent.append(send())
        except ServerError as err:  # the pause, or the continue
            logger.warning("generation servers: %s", err)
            if not sent:
                sent.append(send())
        return sent[0]

    def _send_adapter(self, step: int, collective: bool) -> Optional[str]:
        """`_send` of a LoRA adapter (`WeightSync.send_adapter`), the training thread waiting for it
        (`timing/reload_wait`); then the main process aborts the requests under way (they continue under the new
        adapter) and unloads the adapters beyond the newest ones."""
        with self.trainer.step_timer.part("reload_wait"):
            error = self.weight_sync.send_adapter(self.trainer.model, step, self.target, collective, retire=False)
        if self.trainer.accelerator.is_main_process:
            if error is None:
                self._abort_in_flight(f"to continue them with the adapter of step {step}",
                                      lambda: self.weight_sync.retire_adapters(self.target))
            self._record_update(step, error)
        return error

    def _record_update(self, step: int, error: Optional[object], log: bool = False) -> None:
        """Keep the outcome of the sync of `step` (None: it succeeded) for `_wait_for_weights` to report; `log`: warn
        of a failure now."""
        self._update_error = None if error is None else f"weight sync of step {step} failed: {error}"
        if log and error is not None:
            logger.warning("%s", self._update_error)

    def _restore_dump(self) -> None:
        """Update thread: give the generation server(s) the last confirmed dump again if they lost its weights."""
        try:
            if self.target.client.weight_version() != self.target.version:
                self.weight_sync.repush(self.target)
        except ServerError as err:  # WeightSyncError among them: its groups would be sampled from lost weights forever
            self._restore_error = (f"the generation server lost its weights (restarted?) and could not be given them "
                                   f"again: {err}")
            logger.warning("%s", self._restore_error)

    def _wait_for_weights(self, step: int) -> None:
        """Main process, before a step takes groups: the servers must hold weights at most `max_weight_staleness` steps
        old, or no group could be trained; wait for the updates queued (`timing/reload_wait`), else stop."""
        if not self.trainer.accelerator.is_main_process or self.target is None:
            return
        needed = step - self.trainer.args.max_weight_staleness
        with self.trainer.step_timer.part("reload_wait"):
            while self._updates and version_number(self.target.version) < needed:
                self._updates.popleft().result()
        while self._updates and self._updates[0].done():
            self._updates.popleft()
        if version_number(self.target.version) < needed:
            raise WeightSyncError(
                f"the generation servers hold the weights of step {version_number(self.target.version)}, more than "
                f"max_weight_staleness={self.trainer.args.max_weight_staleness} steps behind step {step}: "
                f"{self._update_error or 'no reload of newer weights succeeded'}")

    def adapters_in_use(self) -> int:
        """The newest two LoRA adapters: a sync aborts the requests of the one before, but a request sent while it
        loads the new one names the one before (and another process names it until its rollout thread switches)."""
        return 2

    # ------------------------------------------------------------------ logs
    def _log_groups(self, groups: list[Group], step: int) -> None:
        """Each group a step takes, and those dropped while it waited, in `rollouts.jsonl` and the staleness metrics."""
        metrics = self.trainer._metrics["train"]
        entries = [self._entry(group, step, step - group.versions()[0]) for group in groups]
        metrics["remote/staleness"].append(float(max(e["staleness"] for e in entries)))
        metrics["inflight/dropped_groups"].append(float(len(self._dropped)))
        metrics["inflight/versions_per_group"].append(sum(len(e["versions"]) for e in entries) / len(entries))
        self._append_rollouts(self._dropped + entries)
        self._dropped = []

    def log_drop(self, group: Group, step: int, staleness: int) -> None:
        partial = group.partial()
        logger.debug("dropped the group of prompt %s (batch %d): its oldest token is %d step(s) old at step %d "
                    "(max_weight_staleness=%d)%s; sending it again", group.index, group.batch, staleness, step + 1,
                    self.trainer.args.max_weight_staleness, ", some from a partial weight update" if partial else "")
        self._dropped.append({**self._entry(group, step, staleness), "dropped": True,
                              **({"partial": True} if partial else {})})

    def _entry(self, group: Group, step: int, staleness: int) -> dict:
        """A group's line in `rollouts.jsonl`; with several trainer processes, `process` names whose group it is
        (`group` is its place in that process's share of the data)."""
        versions, accelerator = group.versions(), self.trainer.accelerator
        return {"step": step + 1, "epoch": group.epoch, "group": list(group.position), "versions": versions,
                "weight_version": versions[0], "staleness": staleness, "sent": group.attempt + 1,
                **({"process": accelerator.process_index} if accelerator.num_processes > 1 else {}),
                **({"replica": group.replica} if group.replica is not None else {})}

    def _append_rollouts(self, entries: list[dict]) -> None:
        """Every process's entries, gathered (each process forms its batches in step with the others), written by
        the main process."""
        if self.trainer.accelerator.num_processes > 1:
            entries = gather_object(entries)
        if self.trainer.accelerator.is_main_process:
            with open(Path(self.trainer.args.output_dir) / "rollouts.jsonl", "a") as log:
                log.write("".join(json.dumps(e) + "\n" for e in entries))

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, checkpoint_dir: str) -> None:
        """Into a checkpoint: which groups of the epoch were trained beyond the batches the data loader will skip on
        resume, and the rows of the groups read but not trained before those (drawn again on resume)."""
        batches = self._batches
        if batches is None:
            return
        state = {"global_step": self.trainer.state.global_step, **batches.state()}
        path = Path(checkpoint_dir) / STATE_FILE.format(rank=self.trainer.accelerator.process_index)
        torch.save(state, path)

    def resume_from(self, checkpoint_dir: str) -> None:
        """Before `train()` resumes from `checkpoint_dir`: read the state `save_state` wrote there."""
        path = Path(checkpoint_dir) / STATE_FILE.format(rank=self.trainer.accelerator.process_index)
        self._resume_state = torch.load(path, weights_only=False) if path.is_file() else None

    def _take_resume_state(self) -> Optional[dict]:
        state, self._resume_state = self._resume_state, None
        if state is None or state["global_step"] != self.trainer.state.global_step:
            return None
        if state["epoch"] != int(self.trainer.state.epoch or 0) or self.trainer.args.ignore_data_skip:
            return None  # the checkpoint ended its epoch (nothing to draw again), or TRL does not skip what was trained
        return state

    def close(self) -> None:
        """End of `train()`: the requests still in flight are aborted (main process) and the threads stopped."""
        self.closing = True
        running = self._refills_out or (self._batches is not None and self._batches.running)
        if running and self.trainer.accelerator.is_main_process:
            self._abort_in_flight("at the end of training")
        if self._senders is not None:
            self._senders.shutdown(wait=True, cancel_futures=True)
        self._senders, self._batches, self._formed = None, None, None
        self._refills_done, self._refills_out = queue.Queue(), 0
        super().close()
        self.closing = False


class InFlightBatches:
    """The training loop's batches with in-flight updates: each `period` consecutive batches (TRL reuses a generation
    batch for `steps_per_generation x num_iterations` of them) are one batch of the next complete groups. Reads the
    data loader (on the training thread only) while fewer than the bound of prompts are in flight."""

    def __init__(self, owner: InFlightGeneration, source: Iterator, epoch: int, state: Optional[dict]):
        self.owner, self.source, self.epoch = owner, source, epoch
        self.read = 0  # generation batches read from the source this epoch (the next one's number)
        self.trained = 0  # generation batches handed to training this epoch
        self.waiting: deque[Group] = deque()  # read (or dropped) and not sent
        self.untrained: dict[tuple[int, int], Group] = {}  # read and not handed to training (waiting, running, done)
        self.trained_positions: set[tuple[int, int]] = set()
        self.skip: set[tuple[int, int]] = set()  # trained before the checkpoint this run resumed from
        self.done: queue.Queue[Group] = queue.Queue()
        self.running = 0
        self.exhausted = False
        self.current: Optional[list] = None
        self.repeats = 0
        if state is not None:
            self._resume(state)

    def __iter__(self) -> "InFlightBatches":
        return self

    def __next__(self) -> list:
        if self.repeats:
            self.repeats -= 1
            return self.current
        batch = self.owner.next_batch(self)
        if batch is None:
            raise StopIteration
        self.current, self.repeats = batch, self.owner.period - 1
        return batch

    def take(self, step: int) -> Optional[list[Group]]:
        """The next `groups_per_batch` groups to complete and be fresh enough for `step` (a stale one is sent again);
        None once the epoch has none left."""
        owner, chosen = self.owner, []
        while len(chosen) < owner.groups_per_batch:
            self.fill()
            if not self.running and self.done.empty():
                if chosen:
                    raise RuntimeError(f"in_flight_updates: {len(chosen)} group(s) left at the end of an epoch, fewer "
                                       f"than a batch's {owner.groups_per_batch}")
                return None
            group = self.done.get()
            self.running -= 1
            if not owner.trainable(group, step):
                self.waiting.appendleft(group)
                continue
            chosen.append(group)
        for group in chosen:
            del self.untrained[group.position]
            self.trained_positions.add(group.position)
        self.trained += 1
        return chosen

    def fill(self) -> None:
        """Read generation batches while a whole one fits under the bound, then send every group waiting."""
        owner = self.owner
        while not self.exhausted and len(self.untrained) + owner.groups_per_batch <= owner.bound:
            rows = self._read_generation_batch()
            if rows is None:
                self.exhausted = True
                break
            for group in owner.split_groups(rows, self.epoch, self.read):
                if group.position not in self.skip:
                    self.waiting.append(group)
                    self.untrained[group.position] = group
            self.read += 1
        while self.waiting:
            self.running += 1
            owner.send(self.waiting.popleft(), self.done)

    def _read_generation_batch(self) -> Optional[list]:
        """The data loader's next generation batch (its `period - 1` repeats read past), or None at the epoch's end."""
        try:
            rows = next(self.source)
            for _ in range(self.owner.period - 1):
                next(self.source)
        except StopIteration:
            return None
        return rows

    def state(self) -> dict[str, Any]:
        """What a resume needs (see `InFlightGeneration.save_state`): the data loader resumes at generation batch
        `trained`; the groups of earlier batches not trained are drawn again from their saved rows, the groups of
        later ones already trained are skipped."""
        return {"epoch": self.epoch, "trained": self.trained,
                "redraw": [(g.batch, g.index, g.rows) for g in self.untrained.values() if g.batch < self.trained],
                "skip": sorted(p for p in self.trained_positions | self.skip if p[0] >= self.trained)}

    def _resume(self, state: dict) -> None:
        self.read = self.trained = state["trained"]
        self.skip = {tuple(p) for p in state["skip"]}
        for batch, index, rows in state["redraw"]:
            (group,) = self.owner.split_groups(rows, self.epoch, batch)
            group.index = index
            self.waiting.append(group)
            self.untrained[group.position] = group
        logger.info("resuming in-flight generation at batch %d of the epoch: %d group(s) read but not trained before "
                    "the checkpoint drawn again, %d trained ahead skipped", self.trained, len(self.waiting), len(self.skip))


def continued(head: Completion, tail: Completion) -> Completion:
    """An aborted completion `head` continued by `tail` (sampled with `head`'s tokens appended to the prompt), as one:
    its `weight_versions` spans say which weights sampled which tokens."""
    if not head.token_ids:
        return tail
    spans: list[tuple[str, int, int]] = []
    for version, start, end in [*version_spans(head, 0), *version_spans(tail, len(head.token_ids))]:
        if spans and spans[-1][0] == version:
            start = spans.pop()[1]
        spans.append((version, start, end))
    logprobs = None if head.logprobs is None or tail.logprobs is None else head.logprobs + tail.logprobs
    return Completion(head.token_ids + tail.token_ids, logprobs, tail.finish_reason, tail.weight_version, spans)


def version_spans(completion: Completion, offset: int) -> list[tuple[str, int, int]]:
    """The completion's `(version, start, end)` spans of tokens, shifted by `offset`; none for no tokens."""
    spans = completion.weight_versions or ([(completion.weight_version, 0, len(completion.token_ids))]
                                           if completion.token_ids else [])
    return [(version, start + offset, end + offset) for version, start, end in spans]
