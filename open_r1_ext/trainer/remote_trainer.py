"""`RemoteGRPOTrainer`: TRL's `GRPOTrainer` with the reference model and generation on a remote server.

It overrides narrow hooks of trl 1.16.0 and copies none of its loop: `_get_per_token_logps_and_entropies` takes
the reference's log-probs from the server (requested ahead by `reference_prefetch.py` once the completions exist,
collected in the loss once the policy's forward has run, `_compute_loss`) and, at `temperature != 1`, gives the KL
term the policy's and a local reference's log-probs at temperature 1 (`untempered_logps.py`); `_generate_single_turn`,
`get_batch_samples` and a callback after each optimizer step call the remote generation object (`generation.py`:
generation, look-ahead, weight sync targets). Each step's time is split into parts (`step_timing.py`) and logged with
TRL's metrics.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import inspect
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
from accelerate.utils import is_peft_model
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from trl import GRPOTrainer
from trl.trainer.callbacks import SyncRefModelCallback
from trl.trainer.utils import get_config_model_id

from open_r1_ext.config.grpo_config import RemoteGRPOConfig
from open_r1_ext.openai_client import OpenAICompletionsClient
from open_r1_ext.server_pool import ServerPool
from open_r1_ext.sglang_client import ServerError, ServerRequestError, SGLangClient, served_vocabulary
from open_r1_ext.trainer.dynamic_sampling import dynamic_sampling
from open_r1_ext.trainer.generation import remote_generation, server_client
from open_r1_ext.trainer.inflight import InFlightGeneration
from open_r1_ext.trainer.reference_prefetch import ReferencePrefetch
from open_r1_ext.trainer.step_timing import PARTS, StepTimer, StepTimingCallback
from open_r1_ext.trainer.stop_signal import StopOnSignal
from open_r1_ext.trainer.untempered_logps import at_temperature_one, laid_out
from open_r1_ext.trainer.weight_sync import (NetworkTransport, SyncTarget, WeightDumpError, WeightSync, WeightSyncError,
                                            epochs_crossed)

logger = logging.getLogger(__name__)
# TRL's `vllm_mode` while remote generation stands in for vLLM: neither "colocate" nor "server", so no TRL code path
# that reaches for a vLLM engine or client (e.g. the tool loop's context length under "colocate") runs.
REMOTE_VLLM_MODE = "remote"
# `GRPOTrainer.__init__`'s signature: `RemoteGRPOTrainer` takes exactly its arguments and passes each one through.
TRL_INIT = inspect.signature(GRPOTrainer.__init__)


class RemoteReference:
    """Stands in for `trainer.ref_model` when the reference lives on a server (or a pool of them): it holds a client,
    no parameters."""

    def __init__(self, client: Union[SGLangClient, ServerPool]):
        self.client = client

    def __repr__(self) -> str:
        return f"RemoteReference({self.client.base_url})"


@dataclass
class LossReference:
    """A generation batch's reference, left for the loss: the sequences sent, and their log-probs once collected."""

    sequences: list[list[int]]
    rows: Optional[dict[tuple, torch.Tensor]] = None


@dataclass
class LossForward:
    """The policy's forward in TRL's loss, awaited by `_get_per_token_logps_and_entropies`: the loss's inputs, whether
    their reference is a placeholder to collect (prefetched), whether the KL term needs the policy at temperature 1;
    once the forward ran, the reference log-probs as TRL laid them out (put back in the inputs after the loss)."""

    inputs: dict
    collect_reference: bool
    untempered: bool
    reference: Optional[torch.Tensor] = None


LEAVE_TIMEOUT_S = 10.0


def leave_process_group() -> None:
    """At exit, end this process's part of the process group (what accelerate's `end_training` does, which neither
    transformers' Trainer nor TRL calls): a gloo rank of torch 2.13 that exits with it still up while another rank runs
    on aborts ("terminate called without an active exception", exit -6): 5 exits in 8 of a bare 2-rank script, and a
    trainer rank in the test suite. The group finishes the work queued in it first; a rank that exits on an error with
    a collective still queued (its peer elsewhere) would wait for it, so the wait is bounded (`LEAVE_TIMEOUT_S`), after
    which the process exits as it did before."""
    if torch.distributed.is_initialized():
        leaving = threading.Thread(target=torch.distributed.destroy_process_group, name="leave-process-group", daemon=True)
        leaving.start()
        leaving.join(LEAVE_TIMEOUT_S)


