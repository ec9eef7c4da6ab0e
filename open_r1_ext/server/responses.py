"""The built-in server's answers, shaped as SGLang 0.5.23 and OpenAI shape theirs.

`/generate` outputs (`text`, `output_ids`, `meta_info` with SGLang's log-prob lists), OpenAI `/v1/completions` choices
(legacy `logprobs` with `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), `/v1/chat/completions` choices and
stream deltas (`logprobs.content`), and the server-sent events they stream. The routes in `app.py` run the work; this module only turns finished (or in-progress) tasks into JSON.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from itertools import chain, islice, repeat
from typing import Any, Optional

import orjson
from transformers.convert_slow_tokenizer import bytes_to_unicode

from open_r1_ext.protocol import TOKEN_ID_PREFIX, finish_reason, logprob_entries
from open_r1_ext.server.engine import GenerationTask, ModelEngine

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: Any) -> bytes:
    """One server-sent event as SGLang writes it: `data: <json>` and a blank line."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def request_id(prefix: str = "") -> str:
    return f"{prefix}{uuid.uuid4().hex}"


@dataclass
class PromptLogprobs:
    """What a request asked for about one prompt's own tokens: SGLang's `input_*` lists (empty when not asked)."""

    token_logprobs: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    token_ids_logprobs: list = field(default_factory=list)


def prompt_logprobs(engine: ModelEngine, prompt: list[int], scored: Optional[list[float]], start: int, want_text: bool,
                    tops: list, chosen: list) -> PromptLogprobs:
    """SGLang's `input_token_logprobs` (and `input_top_logprobs`, `input_token_ids_logprobs`) from `logprob_start_len`
    on; at the first position returned the log-prob (and each list) is null, as SGLang 0.5.23 answers whatever the
    start (`logprob_result_processor.py` ~38, 50). `scored[i]`, `tops[i]`, `chosen[i]` are token i + 1's."""
    if start < 0 or scored is None:
        return PromptLogprobs()
    ids = prompt[start:]

    def from_start(values):
        return chain([None], islice(values, start, None))

    return PromptLogprobs(
        token_logprobs=logprob_entries(from_start(scored), ids, token_texts(engine, ids, want_text)),
        top_logprobs=[None if pairs is None else pair_entries(engine, pairs, want_text) for pairs in from_start(tops)] if tops else [],
        token_ids_logprobs=[None if pairs is None else pair_entries(engine, pairs, want_text) for pairs in from_start(chosen)] if chosen else [],
    )


def token_texts(engine: ModelEngine, ids: list[int], want_text: bool):
    return [engine.tokenizer.decode([t]) for t in ids] if want_text else None


def pair_entries(engine: ModelEngine, pairs: list[tuple[float, int]], want_text: bool) -> list:
    """`(logprob, id)` pairs as SGLang's `[logprob, id, text-or-null]` entries."""
    ids = [i for _, i in pairs]
    return logprob_entries((v for v, _ in pairs), ids, token_texts(engine, ids, want_text))


def output_text(engine: ModelEngine, task: GenerationTask, count: Optional[int] = None) -> str:
    """The completion's text, cut before a matched stop string (unless `no_stop_trim`), as SGLang's detokenizer.
    With `count` (a stream chunk of the first `count` tokens) it holds back, as SGLang does, what may still change:
    a character whose bytes are not all out yet, and the end that could be the start of a stop string."""
    ids = task.output_ids if count is None else task.output_ids[:count]
    text = engine.tokenizer.decode(ids, skip_special_tokens=task.params.skip_special_tokens,
                                   spaces_between_special_tokens=task.params.spaces_between_special_tokens)
    if count is not None:
        text = text.rstrip("\ufffd")
        hold = max(map(len, task.params.stop_strings), default=1) - 1
        return text[: len(text) - hold] if hold else text
    matched = task.finish[1] if task.finish and task.finish[0] == "stop" else None
    if isinstance(matched, str) and not task.params.no_stop_trim:
        text = text[: text.find(matched)] if matched in text else text
    return text


@dataclass
class GenerateAsk:
    """What a `/generate` request asked for about one prompt's log-probs."""

    return_logprob: bool
    top_logprobs_num: int
    token_ids_logprob: Optional[list[int]]
    return_text: bool


