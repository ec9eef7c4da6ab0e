"""Remote generation for `RemoteGRPOTrainer`, in the shape of TRL's `VLLMGeneration`: the trainer's hooks call
`generate()`, `sync_weights()`, `batches()` and `close()`. `RemoteGeneration` samples a batch when the trainer asks;
`AsyncRemoteGeneration` reads batches ahead and samples them on a rollout thread while the current step trains.
Both own the generation server's client, its weight-sync target, the per-sample seeds, the context-length check
and the staleness log; with adapter-only LoRA sync, the name of the adapter each request samples with. A user's
`rollout_func` and TRL's tool loop call `generate()` for each turn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import random
import re
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from open_r1_ext.config.grpo_config import RemoteGRPOConfig
from open_r1_ext.openai_client import OpenAICompletionsClient
from open_r1_ext.protocol import DEFAULT_WEIGHT_VERSION, Completion, is_partial, sampling_params
from open_r1_ext.server_pool import ServerPool
from open_r1_ext.sglang_client import ServerError, ServerRequestError, SGLangClient
from open_r1_ext.trainer.weight_sync import SyncTarget, WeightSync, WeightSyncError, adapter_name

logger = logging.getLogger(__name__)
# A process other than the main one that names an adapter the server does not hold waits for the main process to
# load it (it is a sync behind, or reloading after a server restart): these waits, 91 s in all, as the client's.
ADAPTER_WAITS_S = (1, 2, 4, 8, 16, 30, 30)


def server_client(args: RemoteGRPOConfig, url: Union[str, list[str], None], directory: Optional[str] = None,
                  min_replicas: int = 1, route: str = "", role: str = "generation") -> Union[SGLangClient, ServerPool]:
    """A client with the config's key, timeout, retries and batch budget: an `SGLangClient` for one URL, a
    `ServerPool` for several or an address `directory` (`min_replicas` of them waited for up to
    `server_wait_timeout`; `route` appended to each address read from the directory)."""
    settings = dict(api_key=args.server_api_key, request_timeout=args.request_timeout,
                    max_batch_tokens=args.max_batch_tokens, admin_api_key=args.server_admin_api_key,
                    max_concurrency=max(8, prompts_in_flight(args) + refills_in_flight(args) if role == "generation"
                                        else 0))
    urls = [url] if isinstance(url, str) else list(url or ())
    if directory is None and len(urls) == 1:
        return SGLangClient(urls[0], max_retries=args.max_retries, **settings)
    return ServerPool(urls, directory, route=route, min_replicas=min_replicas, wait_timeout=args.server_wait_timeout,
                      role=role, **settings)


def prompts_in_flight(args: RemoteGRPOConfig) -> int:
    """With `in_flight_updates`, the prompts a process keeps read and untrained (`max_prompts_in_flight`; by default
    `max_weight_staleness` generation batches' worth, at least two: a group read now is trained about that many steps
    later, its staleness about one less, which leaves its completions a step to be long in); else 0."""
    if not args.in_flight_updates:
        return 0
    return args.max_prompts_in_flight or max(2, args.max_weight_staleness) * batch_groups(args)


def refills_in_flight(args: RemoteGRPOConfig) -> int:
    """With `in_flight_updates` and `dynamic_sampling`, the most refill groups a process has in flight beside the
    data's: an extra round's most, `dynamic_sampling_max_oversampling` times its generation batch's groups; else 0."""
    if not (args.in_flight_updates and args.dynamic_sampling):
        return 0
    return math.ceil(args.dynamic_sampling_max_oversampling * batch_groups(args))


def batch_groups(args: RemoteGRPOConfig) -> int:
    """The groups of `num_generations` completions in a process's generation batch."""
    return args.per_device_train_batch_size * args.steps_per_generation // args.num_generations


