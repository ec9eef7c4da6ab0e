"""`RemoteGRPOTrainer`: TRL's `GRPOTrainer` with the reference model and generation on a remote server.

It overrides two narrow hooks of trl 1.16.0 and copies none of its loop:
- `_get_per_token_logps_and_entropies`: for the reference model, the log-probs come from the server;
- `_generate_single_turn`: completions come from the server as token ids, with their sampling log-probs.
A callback (`WeightSyncCallback`) dumps the policy for the servers after optimizer steps (`weight_sync.py`).
With `async_generation`, `get_batch_samples` reads batches ahead and a rollout thread generates them while the
current step trains (`async_rollout.py`).
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Optional

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.trainer.callbacks import SyncRefModelCallback

from open_r1_ext.trainer.async_rollout import LookaheadIterator, RolloutQueue, prompts_key
from open_r1_ext.sglang_client import ServerError, SGLangClient
from open_r1_ext.trainer.config import RemoteGRPOConfig
from open_r1_ext.openai_client import OpenAICompletionsClient
from open_r1_ext.trainer.weight_sync import SyncTarget, WeightSync, WeightSyncError, epochs_crossed

logger = logging.getLogger(__name__)


class RemoteReference:
    """Stands in for `trainer.ref_model` when the reference lives on a server: it holds a client, no parameters."""

    def __init__(self, client: SGLangClient):
        self.client = client

    def __repr__(self) -> str:
        return f"RemoteReference({self.client.base_url})"


class RemoteGRPOTrainer(GRPOTrainer):
    """A `GRPOTrainer` whose reference model and/or generation run on SGLang-protocol servers.

    Takes the same arguments as [`~trl.GRPOTrainer`], with `args` a [`RemoteGRPOConfig`]. With `ref_model_url` set
    (and `beta > 0`) no reference model is built; with `generation_url` set, completions are sampled by the server.

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

    def __init__(self, model, reward_funcs, args: RemoteGRPOConfig, *pargs, **kwargs):
        if not isinstance(args, RemoteGRPOConfig):
            raise TypeError(f"RemoteGRPOTrainer needs a RemoteGRPOConfig, got {type(args).__name__}")
        if args.generation_url and kwargs.get("rollout_func") is not None:
            raise ValueError("rollout_func and generation_url are exclusive: the server does the rollout")
        remote_reference = args.remote_reference
        beta, sync_ref_model = args.beta, args.sync_ref_model
        # TRL builds a local reference model whenever beta != 0: hide beta while it initialises. Reference sync is
        # ours (it knows epochs and remote references), so TRL's own sync callback is kept out too.
        args.beta = 0.0 if remote_reference else beta
        args.sync_ref_model = False
        try:
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        finally:
            args.beta, args.sync_ref_model = beta, sync_ref_model
        self.beta = beta

        self.ref_client = self._client(args.ref_model_url) if remote_reference else None
        if remote_reference:
            self.ref_model = RemoteReference(self.ref_client)
            if args.temperature != 1.0:
                logger.warning(
                    "temperature=%s: the server's reference log-probs are unscaled (temperature 1), while TRL's local "
                    "reference is scaled by the temperature; the KL term uses the unscaled reference.", args.temperature
                )
        self.generation_client = None
        if args.generation_url:
            if args.generation_backend == "openai":
                self.generation_client = OpenAICompletionsClient(
                    args.generation_url, tokenizer=self.processing_class, model=args.generation_model_name,
                    api_key=args.server_api_key, request_timeout=args.request_timeout, max_retries=args.max_retries,
                )
            else:
                self.generation_client = self._client(args.generation_url)
            # TRL applies its importance-sampling correction (sampling log-probs vs. the trainer's) only on its vLLM
            # path; the flag is read nowhere else once `_generate_single_turn` is ours.
            self.use_vllm = bool(args.vllm_importance_sampling_correction)
        self._check_servers()

        self.generation_target = None
        if self.generation_client is not None and args.weight_sync_steps > 0:
            weights_client = getattr(self.generation_client, "http", self.generation_client)
            self.generation_target = SyncTarget("generation", weights_client)
        self.reference_target = None
        if remote_reference and sync_ref_model:
            self.reference_target = SyncTarget("reference", self.ref_client, mixup_alpha=args.ref_model_mixup_alpha)
        targets = [t for t in (self.generation_target, self.reference_target) if t is not None]
        self.weight_sync = WeightSync(self.accelerator, args.sync_dir, args.keep_last_dumps,
                                      f"{args.output_dir}/weight_sync.jsonl", targets)
        if targets or sync_ref_model:
            self.add_callback(WeightSyncCallback(self))
        self.rollouts: Optional[RolloutQueue] = None  # the async-generation thread, while training
        self._lookahead: Optional[LookaheadIterator] = None

    # ----------------------------------------------------------------- set-up
    def _client(self, url: str) -> SGLangClient:
        args = self.args
        return SGLangClient(url, api_key=args.server_api_key, request_timeout=args.request_timeout,
                            max_retries=args.max_retries, max_batch_tokens=args.max_batch_tokens)

    def _check_servers(self) -> None:
        """Wait for each server, then refuse to train if it serves another model or vocabulary than ours."""
        progress = self.accelerator.is_main_process
        for role, client in (("reference", self.ref_client), ("generation", self.generation_client)):
            if client is None:
                continue
            client.wait_until_healthy(timeout=self.args.server_wait_timeout, progress=progress)
            mismatch = describe_model_mismatch(client.model_info(), self.model.config, len(self.processing_class))
            if mismatch:
                raise ValueError(f"The {role} server at {client.base_url} serves another model than the trainer's: {mismatch}")

    # ------------------------------------------------------------------ hooks
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if isinstance(model, RemoteReference):
            self._ensure_reference_weights()
            return remote_completion_logps(model.client, input_ids, attention_mask, logits_to_keep), None, None
        return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.generation_client is None:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if images:
            raise ValueError("remote generation (generation_url) serves text prompts only")
        if self.rollouts is not None:
            announced = self.rollouts.take(prompts_key(prompt_ids))
            if announced is None:  # not read ahead (e.g. the first batch after a resume): generate it now, in order
                job = self._generation_job(prompt_ids, num_generations, self._sampling_seeds(len(prompt_ids)))
                announced = self.rollouts.submit(job)
            completions = announced.result()
        else:
            self._ensure_generation_weights()
            completions = self._generation_job(prompt_ids, num_generations, self._sampling_seeds(len(prompt_ids)))()
        self._log_rollout(completions)
        completion_ids = [c.token_ids for c in completions]
        logprobs = [c.logprobs for c in completions] if all(c.logprobs is not None for c in completions) else None
        if logprobs is None and self.use_vllm:
            self.use_vllm = False  # no sampling log-probs from this server: no importance-sampling correction
        return completion_ids, logprobs

    def _generation_job(self, prompt_ids, num_generations, seeds):
        """A callable that generates the completions of `prompt_ids` (on this thread or the rollout thread)."""
        unique, n = group_repeated_prompts(prompt_ids, num_generations)
        sampling = self._remote_sampling_params()

        def generate():
            groups = self.generation_client.generate(unique, sampling, n=n, seeds=seeds)
            completions = [c for group in groups for c in group]
            target = self.generation_target
            if target is not None and any(version_number(c.weight_version) < version_number(target.version)
                                          for c in completions if c.weight_version is not None):
                self.weight_sync.repush(target)  # the server restarted and lost our weights: reload, sample again
                groups = self.generation_client.generate(unique, sampling, n=n, seeds=seeds)
                completions = [c for group in groups for c in group]
            return completions

        return generate

    def _log_rollout(self, completions) -> None:
        """Log each batch's weight version and staleness (steps between the weights it was sampled from and the
        policy it trains); stop if it exceeds `max_weight_staleness` (plus the steps between two syncs)."""
        versions = [version_number(c.weight_version) for c in completions if c.weight_version is not None]
        if not versions or self.generation_target is None or not self.model.training:
            return
        oldest = min(versions)
        staleness = self.state.global_step - oldest
        self._metrics["train"]["remote/staleness"].append(float(staleness))
        if self.accelerator.is_main_process:
            with open(Path(self.args.output_dir) / "rollouts.jsonl", "a") as log:
                log.write(json.dumps({"step": self.state.global_step + 1, "weight_version": oldest, "staleness": staleness}) + "\n")
        allowed = self.args.max_weight_staleness + self.args.weight_sync_steps - 1
        if staleness > allowed:
            raise WeightSyncError(
                f"the batch for step {self.state.global_step + 1} was sampled from weights of step {oldest}, "
                f"{staleness} steps old (at most {allowed} allowed by max_weight_staleness): the generation server "
                "is not taking the new weights (see the warnings above)"
            )

    # -------------------------------------------------------- async generation
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if not self.args.async_generation:  # (only the training loop reads its batches through this method)
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._lookahead is None or self._lookahead.source is not epoch_iterator:
            if self.rollouts is None:
                self.rollouts = RolloutQueue()
            period = self.args.steps_per_generation * self.num_iterations
            self._lookahead = LookaheadIterator(epoch_iterator, self._announce_batch, self.args.max_weight_staleness, period)
        return super().get_batch_samples(self._lookahead, num_batches, device)

    def _announce_batch(self, batch) -> None:
        """A generation batch read ahead: queue its generation behind the reloads queued so far."""
        self._ensure_generation_weights()
        prompt_ids, _, _ = self._tokenize_prompts([example["prompt"] for example in batch])
        seeds = self._sampling_seeds(len(prompt_ids), salt=self._lookahead.read if self._lookahead else 0)
        job = self._generation_job(prompt_ids, self.num_generations, seeds)
        self.rollouts.submit_generation(prompts_key(prompt_ids), job)

    # ------------------------------------------------------------ weight sync
    def sync_weights(self, targets: list[SyncTarget]) -> None:
        """Dump the policy and have `targets` reload it (every rank calls this); stop on failure unless the
        generation weights stay within `max_weight_staleness` steps. With async generation the generation server's
        reload is queued on the rollout thread, between two generation batches; the reference's is done now, so
        the next step's reference log-probs come from the new reference."""
        step = self.state.global_step
        if self.rollouts is not None:
            path, error = self.weight_sync.dump(self.model, step)
            if error is not None:
                raise WeightSyncError(error)
            generation = [t for t in targets if t.role == "generation"]
            reference = [t for t in targets if t.role != "generation"]
            if reference and (error := self.weight_sync.publish(reference, path, step)) is not None:
                raise WeightSyncError(f"{error}\nStopping at step {step} rather than training on a stale reference.")
            self.weight_sync.share_state(generation)
            if generation and self.accelerator.is_main_process:
                self.rollouts.submit(lambda: self._push_logged(generation, path, step))
            return
        error = self.weight_sync.sync(self.model, step, targets)
        if error is None:
            return
        stale = step - (self.generation_target.step or 0) if self.generation_target is not None else step
        only_generation = all(t.role == "generation" for t in targets)
        if only_generation and stale <= self.args.max_weight_staleness:
            logger.warning("weight sync at step %d failed (%s); generating from weights %d step(s) old "
                           "(max_weight_staleness=%d)", step, error, stale, self.args.max_weight_staleness)
            return
        raise WeightSyncError(
            f"{error}\nStopping at step {step} rather than training on stale weights (set max_weight_staleness > 0 "
            "to tolerate a few failed reloads)."
        )

    def _push_logged(self, targets, path, step) -> None:
        try:
            self.weight_sync.push_and_confirm(targets, path, step)
        except WeightSyncError as err:  # the staleness check on the next batches decides whether to stop
            logger.warning("weight sync of step %d failed: %s", step, err)

    def sync_local_reference(self) -> None:
        model = self.accelerator.unwrap_model(self.model)
        SyncRefModelCallback.sync_target_model(model, self.ref_model, self.args.ref_model_mixup_alpha)

    def _ensure_generation_weights(self) -> None:
        """At the first generation of this process, make the server hold the trainer's weights (e.g. on resume)."""
        target = self.generation_target
        if target is None or target.version is not None:
            return
        reported = target.client.weight_version()
        stale = self.state.global_step > 0 or reported not in (None, "default", "0")
        if self.weight_sync.broadcast_from_main(stale if self.accelerator.is_main_process else None):
            self.sync_weights([target])
        else:
            target.version = reported

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
            self.weight_sync.repush(target)

    # --------------------------------------------------------------- helpers
    def _remote_sampling_params(self) -> dict:
        params = {
            "max_new_tokens": self.max_completion_length,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k if self.top_k and self.top_k > 0 else -1,
            "stop_token_ids": list(self.eos_token_ids),
        }
        if self.min_p is not None:
            params["min_p"] = self.min_p
        if self.repetition_penalty != 1.0:
            params["repetition_penalty"] = self.repetition_penalty
        params.update(self.args.generation_kwargs or {})
        return params

    def _sampling_seeds(self, count: int, salt: int = 0) -> list[int]:
        """One seed per sample, a function of (seed, step, mode, rank, salt): a retried or resumed step samples the same."""
        mode = "train" if self.model.training else "eval"
        rng = random.Random(f"{self.args.seed}/{self.state.global_step}/{mode}/{self.accelerator.process_index}/{salt}")
        return [rng.getrandbits(63) for _ in range(count)]

    def train(self, *args, **kwargs):
        try:
            result = super().train(*args, **kwargs)
        except ServerError as err:
            checkpoint = self._save_resumable_checkpoint()
            err.args = (
                f"{err}\nTraining stopped at step {self.state.global_step}. A checkpoint to resume from is in {checkpoint} "
                "(run the same command again once the server is back: open-r1-ext train resumes from it).",
            )
            raise
        finally:
            if self.rollouts is not None:
                self.rollouts.shutdown()
                self.rollouts, self._lookahead = None, None
        self.weight_sync.wait_durable()  # the last dumps on disk and their syncs logged before train() returns
        return result

    def _save_checkpoint(self, model, trial):
        self.weight_sync.wait_durable()  # a checkpoint never runs ahead of the weight-sync log its resume reads
        return super()._save_checkpoint(model, trial)

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
        trainer, targets = self.trainer, []
        if trainer.generation_target is not None and state.global_step % args.weight_sync_steps == 0:
            targets.append(trainer.generation_target)
        if args.sync_ref_model and reference_sync_due(args, state.global_step, self.previous_epoch, state.epoch):
            if trainer.reference_target is not None:
                targets.append(trainer.reference_target)
            else:
                trainer.sync_local_reference()
        self.previous_epoch = state.epoch
        if targets:
            trainer.sync_weights(targets)


