"""Generation through any OpenAI-compatible `/v1/completions` server (SGLang, vLLM, others).

Prompts go out as token ids. Completions come back as token ids where the server can say them (vLLM's
`return_tokens_as_token_ids`, which gives tokens as `"token_id:N"`); a server that returns only text is
re-tokenized with the trainer's tokenizer, with a one-time warning that this is lossy and that no sampling
log-probs can be used. Same `generate(...)` signature as `SGLangClient.generate`.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from open_r1_ext.protocol import Completion, completion_from_choice, completions_request, finish_reason_of_choice
from open_r1_ext.sglang_client import DEFAULT_MAX_RETRIES, DEFAULT_REQUEST_TIMEOUT, SGLangClient

logger = logging.getLogger(__name__)


class OpenAICompletionsClient:
    """`/v1/completions` client with SGLangClient's retry and timeout policy (it reuses its HTTP session)."""

    def __init__(self, base_url: str, tokenizer, model: Optional[str] = None, api_key: Optional[str] = None,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES):
        self.http = SGLangClient(base_url, api_key=api_key, request_timeout=request_timeout, max_retries=max_retries)
        self.base_url = self.http.base_url
        self.tokenizer = tokenizer
        self._model = model
        self._warned_lossy = False

    # The trainer waits for and checks every server through these two calls.
    def wait_until_healthy(self, timeout: float = 600.0, progress: bool = True) -> None:
        self.http.wait_until_healthy(timeout=timeout, progress=progress, route="/v1/models")

    def model_info(self) -> dict:
        return {}  # an OpenAI server does not describe its vocabulary

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self.http.get_json("/v1/models")["data"][0]["id"]
        return self._model

    def generate(self, prompts: Sequence[Sequence[int]], sampling: dict, n: int = 1,
                 seeds: Optional[Sequence[int]] = None) -> list[list[Completion]]:
        body = completions_request(self.model, prompts, sampling, n, seed=None if seeds is None else seeds[0])
        answer = self.http.post_json("/v1/completions", body)
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts) * n:
            raise ValueError(f"{self.base_url}/v1/completions returned {len(choices)} choices for {len(prompts)} prompts x n={n}")
        flat = [self._completion(c) for c in choices]
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _completion(self, choice: dict) -> Completion:
        completion = completion_from_choice(choice)
        if completion is not None:
            return completion
        if not self._warned_lossy:
            logger.warning(
                "%s returns completions as text only: re-tokenizing them with the trainer's tokenizer is lossy (the ids "
                "may differ from those sampled), and no sampling log-probs are used. Prefer a server that returns token "
                "ids (SGLang's native /generate, or vLLM's return_tokens_as_token_ids).", self.base_url)
            self._warned_lossy = True
        ids = self.tokenizer(choice["text"], add_special_tokens=False)["input_ids"]
        reason = finish_reason_of_choice(choice)
        if reason == "stop" and self.tokenizer.eos_token_id is not None:
            ids = ids + [self.tokenizer.eos_token_id]
        return Completion(ids, None, reason, None)