def remote_generation(trainer, weight_sync: WeightSync, in_flight_kind: Optional[type] = None) -> Optional["RemoteGeneration"]:
    """The generation object `trainer.args` asks for (None without `generation_url`: TRL generates); with
    `in_flight_updates`, an `in_flight_kind` (`inflight.InFlightGeneration`, which builds on this module)."""
    args = trainer.args
    if not args.generation_on_server:
        return None
    if args.generation_backend == "openai":
        client = OpenAICompletionsClient(args.generation_url, tokenizer=trainer.processing_class,
                                         model=args.generation_model_name, api_key=args.server_api_key,
                                         request_timeout=args.request_timeout, max_retries=args.max_retries)
    else:
        client = server_client(args, args.generation_url, args.generation_server_dir, args.generation_min_replicas)
    kind = in_flight_kind if args.in_flight_updates else AsyncRemoteGeneration if args.async_generation else RemoteGeneration
    return kind(trainer, client, weight_sync)


class RemoteGeneration:
    """Samples each generation batch on the server when the trainer asks for it.

    Args:
        trainer (`RemoteGRPOTrainer`): read for its sampling settings, step, mode, rank, model and metrics.
        client (`SGLangClient` or `OpenAICompletionsClient`): the generation server.
        weight_sync (`WeightSync`): dumps the policy; with `weight_sync_steps > 0` the server reloads each dump
            (`target`, registered with `weight_sync`).
    """

    def __init__(self, trainer, client, weight_sync: WeightSync):
        self.trainer = trainer
        self.client = client
        self.weight_sync = weight_sync
        self.target: Optional[SyncTarget] = None
        if trainer.args.weight_sync_steps > 0:
            self.target = SyncTarget("generation", getattr(client, "http", client), adapter=weight_sync.adapter_only,
                                     keep_adapters=self.adapters_in_use(),
                                     distributed=trainer.args.transport == "distributed")
            weight_sync.targets.append(self.target)
            if self.target.distributed and isinstance(client, ServerPool) and trainer.accelerator.is_main_process:
                client.push_hook = self._catch_up_while_waiting
        self._catching_up = False
        self._weights_checked = False
        self.sequence_limit: Optional[int] = None  # set at start-up (`RemoteGRPOTrainer._check_servers`)
        self.later_turn = False  # set while TRL's tool loop asks for the turns after a tool call

    # ------------------------------------------------------------ interface
    def generate(self, prompt_ids: list[list[int]], num_generations: int) -> list[Completion]:
        """One completion per entry of `prompt_ids` (TRL's layout: each prompt repeated `num_generations` times).

        A `rollout_func` may call it once per turn: each call's seeds depend on its prompts, so two turns of a step
        sample independently while a retried step samples the same."""
        self.ensure_weights()
        completions, served = self._job(prompt_ids, num_generations,
                                        self._seeds(len(prompt_ids), prompts_salt(prompt_ids)))()
        self._log_rollout(completions, served)
        return completions

    def check_sampling(self) -> None:
        """At start-up, before the first batch: an SGLang-protocol server (every replica of a pool) is sent a one-token
        request with this run's sampling settings, and a refusal stops the run now, naming the settings it refused
        (`ValueError`, `refused_sampling_message`); an OpenAI-compatible server refuses those it cannot be sent
        (`OpenAICompletionsClient.check_sampling`)."""
        sampling = self._sampling_params()
        try:
            self.client.check_sampling(sampling)
        except ServerRequestError as err:
            raise ValueError(refused_sampling_message(err, sampling, self.trainer.args.generation_kwargs or {})) from None

    @property
    def gives_sampling_logprobs(self) -> bool:
        """Whether the server's completions carry sampling log-probs (an OpenAI-compatible one's probe says)."""
        return not isinstance(self.client, OpenAICompletionsClient) or self.client.abilities.logprobs

    @contextlib.contextmanager
    def later_turns(self):
        """While TRL's tool loop runs: its turns after a tool call may be truncated to the context (see `_fitting`)."""
        self.later_turn = True
        try:
            yield
        finally:
            self.later_turn = False

    def batches(self, epoch_iterator: Iterator) -> Iterator:
        """The training loop's batches, read through this object (the async variant reads ahead)."""
        return epoch_iterator

    def sync_due(self, step: int) -> bool:
        return self.target is not None and step % self.trainer.args.weight_sync_steps == 0

    def sync_weights(self, step: int, references: list[SyncTarget]) -> None:
        """Dump the policy of `step`; the generation server and `references` reload it (every rank calls this).
        A failed reload stops training unless only generation failed and its weights are at most
        `max_weight_staleness` steps old."""
        error = self.weight_sync.sync(self.trainer.model, step, [self.target, *references])
        if error is None:
            return
        stale = step - (self.target.step or 0)
        allowed = self.trainer.args.max_weight_staleness
        if not references and stale <= allowed:
            logger.warning("weight sync at step %d failed (%s); generating from weights %d step(s) old "
                           "(max_weight_staleness=%d)", step, error, stale, allowed)
            return
        raise WeightSyncError(
            f"{error}\nStopping at step {step} rather than training on stale weights (set max_weight_staleness > 0 "
            "to tolerate a few failed reloads)."
        )

    def close(self) -> None:
        """End of `train()`."""

    def adapters_in_use(self) -> int:
        """How many of the newest LoRA adapters requests may still name: one, since every process switches to a
        new adapter at the sync itself, with no request in flight."""
        return 1

    # -------------------------------------------------------------- shared
    def ensure_weights(self) -> None:
        """At the first generation of this process, make the server hold the trainer's weights (e.g. on resume)."""
        if self.target is None or self._weights_checked:
            return
        self._weights_checked = True
        trainer = self.trainer
        stale = None
        if trainer.accelerator.is_main_process:
            reported = self.target.client.weight_version()
            # a server of adapters keeps its base weights: only a resumed run has an adapter to load
            foreign = not self.target.adapter and reported not in (None, DEFAULT_WEIGHT_VERSION, "0")
            stale = trainer.state.global_step > 0 or foreign
            if not stale:
                self.target.version = reported
        if self.weight_sync.broadcast_from_main(stale):
            self.sync_weights(trainer.state.global_step, [])
        else:
            self.weight_sync.share_state([self.target])

    # --------------------------------------------------------- weights pushed over the network (catch-up)
    def catch_up(self, collective: bool = True) -> None:
        """With `transport: distributed`, bring the servers that lost the trainer's weights (a pool's joiners, restarted
        or dropped replicas; a restarted server) back to them. Every rank calls it at the start of each generation
        batch (`collective`: the training loop's lock-step); else the main process alone, where it holds the whole
        policy (`_can_push_here`). The weights of the last sync go to those servers; if the policy changed since
        (`weight_sync_steps > 1`), every server gets the current one, a sync (only collectively, or in one process)."""
        target, trainer = self.target, self.trainer
        # (an adapter sent in the request is sent again to a server that answers it does not hold it,
        # `_sample_with_adapter`; a pool replays it to a replica that joins)
        if target is None or not target.distributed or target.adapter or target.version is None or self._catching_up:
            return
        plan, error = None, None
        if trainer.accelerator.is_main_process:
            try:
                behind = self._servers_behind()
            except ServerError as err:  # the server is gone: every rank stops with this
                behind, error = [], f"{err}"
            if behind:
                plan = behind if trainer.state.global_step == target.step else "whole"
        if collective:
            plan, error = self.weight_sync.broadcast_from_main((plan, error))
        if error is not None:
            raise ServerError(error)
        if plan is None or (plan == "whole" and not collective and trainer.accelerator.num_processes > 1):
            return  # (the other processes' pools must learn a new version: at the next batch)
        self._catching_up = True
        try:
            if plan == "whole":
                failed = self._send(trainer.state.global_step, collective=collective)
            else:
                logger.info("sending the weights of step %d to %s (they lost them)", target.step, ", ".join(plan))
                failed = self._send(target.step, only=plan, collective=collective)
        finally:
            self._catching_up = False
        if failed is not None:
            logger.warning("could not send the trainer's weights to servers that lost them: %s", failed)

    def _send(self, step: int, only: Optional[list[str]] = None, collective: bool = True) -> Optional[str]:
        """Broadcast the policy to the generation servers as weight version `step` (`WeightSync.send`, which says what
        `only` and `collective` mean): None or the error."""
        return self.weight_sync.send(self.trainer.model, step, self.target, only=only, collective=collective)

    def _servers_behind(self) -> list[str]:
        """Main process: the servers that answer without the trainer's weights (a pool's replica names, or the URL)."""
        client = self.target.client
        if isinstance(client, ServerPool):
            return client.behind()
        return [] if client.weight_version() == self.target.version else [client.base_url]

    def _can_push_here(self) -> bool:
        """Whether this thread may push the weights alone: the main process's training thread, holding the whole
        policy (one process, or not ZeRO-3) and not in the middle of an optimizer step (that is another thread)."""
        accelerator = self.trainer.accelerator
        plugin = getattr(accelerator.state, "deepspeed_plugin", None)
        zero3 = plugin is not None and plugin.zero_stage == 3
        return (accelerator.is_main_process and threading.current_thread() is threading.main_thread()
                and (accelerator.num_processes == 1 or not zero3))

    def _catch_up_while_waiting(self) -> None:
        """A pool's wait for replicas (`push_hook`): send the weights to those behind, if this thread may."""
        if self._can_push_here():
            self.catch_up(collective=False)

    def _restore(self) -> None:
        """A generation came back from other weights than the trainer's (the server restarted, or an update reached it
        half-way): send them now if this thread may, else wait for the main process to (its next batch or sync),
        up to `ADAPTER_WAITS_S`; then `WeightSyncError`."""
        target = self.target
        if self._can_push_here():
            self.catch_up(collective=False)
        for wait in (0, *ADAPTER_WAITS_S):
            time.sleep(wait)
            reported = target.client.weight_version()
            if not is_partial(reported) and version_number(reported) >= version_number(target.version):
                return
            logger.warning("generation server at %s reports weight_version %s, the trainer's is %s: waiting for the "
                           "main process to send its weights", target.client.base_url, reported, target.version)
        raise WeightSyncError(
            f"the generation server at {target.client.base_url} lost the trainer's weights (it reports "
            f"{target.client.weight_version()!r}, expected {target.version!r}) and did not get them back within "
            f"{sum(ADAPTER_WAITS_S)} s; under DeepSpeed ZeRO-3 with transport distributed the weights are sent again "
            "at the start of the next batch only: resume from the checkpoint")

    def _job(self, prompt_ids, num_generations: int,
             seeds: list[int]) -> Callable[[], tuple[list[Completion], Optional[list[str]]]]:
        """A callable that generates the completions of `prompt_ids` (on this thread or the rollout thread), and
        names the replica that sampled each prompt's completions (a pool of servers; else None)."""
        unique, n = group_repeated_prompts(prompt_ids, num_generations)
        sampling = self._fitting(unique, self._sampling_params())

        def sample() -> list[Completion]:
            if self.target is not None and self.target.adapter:
                return self._sample_with_adapter(unique, sampling, n, seeds)
            return [c for group in self.client.generate(unique, sampling, n=n, seeds=seeds) for c in group]

        def generate() -> tuple[list[Completion], Optional[list[str]]]:
            with self.trainer.step_timer.part("generate"):  # async: on the rollout thread, beside the step
                completions = sample()
                target = self.target
                # (a target of adapters: a server that lost one refuses the request naming it, `_sample_with_adapter`;
                # a batch sampled with the base model before the first sync says "default", and async generation
                # may read a sync that came after it)
                if target is not None and not target.adapter and any(
                        is_partial(c.weight_version) or version_number(c.weight_version) < version_number(target.version)
                        for c in completions if c.weight_version is not None):
                    # the server restarted and lost our weights: reload (or send) them, sample again
                    self._restore() if target.distributed else self.weight_sync.repush(target)
                    completions = sample()
            self.trainer.prefetch_reference(prompt_ids, [c.token_ids for c in completions])
            return completions, self.client.served_by() if isinstance(self.client, ServerPool) else None

        return generate

    def _sample_with_adapter(self, prompts, sampling: dict, n: int, seeds: list[int], **options) -> list[Completion]:
        """Sample with the newest adapter this process knows the server holds (`lora_path`; none before the first
        sync: the policy is then the base model); each completion's weight version is that adapter's. A server that
        answers it does not hold the adapter lost it (restarted): the main process loads it again, another waits for
        that. `options`: `generate`'s others (`keep_aborted`, a pool's `any_version`)."""
        target, main = self.target, self.trainer.accelerator.is_main_process
        for wait in (*ADAPTER_WAITS_S, None):
            version = target.version if target.step is not None else None
            name = adapter_name(version) if version is not None else None
            try:
                groups = self.client.generate(prompts, sampling, n=n, seeds=seeds, lora_path=name, **options)
            except ServerRequestError as err:
                if name is None or name not in str(err) or wait is None:
                    raise
                logger.warning("generation server: %s (restarted?); %s", err,
                               "loading it again" if main else f"waiting {wait} s for the main process to load it")
                if main:
                    self.weight_sync.repush(target)
                else:
                    time.sleep(wait)
                continue
            return [dataclasses.replace(c, weight_version=version, weight_versions=None) if version is not None else c
                    for group in groups for c in group]

    def _fitting(self, prompts: list[list[int]], sampling: dict) -> dict:
        """`sampling`, checked to fit `sequence_limit`, the most tokens of prompt + completion the servers serve
        (SGLang answers 400 to a prompt past it, failing the whole batch, and to a reference request of a sequence
        past it). A first turn that does not fit is refused before anything is sent, naming it; a later turn of TRL's
        tool loop asks for what fits (TRL cuts those turns to the completion budget anyway)."""
        limit, max_new = self.sequence_limit, sampling["max_new_tokens"]
        if limit is None:
            return sampling
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        length = len(prompts[longest])
        if length + max_new <= limit:
            return sampling
        if self.later_turn and length < limit:
            return {**sampling, "max_new_tokens": limit - length}
        text = " ".join(self.trainer.processing_class.decode(prompts[longest], skip_special_tokens=True).split())
        raise ValueError(
            f"prompt {longest} of this batch ({length} tokens: {text if len(text) <= 100 else text[:50] + ' ... ' + text[-50:]!r}) "
            f"plus max_completion_length={max_new} "
            f"does not fit the {limit} tokens of prompt + completion the servers serve (max_req_input_len - 1 in "
            f"the /server_info of {self.client.base_url} and of the reference server: SGLang refuses an input of the "
            "context length - 6 tokens or more): shorten or filter out long prompts, lower max_completion_length, or "
            "start the servers with a larger --context-length")

    def _sampling_params(self) -> dict:
        """The run's SGLang `sampling_params`: what TRL's config sends a vLLM server (`SAMPLING_SOURCES`), then the
        user's `generation_kwargs`, which win (as TRL's)."""
        trainer = self.trainer
        params = dict(temperature=trainer.temperature, top_p=trainer.top_p, top_k=trainer.top_k,
                      stop_token_ids=trainer.eos_token_ids, min_p=trainer.min_p,
                      repetition_penalty=trainer.repetition_penalty)
        if trainer.args.vllm_structured_outputs_regex is not None:
            params["regex"] = trainer.args.vllm_structured_outputs_regex
        params.update(trainer.args.generation_kwargs or {})
        return sampling_params(trainer.max_completion_length, **params)

    def _seeds(self, count: int, salt: object = 0) -> list[int]:
        trainer = self.trainer
        return sampling_seeds(trainer.args.seed, trainer.state.global_step, "train" if trainer.model.training else "eval",
                              trainer.accelerator.process_index, count, salt)

    def _log_rollout(self, completions: list[Completion], served: Optional[list[str]] = None) -> None:
        """Log each batch's weight version and staleness (steps between the weights it was sampled from and the
        policy it trains), and with a pool the replica of each prompt (`served`); stop if the staleness exceeds
        `max_weight_staleness` (plus the steps between two syncs)."""
        trainer, args = self.trainer, self.trainer.args
        versions = [version_number(c.weight_version) for c in completions if c.weight_version is not None]
        if not versions or self.target is None or not trainer.model.training:
            return
        step, oldest = trainer.state.global_step, min(versions)
        staleness = step - oldest
        trainer._metrics["train"]["remote/staleness"].append(float(staleness))
        if trainer.accelerator.is_main_process:
            with open(Path(args.output_dir) / "rollouts.jsonl", "a") as log:
                entry = {"step": step + 1, "weight_version": oldest, "staleness": staleness}
                log.write(json.dumps(entry if served is None else {**entry, "replicas": served}) + "\n")
        allowed = args.max_weight_staleness + args.weight_sync_steps - 1
        if staleness > allowed:
            raise WeightSyncError(
                f"the batch for step {step + 1} was sampled from weights of step {oldest}, {staleness} steps old (at "
                f"most {allowed} allowed by max_weight_staleness): the generation server is not taking the new weights "
                "(see the warnings above)"
            )


