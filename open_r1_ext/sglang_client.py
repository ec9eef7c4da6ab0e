"""HTTP client for SGLang's native protocol: reference log-probs, generation, and weight reloads.

One class, `SGLangClient`, drives a real SGLang server and the built-in server (`python -m open_r1_ext.server`) alike.
Every call has a timeout; connection errors and 5xx are retried with exponential back-off (urllib3 `Retry`);
4xx is not retried and the server's message is raised. Large batches are split by a token budget and sent
concurrently. Bodies are built and read through `open_r1_ext.protocol` (the one module that knows SGLang's field
names) and encoded and decoded with orjson (a 32x256 reference answer, ~250 KB, parses in ~1.5 ms instead of ~6 ms
with `json`). What SGLang 0.5.23 does that a client must guard against is handled here: an aborted item answered
with HTTP 200 is re-sent, a dump whose manifest does not match its files is never sent for loading, a token id outside
the served model's vocabulary is never sent (it kills SGLang's scheduler), `/health` is not asked of a server this
client paused (it hangs then), the admin key goes to the admin routes only, and `sampling_kwargs` checks sampling
settings against SGLang's names.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

import orjson
import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from open_r1_ext.protocol import (
    ADMIN_ROUTES,
    Completion,
    sampling_range_problems,
    completion_from_generate,
    generate_request,
    input_token_logprobs,
    load_lora_request,
    load_lora_tensors_request,
    reference_request,
    unload_lora_request,
    update_weights_request,
    with_seed,
)
from open_r1_ext.wait_progress import WaitProgress
from open_r1_ext.weight_files import MANIFEST, WeightFileError, check_reloadable

if TYPE_CHECKING:
    import torch

    from open_r1_ext.named_tensors import AdapterTensors

logger = logging.getLogger(__name__)

# The clients' defaults; `RemoteGRPOConfig` and `OpenAICompletionsClient` read them from here.
# The one retry budget of a call to a server that is gone: DEFAULT_MAX_RETRIES retries (connection errors, 5xx) with
# urllib3's back-off of 0, 1, 2, 4, 8, 16, 30, 30 s = 91 s of waiting; each try also spends up to CONNECT_TIMEOUT
# (a host that vanished; a refused port answers at once), so a lost server stops the call after ~1.5-3 minutes.
# Callers do not add attempts of their own on top (a reload is retried only when the server answered).
DEFAULT_REQUEST_TIMEOUT = 600.0  # seconds for one HTTP call (a server that accepts and then hangs: this, per try)
DEFAULT_MAX_RETRIES = 8
DEFAULT_SERVER_WAIT_TIMEOUT = 900.0  # seconds a trainer waits for its servers at start-up (`server_wait_timeout`)
DEFAULT_BACKOFF_FACTOR = 0.5
BACKOFF_MAX_S = 30.0  # the longest wait between two tries
CONNECT_TIMEOUT = 10.0  # seconds to open a connection (of the request timeout)
DEFAULT_MAX_BATCH_TOKENS = 65536
ABORT_RETRIES = 2  # times an item the server aborted (HTTP 200, finish_reason "abort") is sent again
# SGLang's refusal of a reload whose cache flush found requests running or queued (the weights changed, the version it
# reports did not): the batch that just ended stays the scheduler's for one more iteration, so a reload sent as a
# generation returns can meet it. The reload waits for them (`/flush_cache?timeout=`) and is sent again, this often.
CACHE_NOT_FLUSHED = "the cache was not flushed"
CACHE_FLUSH_ATTEMPTS = 3
CACHE_FLUSH_WAIT_S = 30.0
HEALTHY, BUSY, DOWN = "healthy", "busy", "down"  # what `SGLangClient.probe` found
PROBE_TOKEN_ID = 0  # the one-token prompt of `SGLangClient.check_sampling`: an id every vocabulary has

# SGLang 0.5.23's `sampling_params` keys (`sglang/srt/sampling/sampling_params.py` ~148-181, the API fields of
# `SamplingParams`; any other key fails `SamplingParams(**kwargs)` in `tokenizer_manager.py` ~1565 with HTTP 400).
SGLANG_SAMPLING_PARAMS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "watermark",
)
# vLLM's (`min_tokens`) and transformers' (`generate()`, TRL's local generation) names of settings SGLang has under
# another name.
SAMPLING_TWINS = {"min_tokens": "min_new_tokens", "stop_strings": "stop", "eos_token_id": "stop_token_ids"}
# transformers `generate()` settings that change nothing on a server, with the values that do so (None: any value).
HARMLESS_GENERATE_KWARGS = {"do_sample": (True,), "pad_token_id": None, "bos_token_id": None, "use_cache": None,
                            "cache_implementation": None, "disable_compile": None}
# transformers `generate()` settings SGLang has no equivalent for, and the nearest setting to use instead.
TRANSFORMERS_NEAREST = {
    "do_sample": "temperature: 0 (greedy decoding; do_sample: true is what sampling already does)",
    "num_beams": "none: GRPO samples num_generations completions per prompt (SGLang's beam_width is beam search)",
    "num_beam_groups": "none (beam search)", "diversity_penalty": "none (beam search)",
    "length_penalty": "none (beam search)", "early_stopping": "none (beam search)",
    "no_repeat_ngram_size": "repetition_penalty or frequency_penalty (SGLang bans no n-grams)",
    "encoder_repetition_penalty": "repetition_penalty",
    "min_length": "min_new_tokens (min_length counts the prompt)",
    "max_length": "max_completion_length (the trainer sets max_new_tokens)",
    "num_return_sequences": "num_generations", "typical_p": "top_p or min_p", "epsilon_cutoff": "min_p",
    "eta_cutoff": "min_p", "top_h": "top_p", "top_nsigma": "top_p or min_p",
    "bad_words_ids": "logit_bias", "suppress_tokens": "logit_bias", "begin_suppress_tokens": "logit_bias",
    "sequence_bias": "logit_bias", "forced_bos_token_id": "logit_bias", "forced_eos_token_id": "stop_token_ids",
    "exponential_decay_length_penalty": "none", "guidance_scale": "none", "renormalize_logits": "none",
}
# Keys the trainer sets itself for every sample, and the setting that controls each.
TRAINER_SET = {"max_new_tokens": "max_completion_length", "max_tokens": "max_completion_length",
               "n": "num_generations", "sampling_seed": "seed (one sampling_seed per sample is derived from it)",
               "seed": "seed (one sampling_seed per sample is derived from it)"}


class ServerError(RuntimeError):
    """The server could not be reached, or kept failing, within the retry budget."""


class AbortedRequestError(ServerError):
    """The server kept aborting an item (SGLang answers an abort with HTTP 200 and a partial output)."""


class ServerRequestError(ServerError):
    """The server rejected a request (HTTP 4xx); retrying would not help."""

    def __init__(self, message: str, status_code: int, detail: str = ""):
        super().__init__(message)
        self.status_code = status_code
        self.detail = detail or message


class IncompleteDumpError(ServerRequestError):
    """A weight dump whose files do not match its manifest, refused before it is sent: SGLang would load the tensors
    that are there and report success. (HTTP 400 is what the built-in server answers to the same dump.)"""

    def __init__(self, message: str):
        super().__init__(message, 400)


class OutOfVocabularyError(ServerRequestError):
    """Token ids outside the served model's vocabulary, refused before they are sent: SGLang 0.5.23 does not check
    input ids, and one past the vocabulary kills its scheduler (an `IndexError` in the embedding; the whole server
    exits). (HTTP 400 is what the built-in server answers to the same request.)"""

    def __init__(self, message: str):
        super().__init__(message, 400)


class SGLangClient:
    """A client for an SGLang (or built-in) server.

    Args:
        base_url (`str`): the server's address, e.g. `"http://node-3:30000"`.
        api_key (`str` or `None`, *optional*): sent as `Authorization: Bearer KEY`.
        request_timeout (`float`, *optional*, defaults to `600.0`): seconds for one HTTP call.
        max_retries (`int`, *optional*, defaults to `8`): retries of a call on connection errors and 5xx; an answer
            that breaks off after its headers (the server killed while it answered) is sent again as often.
        backoff_factor (`float`, *optional*, defaults to `0.5`): retry `k` waits `backoff_factor * 2**k` s (at most 30).
        max_batch_tokens (`int`, *optional*, defaults to `65536`): token budget of one request; larger batches are
            split and the parts sent concurrently.
        max_concurrency (`int`, *optional*, defaults to `8`): requests in flight at once from this client.
        admin_api_key (`str` or `None`, *optional*): sent instead of `api_key` on `/update_weights_from_disk`,
            `/flush_cache`, `/load_lora_adapter` and `/unload_lora_adapter` (SGLang's `--admin-api-key` locks them to it).

    Examples:
        Start a server (`python -m sglang.launch_server --model-path Qwen/Qwen2.5-1.5B-Instruct --port 30000`,
        or `python -m open_r1_ext.server --model-path DIR --port 30000`), then:

        ```python
        >>> client = SGLangClient("http://localhost:30000")
        >>> client.wait_until_healthy(timeout=600)
        >>> client.ref_logprobs([[1, 2, 3, 4]])
        [tensor([-5.6, -5.7, -5.5])]
        >>> client.generate([[1, 2, 3]], {"max_new_tokens": 4, "temperature": 1.0}, n=2, seeds=[0, 1])
        [[Completion(token_ids=[17, 3, ...], logprobs=[...], finish_reason='length', weight_version='default'), ...]]
        >>> client.update_weights_from_disk("/shared/run/weights/step-10", weight_version="10")
        {'success': True, 'message': 'Succeeded to update model weights...', 'num_paused_requests': 0}
        ```

        With LoRA (`--enable-lora --max-lora-rank 16 --lora-target-modules all`), the base model serves the reference
        and an adapter the policy:

        ```python
        >>> client.load_lora_adapter("policy-v10", "/shared/run/weights/step-10")
        {'success': True, 'error_message': '', 'loaded_adapters': {'policy-v10': '/shared/run/weights/step-10'}, ...}
        >>> client.generate([[1, 2, 3]], {"max_new_tokens": 4}, lora_path="policy-v10")
        >>> client.unload_lora_adapter("policy-v9")
        ```
    """

    def __init__(
        self,
        base_url: str,
        api_key: Optional[str] = None,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        backoff_factor: float = DEFAULT_BACKOFF_FACTOR,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_concurrency: int = 8,
        admin_api_key: Optional[str] = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.request_timeout = request_timeout
        self.max_retries, self.backoff_factor = max_retries, backoff_factor
        self.max_batch_tokens = max_batch_tokens
        self.max_concurrency = max_concurrency
        self.session = requests.Session()
        retry = Retry(
            total=max_retries,
            connect=max_retries,
            read=max_retries,
            status=max_retries,
            other=0,
            status_forcelist=(500, 502, 503, 504),
            allowed_methods=None,  # our POSTs are idempotent: scoring, seeded sampling, reloading a path
            backoff_factor=backoff_factor,
            backoff_max=BACKOFF_MAX_S,
            raise_on_status=False,
        )
        adapter = HTTPAdapter(max_retries=retry, pool_connections=max_concurrency, pool_maxsize=max_concurrency)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self.admin_headers = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}
        self.paused = False  # this client paused the server's generation (`pause_generation`) and has not continued it
        self._vocabulary: Optional[tuple[Optional[int], str]] = None  # (size, model), asked at the first request
        self._vocabulary_asked = threading.Lock()  # by one of the threads sending first requests at once

    # ------------------------------------------------------------------ HTTP
    def _request(self, method: str, route: str, json: Any = None, timeout: Optional[float] = None,
                 params: Optional[dict] = None) -> requests.Response:
        url = f"{self.base_url}{route}"
        headers = dict(self.admin_headers) if route in ADMIN_ROUTES else {}
        body = None if json is None else _encode_json(json)
        if body is not None:
            headers["Content-Type"] = "application/json"
        for cut_off in range(self.max_retries + 1):
            try:
                response = self.session.request(method, url, data=body, headers=headers or None, params=params,
                                                timeout=(CONNECT_TIMEOUT, timeout or self.request_timeout))
                break
            except requests.exceptions.ChunkedEncodingError as err:
                # The answer broke off after its headers (a server killed while it answered): urllib3's retries end
                # at the headers, so the call is sent again here, with the same back-off.
                if cut_off == self.max_retries:
                    raise ServerError(f"{url}: the answer broke off {cut_off + 1} times: {err}") from err
                logger.warning("%s: the answer broke off (%s); sending the request again", url, err)
                time.sleep(min(BACKOFF_MAX_S, self.backoff_factor * 2 ** cut_off))
            except requests.RequestException as err:
                raise ServerError(f"{url}: no answer within the retry budget: {err}") from err
        if 400 <= response.status_code < 500:
            detail = _error_text(response)
            raise ServerRequestError(f"{url} rejected the request (HTTP {response.status_code}): {detail}",
                                     response.status_code, detail)
        if response.status_code >= 500:
            raise ServerError(f"{url}: HTTP {response.status_code} after retries: {_error_text(response)}")
        return response

    def get_json(self, route: str, timeout: Optional[float] = None) -> Any:
        return orjson.loads(self._request("GET", route, timeout=timeout).content)

    def post_json(self, route: str, body: dict, timeout: Optional[float] = None) -> Any:
        return orjson.loads(self._request("POST", route, json=body, timeout=timeout).content)

    def post_once(self, route: str, body: dict, timeout: float) -> dict:
        """POST `body` once, no retries, within `timeout` seconds, to a route that answers `{success, message}`:
        that answer, HTTP 400 included (how SGLang says `success: false`). `ServerError` when there is no answer,
        `ServerRequestError` for another 4xx. For the weight-update routes, whose calls pair with a broadcast."""
        url = f"{self.base_url}{route}"
        headers = {**self.session.headers, "Content-Type": "application/json",
                   **(self.admin_headers if route in ADMIN_ROUTES else {})}
        try:
            response = requests.post(url, data=_encode_json(body), headers=headers, timeout=(CONNECT_TIMEOUT, timeout))
        except requests.RequestException as err:
            raise ServerError(f"{url}: no answer: {err}") from err
        if response.status_code in (200, 400):
            try:
                answer = orjson.loads(response.content)
            except orjson.JSONDecodeError:
                answer = None
            if isinstance(answer, dict) and "success" in answer:
                return answer
        if 400 <= response.status_code < 500:
            detail = _error_text(response)
            raise ServerRequestError(f"{url} rejected the request (HTTP {response.status_code}): {detail}",
                                     response.status_code, detail)
        raise ServerError(f"{url}: HTTP {response.status_code}: {_error_text(response)}")

    # ---------------------------------------------------------------- health
    def probe(self, timeout: float = 5.0, route: str = "/health") -> str:
        """One look at `route`, no retries (the caller polls): `HEALTHY` (200); `BUSY`, the server answered another
        status or took the connection but not answered within `timeout` (SGLang's `/health` runs a one-token
        generation, at least ~1 s, which waits behind a long reload, then answers 503: `http_server.py` ~721-800);
        `DOWN`, no connection (refused or reset: the process is gone).

        While this client has the server paused, `/health` is not asked: SGLang's waits for the scheduler, which the
        pause holds, and never answers; `/model_info` (answered by the HTTP process at once, paused or not) is."""
        if self.paused and route == "/health":
            route = "/model_info"
        try:
            status = requests.get(f"{self.base_url}{route}", timeout=(CONNECT_TIMEOUT, timeout),
                                  headers=dict(self.session.headers)).status_code
        except requests.ReadTimeout:
            return BUSY
        except requests.RequestException:
            return DOWN
        return HEALTHY if status == 200 else BUSY

    def is_healthy(self, timeout: float = 5.0, route: str = "/health") -> bool:
        return self.probe(timeout, route) == HEALTHY

    def wait_until_healthy(self, timeout: float = 600.0, poll_interval: float = 1.0, progress: bool = True,
                           route: str = "/health") -> None:
        """Block until `route` answers 200, showing the time waited (`WaitProgress`: a bar on a terminal, a line every
        10 s in a log file); raise `ServerError` after `timeout` seconds."""
        start = time.monotonic()
        with WaitProgress(f"{self.base_url}{route}", timeout, enabled=progress) as waiting:
            while not self.is_healthy(route=route):
                elapsed = time.monotonic() - start
                if elapsed > timeout:
                    raise ServerError(
                        f"{self.base_url} did not become healthy within {timeout:.0f} s "
                        "(is the server job running, and is the URL right?)"
                    )
                time.sleep(poll_interval)
                waiting.update()

    def model_info(self) -> dict:
        """`/model_info` (SGLang's `/get_model_info` is deprecated and logs a warning per call)."""
        return self.get_json("/model_info")

    def server_info(self) -> dict:
        """`/server_info` (SGLang's `/get_server_info` is deprecated)."""
        return self.get_json("/server_info")

    def sequence_limit(self) -> Optional[int]:
        """The most tokens of prompt + completion the server serves, to sample (the prompt as input) and to score (the
        whole sequence as one input): `/server_info.max_req_input_len` - 1, since SGLang refuses an input of at least
        `max_req_input_len` tokens (the context length - 6), and the built-in server reports and keeps the same bound.
        A server that reports only `context_length`: that; neither (None): the caller takes the model's own."""
        info = self.server_info()
        bound, context = info.get("max_req_input_len"), info.get("context_length")
        if isinstance(bound, int):
            return bound - 1
        return context if isinstance(context, int) else None

    def weight_version(self) -> Optional[str]:
        return self.model_info().get("weight_version")

    def check_sampling(self, sampling: dict) -> None:
        """At start-up: a one-token `/generate` with `sampling` (the run's `sampling_params`), so that a setting the
        server refuses (HTTP 400 naming it) is found before training starts; `ServerRequestError` then."""
        probe = {**sampling, "max_new_tokens": 1}
        if "min_new_tokens" in probe:
            probe["min_new_tokens"] = min(probe["min_new_tokens"], 1)
        self.post_json("/generate", generate_request([[PROBE_TOKEN_ID]], [probe]))

    def check_token_ids(self, sequences: Sequence[Sequence[int]], what: str = "sequence") -> None:
        """`OutOfVocabularyError` naming the first id of `sequences` outside the served model's vocabulary
        (`served_vocabulary`, asked once, at the first request); nothing when the vocabulary cannot be known here."""
        with self._vocabulary_asked:
            if self._vocabulary is None:
                self._vocabulary = served_vocabulary(self.model_info())
        size, model = self._vocabulary
        if size is None:
            return
        for i, ids in enumerate(sequences):
            if ids and (min(ids) < 0 or max(ids) >= size):
                bad = next(t for t in ids if not 0 <= t < size)
                raise OutOfVocabularyError(
                    f"not sent to {self.base_url}: token id {bad} of {what} {i} is outside the vocabulary of the model "
                    f"it serves ({model}: ids 0-{size - 1}); SGLang's scheduler dies on such an id. Tokenize with the "
                    "served model's tokenizer, or serve a model whose embeddings cover the tokenizer's ids.")

    # ------------------------------------------------------------ the work
    def ref_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per-token log-probs `log p(t_i | t_<i)`, i = 1..len-1, of each whole sequence (a reference-model pass)."""
        self.check_token_ids(sequences)
        results = self._batched_generate(list(sequences), reference_request, [len(s) for s in sequences])
        import torch  # here only: the launchers and `open-r1-ext status` use this client without tensors (~1.5 s)

        # One tensor for the whole batch, then split: a single torch.tensor call instead of one per sequence.
        rows = [input_token_logprobs(r) for r in results]
        flat = torch.tensor([entry[0] for row in rows for entry in islice(row, 1, None)], dtype=torch.float32)
        return list(flat.split([len(row) - 1 for row in rows]))

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: dict,
        n: int = 1,
        seeds: Optional[Sequence[int]] = None,
        lora_path: Optional[str] = None,
        keep_aborted: bool = False,
    ) -> list[list[Completion]]:
        """Sample `n` completions of each prompt; returns them prompt by prompt.

        Each copy is its own request item with its own `sampling_seed` (from `seeds`, `len(prompts) * n` of them,
        prompt-major), so copies differ even on a server in deterministic mode. `lora_path`: the name of a loaded
        LoRA adapter (`load_lora_adapter`) every item samples with; None samples with the base model. An item the
        server aborted is sent again (see `_batched_generate`), unless `keep_aborted`: then it is returned as it came
        (`finish_reason` "abort", partial), for the caller to judge.
        """
        prompt_ids = [list(map(int, p)) for p in prompts]
        items = [ids for ids in prompt_ids for _ in range(n)]
        if seeds is not None and len(seeds) != len(items):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(items)} samples")
        self.check_token_ids(prompt_ids, "prompt")
        params = [with_seed(sampling, None if seeds is None else seeds[i]) for i in range(len(items))]
        indexed = list(zip(items, params))
        max_new = int(sampling.get("max_new_tokens", 128))

        def body(batch):
            return generate_request([ids for ids, _ in batch], [p for _, p in batch], lora_path)

        sizes = [len(ids) + max_new for ids in items]
        results = self._send_generate(indexed, body, sizes) if keep_aborted else self._batched_generate(indexed, body, sizes)
        flat = [completion_from_generate(r) for r in results]
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    def update_weights_from_disk(self, model_path: str, weight_version: Optional[str] = None, **extra: Any) -> dict:
        """Ask the server to load new weights from `model_path` (a directory it can read); raises on failure.

        A dump with a `manifest.json` (the trainer's) that this machine can see is checked first, every file present
        with its size (and checksum, once sealed): SGLang loads whatever tensors a directory holds and reports success.
        A reload SGLang refuses
        because requests still ran at its cache flush is sent again once they ended (`CACHE_NOT_FLUSHED`).
        """
        _check_dump(model_path, f"{self.base_url}/update_weights_from_disk")
        body, what = update_weights_request(model_path, weight_version, **extra), f"the weights in {model_path}"
        for attempt in range(1, CACHE_FLUSH_ATTEMPTS + 1):
            try:
                return self._post_checked("/update_weights_from_disk", body, what, "message")
            except ServerRequestError as err:
                if CACHE_NOT_FLUSHED not in err.detail or attempt == CACHE_FLUSH_ATTEMPTS:
                    raise
                logger.info("%s: %s; reloading once they are done", self.base_url, err.detail)
                self.flush_cache(wait_s=CACHE_FLUSH_WAIT_S)

    def flush_cache(self, wait_s: float = 0.0) -> bool:
        """SGLang's `/flush_cache`: drop the prefix cache; with `wait_s`, the server waits that long for the requests
        running or queued to end first. False when they did not (HTTP 400)."""
        try:
            self._request("POST", "/flush_cache", params={"timeout": wait_s}, timeout=wait_s + self.request_timeout)
        except ServerRequestError:
            return False
        return True

    def pause_generation(self, mode: str = "retract") -> dict:
        """SGLang's `/pause_generation`: `retract` (the requests under way keep their tokens; their KV cache is
        recomputed with the weights served at `continue_generation`, so the tokens after it come from those weights,
        and each answer's `weight_versions` says which tokens came from which), `in_place` (they keep their KV cache)
        or `abort` (they end, `finish_reason` abort). Requests sent meanwhile wait; a reload runs at once. Until
        `continue_generation`, `probe` asks `/model_info` instead of `/health` (which hangs while paused)."""
        self.paused = True  # from the request on: a pause whose answer is lost may still be in force
        return self.post_json("/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        """SGLang's `/continue_generation`: what `pause_generation` held goes on (a no-op when not paused)."""
        answer = self.post_json("/continue_generation", {})
        self.paused = False
        return answer

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """Load the PEFT adapter directory `lora_path` (one the server can read) under the name `lora_name`, which
        `generate(..., lora_path=lora_name)` then names (SGLang's dynamic LoRA: the server needs `--enable-lora`);
        raises `ServerRequestError` on failure (e.g. the name is taken). A dump with a `manifest.json` this machine
        can see is checked first, as for `update_weights_from_disk`."""
        _check_dump(lora_path, f"{self.base_url}/load_lora_adapter")
        return self._post_checked("/load_lora_adapter", load_lora_request(lora_name, lora_path),
                                  f"the LoRA adapter {lora_name} from {lora_path}")

    def load_lora_adapter_from_tensors(self, lora_name: str, adapter: AdapterTensors) -> dict:
        """Load a LoRA adapter sent in the request (SGLang's `/load_lora_adapter_from_tensors`; no file): `adapter`'s
        tensors, plainly pickled, which crosses nodes (`named_tensors.AdapterTensors`), once per tensor-parallel rank
        of the server (`/server_info` `tp_size`), and its `adapter_config.json`. Raises `ServerRequestError` on
        failure, as `load_lora_adapter`."""
        copies = int(self.server_info().get("tp_size") or 1)
        return self._post_checked("/load_lora_adapter_from_tensors",
                                  load_lora_tensors_request(lora_name, adapter.serialized, adapter.config, copies),
                                  f"the LoRA adapter {lora_name} from tensors")

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """Unload the adapter `lora_name`; raises `ServerRequestError` on failure (e.g. no adapter of that name).
        SGLang refuses new requests naming it at once and unloads it once the requests in flight that use it end."""
        return self._post_checked("/unload_lora_adapter", unload_lora_request(lora_name),
                                  f"unloading the LoRA adapter {lora_name}")

    def _post_checked(self, route: str, body: dict, what: str, message_key: str = "error_message") -> dict:
        """POST to a route that answers `{success, <message_key>, ...}` (a reload, a LoRA load/unload); a refusal
        (HTTP 4xx, or `success: false`) raises `ServerRequestError` saying the server refused `what`, and why."""
        url = f"{self.base_url}{route}"
        try:
            result = self.post_json(route, body)
        except ServerRequestError as err:
            raise ServerRequestError(f"{url} refused {what} (HTTP {err.status_code}): {err.detail}",
                                     err.status_code, err.detail) from err
        if not result.get("success", False):
            raise ServerRequestError(f"{url} refused {what}: {result.get(message_key)}", 400)
        return result

    # ------------------------------------------------------------- batching
    def _batched_generate(self, items: list, body, sizes: list[int]) -> list[dict]:
        """POST `/generate` for `items` in token-budgeted parts, concurrently; results in input order. An item the
        server aborted (HTTP 200 with `finish_reason.type == "abort"` and a partial output, as SGLang answers
        e.g. a request aborted in its queue) is sent again, `ABORT_RETRIES` times, then `AbortedRequestError`."""
        results = self._send_generate(items, body, sizes)
        for attempt in range(ABORT_RETRIES + 1):
            aborted = [i for i, result in enumerate(results) if _aborted(result)]
            if not aborted:
                return results
            reason = results[aborted[0]]["meta_info"]["finish_reason"]
            if attempt == ABORT_RETRIES:
                raise AbortedRequestError(
                    f"{self.base_url}/generate aborted {len(aborted)} of {len(items)} item(s) (e.g. item {aborted[0]}: "
                    f"{reason.get('message') or 'no message'}) {ABORT_RETRIES + 1} times; their partial output is not "
                    "trained on. See the server's log for why it aborts requests.")
            logger.warning("%s/generate aborted %d item(s) (%s): sending them again", self.base_url, len(aborted),
                           reason.get("message") or "no message")
            again = self._send_generate([items[i] for i in aborted], body, [sizes[i] for i in aborted])
            for i, result in zip(aborted, again):
                results[i] = result
        return results

    def _send_generate(self, items: list, body, sizes: list[int]) -> list[dict]:
        if not items:
            return []
        parts = list(_split_by_budget(sizes, self.max_batch_tokens))

        def send(span: tuple[int, int]) -> list[dict]:
            start, stop = span
            answer = self.post_json("/generate", body(items[start:stop]))
            return answer if isinstance(answer, list) else [answer]

        if len(parts) == 1:
            return send(parts[0])
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(parts))) as pool:
            return [r for chunk in pool.map(send, parts) for r in chunk]


def _check_dump(path: str, url: str) -> None:
    """A dump with a `manifest.json` (the trainer's) that this machine can see: every file present with its size, and
    its checksum once the dump is sealed (`weight_files.check_reloadable`), else `IncompleteDumpError` (SGLang loads
    whatever tensors a directory holds and reports success, and its scheduler dies on a damaged safetensors file)."""
    if os.path.lexists(os.path.join(path, MANIFEST)):
        try:
            check_reloadable(Path(path))
        except WeightFileError as err:
            raise IncompleteDumpError(f"not asking {url} to load an incomplete dump: {err}") from err


def served_vocabulary(model_info: dict) -> tuple[Optional[int], str]:
    """`(vocabulary size, model)` of the model a server serves, from its `/model_info`: neither SGLang 0.5.23 nor the
    built-in server reports the size there (nor in `/server_info`), so it is read from the model's config (the text
    model's `vocab_size`, as SGLang's `ModelConfig` takes it) at `model_path` (after a reload the dump, which carries
    the config) or else `tokenizer_path` (the model it started with), a directory or a Hub id already in this
    machine's cache. `(None, ...)` when neither is readable here."""
    from transformers import AutoConfig

    for key in ("model_path", "tokenizer_path"):
        path = model_info.get(key)
        if not path:
            continue
        try:
            size = getattr(AutoConfig.from_pretrained(path, local_files_only=True).get_text_config(), "vocab_size", None)
        except (OSError, ValueError):
            continue
        if isinstance(size, int):
            return size, str(path)
    logger.warning("the served model's config (%s) is not readable here: token ids are not checked against its "
                   "vocabulary before they are sent", model_info.get("model_path"))
    return None, str(model_info.get("model_path"))


def _aborted(result: dict) -> bool:
    return ((result.get("meta_info") or {}).get("finish_reason") or {}).get("type") == "abort"


def sampling_kwargs(kwargs: Optional[dict], where: str = "generation_kwargs", max_new_tokens: Optional[int] = None) -> dict:
    """`kwargs` as SGLang `sampling_params`: vLLM and transformers names with an SGLang twin renamed (`min_tokens` ->
    `min_new_tokens`, `stop_strings` -> `stop`, `eos_token_id` -> `stop_token_ids`), transformers settings that change
    nothing on a server dropped (`do_sample: true`, `pad_token_id`, ...); a key SGLang does not know (a transformers
    one named with its nearest SGLang setting, `TRANSFORMERS_NEAREST`), one the trainer sets for every sample, or a
    value outside the range SGLang takes (`sampling_range_problems`, with the completions' `max_new_tokens`) raises
    `ValueError` naming it and the fix (SGLang would answer every request with HTTP 400)."""
    out, given = {}, {}
    for key, value in (kwargs or {}).items():
        harmless = HARMLESS_GENERATE_KWARGS.get(key, ())
        if key in HARMLESS_GENERATE_KWARGS and (harmless is None or value in harmless):
            continue
        if key in TRANSFORMERS_NEAREST:
            raise ValueError(f"{where}.{key}={value!r}: a transformers generate() setting SGLang has no equivalent "
                             f"for; nearest SGLang setting: {TRANSFORMERS_NEAREST[key]}")
        name = SAMPLING_TWINS.get(key, key)
        if name == "stop_token_ids" and isinstance(value, int):
            value = [value]
        if name in TRAINER_SET:
            raise ValueError(f"{where}.{key}: set by the trainer for every sample; use {TRAINER_SET[name]}")
        if name not in SGLANG_SAMPLING_PARAMS:
            raise ValueError(f"{where}.{key}: not a sampling parameter of SGLang; valid names: "
                             f"{', '.join(k for k in SGLANG_SAMPLING_PARAMS if k not in TRAINER_SET)} "
                             f"(vLLM's and transformers' {', '.join(f'{a} is {b}' for a, b in SAMPLING_TWINS.items())})")
        if name in out:
            raise ValueError(f"{where}: {given[name]} and {key} are the same setting; give one")
        out[name], given[name] = value, key
    for name, must in sampling_range_problems(out, max_new_tokens):
        raise ValueError(f"{where}.{given[name]}={out[name]!r}: must be {must}, or SGLang answers every request with "
                         "HTTP 400")
    return out


def _split_by_budget(sizes: Iterable[int], budget: int):
    """Consecutive `(start, stop)` spans whose summed sizes stay within `budget` (at least one item each)."""
    start, total = 0, 0
    sizes = list(sizes)
    for i, size in enumerate(sizes):
        if i > start and total + size > budget:
            yield start, i
            start, total = i, 0
        total += size
    yield start, len(sizes)


def _encode_json(body: Any) -> bytes:
    """`body` as JSON bytes; numpy scalars and other float subclasses pass as numbers, as `json.dumps` lets them."""
    return orjson.dumps(body, default=_float_subclass, option=orjson.OPT_SERIALIZE_NUMPY)


def _float_subclass(value: Any) -> float:
    if isinstance(value, float):
        return float(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _error_text(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500]
    if isinstance(body, dict):
        error = body.get("error") or body.get("error_message") or body.get("message") or body
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(error)
    return str(body)[:500]
