"""Generation through any OpenAI-compatible `/v1/completions` server (SGLang, vLLM, llama.cpp and others).

Once, at start-up, a one-token probe finds out what the server can do (`ServerAbilities`) and the client adapts:
prompts go out as token ids, else as text (decoded once, with a one-time warning that this is lossy); several prompts
in one request, else one request per prompt (a server that takes one string, as `transformers serve`); `n` copies in
one request, else one request per copy (said once); whether it reloads weights (it answers SGLang's `/model_info`:
the trainer refuses weight sync to one that cannot, before step 1); completions come back as token ids where the server says them
(SGLang's `return_token_ids` -> `choices[i].token_ids`, vLLM's `return_tokens_as_token_ids` -> `"token_id:N"`
tokens), else the text is re-tokenized with the trainer's tokenizer (lossy, warned once); sampling log-probs are used
where given, and the weight version where the server says it (SGLang's `metadata.weight_version`). The sampling
settings go out under their `/v1/completions` names (`protocol.completions_sampling`); `check_sampling` refuses, before
training, those a server cannot be sent. A choice the server aborted (`finish_reason: "abort"`, partial output) is asked
again, as `SGLangClient` does on `/generate`, never returned. With `seeds`, each copy is a request of its own with its
own `seed` (an OpenAI `seed` is per request, and SGLang gives it to every copy, so `n` copies in one seeded request
would all be the same sample). A server error (5xx) is retried a few times only: the same validation error each time
should not stall training for minutes. Same `generate(...)` signature as `SGLangClient.generate`.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from open_r1_ext.protocol import (
    Completion,
    completion_from_choice,
    completions_request,
    completions_sampling,
    completions_weight_version,
    finish_reason_of_choice,
)
from open_r1_ext.sglang_client import (
    ABORT_RETRIES,
    DEFAULT_BACKOFF_FACTOR,
    DEFAULT_MAX_RETRIES,
    DEFAULT_REQUEST_TIMEOUT,
    AbortedRequestError,
    SGLangClient,
    ServerError,
    ServerRequestError,
)

logger = logging.getLogger(__name__)

# Retries of a call the server answered with 5xx (connection errors keep `max_retries`).
DEFAULT_SERVER_ERROR_RETRIES = 2
PROBE_TEXT = "Hello"


@dataclass(frozen=True)
class ServerAbilities:
    """What an OpenAI-compatible server did with the start-up probe."""

    token_id_prompts: bool  # takes prompts as lists of token ids
    prompt_lists: bool  # takes several prompts in one request (else one string: one request per prompt)
    n_in_one_request: bool  # answers `n` choices per prompt
    token_ids: bool  # says the completions' token ids
    logprobs: bool  # gives each sampled token's log-prob
    extensions: bool  # accepts SGLang's and vLLM's extra fields (a strict server refuses unknown fields)
    reloads_weights: bool  # answers SGLang's `/model_info`, so it takes weight reloads (vLLM, llama.cpp: 404)


class OpenAICompletionsClient:
    """`/v1/completions` client with SGLangClient's timeouts and connection retries (it reuses its HTTP session).

    Args:
        base_url (`str`): the server, e.g. `"http://node-3:8000"`.
        tokenizer: the trainer's tokenizer (text prompts and completions of servers that do not take or say ids).
        model (`str` or `None`, *optional*): `model` of every request (default: the first of `/v1/models`).
        api_key (`str` or `None`, *optional*): sent as `Authorization: Bearer KEY`.
        request_timeout (`float`, *optional*, defaults to `600.0`): seconds for one HTTP call.
        max_retries (`int`, *optional*, defaults to `8`): retries on connection errors.
        server_error_retries (`int`, *optional*, defaults to `2`): retries of a call answered with HTTP 5xx.

    Examples:
        ```python
        >>> client = OpenAICompletionsClient("http://localhost:8000", tokenizer)
        >>> client.wait_until_healthy()  # then probes the server once
        >>> client.abilities
        ServerAbilities(token_id_prompts=True, prompt_lists=True, n_in_one_request=True, token_ids=True, logprobs=True,
                        extensions=True, reloads_weights=True)
        >>> client.check_sampling({"max_new_tokens": 4, "temperature": 1.0, "min_p": 0.05})  # raises if it cannot
        >>> client.generate([[1, 2, 3]], {"max_new_tokens": 4, "temperature": 1.0}, n=2, seeds=[0, 1])
        [[Completion(token_ids=[17, 3, ...], logprobs=[...], finish_reason='length', weight_version='default'), ...]]
        ```
    """

    def __init__(self, base_url: str, tokenizer, model: Optional[str] = None, api_key: Optional[str] = None,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES,
                 server_error_retries: int = DEFAULT_SERVER_ERROR_RETRIES, backoff_factor: float = DEFAULT_BACKOFF_FACTOR):
        self.http = SGLangClient(base_url, api_key=api_key, request_timeout=request_timeout, max_retries=max_retries)
        retry = Retry(total=max_retries + server_error_retries, connect=max_retries, read=max_retries,
                      status=server_error_retries, other=0, status_forcelist=(500, 502, 503, 504), allowed_methods=None,
                      backoff_factor=backoff_factor, backoff_max=30.0, raise_on_status=False)
        adapter = HTTPAdapter(max_retries=retry, pool_connections=self.http.max_concurrency,
                              pool_maxsize=self.http.max_concurrency)
        self.http.session.mount("http://", adapter)
        self.http.session.mount("https://", adapter)
        self.base_url = self.http.base_url
        self.tokenizer = tokenizer
        self._model = model
        self._abilities: Optional[ServerAbilities] = None
        self._warned: set[str] = set()

    # The trainer waits for and checks every server through these two calls.
    def wait_until_healthy(self, timeout: float = 600.0, progress: bool = True) -> None:
        self.http.wait_until_healthy(timeout=timeout, progress=progress, route="/v1/models")
        self.abilities  # noqa: B018 - probe once, at start-up

    def model_info(self) -> dict:
        return {}  # an OpenAI server does not describe its vocabulary

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self.http.get_json("/v1/models")["data"][0]["id"]
        return self._model

    # ------------------------------------------------------------------ probe
    @property
    def abilities(self) -> ServerAbilities:
        if self._abilities is None:
            self._abilities = self._probe()
            logger.info("%s/v1/completions: %s", self.base_url, self._abilities)
            if not self._abilities.n_in_one_request:
                logger.warning("%s/v1/completions answers one choice per prompt whatever `n`: each copy is asked in a "
                               "request of its own.", self.base_url)
        return self._abilities

    def _probe(self) -> ServerAbilities:
        """Ask for one token, two copies, with token ids and log-probs: prompts as a list of ids then of text with the
        extensions, the same without them, then as one string (`transformers serve` takes nothing else); what the
        first accepted form gives back says what the server can do. A form the server refuses or fails on (after the
        few 5xx retries) is skipped; if it takes none, the error lists every answer."""
        ids = self.tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"][:1] or [0]
        sampling = {"max_new_tokens": 1, "temperature": 1.0}
        refusals = []
        forms = [(True, True, True), (False, True, True), (True, True, False), (False, True, False),
                 (False, False, True), (False, False, False)]
        for token_id_prompts, prompt_lists, extensions in forms:
            body = completions_request(self.model, [ids], sampling, n=2, seed=None, extensions=extensions)
            if not token_id_prompts:
                body["prompt"] = [PROBE_TEXT] if prompt_lists else PROBE_TEXT
            try:
                answer = self.http.post_json("/v1/completions", body)
            except ServerError as err:  # 4xx, or a 5xx (FastChat's server fails token-id prompts with a 500)
                refusals.append(getattr(err, "detail", str(err)))
                continue
            choices = answer.get("choices") or []
            first = choices[0] if choices else {}
            completion = completion_from_choice(first)
            return ServerAbilities(
                token_id_prompts=token_id_prompts,
                prompt_lists=prompt_lists,
                n_in_one_request=len(choices) == 2,
                token_ids=completion is not None,
                logprobs=bool(((first.get("logprobs") or {}).get("token_logprobs"))),
                extensions=extensions,
                reloads_weights=reloads_weights(self.http),
            )
        raise ServerError(f"{self.base_url}/v1/completions refused every form of a one-token request: "
                          + " | ".join(refusals))

    # --------------------------------------------------------------- generate
    def generate(self, prompts: Sequence[Sequence[int]], sampling: dict, n: int = 1,
                 seeds: Optional[Sequence[int]] = None) -> list[list[Completion]]:
        """`n` completions of each prompt (prompt-major); with `seeds` (`len(prompts) * n`), copy `i` samples with
        `seeds[i]`."""
        if not prompts:
            return []
        abilities = self.abilities
        texts = None if abilities.token_id_prompts else self._as_text(prompts)
        if seeds is not None:  # one request per copy, each with its own seed
            calls = [([i // n], 1, seeds[i]) for i in range(len(prompts) * n)]
        elif abilities.n_in_one_request:
            calls = [(list(range(len(prompts))), n, None)]
        else:  # the server answers one choice per prompt: one request per copy
            calls = [(list(range(len(prompts))), 1, None)] * n
        if not abilities.prompt_lists:  # the server takes one prompt a request
            calls = [([index], copies, seed) for indices, copies, seed in calls for index in indices]
        with ThreadPoolExecutor(max_workers=min(len(calls), self.http.max_concurrency)) as pool:
            answers = list(pool.map(lambda call: self._call(prompts, texts, sampling, *call), calls))
        groups: list[list[Completion]] = [[] for _ in prompts]
        for (indices, copies, _), answer in zip(calls, answers):  # each answer: its prompts' copies, prompt-major
            for k, completion in enumerate(answer):
                groups[indices[k // copies]].append(completion)
        return groups

    def check_sampling(self, sampling: dict) -> None:
        """Refuse, before anything is generated, sampling settings (SGLang `sampling_params`) this server cannot be
        sent: those SGLang's `/v1/completions` has no field for, and SGLang's extensions (`top_k`, `min_p`,
        `repetition_penalty`, `min_new_tokens`, ...) to a server that refused them at the probe. Only `stop_token_ids`
        is left out with a warning (such a server stops at the model's own end-of-sequence tokens)."""
        _, left_out = completions_sampling(sampling, self.abilities.extensions)
        if "stop_token_ids" in left_out:
            left_out.remove("stop_token_ids")
            self._warn_once("stop_token_ids", "%s/v1/completions refuses fields beyond OpenAI's: stop_token_ids are not "
                            "sent (the server stops at the model's own end-of-sequence tokens).", self.base_url)
        if left_out:
            settings = ", ".join(f"{key}={sampling[key]!r}" for key in left_out)
            raise ValueError(
                f"{self.base_url}/v1/completions cannot be sent {settings}: "
                + ("SGLang's /v1/completions has no such field" if self.abilities.extensions else
                   "the server refused fields beyond OpenAI's at the start-up probe")
                + ". Leave them at their defaults (GRPOConfig's top_k, min_p, repetition_penalty, or generation_kwargs), "
                "or generate with generation_backend: sglang.")

    def _call(self, prompts, texts, sampling: dict, indices: list[int], n: int, seed: Optional[int]) -> list[Completion]:
        """One request: `n` choices of each prompt of `indices`. Choices the server aborted (SGLang answers an abort
        with `finish_reason: "abort"` and the partial output, `serving_completions.py` ~604-611) are asked again,
        `ABORT_RETRIES` times, then `AbortedRequestError`: a partial completion is never trained on."""
        completions = self._ask(prompts, texts, sampling, indices, n, seed)
        for attempt in range(ABORT_RETRIES + 1):
            aborted = [k for k, completion in enumerate(completions) if completion.finish_reason == "abort"]
            if not aborted:
                return completions
            if attempt == ABORT_RETRIES:
                raise AbortedRequestError(
                    f"{self.base_url}/v1/completions aborted {len(aborted)} of {len(completions)} choice(s) "
                    f"{ABORT_RETRIES + 1} times; their partial output is not trained on. See the server's log for why "
                    "it aborts requests.")
            logger.warning("%s/v1/completions aborted %d choice(s): asking for them again", self.base_url, len(aborted))
            again = self._ask(prompts, texts, sampling, [indices[k // n] for k in aborted], 1, seed)
            for k, completion in zip(aborted, again):
                completions[k] = completion
        return completions

    def _ask(self, prompts, texts, sampling: dict, indices: list[int], n: int, seed: Optional[int]) -> list[Completion]:
        body = completions_request(self.model, [prompts[i] for i in indices], sampling, n, seed,
                                   extensions=self.abilities.extensions)
        if texts is not None:
            body["prompt"] = [texts[i] for i in indices] if self.abilities.prompt_lists else texts[indices[0]]
        answer = self.http.post_json("/v1/completions", body)
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or len(choices) != len(indices) * n:
            count = len(choices) if isinstance(choices, list) else "no"
            hint = " (it ignores n)" if n > 1 and count == len(indices) else ""
            raise ServerError(f"{self.base_url}/v1/completions returned {count} choices for {len(indices)} prompt(s) "
                              f"x n={n}{hint}: expected {len(indices) * n}")
        choices = [c for _, c in sorted(enumerate(choices), key=lambda p: (p[1].get("index", p[0]), p[0]))]
        version = completions_weight_version(answer)
        return [self._completion(c, version, limit=body["max_tokens"]) for c in choices]

    def _as_text(self, prompts: Sequence[Sequence[int]]) -> list[str]:
        self._warn_once("prompts", "%s takes text prompts only: the prompts are decoded to text and the server "
                        "re-tokenizes them, which may not give the same ids.", self.base_url)
        return [self.tokenizer.decode(list(p)) for p in prompts]

    def _warn_once(self, key: str, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)

    def _completion(self, choice: dict, weight_version: Optional[str] = None, limit: Optional[int] = None) -> Completion:
        """The choice's ids as the server said them, else its text re-tokenized (at most `limit` ids: re-tokenizing
        can give more ids than were sampled, e.g. for bytes that are no whole character)."""
        completion = completion_from_choice(choice, weight_version)
        if completion is not None:
            return completion
        self._warn_once(
            "completions",
            "%s returns completions as text only: re-tokenizing them with the trainer's tokenizer is lossy (the ids "
            "may differ from those sampled), and no sampling log-probs are used. Prefer a server that returns token "
            "ids (SGLang's native /generate or return_token_ids, or vLLM's return_tokens_as_token_ids).", self.base_url)
        ids = self.tokenizer(choice["text"], add_special_tokens=False)["input_ids"][:limit]
        reason = finish_reason_of_choice(choice)
        if reason == "stop" and self.tokenizer.eos_token_id is not None:
            ids = ids + [self.tokenizer.eos_token_id]
        return Completion(ids, None, reason, weight_version)


def reloads_weights(http: SGLangClient) -> bool:
    """Whether the server behind `http` takes weight reloads the way weight sync sends them: it answers SGLang's
    `/model_info` (its `weight_version`; SGLang and the built-in server), where vLLM, llama.cpp and `transformers
    serve` answer 404."""
    try:
        http.get_json("/model_info")
    except ServerRequestError:
        return False
    return True