def generate_output(engine: ModelEngine, task: GenerationTask, ask: GenerateAsk, inputs: PromptLogprobs, rid: str,
                    count: Optional[int] = None, since: int = 0) -> dict:
    """SGLang's `/generate` answer for one sequence; `count`: only its first `count` tokens (a stream chunk, which
    carries no finish reason until the last); `since`: only the tokens (and text) after the first `since` (a chunk of
    `--incremental-streaming-output`)."""
    done = count is None or (task.finish is not None and count >= len(task.output_ids))
    n = len(task.output_ids) if count is None else count
    kind, value = task.finish or ("length", n)
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason(kind, value) if done else None,
        "prompt_tokens": len(task.prompt),
        "completion_tokens": n,
        "cached_tokens": 0,
        "weight_version": engine.weight_version,
    }
    if done:
        meta["weight_versions"] = weight_version_spans(task.version_events, engine.weight_version, n)
    if ask.return_logprob:
        ids = task.output_ids[since:n]
        meta["input_token_logprobs"] = inputs.token_logprobs
        meta["output_token_logprobs"] = logprob_entries(task.output_logprobs[since:n], ids, token_texts(engine, ids, ask.return_text))
        if ask.top_logprobs_num:
            meta["input_top_logprobs"] = inputs.top_logprobs
            meta["output_top_logprobs"] = [pair_entries(engine, p, ask.return_text) for p in task.output_top_logprobs[since:n]]
        if ask.token_ids_logprob is not None:
            meta["input_token_ids_logprobs"] = inputs.token_ids_logprobs
            meta["output_token_ids_logprobs"] = [pair_entries(engine, p, ask.return_text)
                                                 for p in task.output_token_ids_logprobs[since:n]]
    text = output_text(engine, task, None if done else n)
    if since:
        text = text[len(output_text(engine, task, since)):]
    return {"text": text, "output_ids": task.output_ids[since:n], "meta_info": meta}


def weight_version_spans(events: list[tuple[str, int]], current: str, count: int) -> list[dict]:
    """SGLang's `meta_info.weight_versions` of a finished sequence of `count` tokens: `{version, start, end}` per run
    of tokens sampled with one weight version, from its `(version before a change, tokens by then)` events and the
    version now (`utils/weight_versions.py`: `compute_weight_version_spans`, then `add_weight_versions_to_meta_info`,
    which keeps the spans that start before `count`, or at 0)."""
    spans: list[dict] = []
    for version, end in [*events, (current, count)]:
        end = min(end, count)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return [span for span in spans if span["start"] < count or span["start"] == 0]


# ------------------------------------------------------------------------------------------------ OpenAI
def openai_logprobs(engine: ModelEngine, entries: list, tops: Optional[list], as_ids: bool, offset: int) -> dict:
    """OpenAI's legacy `logprobs` object from SGLang-style `[logprob, id, _]` entries (and their top lists)."""
    names = [f"{TOKEN_ID_PREFIX}{e[1]}" if as_ids else engine.tokenizer.decode([e[1]]) for e in entries]
    offsets = []
    for name in names:
        offsets.append(offset)
        offset += len(name)
    top = None
    if tops is not None:
        top = [None if pairs is None else {(f"{TOKEN_ID_PREFIX}{i}" if as_ids else engine.tokenizer.decode([i])): v
                                           for v, i in pairs} for pairs in tops]
    return {"tokens": names, "token_logprobs": [e[0] for e in entries], "top_logprobs": top, "text_offset": offsets}


@dataclass
class CompletionAsk:
    """What a `/v1/completions` request asked for, beyond the sampling."""

    logprobs: Optional[int]
    echo: bool
    return_token_ids: bool
    tokens_as_ids: bool