class AsyncRemoteGeneration(RemoteGeneration):
    """Overlaps generation with training: `batches()` reads `max_weight_staleness` generation batches ahead and
    queues their generation on one rollout thread per rank, in order with the generation server's reloads.

    FIFO order is the staleness bound: a batch read ahead while step N trains is generated after the reload of the
    weights of step N - depth, and reloads always fall between two generation batches. The reference server (if
    synced) reloads at the sync itself, so the next step's reference log-probs come from the new reference.
    """

    def __init__(self, trainer, client, weight_sync: WeightSync):
        super().__init__(trainer, client, weight_sync)
        self._rollouts: Optional[RolloutQueue] = None
        self._lookahead: Optional[LookaheadIterator] = None
        self.last_push: Optional[Future] = None  # the generation server's reload queued by the last sync (main process)

    @property
    def rollouts(self) -> "RolloutQueue":
        if self._rollouts is None:
            self._rollouts = RolloutQueue()
        return self._rollouts

    def generate(self, prompt_ids: list[list[int]], num_generations: int) -> list[Completion]:
        announced = self.rollouts.take(prompts_key(prompt_ids))
        if announced is None:  # not read ahead (the first batch after a resume, eval, later turns): generate it now
            self.ensure_weights()
            seeds = self._seeds(len(prompt_ids), prompts_salt(prompt_ids))
            announced = self.rollouts.submit(self._job(prompt_ids, num_generations, seeds))
        with self.trainer.step_timer.part("rollout_wait"):
            completions, served = announced.result()
        self._log_rollout(completions, served)
        return completions

    def batches(self, epoch_iterator: Iterator) -> Iterator:
        if self._lookahead is None or self._lookahead.source is not epoch_iterator:
            period = self.trainer.args.steps_per_generation * self.trainer.num_iterations
            self._lookahead = LookaheadIterator(epoch_iterator, self._announce, self.trainer.args.max_weight_staleness,
                                                period)
        return self._lookahead

    def _announce(self, batch) -> None:
        """A generation batch read ahead: queue its generation behind the reloads queued so far (with
        `dynamic_sampling`, in one request with the prompts that oversample it)."""
        self.ensure_weights()
        if self.trainer.dynamic_sampling is not None:
            batch = [*batch, *self.trainer.dynamic_sampling.ahead(batch)]
        prompt_ids, _, _ = self.trainer._tokenize_prompts([example["prompt"] for example in batch])
        seeds = self._seeds(len(prompt_ids), salt=self._lookahead.read if self._lookahead else 0)
        self.rollouts.submit_generation(prompts_key(prompt_ids), self._job(prompt_ids, self.trainer.num_generations, seeds))

    def sync_weights(self, step: int, references: list[SyncTarget]) -> None:
        """Dump now; the reference servers reload now, the generation server's reload is queued on the rollout
        thread (a failure there is logged, and the staleness check of the next batches decides whether to stop).
        With `transport: distributed` the generation server gets the policy now, by a broadcast from this thread
        (the weights change after it): a generation in flight on the server delays it (SGLang lets requests end
        first), and requests that end between two buckets say `<N>-partial` and are sampled again."""
        if self.target.distributed:
            if references and (error := self.weight_sync.sync(self.trainer.model, step, references)) is not None:
                raise WeightSyncError(f"{error}\nStopping at step {step} rather than training on a stale reference.")
            self._sync_over_the_network(step)
            return
        path = self.weight_sync.dump(self.trainer.model, step)  # raises WeightDumpError on every rank
        if references and (error := self.weight_sync.publish(references, path, step)) is not None:
            raise WeightSyncError(f"{error}\nStopping at step {step} rather than training on a stale reference.")
        if not self.target.adapter:
            self.weight_sync.share_state([self.target])
        if self.trainer.accelerator.is_main_process:
            self.last_push = self.rollouts.submit(lambda: self._push_logged(path, step))
        elif self.target.adapter:  # requests name the adapter from here on in this process's queue, as on the main one
            self.rollouts.submit(lambda: self.weight_sync.confirm([self.target], path, step))

    def _sync_over_the_network(self, step: int) -> None:
        """`sync_weights`'s send to the generation servers with `transport: distributed` (every rank)."""
        if (error := self._send(step)) is not None:
            logger.warning("weight sync of step %d failed: %s", step, error)

    def adapters_in_use(self) -> int:
        """The newest `max_weight_staleness + 1` LoRA adapters: a process's rollout thread switches to a new adapter
        in its own queue, after generating the batches read ahead before the sync; by the sync `max_weight_staleness`
        steps later, every process has generated them."""
        return self.trainer.args.max_weight_staleness + 1

    def _push_logged(self, path: Path, step: int) -> None:
        try:
            self.weight_sync.push_and_confirm([self.target], path, step)
        except WeightSyncError as err:
            logger.warning("weight sync of step %d failed: %s", step, err)

    def close(self) -> None:
        """Cancel what was read ahead and stop the rollout thread (a later `train()` starts a new one)."""
        if self._rollouts is not None:
            self._rollouts.shutdown()
        self._rollouts, self._lookahead = None, None