class RemoteGRPOTrainer(GRPOTrainer):
    """A `GRPOTrainer` whose reference model and/or generation run on SGLang-protocol servers.

    Takes every argument of [`~trl.GRPOTrainer`] with its default (`reward_funcs` may be left out when an
    `environment_factory`'s environment owns the reward), `args` a [`RemoteGRPOConfig`] (default: TRL's, as one).
    With `ref_model_url` set (and `beta > 0`) no reference model is built; with `generation_url` set, completions are
    sampled by the server (`self.remote_generation`, see `generation.py`).

    Example:
        ```python
        from open_r1_ext import RemoteGRPOConfig, RemoteGRPOTrainer

        args = RemoteGRPOConfig(output_dir="out", beta=0.04, ref_model_url="http://node-3:30000",
                                generation_url="http://node-3:30000")
        trainer = RemoteGRPOTrainer(model="Qwen/Qwen2.5-1.5B-Instruct", reward_funcs=accuracy_reward,
                                    args=args, train_dataset=dataset)
        trainer.train()
        ```
    """

    def __init__(self, *pargs, **kwargs):
        call = TRL_INIT.bind(self, *pargs, **kwargs)  # TRL's TypeError for a missing or unknown argument
        call.apply_defaults()
        arguments = call.arguments
        args = arguments["args"]
        if args is None:  # TRL's default config, as ours
            model = arguments["model"]
            args = arguments["args"] = RemoteGRPOConfig(
                f"{(model if isinstance(model, str) else get_config_model_id(model.config)).split('/')[-1]}-GRPO")
        if not isinstance(args, RemoteGRPOConfig):
            raise TypeError(f"RemoteGRPOTrainer needs a RemoteGRPOConfig, got {type(args).__name__}")
        if args.async_generation and arguments["rollout_func"] is not None:
            raise ValueError("rollout_func and async_generation=True are exclusive: the look-ahead samples TRL's own "
                             "single-turn batches, which a rollout_func replaces; set async_generation=False")
        remote_reference = args.remote_reference
        beta, sync_ref_model = args.beta, args.sync_ref_model
        # TRL builds a local reference model whenever beta != 0: hide beta while it initialises. Reference sync is
        # ours (it knows epochs and remote references), so TRL's own sync callback is kept out too.
        args.beta = 0.0 if remote_reference else beta
        args.sync_ref_model = False
        try:
            super().__init__(**{name: value for name, value in arguments.items() if name != "self"})
        finally:
            args.beta, args.sync_ref_model = beta, sync_ref_model
        if sync_ref_model and is_peft_model(self.model):  # TRL's own refusal, which hiding the setting skipped
            raise ValueError("sync_ref_model=True with a PEFT policy: the reference is the base model (the adapter "
                             "disabled, or a server's base weights), which never changes; set sync_ref_model=False")
        self.beta = beta
        self.step_timer = StepTimer(PARTS)  # its parts are narrowed to this run's once the servers are known
        if torch.distributed.is_initialized():
            atexit.register(leave_process_group)

        adapter_only = syncs_adapter(self.model, args)
        network = NetworkTransport(args.distributed_backend, args.distributed_timeout, args.distributed_master_address,
                                   args.distributed_port) if args.transport == "distributed" else None
        self.weight_sync = WeightSync(self.accelerator, args.sync_dir, args.keep_last_dumps,
                                      f"{args.output_dir}/weight_sync.jsonl", targets=[], bucket_mb=args.bucket_mb,
                                      adapter_only=adapter_only, network=network)
        self.ref_client = server_client(args, args.ref_model_url, args.ref_model_server_dir, args.reference_min_replicas,
                                        args.ref_model_route, role="reference") if remote_reference else None
        self.reference_target = None
        if remote_reference:
            self.ref_model = RemoteReference(self.ref_client)
            if sync_ref_model:
                self.reference_target = SyncTarget("reference", self.ref_client, mixup_alpha=args.ref_model_mixup_alpha)
                self.weight_sync.targets.append(self.reference_target)
        self.reference_prefetch = None
        if remote_reference and args.prefetch_reference:
            # unclaimed prefetches kept: the batches read ahead, the one training, one of an evaluation
            self.reference_prefetch = ReferencePrefetch(self.ref_client, self.step_timer.part,
                                                        depth=args.max_weight_staleness + 2)
        self._deferred_reference = None  # see _generate_and_score_completions
        self._loss_references: dict[str, LossReference] = {}  # per mode ("train", "eval"): see _compute_loss
        self._loss_forward: Optional[LossForward] = None
        self.remote_generation = remote_generation(self, self.weight_sync, InFlightGeneration)
        self.dynamic_sampling = dynamic_sampling(self)  # fills each generation batch with informative groups
        if self.remote_generation is not None:
            self._use_importance_sampling(args.vllm_importance_sampling_correction)
        self._check_servers()
        self.add_callback(WeightSyncCallback(self))
        self._time_steps(remote_reference)
        self.stop_signal = StopOnSignal(self.accelerator)  # SIGTERM: checkpoint at the end of the step, then stop
        self.add_callback(self.stop_signal)

    __init__.__signature__ = TRL_INIT  # every argument of TRL's, its defaults (help() and IDEs show them)

    # ----------------------------------------------------------------- set-up
    def _use_importance_sampling(self, enabled: bool) -> None:
        """TRL applies its truncated importance-sampling correction (sampling log-probs vs. the trainer's) only
        where `use_vllm` is true; remote generation switches it through that flag, here only, with `vllm_mode` set to
        one that names no vLLM engine (`REMOTE_VLLM_MODE`)."""
        self.use_vllm, self.vllm_mode = bool(enabled), REMOTE_VLLM_MODE

    def _check_servers(self) -> None:
        """Wait for each server, then refuse to train if it serves another model or vocabulary than ours, or cannot
        do the soft reference update or load the LoRA adapters asked for; check what fits their context."""
        progress = self.accelerator.is_main_process
        generation_client = self.remote_generation.client if self.remote_generation is not None else None
        for role, client in (("reference", self.ref_client), ("generation", generation_client)):
            if client is None:
                continue
            client.wait_until_healthy(timeout=self.args.server_wait_timeout, progress=progress)
            mismatch = describe_model_mismatch(client.model_info(), self.model.config, self.processing_class)
            if mismatch:
                raise ValueError(f"The {role} server at {client.base_url} serves another model than the trainer's: {mismatch}")
        if (isinstance(generation_client, OpenAICompletionsClient) and self.remote_generation.target is not None
                and not generation_client.abilities.reloads_weights):
            raise ValueError(
                f"weight_sync_steps={self.args.weight_sync_steps}: the generation server at {generation_client.base_url} "
                "cannot reload weights (it does not answer SGLang's /model_info, as vLLM, llama.cpp and `transformers "
                "serve` do not), so the first weight sync would fail. Set weight_sync_steps=0 (a recipe's "
                "sync.weight_sync_steps: 0) to sample from the server's own fixed weights, or generate with an engine that "
                "reloads them: SGLang or the built-in server (generation_backend='sglang').")
        target = self.reference_target
        if target is not None and target.mixup_alpha not in (None, 1.0) and not target.client.server_info().get("supports_weight_mixup"):
            raise ValueError(
                f"ref_model_mixup_alpha={target.mixup_alpha}: the reference server at {target.client.base_url} does not "
                "say it can mix old and new weights on a reload (no supports_weight_mixup in its /server_info); SGLang "
                "reloads weights as they are, so every soft update would silently be a full copy. Set "
                "ref_model_mixup_alpha=1.0, or host the reference on the built-in server.")
        if generation_client is not None and getattr(self.remote_generation.target, "adapter", False):
            info, rank = generation_client.server_info(), self.model.active_peft_config.r
            if not info.get("enable_lora") or (info.get("max_lora_rank") or rank) < rank:
                raise ValueError(
                    f"The generation server at {generation_client.base_url} does not load LoRA adapters of rank {rank} "
                    f"(its /server_info: enable_lora {info.get('enable_lora')}, max_lora_rank {info.get('max_lora_rank')}), "
                    f"which adapter-only weight sync sends it: start it with --enable-lora --max-lora-rank {rank} "
                    "--lora-target-modules all (or the adapter's modules)")
        if generation_client is not None and getattr(self.remote_generation.target, "distributed", False):
            dp_size = generation_client.server_info().get("dp_size") or 1
            if dp_size > 1:
                raise ValueError(f"transport='distributed': the generation server at {generation_client.base_url} runs "
                                 f"dp_size {dp_size}, and SGLang refuses distributed weight updates with data "
                                 "parallelism: set transport='disk', or serve with dp_size 1 (replicas for more servers)")
        self._check_sequence_limit(generation_client)
        if self.remote_generation is not None:
            self.remote_generation.check_sampling()
            if not self.remote_generation.gives_sampling_logprobs:
                self._without_sampling_logprobs()

    def _check_sequence_limit(self, generation_client) -> None:
        """Before anything is sent: the most tokens of prompt + completion the servers serve (`sequence_limit`: SGLang
        refuses an input of `/server_info.max_req_input_len` tokens or more, and a reference request's input is the
        whole sequence), else the model's `max_position_embeddings`, must leave room for a prompt beside
        `max_completion_length`. Remote generation checks each batch's prompts against it."""
        clients = [c for c in (self.ref_client, generation_client) if isinstance(c, (SGLangClient, ServerPool))]
        reported = [n for n in (c.sequence_limit() for c in clients) if n is not None]
        limit = min(reported) if reported else getattr(self.model.config, "max_position_embeddings", None)
        if limit is not None and self.max_completion_length >= limit:
            raise ValueError(
                f"max_completion_length={self.max_completion_length} leaves no room for a prompt: the servers serve at "
                f"most {limit} tokens of prompt + completion ({', '.join(c.base_url for c in clients) or 'the model'}; "
                "SGLang refuses an input of the context length - 6 tokens or more, /server_info.max_req_input_len): "
                "lower max_completion_length or start the servers with a larger --context-length")
        if self.remote_generation is not None:
            self.remote_generation.sequence_limit = limit

    def _time_steps(self, remote_reference: bool) -> None:
        """Log each step's parts (`step_timing.py`): those this run can have. Weight sync is timed around the calls
        of `self.weight_sync` (it knows nothing of steps): the dump, the servers' reloads (or the broadcast they
        receive), the wait for the last seal."""
        asynchronous, in_flight = self.args.async_generation, self.args.in_flight_updates
        # (in flight, what is not a batch's group, dynamic sampling's extra rounds or the turns after a tool call, is
        # generated on the training thread)
        absent = {"generate", "rollout_wait", "group_wait"} - (
            {"group_wait", "generate"} if in_flight else {"rollout_wait"} if asynchronous else {"generate"})
        if not remote_reference:
            absent |= {"reference_send", "reference_wait"}
        elif self.reference_prefetch is None or (asynchronous and not in_flight):
            absent.add("reference_send")  # sent from TRL's hook, or from the rollout thread
        if not self.weight_sync.targets:
            absent |= {"dump", "reload_wait", "seal_wait"}
        elif all(target.distributed for target in self.weight_sync.targets):
            absent |= {"dump", "seal_wait"}  # sent over the network: no dump
        if not (in_flight and any(t.distributed and not t.adapter for t in self.weight_sync.targets)):
            absent.add("stage")  # (in-flight updates over the network stage the policy for the update thread)
        self.step_timer.parts = tuple(part for part in PARTS if part not in absent)
        for method, part in (("dump", "dump"), ("stage", "stage"), ("publish", "reload_wait"),
                             ("repush", "reload_wait"), ("send", "reload_wait"), ("wait_durable", "seal_wait")):
            self.step_timer.time_calls(self.weight_sync, method, part)
        self.add_callback(StepTimingCallback(self))

    # ------------------------------------------------------------------ hooks
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           **kwargs):
        if isinstance(model, RemoteReference):
            if self._deferred_reference is not None:  # collected once the rewards are computed: a placeholder now
                placeholder = torch.full((input_ids.size(0), logits_to_keep), float("nan"), device=input_ids.device)
                self._deferred_reference.append((placeholder, input_ids, attention_mask, logits_to_keep))
                return placeholder, None, None
            return self._reference_logps(input_ids, attention_mask, logits_to_keep), None, None
        forward = self._loss_forward
        if forward is not None and forward.reference is None:  # the policy's forward of the loss (_compute_loss)
            return self._policy_forward_of_the_loss(forward, model, input_ids, attention_mask, logits_to_keep,
                                                    batch_size, **kwargs)
        if self.temperature != 1.0 and self._is_local_reference(model):  # the KL compares models at temperature 1
            with at_temperature_one(replace=True):
                return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                                  batch_size, **kwargs)
        return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                                          **kwargs)

    def _policy_forward_of_the_loss(self, forward: LossForward, model, input_ids, attention_mask, logits_to_keep,
                                    batch_size, **kwargs):
        """TRL's forward of the policy (its log-probs at `temperature`, which the policy-gradient ratio and the
        importance sampling read), then the reference the KL term will read: collected now if it was prefetched, and
        at `temperature != 1` shifted by (tempered - untempered) policy log-probs of this same forward, so that TRL's
        `ref - logp` is the reference minus the policy's log-probs at temperature 1: both models compared as they are,
        the gradient flowing through the policy's untempered log-probs."""
        with at_temperature_one() if forward.untempered else contextlib.nullcontext() as scored:
            result = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                                batch_size, **kwargs)
        inputs = forward.inputs
        if forward.collect_reference:
            forward.reference = self._loss_reference(input_ids, attention_mask, logits_to_keep)
        else:
            forward.reference = inputs["ref_per_token_logps"]
        reference = forward.reference
        if forward.untempered:
            untempered = laid_out(scored, input_ids, attention_mask, logits_to_keep, batch_size)
            reference = reference + (result[0] - untempered)
        inputs["ref_per_token_logps"] = reference
        return result

    def _is_local_reference(self, model) -> bool:
        """Whether TRL asks for the log-probs of a reference it holds: its reference model, or the PEFT policy with
        its adapter disabled (or TRL's "ref" adapter active), TRL's reference when the policy is an adapter."""
        if self.ref_model is not None:
            return model is self.ref_model
        unwrapped = self.accelerator.unwrap_model(model)
        return self.beta != 0.0 and is_peft_model(unwrapped) and (not unwrapped.has_active_enabled_adapter
                                                                  or unwrapped.active_adapter == "ref")

    def _generate_and_score_completions(self, inputs):
        """TRL's, with the remote reference left for the loss: TRL asks for it before computing the rewards and uses
        it only in the loss, so the prefetched request runs on the server through the trainer's own log-probs, the
        rewards and the policy's forward of the loss (`_compute_loss`). The hook hands TRL a NaN placeholder, checked
        here to be returned untouched and replaced in the loss. With `dynamic_sampling`, TRL scores the batch of
        informative groups `fill` formed from `inputs`."""
        if self.dynamic_sampling is not None and self.model.training:
            inputs = self.dynamic_sampling.fill(inputs)
        if self.reference_prefetch is None:
            return super()._generate_and_score_completions(inputs)
        self._deferred_reference = []
        try:
            output = super()._generate_and_score_completions(inputs)
            deferred = self._deferred_reference
        finally:
            self._deferred_reference = None
        for placeholder, input_ids, attention_mask, logits_to_keep in deferred:
            if output.get("ref_per_token_logps") is not placeholder:
                raise RuntimeError("TRL did not return the reference log-probs it asked for as they were: this trl "
                                   "version does not fit RemoteGRPOTrainer (set prefetch_reference=False)")
            mode = "train" if self.model.training else "eval"
            self._loss_references[mode] = LossReference(reference_sequences(input_ids, attention_mask))
        return output

    def _compute_loss(self, model, inputs):
        """TRL's; when the KL term needs more than TRL's inputs hold, the reference is set once the policy's forward
        has run (`_policy_forward_of_the_loss`), before TRL reads it: a prefetched reference (a NaN placeholder) is
        collected, and at `temperature != 1` the KL compares the models at temperature 1. The inputs get the reference
        back as collected after the loss (TRL trains a batch again with `num_iterations > 1`)."""
        reference = inputs.get("ref_per_token_logps")
        if reference is None:  # beta = 0: no KL term
            return super()._compute_loss(model, inputs)
        collect = bool(self._loss_references) and bool(torch.isnan(reference).all())
        untempered = self.temperature != 1.0
        if not (collect or untempered):
            return super()._compute_loss(model, inputs)
        forward = self._loss_forward = LossForward(inputs, collect, untempered)
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._loss_forward = None
            if forward.reference is not None:
                inputs["ref_per_token_logps"] = forward.reference
        if forward.reference is None:
            raise RuntimeError("TRL's loss did not run the policy's forward through _get_per_token_logps_and_entropies: "
                               "this trl version does not fit RemoteGRPOTrainer")
        return loss

    def _loss_reference(self, input_ids, attention_mask, logits_to_keep) -> torch.Tensor:
        """The reference log-probs of a batch of the loss (rows of the generation batch, shuffled and split by TRL):
        the generation batch's prefetched answer is collected at its first batch, then each row looked up."""
        batch = self._loss_references["train" if self.model.training else "eval"]
        if batch.rows is None:
            with self.step_timer.part("reference_wait"):
                scored = self.reference_prefetch.collect(batch.sequences, self._ensure_reference_weights)
            batch.rows = {tuple(sequence): row for sequence, row in zip(batch.sequences, scored)}
        scored = [batch.rows[tuple(sequence)] for sequence in reference_sequences(input_ids, attention_mask)]
        return completion_logps(scored, input_ids, attention_mask, logits_to_keep)

    def _reference_logps(self, input_ids, attention_mask, logits_to_keep) -> torch.Tensor:
        """The reference server's log-probs in TRL's layout, asked now (without prefetch), after making sure the
        server holds the right reference."""
        with self.step_timer.part("reference_wait"):
            self._ensure_reference_weights()
            scored = self.ref_client.ref_logprobs(reference_sequences(input_ids, attention_mask))
        return completion_logps(scored, input_ids, attention_mask, logits_to_keep)

    def prefetch_reference(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], kept: bool = False) -> None:
        """Send the reference request of a batch whose completions just came back (the generation's thread): the
        sequences TRL will score, each prompt + completion (the prompt alone for a truncated completion under
        `mask_truncated_completions`). Not with tools or a `rollout_func`: their turns change the completions. With
        `dynamic_sampling`, only for the groups it `kept`."""
        if self.reference_prefetch is None or self.tools or self.rollout_func is not None:
            return
        if self.dynamic_sampling is not None and not kept:
            return
        with self.step_timer.part("reference_send"):
            stops = {*self.eos_token_ids, self._tokenizer.pad_token_id}
            masked = self.mask_truncated_completions
            self.reference_prefetch.send([list(prompt) + ([] if masked and (not ids or ids[-1] not in stops) else list(ids))
                                          for prompt, ids in zip(prompt_ids, completion_ids)])

    def _calculate_rewards(self, *args, **kwargs):
        if self.dynamic_sampling is not None and (kept := self.dynamic_sampling.take_rewards()) is not None:
            return kept  # scored already, when the batch was formed
        with self.step_timer.part("rewards"):
            return super()._calculate_rewards(*args, **kwargs)

    def training_step(self, *args, **kwargs):
        with self.step_timer.part("train"):  # less what is timed inside: generation, reference, rewards
            return super().training_step(*args, **kwargs)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.remote_generation is None:
            with self.step_timer.part("generate"):
                completion_ids, logprobs = super()._generate_single_turn(prompt_ids, images, multimodal_fields,
                                                                         num_generations, has_tool_images)
            self.prefetch_reference(prompt_ids, completion_ids)
            return completion_ids, logprobs
        if images:
            raise ValueError("remote generation (generation_url) serves text prompts only")
        completions = self.remote_generation.generate(prompt_ids, num_generations)
        completion_ids = [c.token_ids for c in completions]
        logprobs = [c.logprobs for c in completions] if all(c.logprobs is not None for c in completions) else None
        if logprobs is None:
            self._without_sampling_logprobs()
        return completion_ids, logprobs

    def _without_sampling_logprobs(self) -> None:
        """The generation server gave no sampling log-probs: TRL's importance-sampling correction, which compares them
        with the trainer's, cannot run. It is switched off for the rest of the run, said once."""
        if self.use_vllm:
            logger.warning(
                "The generation server at %s gives no sampling log-probs: TRL's importance-sampling correction "
                "(vllm_importance_sampling_correction) cannot run and is off for the rest of this run%s.",
                self.remote_generation.client.base_url,
                "; the batches async_generation samples ahead are trained without correction" if self.args.async_generation
                else "")
        self._use_importance_sampling(False)

    def _generate(self, prompts):
        if self.dynamic_sampling is not None and (sampled := self.dynamic_sampling.take_sampled(prompts)) is not None:
            return sampled  # generated already, when the batch was formed
        if self.remote_generation is not None and self.rollout_func is not None:
            # TRL would sync vLLM before a rollout_func (it reads use_vllm, on here for its importance sampling);
            # the weight-sync callback has synced the server already.
            self._last_loaded_step = self.state.global_step
        return super()._generate(prompts)

    def _tool_call_loop(self, *args, **kwargs):
        if self.remote_generation is None:
            return super()._tool_call_loop(*args, **kwargs)
        with self.remote_generation.later_turns():
            return super()._tool_call_loop(*args, **kwargs)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # (only the training loop reads its batches through this method)
        if self.remote_generation is not None:
            self.remote_generation.catch_up()  # every rank, at each step: servers that lost pushed weights get them
            epoch_iterator = self.remote_generation.batches(epoch_iterator)
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    # ------------------------------------------------------------ weight sync
    def sync_weights(self, generation_due: bool, references: list[SyncTarget]) -> None:
        """Dump the policy; the generation server (when due) and the `references` reload it (every rank calls this)."""
        step = self.state.global_step
        with self._reference_reloading() if references else contextlib.nullcontext():
            if generation_due:
                self.remote_generation.sync_weights(step, references)
            elif references and (error := self.weight_sync.sync(self.model, step, references)) is not None:
                raise WeightSyncError(f"{error}\nStopping at step {step} rather than training on a stale reference.")

    def _reference_reloading(self):
        """Around a reload of the reference server: reference requests prefetched before it are not used after it."""
        return self.reference_prefetch.reloading() if self.reference_prefetch is not None else contextlib.nullcontext()

    def sync_local_reference(self) -> None:
        model = self.accelerator.unwrap_model(self.model)
        SyncRefModelCallback.sync_target_model(model, self.ref_model, self.args.ref_model_mixup_alpha)

    def _ensure_reference_weights(self) -> None:
        """Keep the reference server on the last synced reference (restored on resume, reloaded after a restart)."""
        target = self.reference_target
        if target is None:
            return
        if target.version is None:
            entry = self.weight_sync.last_logged("reference") if self.state.global_step > 0 else None
            if entry is None or not Path(entry["path"]).is_dir():
                return
            target.path, target.version, target.step = Path(entry["path"]), entry["weight_version"], entry["step"]
        if target.client.weight_version() != target.version:
            with self._reference_reloading():
                self.weight_sync.repush(target)

    # ------------------------------------------------------------- lifecycle
    def train(self, *args, **kwargs):
        # The ~450k objects torch, transformers and TRL leave on the heap by now live as long as training: keep the
        # garbage collector from re-scanning them (measured on the tiny model: collections took ~300 ms per 10 steps,
        # ~3 ms frozen), as the server does with its start-up heap. Unfrozen at the end, so trainers built one after
        # another in a process can still be collected.
        gc.collect()
        gc.freeze()
        self._resume_generation_state(kwargs.get("resume_from_checkpoint", args[0] if args else None))
        self.stop_signal.install()
        try:
            result = super().train(*args, **kwargs)
        except ServerError as err:
            err.args = (f"{err}\n{self._stop_after_failure(err)}",)
            raise
        finally:
            self.stop_signal.uninstall()
            gc.unfreeze()
            if self.remote_generation is not None:
                self.remote_generation.close()
            if self.reference_prefetch is not None:
                self.reference_prefetch.close()
            self.weight_sync.close()
        self.weight_sync.wait_durable()  # the last dumps on disk and their syncs logged before train() returns
        return result

    def _resume_generation_state(self, checkpoint) -> None:
        """With in-flight updates, resuming from `checkpoint` (a path, or True: the last one in `output_dir`): the groups
        saved with it are drawn again; with dynamic sampling, its oversampling goes on as saved."""
        resuming = [self.remote_generation] if isinstance(self.remote_generation, InFlightGeneration) else []
        resuming += [self.dynamic_sampling] if self.dynamic_sampling is not None else []
        if not resuming or not checkpoint:
            return
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        for part in resuming if checkpoint else ():
            part.resume_from(checkpoint)

    def _save_checkpoint(self, model, trial):
        self.weight_sync.wait_durable()  # a checkpoint never runs ahead of the weight-sync log its resume reads
        result = super()._save_checkpoint(model, trial)
        checkpoint_dir = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if isinstance(self.remote_generation, InFlightGeneration):  # the groups read and not trained, drawn again on resume
            self.remote_generation.save_state(checkpoint_dir)
        if self.dynamic_sampling is not None:  # the oversampling's estimate
            self.dynamic_sampling.save_state(checkpoint_dir)
        return result

    def _stop_after_failure(self, err: ServerError) -> str:
        """After a server or weight-dump failure: log the metrics of a step that finished but was not logged yet (its
        sync failed), save a checkpoint if a step finished, and say what to do next (the cause decides when)."""
        step, history = self.state.global_step, self.state.log_history
        if self._metrics["train"] and (not history or history[-1].get("step", -1) < step):
            self.log({})
        checkpoint = self._save_resumable_checkpoint() if step > 0 else None
        if isinstance(err, WeightDumpError):
            when = "once the dump can be written (see the first line)"
        elif isinstance(err, ServerRequestError):  # a refusal is no outage: the same request would be refused again
            when = (f"once what the server refused (HTTP {err.status_code}, the first line) is fixed: the same request "
                    "would be refused again")
        else:
            when = "once the server answers again (see its log)"
        if checkpoint is None:
            return f"Training stopped at step {step}, with no checkpoint; run the same command again {when}."
        return (f"Training stopped at step {step}. A checkpoint to resume from is in {checkpoint}: run the same command "
                f"again {when}.")

    def _save_resumable_checkpoint(self) -> Optional[str]:
        try:
            self._save_checkpoint(self.model_wrapped, trial=None)
        except Exception:  # noqa: BLE001 - the server error is what the user must see
            logger.exception("could not save a checkpoint after the server failure")
            return None
        return f"{self.args.output_dir}/checkpoint-{self.state.global_step}"


