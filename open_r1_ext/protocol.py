"""The subset of SGLang's native HTTP protocol that the trainer uses, as validated request types.

Field names, defaults and response shapes follow SGLang 0.5.23 (`sglang/srt/managers/io_struct.py`,
`sglang/srt/entrypoints/http_server.py`). This is the one module that knows those names: the built-in
server parses requests with the models below, and the clients build their bodies and read the answers with the
functions at the end (`generate_request`, `completion_from_generate`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import Any, Iterable, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

# SGLang's `temperature` below this means greedy decoding.
GREEDY_TEMPERATURE = 1e-6
# SGLang's `/get_model_info` reports this `weight_version` until an update sets one.
DEFAULT_WEIGHT_VERSION = "default"
# `--dtype` values both the built-in server and SGLang accept (the recipe's `dtype` field offers these).
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")

Number = Union[StrictInt, StrictFloat]
# Ranges checked at the edge, so that no value that passes validation overflows later inside a shared batch.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # SGLang's `sampling_seed` is an i64
TOP_K_MAX = 1 << 30  # SGLang's TOP_K_ALL; -1 (or 0) disables top-k


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParams(_Strict):
    """Per-prompt sampling settings (SGLang `sampling_params`)."""

    max_new_tokens: StrictInt = Field(128, ge=0)
    temperature: Number = Field(1.0, ge=0.0)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(-1, ge=-1, le=TOP_K_MAX)
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    n: StrictInt = Field(1, ge=1)
    sampling_seed: Optional[StrictInt] = Field(None, ge=SEED_MIN, le=SEED_MAX)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


class GenerateReqInput(_Strict):
    """Body of `POST /generate`: one prompt (`input_ids: [int]`) or a batch (`[[int]]`)."""

    input_ids: Union[list[StrictInt], list[list[StrictInt]]]
    sampling_params: Union[SamplingParams, list[SamplingParams], None] = None
    return_logprob: Union[StrictBool, list[StrictBool]] = False
    logprob_start_len: Union[StrictInt, list[StrictInt]] = -1
    top_logprobs_num: StrictInt = Field(0, ge=0, le=0)
    return_text_in_logprobs: StrictBool = False
    stream: StrictBool = Field(False, description="streaming is not supported by the built-in server")
    rid: Union[StrictStr, list[StrictStr], None] = None

    @property
    def is_batch(self) -> bool:
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def prompts(self) -> list[list[int]]:
        return self.input_ids if self.is_batch else [self.input_ids]  # type: ignore[return-value]

    def per_prompt(self, value: Any, name: str) -> list[Any]:
        """Broadcast a scalar-or-list request field to one value per prompt."""
        count = len(self.prompts())
        if isinstance(value, list):
            if len(value) != count:
                raise ValueError(f"'{name}' has {len(value)} entries for {count} prompts")
            return value
        return [value] * count

    def sampling_per_prompt(self) -> list[SamplingParams]:
        return self.per_prompt(self.sampling_params or SamplingParams(), "sampling_params")


class UpdateWeightFromDiskReqInput(_Strict):
    """Body of `POST /update_weights_from_disk`.

    `mixup_alpha` is an extension of the built-in server (SGLang has no such field): the loaded weights
    become `alpha * new + (1 - alpha) * old`, TRL's soft reference update.
    """

    model_path: StrictStr = Field(min_length=1)
    load_format: Optional[StrictStr] = None
    weight_version: Optional[StrictStr] = None
    abort_all_requests: StrictBool = False
    flush_cache: StrictBool = True
    mixup_alpha: Optional[Number] = Field(None, gt=0.0, le=1.0)


class CompletionRequest(BaseModel):
    """Body of `POST /v1/completions` (OpenAI), the fields the built-in server honours; others are ignored.

    `return_tokens_as_token_ids` (a vLLM extension) makes `logprobs.tokens` read `"token_id:N"`.
    """

    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = None
    prompt: Union[list[StrictInt], list[list[StrictInt]]]
    n: StrictInt = Field(1, ge=1)
    max_tokens: StrictInt = Field(16, ge=0)
    temperature: Number = Field(1.0, ge=0.0)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(-1, ge=-1, le=TOP_K_MAX)
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=0)
    seed: Optional[StrictInt] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop_token_ids: Optional[list[StrictInt]] = None
    return_tokens_as_token_ids: StrictBool = False
    skip_special_tokens: StrictBool = True

    def prompts(self) -> list[list[int]]:
        return self.prompt if self.prompt and isinstance(self.prompt[0], list) else [self.prompt]  # type: ignore[return-value]

    def sampling(self) -> SamplingParams:
        """The settings of every prompt (copy `i` of the request samples with `seed + i`, see the server)."""
        return SamplingParams(max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, stop_token_ids=self.stop_token_ids, n=self.n, sampling_seed=self.seed,
                              skip_special_tokens=self.skip_special_tokens)


def logprob_entries(logprobs: Iterable[Optional[float]], token_ids: Iterable[int], texts: Optional[Iterable[Optional[str]]] = None):
    """SGLang's `[logprob, token_id, text-or-null]` triples, as tuples (JSON arrays all the same): `zip` builds them
    without a Python step per entry, and a reference answer has thousands."""
    return list(zip(logprobs, token_ids, repeat(None) if texts is None else texts))


def finish_reason(kind: str, matched_or_length: int) -> dict:
    """SGLang's `finish_reason` object: `{"type": "stop", "matched": id}` or `{"type": "length", "length": n}`."""
    if kind == "stop":
        return {"type": "stop", "matched": matched_or_length}
    return {"type": "length", "length": matched_or_length}