class LookaheadIterator:
    """Yields the batches of `source` unchanged while reading ahead; `announce(batch)` sees each batch early.

    Only every `period`-th batch is announced (TRL reuses one generation batch for `steps_per_generation x
    num_iterations` consecutive steps), up to `depth` announced batches beyond the one being trained.
    """

    def __init__(self, source: Iterator, announce: Callable[[Any], None], depth: int, period: int):
        self.source = source
        self.announce = announce
        self.depth = depth
        self.period = period
        self.buffer: deque = deque()
        self.read = 0  # batches read from source so far
        self.exhausted = False

    def __iter__(self) -> "LookaheadIterator":
        return self

    def __next__(self):
        self._fill(ahead=self.depth * self.period + 1)
        if not self.buffer:
            raise StopIteration
        return self.buffer.popleft()

    def _fill(self, ahead: int) -> None:
        while not self.exhausted and len(self.buffer) < ahead:
            try:
                batch = next(self.source)
            except StopIteration:
                self.exhausted = True
                return
            if self.read % self.period == 0:
                self.announce(batch)
            self.read += 1
            self.buffer.append(batch)


# The GIL switch interval while a rollout thread runs. Its HTTP calls need the GIL back after every socket read and
# file check, while the training thread runs Python (TRL's step between torch calls), and Python hands the GIL over
# only once per switch interval (5 ms by default) while the server waits for the next request. At 0.5 ms the async
# step of tools/bench_async.py was 3-11% shorter in each of three rounds side by side, on a busy host (load ~5.8;
# the rollout thread's generation 4-19% shorter, the training thread's part 3-11%).
ROLLOUT_SWITCH_INTERVAL_S = 0.0005