class WeightSyncCallback(TrainerCallback):
    """After each optimizer step: sync the generation server every `weight_sync_steps`, and the reference every
    `ref_model_sync_steps` or `ref_model_sync_epochs` (remote: a dump it reloads; local: TRL's soft update)."""

    def __init__(self, trainer: RemoteGRPOTrainer):
        self.trainer = trainer
        self.previous_epoch = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.previous_epoch = state.epoch or 0.0

    def on_step_end(self, args, state, control, **kwargs):
        trainer, references = self.trainer, []
        generation = trainer.remote_generation
        generation_due = generation is not None and generation.sync_due(state.global_step)
        if args.sync_ref_model and reference_sync_due(args, state.global_step, self.previous_epoch, state.epoch):
            if trainer.reference_target is not None:
                references.append(trainer.reference_target)
            else:
                trainer.sync_local_reference()
        self.previous_epoch = state.epoch
        if generation_due or references:
            trainer.sync_weights(generation_due, references)


def syncs_adapter(model, args: RemoteGRPOConfig) -> bool:
    """Whether weight syncs ship a PEFT policy's LoRA adapter alone, loaded by the generation server beside its base
    weights (SGLang's dynamic LoRA); else (no PEFT, or an OpenAI-compatible server) the merged weights are dumped."""
    if not (is_peft_model(model) and args.generation_on_server and args.generation_backend == "sglang"):
        return False
    from peft import LoraConfig

    config = model.active_peft_config
    if not isinstance(config, LoraConfig) or config.use_dora or config.modules_to_save:
        raise ValueError("adapter-only weight sync (a PEFT policy, generation on an SGLang-protocol server) loads plain "
                         f"LoRA adapters, not this {type(config).__name__} (DoRA or modules_to_save included): use a "
                         "LoraConfig without use_dora and modules_to_save")
    return True


