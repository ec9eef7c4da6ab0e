"""What one request may ask of the built-in server, checked at the edge before any of its work is queued.

The `--max-*` flags bound what a request can make the server hold or compute (copies per prompt, prompts per
request, tokens, body bytes); the checks below also refuse every value the model cannot serve (token ids outside
the vocabulary, sequences past the context length), so nothing that passes them can fail later inside a batch
shared with other requests. Each check is per prompt (`len`, `min`, `max` in C), never per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from open_r1_ext.protocol import SamplingParams


class BadRequest(ValueError):
    """A request that is well-formed JSON but asks for something this server cannot or will not do (HTTP 400)."""


@dataclass(frozen=True)
class Limits:
    """The server's `--max-*` flags. The defaults stay above what the trainer's client sends with its own default
    budget (`max_batch_tokens` 65536, each sequence its own item of at least one token, `n` 1)."""

    max_n: int = 256  # copies per prompt (`n`)
    max_batch_items: int = 65536  # prompts per request
    max_request_tokens: int = 1 << 20  # sum over prompts of n x (prompt + max_new_tokens)
    max_body_bytes: int = 32 << 20


class Fields(NamedTuple):
    """How a route's request spells the fields the checks name in their messages."""

    prompts: str
    n: str
    max_new_tokens: str
    stop_token_ids: str


GENERATE_FIELDS = Fields("input_ids", "sampling_params.n", "sampling_params.max_new_tokens", "sampling_params.stop_token_ids")
COMPLETION_FIELDS = Fields("prompt", "n", "max_tokens", "stop_token_ids")
CHAT_FIELDS = Fields("messages", "n", "max_completion_tokens", "stop_token_ids")


def check_request(prompts: Sequence[Sequence[int]], sampling: Sequence[SamplingParams], starts: Sequence[int],
                  fields: Fields, limits: Limits, vocab_size: int, context_length: int, max_input_len: int) -> None:
    """Raise `BadRequest` naming the field unless the server can serve every prompt with its settings: among them an
    input shorter than `max_input_len` (`protocol.max_req_input_len`, SGLang's bound) whose length plus its new
    tokens fits `context_length`."""
    if not prompts:
        raise BadRequest(f"{fields.prompts}: empty batch")
    if len(prompts) > limits.max_batch_items:
        raise BadRequest(f"{fields.prompts}: {len(prompts)} prompts, more than the server's limit (--max-batch-items "
                         f"{limits.max_batch_items}); split the request")
    tokens = 0
    for index, (prompt, params, start) in enumerate(zip(prompts, sampling, starts)):
        where = f"{fields.prompts}[{index}]"
        if not prompt:
            raise BadRequest(f"{where}: empty sequence")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            bad = next(t for t in prompt if not 0 <= t < vocab_size)
            raise BadRequest(f"{where}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        if len(prompt) >= max_input_len:
            raise BadRequest(f"{where}: the input ({len(prompt)} tokens) is not shorter than the server's "
                             f"max_req_input_len ({max_input_len} tokens: the context length {context_length} - 6, the "
                             "margin SGLang keeps)")
        if len(prompt) + params.max_new_tokens > context_length:
            raise BadRequest(
                f"{where}: the input ({len(prompt)} tokens) plus {fields.max_new_tokens} ({params.max_new_tokens}) "
                f"is longer than the model's context length ({context_length} tokens)"
            )
        if not -1 <= start < len(prompt):
            raise BadRequest(f"logprob_start_len[{index}]: {start} is outside [-1, {len(prompt) - 1}]")
        if params.n > limits.max_n:
            raise BadRequest(f"{fields.n}: {params.n} copies of {where}, more than the server's limit (--max-n {limits.max_n})")
        stops = params.stop_token_ids
        if stops and (min(stops) < 0 or max(stops) >= vocab_size):
            bad = next(t for t in stops if not 0 <= t < vocab_size)
            raise BadRequest(f"{fields.stop_token_ids}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        tokens += params.n * (len(prompt) + params.max_new_tokens)
    if tokens > limits.max_request_tokens:
        raise BadRequest(f"{fields.prompts}: the request asks for {tokens} tokens (n x (input + {fields.max_new_tokens}) "
                         f"over its prompts), more than the server's limit (--max-request-tokens "
                         f"{limits.max_request_tokens}); split the request")


def check_token_ids(lists: Sequence, field: str, vocab_size: int) -> None:
    """Raise `BadRequest` naming `field` unless every list of token ids (None: none given) lies in the vocabulary."""
    for ids in lists:
        if ids and not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            bad = next(t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size))
            raise BadRequest(f"{field}: token id {bad!r} is outside the vocabulary [0, {vocab_size})")