class RolloutQueue:
    """One background thread running generation and reload jobs in order; generation results are keyed by prompts.
    While it lives, the process's GIL switch interval is at most `ROLLOUT_SWITCH_INTERVAL_S`."""

    def __init__(self):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="open_r1_ext-rollout")
        self._pending: dict[tuple, Future] = {}
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, ROLLOUT_SWITCH_INTERVAL_S))

    def submit(self, job: Callable[[], Any]) -> Future:
        return self._executor.submit(job)

    def submit_generation(self, key: tuple, job: Callable[[], Any]) -> None:
        if key not in self._pending:
            self._pending[key] = self.submit(job)

    def take(self, key: tuple) -> Optional[Future]:
        """The announced generation for these prompts, if any (each is taken once)."""
        return self._pending.pop(key, None)

    def shutdown(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._executor.shutdown(wait=True)
        sys.setswitchinterval(self._switch_interval)


# Where each SGLang `sampling_params` key of a run comes from, when not from `generation_kwargs` (RemoteGRPOConfig
# fields, TRL's own, as TRL maps them to vLLM's sampling).
SAMPLING_SOURCES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_completion_length",
                    "regex": "vllm_structured_outputs_regex", "stop_token_ids": "the tokenizer's EOS ids"}


def refused_sampling_message(err: ServerRequestError, sampling: dict, generation_kwargs: dict) -> str:
    """What a server's refusal of the run's `sampling` says to the user: the settings it names (each with where it is
    set: a config field, or `generation_kwargs.<key>`), the server's message, and the fix (not an outage: the same
    request would be refused again)."""
    def source(key: str) -> str:
        return f"generation_kwargs.{key}" if key in generation_kwargs else SAMPLING_SOURCES.get(key, key)

    named = ([key for key in sampling if re.search(rf"\b{key}\b", err.detail)]
             or [key for key in sampling if key in generation_kwargs])
    settings = ", ".join(f"{source(key)}={sampling[key]!r}" for key in named) or "this run's sampling settings"
    return (f"The generation server refuses {settings}: {err}\nThis is a refusal, not an outage: the same request "
            "would be refused again. Change or remove the setting (a recipe's trainer: section, or RemoteGRPOConfig), "
            "or generate with a server that takes it (real SGLang takes every SGLang sampling parameter; the built-in "
            "server refuses stop_regex, regex, json_schema, ebnf, structural_tag, beam_width, custom_params).")