def reference_sync_due(args: RemoteGRPOConfig, step: int, previous_epoch: float, epoch: float) -> bool:
    if args.ref_model_sync_epochs is not None:
        return epochs_crossed(previous_epoch, epoch, args.ref_model_sync_epochs)
    return step % args.ref_model_sync_steps == 0


def remote_completion_logps(client: SGLangClient, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                            logits_to_keep: int) -> torch.Tensor:
    """Reference log-probs of the last `logits_to_keep` positions, laid out exactly as TRL's local reference.

    Each row is sent without its padding; entry `j` of the result is `log p(token at column T-K+j | tokens
    before it)`, and 0 where the column is padding or the row's first token (as TRL's fused LM head gives for
    masked labels). Tensor operations throughout: no Python step per row and position.
    """
    scored = client.ref_logprobs(reference_sequences(input_ids, attention_mask))
    return completion_logps(scored, input_ids, attention_mask, logits_to_keep)


def reference_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Each row of TRL's padded batch without its padding: what the reference server scores."""
    ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
    return [row.tolist() for row in ids[mask].split(mask.sum(dim=1).tolist())]


def completion_logps(scored: list[torch.Tensor], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     logits_to_keep: int) -> torch.Tensor:
    """The server's answer for `reference_sequences(input_ids, attention_mask)` (row r: the log-probs of its unpadded
    tokens 1 .. length - 1) laid out as `remote_completion_logps` describes."""
    ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
    lengths = mask.sum(dim=1)
    rows, width = ids.shape
    # table[r, p]: the log-prob of row r's p-th unpadded token (p >= 1; column 0 stays 0)
    table = torch.zeros((rows, width), dtype=torch.float32)
    counts = (lengths - 1).clamp(min=0)
    row_of = torch.repeat_interleave(torch.arange(rows), counts)
    starts = torch.cumsum(counts, dim=0) - counts
    table[row_of, torch.arange(len(row_of)) - torch.repeat_interleave(starts, counts) + 1] = torch.cat(scored).float()
    position = (mask.long().cumsum(dim=1) - 1)[:, width - logits_to_keep:]  # each kept column's unpadded index
    kept = mask[:, width - logits_to_keep:] & (position > 0)
    out = torch.where(kept, table.gather(1, position.clamp(min=0)), torch.zeros((), dtype=torch.float32))
    return out.to(input_ids.device)