def completion_choice(engine: ModelEngine, index: int, task: GenerationTask, ask: CompletionAsk, echo_text: str,
                      inputs: PromptLogprobs, start: int = 0, count: Optional[int] = None, text_from: int = 0) -> dict:
    """One OpenAI choice: the text (after `echo_text`), log-probs of tokens `start`..`count`, the finish reason
    once done. A stream chunk passes `start`/`count`/`text_from` for the part not yet sent."""
    done = count is None or (task.finish is not None and count >= len(task.output_ids))
    n = len(task.output_ids) if count is None else count
    text = output_text(engine, task, None if done else n)
    logprobs = None
    if ask.logprobs is not None:
        entries = list(zip(task.output_logprobs[start:n], task.output_ids[start:n]))
        tops = [[(v, i) for v, i in p] for p in task.output_top_logprobs[start:n]] if ask.logprobs else None
        if ask.echo and ask.logprobs and start == 0:
            entries = [(e[0], e[1]) for e in inputs.token_logprobs] + entries
            tops = [None if p is None else [(e[0], e[1]) for e in p] for p in inputs.top_logprobs] + (tops or [])
        logprobs = openai_logprobs(engine, [(v, i, None) for v, i in entries], tops, ask.tokens_as_ids,
                                   offset=text_from if start else 0)
    matched = matched_stop(task) if done else None
    choice = {"index": index, "text": (echo_text if start == 0 else "") + text[text_from:], "logprobs": logprobs,
              "finish_reason": task.finish[0] if done and task.finish else None, "matched_stop": matched}
    if ask.return_token_ids:
        choice["token_ids"] = task.output_ids[start:n]
        if start == 0:
            choice["prompt_token_ids"] = task.prompt
    return choice


def usage(prompts: list[list[int]], tasks: list[GenerationTask], count: Optional[int] = None) -> dict:
    """OpenAI's `usage` (each prompt counted once, whatever `n`); `count`: the tokens out so far (a stream chunk)."""
    prompt_tokens = sum(map(len, prompts))
    completion_tokens = count if count is not None else sum(len(t.output_ids) for t in tasks)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# GPT-2's byte-level BPE writes each byte as one printable character; this maps them back.
BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer, token_id: int, text: str, byte_level: bool) -> list[int]:
    """OpenAI's `bytes` of a token, as SGLang: with a byte-level BPE tokenizer (GPT-2's family: Qwen, Llama 3) the
    token's own bytes, also for part of a character (whose text is U+FFFD); otherwise its text's UTF-8 bytes."""
    if byte_level:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if piece and all(char in BYTE_OF_CHAR for char in piece):
            return [BYTE_OF_CHAR[char] for char in piece]
    return list(text.encode())


def chat_logprobs(engine: ModelEngine, task: GenerationTask, start: int, stop: int, with_top: bool) -> dict:
    """OpenAI's chat `logprobs` (`{"content": [{token, bytes, logprob, top_logprobs}]}`) of tokens `start`..`stop`."""
    tokenizer = engine.tokenizer
    byte_level = "ByteLevel" in repr(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None))

    def entry(logprob: float, token_id: int) -> dict:
        token = tokenizer.decode([token_id])
        return {"token": token, "bytes": token_bytes(tokenizer, token_id, token, byte_level), "logprob": logprob}

    tops = task.output_top_logprobs[start:stop] if with_top else repeat([])
    return {"content": [{**entry(v, i), "top_logprobs": [entry(tv, ti) for tv, ti in top]}
                        for v, i, top in zip(task.output_logprobs[start:stop], task.output_ids[start:stop], tops)]}


def matched_stop(task: GenerationTask):
    """SGLang's `matched_stop`: the stop string or token id that ended the task (None otherwise)."""
    return task.finish[1] if task.finish and task.finish[0] == "stop" else None


def chat_choice(engine: ModelEngine, index: int, task: GenerationTask, logprobs: bool, with_top: bool) -> dict:
    """One choice of a finished `/v1/chat/completions` answer."""
    return {"index": index, "message": {"role": "assistant", "content": output_text(engine, task), "reasoning_content": None},
            "logprobs": chat_logprobs(engine, task, 0, len(task.output_ids), with_top) if logprobs else None,
            "finish_reason": task.finish[0] if task.finish else "length", "matched_stop": matched_stop(task)}


def chat_delta(index: int, delta: dict, logprobs: Optional[dict] = None, finish: Optional[GenerationTask] = None) -> dict:
    """One choice of a `/v1/chat/completions` stream chunk, as SGLang's `build_sse_content` writes it; `finish`: the
    task whose finish reason this (last) chunk of the choice carries."""
    return {"index": index, "delta": {"reasoning_content": None, **delta}, "logprobs": logprobs,
            "finish_reason": (finish.finish[0] if finish.finish else "length") if finish else None,
            "matched_stop": matched_stop(finish) if finish else None}
