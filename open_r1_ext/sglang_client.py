"""HTTP client for SGLang's native protocol: reference log-probs, generation, and weight reloads.

One class, `SGLangClient`, drives a real SGLang server and the built-in server (`python -m open_r1_ext.server`) alike.
Every call has a timeout; connection errors and 5xx are retried with exponential back-off (urllib3 `Retry`);
4xx is not retried and the server's message is raised. Large batches are split by a token budget and sent
concurrently. Bodies are built and read through `open_r1_ext.protocol` (the one module that knows SGLang's field
names) and encoded and decoded with orjson (a 32x256 reference answer, ~250 KB, parses in ~1.5 ms instead of ~6 ms
with `json`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from typing import Any, Iterable, Optional, Sequence

import orjson
import requests
import torch
from requests.adapters import HTTPAdapter
from tqdm.auto import tqdm
from urllib3.util.retry import Retry

from open_r1_ext.protocol import (
    Completion,
    completion_from_generate,
    generate_request,
    input_token_logprobs,
    reference_request,
    update_weights_request,
    with_seed,
)

logger = logging.getLogger(__name__)

# The clients' defaults; `RemoteGRPOConfig` and `OpenAICompletionsClient` read them from here.
# The one retry budget of a call to a server that is gone: DEFAULT_MAX_RETRIES retries (connection errors, 5xx) with
# urllib3's back-off of 0, 1, 2, 4, 8, 16, 30, 30 s = 91 s of waiting; each try also spends up to CONNECT_TIMEOUT
# (a host that vanished; a refused port answers at once), so a lost server stops the call after ~1.5-3 minutes.
# Callers do not add attempts of their own on top (a reload is retried only when the server answered).
DEFAULT_REQUEST_TIMEOUT = 600.0  # seconds for one HTTP call (a server that accepts and then hangs: this, per try)
DEFAULT_MAX_RETRIES = 8
DEFAULT_BACKOFF_FACTOR = 0.5
CONNECT_TIMEOUT = 10.0  # seconds to open a connection (of the request timeout)
DEFAULT_MAX_BATCH_TOKENS = 65536


class ServerError(RuntimeError):
    """The server could not be reached, or kept failing, within the retry budget."""


class ServerRequestError(ServerError):
    """The server rejected a request (HTTP 4xx); retrying would not help."""

    def __init__(self, message: str, status_code: int, detail: str = ""):
        super().__init__(message)
        self.status_code = status_code
        self.detail = detail or message


class SGLangClient:
    """A client for an SGLang (or built-in) server.

    Args:
        base_url (`str`): the server's address, e.g. `"http://node-3:30000"`.
        api_key (`str` or `None`, *optional*): sent as `Authorization: Bearer KEY`.
        request_timeout (`float`, *optional*, defaults to `600.0`): seconds for one HTTP call.
        max_retries (`int`, *optional*, defaults to `8`): retries of a call on connection errors and 5xx.
        backoff_factor (`float`, *optional*, defaults to `0.5`): retry `k` waits `backoff_factor * 2**k` s (at most 30).
        max_batch_tokens (`int`, *optional*, defaults to `65536`): token budget of one request; larger batches are
            split and the parts sent concurrently.
        max_concurrency (`int`, *optional*, defaults to `8`): requests in flight at once from this client.

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
    ):
        self.base_url = base_url.rstrip("/")
        self.request_timeout = request_timeout
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
            backoff_max=30.0,
            raise_on_status=False,
        )
        adapter = HTTPAdapter(max_retries=retry, pool_connections=max_concurrency, pool_maxsize=max_concurrency)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    # ------------------------------------------------------------------ HTTP
    def _request(self, method: str, route: str, json: Any = None, timeout: Optional[float] = None) -> requests.Response:
        url = f"{self.base_url}{route}"
        body, headers = (None, None) if json is None else (_encode_json(json), {"Content-Type": "application/json"})
        try:
            response = self.session.request(method, url, data=body, headers=headers, timeout=(CONNECT_TIMEOUT, timeout or self.request_timeout))
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

    # ---------------------------------------------------------------- health
    def is_healthy(self, timeout: float = 5.0, route: str = "/health") -> bool:
        try:
            # no retries here: the caller polls
            return requests.get(f"{self.base_url}{route}", timeout=timeout, headers=dict(self.session.headers)).status_code == 200
        except requests.RequestException:
            return False

    def wait_until_healthy(self, timeout: float = 600.0, poll_interval: float = 1.0, progress: bool = True,
                           route: str = "/health") -> None:
        """Block until `route` answers 200, showing elapsed time; raise `ServerError` after `timeout` seconds."""
        start = time.monotonic()
        # the bar shows only once the wait is long (delay): a server that is already up prints nothing
        with tqdm(total=None, desc=f"waiting for {self.base_url}", unit="s", disable=not progress, leave=False,
                  delay=2.0) as bar:
            while not self.is_healthy(route=route):
                elapsed = time.monotonic() - start
                if elapsed > timeout:
                    raise ServerError(
                        f"{self.base_url} did not become healthy within {timeout:.0f} s "
                        "(is the server job running, and is the URL right?)"
                    )
                time.sleep(poll_interval)
                bar.update(round(time.monotonic() - start - bar.n))

    def model_info(self) -> dict:
        return self.get_json("/get_model_info")

    def server_info(self) -> dict:
        return self.get_json("/get_server_info")

    def weight_version(self) -> Optional[str]:
        return self.model_info().get("weight_version")

    # ------------------------------------------------------------ the work
    def ref_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per-token log-probs `log p(t_i | t_<i)`, i = 1..len-1, of each whole sequence (a reference-model pass)."""
        results = self._batched_generate(list(sequences), reference_request, [len(s) for s in sequences])
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
    ) -> list[list[Completion]]:
        """Sample `n` completions of each prompt; returns them prompt by prompt.

        Each copy is its own request item with its own `sampling_seed` (from `seeds`, `len(prompts) * n` of them,
        prompt-major), so copies differ even on a server in deterministic mode.
        """
        items = [list(map(int, p)) for p in prompts for _ in range(n)]
        if seeds is not None and len(seeds) != len(items):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(items)} samples")
        params = [with_seed(sampling, None if seeds is None else seeds[i]) for i in range(len(items))]
        indexed = list(zip(items, params))
        max_new = int(sampling.get("max_new_tokens", 128))

        def body(batch):
            return generate_request([ids for ids, _ in batch], [p for _, p in batch])

        results = self._batched_generate(indexed, body, [len(ids) + max_new for ids in items])
        flat = [completion_from_generate(r) for r in results]
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    def update_weights_from_disk(self, model_path: str, weight_version: Optional[str] = None, **extra: Any) -> dict:
        """Ask the server to load new weights from `model_path` (a directory it can read); raises on failure."""
        body = update_weights_request(model_path, weight_version, **extra)
        url = f"{self.base_url}/update_weights_from_disk"
        try:
            result = self.post_json("/update_weights_from_disk", body)
        except ServerRequestError as err:
            raise ServerRequestError(f"{url} refused the weights in {model_path} (HTTP {err.status_code}): {err.detail}",
                                     err.status_code, err.detail) from err
        if not result.get("success", False):
            raise ServerRequestError(f"{url} refused the weights in {model_path}: {result.get('message')}", 400)
        return result

    # ------------------------------------------------------------- batching
    def _batched_generate(self, items: list, body, sizes: list[int]) -> list[dict]:
        """POST `/generate` for `items` in token-budgeted parts, concurrently; results in input order."""
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
        error = body.get("error") or body.get("message") or body
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(error)
    return str(body)[:500]