def describe_model_mismatch(model_info: dict, config, tokenizer) -> Optional[str]:
    """What differs between a server's `/model_info` (`model_type`, `architectures`; the vocabulary size from the
    served model's config, `served_vocabulary`) and the trainer's model and tokenizer, or None if nothing we can see.
    A tokenizer with more tokens than the served vocabulary could send ids that kill SGLang's scheduler."""
    problems = []
    vocab, served = served_vocabulary(model_info) if model_info else (None, "")
    if vocab is not None and vocab != config.vocab_size:
        problems.append(f"vocabulary size {vocab} on the server, {config.vocab_size} in the trainer's model")
    if vocab is not None and len(tokenizer) > vocab:
        problems.append(f"the tokenizer {getattr(tokenizer, 'name_or_path', '')} has {len(tokenizer)} tokens (added "
                        f"tokens included), more than the {vocab} of the served model {served}: an id past "
                        f"{vocab - 1} would kill SGLang's scheduler. Serve a model whose embeddings cover the "
                        "tokenizer (resize_token_embeddings, then save it), or use the model's own tokenizer")
    server_type = model_info.get("model_type")
    if server_type is not None and server_type != getattr(config, "model_type", None):
        problems.append(f"model_type {server_type!r} on the server, {config.model_type!r} in the trainer")
    served, ours = model_info.get("architectures"), getattr(config, "architectures", None)
    if served and ours and sorted(served) != sorted(ours):
        problems.append(f"architectures {served} on the server, {ours} in the trainer")
    return "; ".join(problems) or None