def reference_sync_due(args: RemoteGRPOConfig, step: int, previous_epoch: float, epoch: float) -> bool:
    if args.ref_model_sync_epochs is not None:
        return epochs_crossed(previous_epoch, epoch, args.ref_model_sync_epochs)
    return step % args.ref_model_sync_steps == 0


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


def remote_completion_logps(client: SGLangClient, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                            logits_to_keep: int) -> torch.Tensor:
    """Reference log-probs of the last `logits_to_keep` positions, laid out exactly as TRL's local reference.

    Each row is sent without its padding; entry `j` of the result is `log p(token at column T-K+j | tokens
    before it)`, and 0 where the column is padding (as TRL's fused LM head gives for masked labels).
    """
    rows = input_ids.tolist()
    masks = attention_mask.bool().tolist()
    sequences = [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(rows, masks)]
    scored = client.ref_logprobs(sequences)
    width = input_ids.size(1)
    out = torch.zeros((len(rows), logits_to_keep), dtype=torch.float32)
    for row, mask in enumerate(masks):
        first = mask.index(True)
        for j in range(logits_to_keep):
            column = width - logits_to_keep + j
            if mask[column] and column > first:
                out[row, j] = scored[row][column - first - 1]
    return out.to(input_ids.device)


def describe_model_mismatch(model_info: dict, config, tokenizer_size: int) -> Optional[str]:
    """What differs between a server's `/get_model_info` and the trainer's model, or None if nothing we can see."""
    problems = []
    vocab = model_info.get("vocab_size")
    if vocab is not None and vocab != config.vocab_size:
        problems.append(f"vocabulary size {vocab} on the server, {config.vocab_size} in the trainer's model")
    if vocab is not None and tokenizer_size > vocab:
        problems.append(f"the trainer's tokenizer has {tokenizer_size} tokens, more than the server's vocabulary ({vocab})")
    server_type = model_info.get("model_type")
    if server_type is not None and server_type != getattr(config, "model_type", None):
        problems.append(f"model_type {server_type!r} on the server, {config.model_type!r} in the trainer")
    return "; ".join(problems) or None
