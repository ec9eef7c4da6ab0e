"""Generation through any OpenAI-compatible `/v1/completions` server (SGLang, vLLM, others).

Prompts go out as token ids. Completions come back as token ids where the server can say them (vLLM's
`return_tokens_as_token_ids`, which gives tokens as `"token_id:N"`); a server that returns only text is
re-tokenized with the trainer's tokenizer, with a one-time warning that this is lossy and that no sampling
log-probs can be used. Same `generate(...)` signature as `SGLangClient.generate`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from open_r1_ext.sglang_client import Completion, SGLangClient

logger = logging.getLogger(__name__)
TOKEN_ID_PREFIX = "token_id:"


class OpenAICompletionsClient:
    """`/v1/completions` client with SGLangClient's retry and timeout policy (it reuses its HTTP session)."""

    def __init__(self, base_url: str, tokenizer, model: Optional[str] = None, api_key: Optional[str] = None,
                 request_timeout: float = 600.0, max_retries: int = 8):
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
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": [list(map(int, p)) for p in prompts],
            "n": n,
            "max_tokens": int(sampling.get("max_new_tokens", 128)),
            "temperature": float(sampling.get("temperature", 1.0)),
            "top_p": float(sampling.get("top_p", 1.0)),
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if sampling.get("top_k", -1) > 0:
            body["top_k"] = int(sampling["top_k"])
        if sampling.get("stop_token_ids"):
            body["stop_token_ids"] = list(sampling["stop_token_ids"])
        if seeds is not None:
            body["seed"] = int(seeds[0]) % (2**31)
        answer = self.http.post_json("/v1/completions", body)
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts) * n:
            raise ValueError(f"{self.base_url}/v1/completions returned {len(choices)} choices for {len(prompts)} prompts x n={n}")
        flat = [self._completion(c) for c in choices]
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _completion(self, choice: dict) -> Completion:
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens")
        reason = choice.get("finish_reason") or "length"
        if tokens and all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in tokens):
            ids = [int(t[len(TOKEN_ID_PREFIX):]) for t in tokens]
            values = logprobs.get("token_logprobs")
            return Completion(ids, [float(v) for v in values] if values else None, reason, None)
        if not self._warned_lossy:
            logger.warning(
                "%s returns completions as text only: re-tokenizing them with the trainer's tokenizer is lossy (the ids "
                "may differ from those sampled), and no sampling log-probs are used. Prefer a server that returns token "
                "ids (SGLang's native /generate, or vLLM's return_tokens_as_token_ids).", self.base_url)
            self._warned_lossy = True
        ids = self.tokenizer(choice["text"], add_special_tokens=False)["input_ids"]
        if reason == "stop" and self.tokenizer.eos_token_id is not None:
            ids = ids + [self.tokenizer.eos_token_id]
        return Completion(ids, None, reason, None)