def error_body(message: str) -> dict:
    """SGLang's error body for a rejected request."""
    return {"error": {"message": message}}


# ------------------------------------------------------------------------------------------------ client side
# What `sglang_client` and `openai_client` send and read. Plain dicts, not the models above: validating every token
# id of a 32x256 reference request on the trainer would cost more than the request itself.

# vLLM's `return_tokens_as_token_ids`: `logprobs.tokens` entries read `"token_id:N"`.
TOKEN_ID_PREFIX = "token_id:"


@dataclass
class Completion:
    """One sampled completion: token ids, their sampling log-probs, why it stopped, and the weights used."""

    token_ids: list[int]
    logprobs: Optional[list[float]]
    finish_reason: str
    weight_version: Optional[str]


def sampling_params(max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                    stop_token_ids: Sequence[int] = (), min_p: Optional[float] = None,
                    repetition_penalty: float = 1.0, **extra: Any) -> dict:
    """SGLang `sampling_params` (`top_k=-1`: no top-k); `min_p` and `repetition_penalty` only when they filter."""
    params = {"max_new_tokens": int(max_new_tokens), "temperature": temperature, "top_p": top_p,
              "top_k": top_k if top_k and top_k > 0 else -1, "stop_token_ids": list(stop_token_ids)}
    if min_p is not None:
        params["min_p"] = min_p
    if repetition_penalty != 1.0:
        params["repetition_penalty"] = repetition_penalty
    params.update(extra)
    return params


def reference_request(sequences: Sequence[Sequence[int]]) -> dict:
    """`/generate` body that scores whole sequences: no new token, the log-prob of every input token."""
    return {
        "input_ids": [list(map(int, s)) for s in sequences],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }


def input_token_logprobs(result: dict) -> list:
    """A `/generate` answer's `[logprob, token_id, text]` entries for its input tokens (the first one's is null)."""
    return result["meta_info"]["input_token_logprobs"]


def generate_request(prompts: list[list[int]], sampling: list[dict]) -> dict:
    """`/generate` body sampling one completion per prompt, with its own `sampling_params`, and their log-probs."""
    return {"input_ids": prompts, "sampling_params": sampling, "return_logprob": True}


def with_seed(sampling: dict, seed: Optional[int]) -> dict:
    return sampling if seed is None else {**sampling, "sampling_seed": int(seed)}


def completion_from_generate(result: dict) -> Completion:
    meta = result["meta_info"]
    return Completion(
        token_ids=list(result["output_ids"]),
        logprobs=[float(e[0]) for e in meta["output_token_logprobs"]],
        finish_reason=(meta.get("finish_reason") or {}).get("type", "length"),
        weight_version=meta.get("weight_version"),
    )


def update_weights_request(model_path: str, weight_version: Optional[str] = None, **extra: Any) -> dict:
    """`/update_weights_from_disk` body; `extra` e.g. the built-in server's `mixup_alpha`."""
    body = {"model_path": str(model_path), **extra}
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return body


def completions_request(model: str, prompts: Sequence[Sequence[int]], sampling: dict, n: int,
                        seed: Optional[int]) -> dict:
    """OpenAI `/v1/completions` body for SGLang-style `sampling` (`sampling_params` above), asking for token ids."""
    body: dict[str, Any] = {
        "model": model,
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
    if seed is not None:
        body["seed"] = int(seed) % (2**31)
    return body


def completion_from_choice(choice: dict) -> Optional[Completion]:
    """An OpenAI choice as a `Completion` when its tokens are given as ids (`"token_id:N"`); None if text only."""
    logprobs = choice.get("logprobs") or {}
    tokens = logprobs.get("tokens")
    if not tokens or not all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in tokens):
        return None
    values = logprobs.get("token_logprobs")
    return Completion([int(t[len(TOKEN_ID_PREFIX):]) for t in tokens], [float(v) for v in values] if values else None,
                      finish_reason_of_choice(choice), None)


def finish_reason_of_choice(choice: dict) -> str:
    return choice.get("finish_reason") or "length"