def prompts_key(prompt_ids) -> tuple:
    return tuple(tuple(int(t) for t in ids) for ids in prompt_ids)


def prompts_salt(prompt_ids) -> str:
    """A short digest of the prompts: seeds salted with it differ between turns and agree when a step is retried."""
    return hashlib.blake2b(repr(prompts_key(prompt_ids)).encode(), digest_size=8).hexdigest()


def sampling_seeds(seed: int, step: int, mode: str, rank: int, count: int, salt: object = 0) -> list[int]:
    """One seed per sample, a function of (seed, step, mode, rank, salt): a retried or resumed step samples the same."""
    rng = random.Random(f"{seed}/{step}/{mode}/{rank}/{salt}")
    return [rng.getrandbits(63) for _ in range(count)]


def version_number(version: Optional[str]) -> int:
    """A weight version as a step number: `"12"` -> 12, `"ref-12"` -> 12; the server's initial `"default"` -> 0."""
    text = str(version or "").rsplit("-", 1)[-1]
    return int(text) if text.isdigit() else 0


def group_repeated_prompts(prompt_ids: list[list[int]], n: int) -> tuple[list[list[int]], int]:
    """`(unique prompts, n)` when the list is runs of `n` identical prompts (TRL's layout), else `(prompts, 1)`."""
    if n > 1 and len(prompt_ids) % n == 0:
        unique = prompt_ids[::n]
        if all(prompt_ids[i] == unique[i // n] for i in range(len(prompt_ids))):
            return unique, n
    return prompt_ids, 1
