"""`RemoteGRPOConfig`: TRL's `GRPOConfig` plus the settings of the remote reference, generation and weight sync.

Read by `RemoteGRPOTrainer`; a recipe's `trainer:` section is parsed into it (`open_r1_ext.config.recipe`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from trl import GRPOConfig

from open_r1_ext.protocol import completions_field, sampling_range_problems
from open_r1_ext.sglang_client import (DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_RETRIES, DEFAULT_REQUEST_TIMEOUT,
                                       DEFAULT_SERVER_WAIT_TIMEOUT, sampling_kwargs)
from open_r1_ext.weight_broadcast import BACKENDS, DEFAULT_TIMEOUT_S
from open_r1_ext.weight_files import DEFAULT_BUCKET_MB, default_sync_dir

GENERATION_BACKENDS = ("sglang", "openai")
TRANSPORTS = ("disk", "distributed")
SYNC = {"section": "sync"}  # field metadata: the field belongs in a recipe's `sync:` section (open_r1_ext.config.recipe)


def _trl_sync_field(name: str):
    """TRL's `GRPOConfig` field `name` as it is (default and help), tagged for a recipe's `sync:` section."""
    trl = GRPOConfig.__dataclass_fields__[name]
    return field(default=trl.default, metadata={**trl.metadata, **SYNC})


@dataclass
class RemoteGRPOConfig(GRPOConfig):
    r"""
    Configuration class for [`RemoteGRPOTrainer`]: every [`~trl.GRPOConfig`] parameter, plus the ones below.

    Parameters:
        > Remote reference model

        ref_model_url (`str` or `None`, *optional*, defaults to `None`):
            Base URL of an SGLang-protocol server (SGLang, or `python -m open_r1_ext.server`) hosting the reference
            model. When set and `beta > 0`, the trainer builds no reference model: per-token reference log-probs of
            prompt + completion come from the server. SGLang returns these log-probs at temperature 1 (never divided
            by `temperature`), so the KL term compares the models at temperature 1 at any `temperature`: the
            policy's side of it is the policy's log-probs at temperature 1 (from the loss's own forward), and a local
            reference (no `ref_model_url`) is scored at temperature 1 too; the policy-gradient ratio keeps TRL's
            tempered log-probs. At `temperature=1.0` this is TRL's KL exactly; the KL is 0 at identical weights for
            every temperature.
        prefetch_reference (`bool`, *optional*, defaults to `True`):
            Send a batch's reference request the moment its completions exist (right after generation; with
            `async_generation`, on the rollout thread), so the server scores it while the trainer computes its own
            log-probs, the rewards and the policy's forward of the loss, and collect the answer in the loss after that
            forward. A prefetch made before a reference
            reload is discarded and asked again. `False` sends the request when TRL's reference hook asks for it.

        > Remote generation

        generation_url (`str`, `list[str]` or `None`, *optional*, defaults to `None`):
            Base URL of the server that generates completions, or a list of them (a pool of replicas, see below).
            Prompts are sent as token ids and completions come back as token ids, `num_generations` samples per
            prompt, each with its own `sampling_seed`.
        generation_backend (`str`, *optional*, defaults to `"sglang"`):
            Protocol of `generation_url`: `"sglang"` (native `/generate`, token ids in and out, with sampling
            log-probs) or `"openai"` (any OpenAI-compatible `/v1/completions` server, probed at start-up: the
            sampling settings go out under their `/v1/completions` names, those the server cannot be sent are refused
            before training; SGLang's `metadata.weight_version` is each completion's weight version; an aborted
            choice is asked again; without sampling log-probs the importance-sampling correction is off, said once).
        generation_model_name (`str` or `None`, *optional*, defaults to `None`):
            The `model` field sent to an OpenAI-compatible server (`generation_backend="openai"`); defaults to the
            first model the server lists at `/v1/models`.

        With `generation_url`, TRL's `generation_kwargs` are SGLang `sampling_params`: checked here against SGLang's
        names (vLLM's `min_tokens` becomes `min_new_tokens`; an unknown key is refused with the list of valid ones)
        and the ranges SGLang takes (e.g. `repetition_penalty` in (0, 2], `top_k` -1 or >= 1, `min_new_tokens` at most
        `max_completion_length`), as is `repetition_penalty`; with `generation_backend="openai"`, also a key SGLang's
        `/v1/completions` has no field for.

        > Replica pools

        With several generation URLs or an address directory, generation and reference requests go to a pool of
        replicas (`open_r1_ext.server_pool.ServerPool`): each prompt's samples on one replica, a batch spread by least
        outstanding tokens, every weight sync to every replica; a replica that fails is dropped and its requests
        re-sent to the others, one that joins is loaded with the current weights first.

        generation_server_dir (`str` or `None`, *optional*, defaults to `None`):
            Address directory of the generation replicas: each `<name>.addr` file (one `host:port` line, written by a
            server job once it is healthy, removed when it stops) is a replica; files that appear or go are replicas
            that join or leave. Rescanned every 2 s.
        generation_min_replicas (`int`, *optional*, defaults to `1`):
            Serving generation replicas needed: below it the trainer waits up to `server_wait_timeout` for replicas to
            (re)join, then stops with a checkpoint and a message naming the lost replicas.
        ref_model_server_dir (`str` or `None`, *optional*, defaults to `None`):
            Address directory of the reference's replicas, as `generation_server_dir` (`ref_model_url` may also be a
            list of URLs).
        ref_model_route (`str`, *optional*, defaults to `""`):
            Appended to each address read from `ref_model_server_dir`: `"/ref"` for the built-in generation servers'
            reference slot.
        reference_min_replicas (`int`, *optional*, defaults to `1`):
            As `generation_min_replicas`, for the reference's replicas.

        > Server connection

        server_api_key (`str` or `None`, *optional*, defaults to `None`):
            Sent as `Authorization: Bearer KEY` to every server.
        server_admin_api_key (`str` or `None`, *optional*, defaults to `None`):
            Sent instead on `/update_weights_from_disk` and `/flush_cache`, for SGLang servers started with
            `--admin-api-key` (which then lock those routes to it).
        request_timeout (`float`, *optional*, defaults to `600.0`):
            Seconds one HTTP call may take before it is retried.
        max_retries (`int`, *optional*, defaults to `8`):
            Retries of a call on connection errors and HTTP 5xx, with exponential back-off (waits of 0, 1, 2, 4, 8,
            16, 30, 30 s: 91 s in all, plus up to 10 s to connect per try). This is the one budget of a failure: a
            weight reload adds no attempts while the server does not answer. A server that stays down longer stops
            training with a short message and a checkpoint to resume from.
        server_wait_timeout (`float`, *optional*, defaults to `900.0`):
            Seconds to wait at start-up for the servers to answer `/health`.
        max_batch_tokens (`int`, *optional*, defaults to `65536`):
            Token budget of one request; larger batches are split and the parts sent concurrently.

        > Weight sync

        weight_sync_steps (`int`, *optional*, defaults to `1`):
            Every this many optimizer steps the policy is dumped to `sync_dir` and the generation server reloads it
            (`/update_weights_from_disk`); 1 is on-policy GRPO, 0 never syncs (generation stays on the initial weights).
        sync_dir (`str` or `None`, *optional*, defaults to `None`):
            Directory the servers can read (a shared file system on a cluster) for the dumps `step-<N>/`; defaults
            to `<output_dir>/weights`.
        keep_last_dumps (`int`, *optional*, defaults to `2`):
            Dumps kept on disk; older ones are deleted once a server confirmed a newer one. 0 keeps all.
        bucket_mb (`float`, *optional*, defaults to `1024.0`):
            A dump walks the policy in buckets of at most this many MB (10^6 bytes), each written as one safetensors
            shard; under DeepSpeed ZeRO-3 only one bucket is gathered at a time, so a dump needs about one bucket of
            extra memory per process, whatever the model's size. With N processes each writes every N-th shard.
        transport (`str`, *optional*, defaults to `"disk"`):
            How the generation server gets the policy: `"disk"` (a dump in `sync_dir` it reloads) or `"distributed"`
            (the main process broadcasts it over torch.distributed, SGLang's `/update_weights_from_distributed`, in
            buckets of `bucket_mb`: nothing is written to disk; the reference's syncs stay dumps). The servers must
            reach this process's address and ports; a server with `dp_size > 1` is refused (SGLang's rule); a LoRA
            adapter is sent in the request instead (`/load_lora_adapter_from_tensors`); OpenAI-compatible servers
            sync through the disk.
        distributed_backend (`str`, *optional*, defaults to `"auto"`):
            `"nccl"`, `"gloo"`, or `"auto"`: NCCL when the trainer is on a GPU and no server says it runs elsewhere
            (`/server_info` `device`), else gloo.
        distributed_timeout (`float`, *optional*, defaults to `300.0`):
            Seconds a group's formation, one bucket's broadcast or one of its HTTP calls may take; past it the server
            is reported and left out of the update (the broadcaster process is killed if it does not return).
        distributed_master_address (`str` or `None`, *optional*, defaults to `None`):
            The address of the trainer's main process that the servers connect to; default: the address of the
            interface this machine reaches each server through.
        distributed_port (`int`, *optional*, defaults to `0`):
            The first port the trainer listens on, one per server (a firewall's opening); 0 takes free ports.
        max_weight_staleness (`int`, *optional*, defaults to `0`):
            When a reload fails after its retries, training stops (0) unless the generation weights are at most this
            many steps old, in which case it goes on with a warning.
        ref_model_sync_steps (`int` or `None`, *optional*, defaults to `None`):
            With `sync_ref_model=True`, sync the reference every this many steps (TRL's τ, and TRL's default 512 when neither this nor
            `ref_model_sync_epochs` is given). With a remote reference, a sync is a dump the reference server reloads.
        ref_model_sync_epochs (`int`, `float` or `None`, *optional*, defaults to `None`):
            With `sync_ref_model=True`, sync the reference every this many epochs: an int >= 1, or a float in (0, 1)
            for a fraction of an epoch (DeepSeekMath syncs once per epoch). Give this or `ref_model_sync_steps`.

        > Overlapping generation with training

        async_generation (`bool`, *optional*, defaults to `False`):
            Generate the next batches on the server while the current one trains (one background thread per
            process). Batches are then up to `max_weight_staleness` steps off-policy (at least 1: set to 1 when 0),
            corrected by TRL's truncated importance sampling (`vllm_importance_sampling_correction`, on by
            default); the staleness of each batch is logged. Needs `generation_url` and `weight_sync_steps=1`.
        in_flight_updates (`bool`, *optional*, defaults to `False`):
            With `async_generation`: generation never waits for a weight sync, nor training for a whole batch. Each
            trainer process keeps up to `max_prompts_in_flight` prompts on the generation servers, one request per
            prompt (its group of `num_generations` completions), and a step trains on the next groups to complete,
            in the order they complete, not on the batch it read. A weight sync pauses every server
            (`/pause_generation` mode `retract`), gives it the new weights (it reloads the dump, or with
            `transport='distributed'` receives the broadcast) and continues (`/continue_generation`): the completions
            under way go on with the new weights, their KV cache recomputed, so one completion may span several
            weight versions, each token's sampling log-prob the one it was drawn with (TRL's truncated importance
            sampling corrects per token). A completion's staleness counts from its oldest token: the step it trains
            at minus the version of the weights that token was drawn with; a group's is its completions' largest.
            A group whose staleness would exceed `max_weight_staleness` when a step takes it (or with tokens from a
            broadcast that stopped half-way, `<N>-partial`) is dropped, never trained on, and its prompt sent again
            (logged in `rollouts.jsonl`, counted in `inflight/dropped_groups`);
            set `max_weight_staleness` to at least the steps your longest completions take, or they are dropped
            over and over (biasing training towards short completions). Before a step takes groups, the main process
            waits for the reload that makes them possible (`timing/reload_wait`). The groups read but not trained
            when a checkpoint is saved are saved with it and drawn again on resume (the data loader resumes after
            the trained batches, as TRL's). With adapter-only LoRA sync a sync aborts the requests under way and
            sends each again from its tokens so far under the new adapter (a request keeps the adapter it named).
            Needs generation on SGLang-protocol servers (SGLang, or the built-in server), and optimizer steps lined
            up with generation batches
            (one of `gradient_accumulation_steps`, `steps_per_generation x num_iterations` a multiple of the other, as
            at TRL's default `steps_per_generation`). When a batch trains over several optimizer steps
            (`num_iterations > 1`), `save_steps` and (when checkpoints are saved) `max_steps` must be multiples of
            that number, so that checkpoints fall between batches. With several trainer processes, `rollouts.jsonl` holds every process's groups
            (`process`).
        max_prompts_in_flight (`int` or `None`, *optional*, defaults to `None`):
            With `in_flight_updates`: the most prompts a trainer process has read from the data and not yet handed to
            a training step (sent to a server, or complete and waiting), each a group of `num_generations`
            completions; None is `max_weight_staleness` generation batches' prompts, at least two batches' (a group
            read now is trained about that many steps later). More keeps the servers busier through long
            completions, at the price of staleness (groups dropped as too stale); at least the prompts of one
            generation batch.

        > Dynamic sampling (DAPO)

        dynamic_sampling (`bool`, *optional*, defaults to `False`):
            Train only informative groups: a group whose completions' rewards do not spread (see
            `dynamic_sampling_min_std`) has zero advantage, so it is dropped after its rewards are computed, and more
            prompts are sampled until the generation batch is full of informative groups, the same size as without
            filtering (DAPO's dynamic sampling). The prompts added are drawn at random from the training set, seeded
            by (`seed`, step, process), each once in a step before any twice and the batch's own prompts last (with
            `async_generation`, the oversampled prompts sent with a batch read ahead: by that batch's prompts; with
            `in_flight_updates`, the refills kept in flight for the extra rounds: by (`seed`, process) alone): a
            resumed run draws the same ones (in flight: that order from its start again), and they do not advance
            the epoch; a filtered prompt counts as seen in its epoch. The reference log-probs (and TRL's own
            log-probs) are computed for the trained groups only. The decision is taken on every process's groups
            together, so each process trains a full batch of the same size. Needs each process's generation batch
            to hold whole groups, a map-style training set, and neither `tools` nor an `environment_factory`.
        dynamic_sampling_reward (`str` or `None`, *optional*, defaults to `None`):
            The reward function (by name, as in `rewards/<name>/mean`) whose spread decides; `None`: the weighted sum
            of the rewards, which TRL normalizes into advantages.
        dynamic_sampling_min_std (`float`, *optional*, defaults to `0.0`):
            A group is informative when the standard deviation of its rewards is above this (0: any spread at all).
        dynamic_sampling_max_rounds (`int`, *optional*, defaults to `4`):
            The most extra generation rounds for one generation batch. When they are spent the batch is trained as
            it is: its informative groups, topped up with filtered ones (zero advantage, as without filtering), and a
            warning says so; `dynamic_sampling/informative_share` below 1 shows it.
        dynamic_sampling_max_oversampling (`float`, *optional*, defaults to `2.0`):
            When the last generation batch's groups were partly filtered, the next one asks for more prompts at once
            (1 / the informative share last time, at most this multiple of the batch's prompts), so that a step
            rarely needs a second round (not with `in_flight_updates`, where the batch's groups complete in flight
            and oversampling them would be a request of its own); 1.0 turns oversampling off. An extra round asks for
            the groups still missing over the informative share this batch's rounds have found so far, at most this
            multiple of the batch's prompts too. Informative groups beyond the batch are dropped.
    """

    ref_model_url: Optional[Union[str, list[str]]] = field(
        default=None,
        metadata={"help": "Base URL of the SGLang-protocol server hosting the reference model (or a list: a pool of "
                          "replicas); no local reference is built."},
    )
    prefetch_reference: bool = field(
        default=True,
        metadata={"help": "Send each batch's reference request as soon as its completions exist (overlapped with the "
                          "trainer's own log-probs, the rewards and the policy's forward of the loss)."},
    )
    generation_url: Optional[Union[str, list[str]]] = field(
        default=None,
        metadata={"help": "Base URL of the server that generates completions (token ids in, token ids out), or a list "
                          "of them: a pool of replicas."},
    )
    generation_backend: str = field(
        default="sglang",
        metadata={"help": "Protocol of `generation_url`.", "choices": list(GENERATION_BACKENDS)},
    )
    generation_model_name: Optional[str] = field(
        default=None,
        metadata={"help": "`model` sent to an OpenAI-compatible server; default: the first one it lists."},
    )
    generation_server_dir: Optional[str] = field(
        default=None,
        metadata={"help": "Address directory of the generation replicas (`<name>.addr` files, one `host:port` each): "
                          "a pool that replicas join and leave."},
    )
    generation_min_replicas: int = field(
        default=1, metadata={"help": "Serving generation replicas needed; below it the trainer waits, then stops."}
    )
    ref_model_server_dir: Optional[str] = field(
        default=None, metadata={"help": "Address directory of the reference's replicas."}
    )
    ref_model_route: str = field(
        default="", metadata={"help": "Appended to each address of ref_model_server_dir (`/ref`: the built-in reference slot)."}
    )
    reference_min_replicas: int = field(
        default=1, metadata={"help": "Serving reference replicas needed; below it the trainer waits, then stops."}
    )
    server_api_key: Optional[str] = field(
        default=None, metadata={"help": "Sent as `Authorization: Bearer KEY` to every server."}
    )
    server_admin_api_key: Optional[str] = field(
        default=None, metadata={"help": "Sent as the bearer token on /update_weights_from_disk and /flush_cache."}
    )
    request_timeout: float = field(default=DEFAULT_REQUEST_TIMEOUT, metadata={"help": "Seconds one HTTP call may take."})
    max_retries: int = field(
        default=DEFAULT_MAX_RETRIES, metadata={"help": "Retries on connection errors and HTTP 5xx, with exponential back-off."}
    )
    server_wait_timeout: float = field(
        default=DEFAULT_SERVER_WAIT_TIMEOUT, metadata={"help": "Seconds to wait at start-up for the servers to become healthy."}
    )
    max_batch_tokens: int = field(
        default=DEFAULT_MAX_BATCH_TOKENS, metadata={"help": "Token budget of one request; larger batches are split and sent concurrently."}
    )

    weight_sync_steps: int = field(
        default=1, metadata={"help": "Sync the generation server's weights every this many steps (0: never).", **SYNC}
    )
    sync_dir: Optional[str] = field(
        default=None, metadata={"help": "Shared directory for weight dumps; default <output_dir>/weights.", **SYNC}
    )
    keep_last_dumps: int = field(default=2, metadata={"help": "Weight dumps kept on disk (0: all).", **SYNC})
    bucket_mb: float = field(
        default=DEFAULT_BUCKET_MB,
        metadata={"help": "Dumps gather (ZeRO-3) and write the policy in buckets of at most this many MB, one shard each.",
                  **SYNC},
    )
    transport: str = field(
        default="disk",
        metadata={"help": "How the generation server gets the policy: a dump it reloads, or a broadcast over "
                          "torch.distributed.", "choices": list(TRANSPORTS), **SYNC},
    )
    distributed_backend: str = field(
        default="auto", metadata={"help": "With transport distributed: nccl, gloo, or auto (NCCL on GPUs).",
                                  "choices": list(BACKENDS), **SYNC},
    )
    distributed_timeout: float = field(
        default=DEFAULT_TIMEOUT_S,
        metadata={"help": "With transport distributed: seconds a group formation, bucket or HTTP call may take.", **SYNC},
    )
    distributed_master_address: Optional[str] = field(
        default=None, metadata={"help": "With transport distributed: the trainer's address the servers connect to.", **SYNC}
    )
    distributed_port: int = field(
        default=0, metadata={"help": "With transport distributed: the first port the trainer listens on (0: free ports).",
                             **SYNC}
    )
    max_weight_staleness: int = field(
        default=0, metadata={"help": "After a failed reload, go on if generation weights are at most this many steps old.", **SYNC}
    )
    sync_ref_model: bool = _trl_sync_field("sync_ref_model")
    ref_model_mixup_alpha: float = _trl_sync_field("ref_model_mixup_alpha")
    ref_model_sync_steps: Optional[int] = field(
        default=None,
        metadata={"help": "With sync_ref_model, sync the reference every this many steps (TRL's default if no epochs "
                          "given).", **SYNC},
    )
    ref_model_sync_epochs: Optional[Union[int, float]] = field(
        default=None,
        metadata={"help": "With sync_ref_model, sync the reference every this many epochs: int >= 1 or float in (0, 1).",
                  **SYNC},
    )

    async_generation: bool = field(
        default=False,
        metadata={"help": "Generate the next batch while the current one trains (off-policy by max_weight_staleness).",
                  **SYNC},
    )
    in_flight_updates: bool = field(
        default=False,
        metadata={"help": "With async_generation: keep prompts in flight on the servers, pause-reload-continue them at "
                          "each weight sync, train on groups as they complete.", **SYNC},
    )
    max_prompts_in_flight: Optional[int] = field(
        default=None,
        metadata={"help": "With in_flight_updates: prompts read and not yet trained, per process (default: "
                          "max_weight_staleness generation batches' worth, at least two).", **SYNC},
    )

    dynamic_sampling: bool = field(
        default=False,
        metadata={"help": "Drop groups whose rewards do not spread (zero advantage) and sample more prompts until the "
                          "batch is full of informative groups (DAPO's dynamic sampling)."},
    )
    dynamic_sampling_reward: Optional[str] = field(
        default=None,
        metadata={"help": "With dynamic_sampling: the reward function whose spread decides (default: the weighted sum "
                          "of the rewards)."},
    )
    dynamic_sampling_min_std: float = field(
        default=0.0,
        metadata={"help": "With dynamic_sampling: a group is informative when its rewards' standard deviation is above "
                          "this."},
    )
    dynamic_sampling_max_rounds: int = field(
        default=4,
        metadata={"help": "With dynamic_sampling: the most extra generation rounds per batch; then the batch trains as "
                          "it is, topped up with filtered groups."},
    )
    dynamic_sampling_max_oversampling: float = field(
        default=2.0,
        metadata={"help": "With dynamic_sampling: ask for up to this multiple of a batch's prompts in a round when "
                          "recent groups were mostly filtered (1.0: never more)."},
    )

    def __post_init__(self):
        steps, epochs = self.ref_model_sync_steps, self.ref_model_sync_epochs
        if steps is not None and epochs is not None:
            raise ValueError(
                f"ref_model_sync_steps={steps} and ref_model_sync_epochs={epochs}: give exactly one of them"
            )
        if epochs is not None:
            if isinstance(epochs, bool) or not isinstance(epochs, (int, float)):
                raise ValueError(f"ref_model_sync_epochs={epochs!r}: an int >= 1 or a float in (0, 1)")
            if isinstance(epochs, int) and epochs < 1:
                raise ValueError(f"ref_model_sync_epochs={epochs}: an int must be >= 1")
            if isinstance(epochs, float) and not 0.0 < epochs < 1.0:
                raise ValueError(
                    f"ref_model_sync_epochs={epochs}: a float must lie in (0, 1) (a fraction of an epoch); "
                    "write whole epochs as an int"
                )
        elif steps is None:
            self.ref_model_sync_steps = GRPOConfig.__dataclass_fields__["ref_model_sync_steps"].default
        if self.activation_checkpointing is None:
            # TRL's `gradient_checkpointing` (default True) is transformers' deprecated name: carry it over as
            # transformers would, without the FutureWarning it raises for every config built (recipe checks, jobs)
            self.activation_checkpointing = self.gradient_checkpointing
        super().__post_init__()
        if self.generation_backend not in GENERATION_BACKENDS:
            raise ValueError(
                f"generation_backend={self.generation_backend!r}: choose one of {', '.join(GENERATION_BACKENDS)}"
            )
        for name in ("ref_model_url", "generation_url"):
            urls = getattr(self, name)
            for url in [urls] if isinstance(urls, str) else urls or ():
                if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                    raise ValueError(f"{name}={url!r}: give a base URL such as 'http://node-3:30000'")
        for name in ("generation_min_replicas", "reference_min_replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.generation_backend == "openai" and (self.generation_server_dir or isinstance(self.generation_url, list)):
            raise ValueError("generation_backend='openai' drives one server: give one generation_url (a pool of "
                             "replicas needs generation_backend='sglang')")
        if self.use_vllm and self.generation_on_server:
            raise ValueError("use_vllm=True and generation_url are exclusive: generation happens on one backend")
        if self.generation_on_server:
            for name, must in sampling_range_problems({"repetition_penalty": self.repetition_penalty}):
                raise ValueError(f"{name}={getattr(self, name)}: must be {must} with generation on a server, or SGLang "
                                 "answers every request with HTTP 400")
        if self.generation_on_server and self.generation_kwargs:
            self.generation_kwargs = sampling_kwargs(self.generation_kwargs, max_new_tokens=self.max_completion_length)
            if self.generation_backend == "openai":
                for key in self.generation_kwargs:
                    if completions_field(key) is None:
                        raise ValueError(f"generation_kwargs.{key}: SGLang's /v1/completions has no such field, so "
                                         "generation_backend='openai' cannot send it; drop it, or use "
                                         "generation_backend='sglang'")
        if self.request_timeout <= 0 or self.server_wait_timeout <= 0:
            raise ValueError("request_timeout and server_wait_timeout must be positive (seconds)")
        if self.max_retries < 0:
            raise ValueError(f"max_retries={self.max_retries}: must be >= 0")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens={self.max_batch_tokens}: must be >= 1")
        for name in ("weight_sync_steps", "keep_last_dumps", "max_weight_staleness"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r}: choose one of {', '.join(TRANSPORTS)}")
        if self.distributed_backend not in BACKENDS:
            raise ValueError(f"distributed_backend={self.distributed_backend!r}: choose one of {', '.join(BACKENDS)}")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout={self.distributed_timeout}: must be > 0 (seconds)")
        if not 0 <= self.distributed_port <= 65535:
            raise ValueError(f"distributed_port={self.distributed_port}: a port in 1-65535, or 0 for free ports")
        if self.transport == "distributed" and self.generation_backend == "openai":
            raise ValueError("transport='distributed' with generation_backend='openai': an OpenAI-compatible server has "
                             "no distributed weight update; use transport='disk'")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb={self.bucket_mb}: must be > 0 (MB per shard of a weight dump)")
        if self.ref_model_sync_steps is not None and self.ref_model_sync_steps < 1:
            raise ValueError(f"ref_model_sync_steps={self.ref_model_sync_steps}: must be >= 1")
        if self.sync_dir is None:
            self.sync_dir = default_sync_dir(self.output_dir)
        if self.async_generation:
            if not self.generation_on_server:
                raise ValueError("async_generation=True needs generation_url: it overlaps remote generation with training")
            if self.weight_sync_steps != 1:
                raise ValueError(f"async_generation=True needs weight_sync_steps=1 (got {self.weight_sync_steps}): "
                                 "its staleness bound counts one reload per step")
            self.max_weight_staleness = max(self.max_weight_staleness, 1)
        self._check_in_flight()
        self._check_dynamic_sampling()

    def _check_in_flight(self) -> None:
        """`in_flight_updates` and `max_prompts_in_flight`: what they need (see the class docstring)."""
        if self.max_prompts_in_flight is not None and self.max_prompts_in_flight < 1:
            raise ValueError(f"max_prompts_in_flight={self.max_prompts_in_flight}: must be >= 1")
        if not self.in_flight_updates:
            return
        if not self.async_generation:
            raise ValueError("in_flight_updates=True needs async_generation=True (it keeps generation running beside "
                             "training)")
        if self.generation_backend != "sglang":
            raise ValueError("in_flight_updates=True needs generation_backend='sglang': it pauses and continues the "
                             "servers with SGLang's /pause_generation and /continue_generation")
        period = self.steps_per_generation * self.num_iterations
        if period % self.gradient_accumulation_steps and self.gradient_accumulation_steps % period:
            raise ValueError(
                f"in_flight_updates=True needs optimizer steps and generation batches to line up: "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps} and steps_per_generation x "
                f"num_iterations = {period} are not multiples of one another; leave steps_per_generation at TRL's "
                "default (gradient_accumulation_steps)")
        self._check_in_flight_checkpoints(period // self.gradient_accumulation_steps)
        rows = self.per_device_train_batch_size * self.steps_per_generation
        if rows % self.num_generations:
            raise ValueError(
                f"in_flight_updates=True needs each process's generation batch to hold whole groups: "
                f"per_device_train_batch_size x steps_per_generation = {rows} is not a multiple of num_generations="
                f"{self.num_generations}")
        if self.max_prompts_in_flight is not None and self.max_prompts_in_flight < rows // self.num_generations:
            raise ValueError(f"max_prompts_in_flight={self.max_prompts_in_flight}: at least the prompts of one generation "
                             f"batch per process ({rows // self.num_generations}), or a step could never fill")

    def _check_in_flight_checkpoints(self, steps_per_batch: int) -> None:
        """With in-flight updates a generation batch trains over `steps_per_batch` optimizer steps (`num_iterations`
        at TRL's defaults): every checkpoint, and the last step, must fall between two batches, or a resumed run would
        train a batch's groups again from their first pass (the checkpoint holds no half-trained batch)."""
        if steps_per_batch <= 1:
            return
        fix = (f"use multiples of {steps_per_batch} (steps_per_generation x num_iterations / "
               "gradient_accumulation_steps)")
        if self.save_strategy == "best" or (self.save_strategy == "steps" and self.save_steps % steps_per_batch):
            raise ValueError(
                f"in_flight_updates=True with num_iterations={self.num_iterations}: each generation batch trains over "
                f"{steps_per_batch} optimizer steps, so a checkpoint must fall between two batches: save_strategy="
                f"{self.save_strategy.value!r}, save_steps={self.save_steps} could save one half-trained; {fix} for "
                "save_steps (save_strategy 'steps'), or save_strategy 'epoch' / 'no'")
        if self.save_strategy != "no" and self.max_steps > 0 and self.max_steps % steps_per_batch:
            raise ValueError(
                f"in_flight_updates=True with num_iterations={self.num_iterations}: max_steps={self.max_steps} would "
                f"stop (and save) inside a generation batch that trains over {steps_per_batch} optimizer steps; {fix}")

    def _check_dynamic_sampling(self) -> None:
        """The `dynamic_sampling_*` fields' ranges, and what filtering needs (see the class docstring)."""
        if not self.dynamic_sampling_min_std >= 0:
            raise ValueError(f"dynamic_sampling_min_std={self.dynamic_sampling_min_std}: must be >= 0")
        if self.dynamic_sampling_max_rounds < 0:
            raise ValueError(f"dynamic_sampling_max_rounds={self.dynamic_sampling_max_rounds}: must be >= 0 (extra "
                             "generation rounds per batch)")
        if not self.dynamic_sampling_max_oversampling >= 1:
            raise ValueError(f"dynamic_sampling_max_oversampling={self.dynamic_sampling_max_oversampling}: must be >= 1 "
                             "(a multiple of a batch's prompts; 1.0 never asks for more)")
        rows = self.per_device_train_batch_size * self.steps_per_generation
        if self.dynamic_sampling and rows % self.num_generations:
            raise ValueError(
                f"dynamic_sampling=True needs each process's generation batch to hold whole groups: "
                f"per_device_train_batch_size x steps_per_generation = {rows} is not a multiple of num_generations="
                f"{self.num_generations}")

    @property
    def generation_on_server(self) -> bool:
        """Whether generation runs on servers (`generation_url` or `generation_server_dir`)."""
        return bool(self.generation_url) or self.generation_server_dir is not None

    @property
    def remote_reference(self) -> bool:
        return (bool(self.ref_model_url) or self.ref_model_server_dir is not None) and self.beta != 0.0
