"""`RemoteGRPOConfig`: TRL's `GRPOConfig` plus the settings of the remote reference, generation and weight sync.

Read by `RemoteGRPOTrainer`; a recipe's `trainer:` section is parsed into it (`open_r1_ext.recipe`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from trl import GRPOConfig

GENERATION_BACKENDS = ("sglang", "openai")


@dataclass
class RemoteGRPOConfig(GRPOConfig):
    r"""
    Configuration class for [`RemoteGRPOTrainer`]: every [`~trl.GRPOConfig`] parameter, plus the ones below.

    Parameters:
        > Remote reference model

        ref_model_url (`str` or `None`, *optional*, defaults to `None`):
            Base URL of an SGLang-protocol server (SGLang, or `python -m open_r1_ext.serve`) hosting the reference
            model. When set and `beta > 0`, the trainer builds no reference model: per-token reference log-probs of
            prompt + completion come from the server. SGLang returns these log-probs at temperature 1 (unscaled);
            TRL scales its local reference by `temperature`, so the two agree exactly at `temperature=1.0`.

        > Remote generation

        generation_url (`str` or `None`, *optional*, defaults to `None`):
            Base URL of the server that generates completions. Prompts are sent as token ids and completions come back
            as token ids, `num_generations` samples per prompt, each with its own `sampling_seed`.
        generation_backend (`str`, *optional*, defaults to `"sglang"`):
            Protocol of `generation_url`: `"sglang"` (native `/generate`, token ids in and out, with sampling
            log-probs) or `"openai"` (any OpenAI-compatible `/v1/completions` server).
        generation_model_name (`str` or `None`, *optional*, defaults to `None`):
            The `model` field sent to an OpenAI-compatible server (`generation_backend="openai"`); defaults to the
            first model the server lists at `/v1/models`.

        > Server connection

        server_api_key (`str` or `None`, *optional*, defaults to `None`):
            Sent as `Authorization: Bearer KEY` to every server.
        request_timeout (`float`, *optional*, defaults to `600.0`):
            Seconds one HTTP call may take before it is retried.
        max_retries (`int`, *optional*, defaults to `8`):
            Retries of a call on connection errors and HTTP 5xx, with exponential back-off (0.5 s doubling, 30 s at
            most: about two minutes in all). A server that stays down longer stops training with an error and a
            checkpoint to resume from.
        server_wait_timeout (`float`, *optional*, defaults to `900.0`):
            Seconds to wait at start-up for the servers to answer `/health`.
        max_batch_tokens (`int`, *optional*, defaults to `65536`):
            Token budget of one request; larger batches are split and the parts sent concurrently.
    """

    ref_model_url: Optional[str] = field(
        default=None,
        metadata={"help": "Base URL of the SGLang-protocol server hosting the reference model; no local reference is built."},
    )
    generation_url: Optional[str] = field(
        default=None,
        metadata={"help": "Base URL of the server that generates completions (token ids in, token ids out)."},
    )
    generation_backend: str = field(
        default="sglang",
        metadata={"help": "Protocol of `generation_url`.", "choices": list(GENERATION_BACKENDS)},
    )
    generation_model_name: Optional[str] = field(
        default=None,
        metadata={"help": "`model` sent to an OpenAI-compatible server; default: the first one it lists."},
    )
    server_api_key: Optional[str] = field(
        default=None, metadata={"help": "Sent as `Authorization: Bearer KEY` to every server."}
    )
    request_timeout: float = field(default=600.0, metadata={"help": "Seconds one HTTP call may take."})
    max_retries: int = field(
        default=8, metadata={"help": "Retries on connection errors and HTTP 5xx, with exponential back-off."}
    )
    server_wait_timeout: float = field(
        default=900.0, metadata={"help": "Seconds to wait at start-up for the servers to become healthy."}
    )
    max_batch_tokens: int = field(
        default=65536, metadata={"help": "Token budget of one request; larger batches are split and sent concurrently."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.generation_backend not in GENERATION_BACKENDS:
            raise ValueError(
                f"generation_backend={self.generation_backend!r}: choose one of {', '.join(GENERATION_BACKENDS)}"
            )
        for name in ("ref_model_url", "generation_url"):
            url = getattr(self, name)
            if url is not None and not url.startswith(("http://", "https://")):
                raise ValueError(f"{name}={url!r}: give a base URL such as 'http://node-3:30000'")
        if self.use_vllm and self.generation_url:
            raise ValueError("use_vllm=True and generation_url are exclusive: generation happens on one backend")
        if self.request_timeout <= 0 or self.server_wait_timeout <= 0:
            raise ValueError("request_timeout and server_wait_timeout must be positive (seconds)")
        if self.max_retries < 0:
            raise ValueError(f"max_retries={self.max_retries}: must be >= 0")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens={self.max_batch_tokens}: must be >= 1")

    @property
    def remote_reference(self) -> bool:
        return self.ref_model_url is not None and self.beta != 0.0

