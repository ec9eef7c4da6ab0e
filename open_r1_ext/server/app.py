"""The built-in inference server: SGLang's native HTTP protocol on top of a transformers model.

    python -m open_r1_ext.server --model-path DIR [--host 127.0.0.1] [--port 30000] [--api-key KEY] [--admin-api-key KEY]
        [--enable-lora --max-lora-rank R --lora-target-modules M [M ...]]

Routes are thin: they validate with `open_r1_ext.protocol` and `limits`, hand work to the `Batcher`, and have
`responses` shape SGLang's and OpenAI's answers (JSON or server-sent events). Every malformed or oversized request,
and every SGLang field this server does not do, gets HTTP 400 naming the field (or file) and the problem. It serves the
same clients as a real SGLang server (`/generate`, `/update_weights_from_disk`, `/model_info`, `/server_info` and
their `/get_*` names, `/health`, `/health_generate`, `/flush_cache`, `/v1/completions`, `/v1/chat/completions`,
`/v1/models`, SGLang's dynamic LoRA: `/load_lora_adapter`, `/unload_lora_adapter`, `lora_path` on `/generate`, and
`/pause_generation`, `/continue_generation`, and its distributed weight update: `/init_weights_update_group`,
`/begin_weight_update`, `/update_weights_from_distributed`, `/end_weight_update`, `/destroy_weights_update_group`, in
`weight_update_routes`).
Two model slots: the policy at `/` and, under `/ref/...`, a second model (the reference, `--ref-model-path`,
default the same weights) that reloads independently, so one process can host both roles of a GRPO run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hmac
import importlib.util
import logging
import os
import random
import re
import sys
import time
from typing import Any, Callable, Optional

import orjson
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from jinja2 import TemplateError
from pydantic import ValidationError

from open_r1_ext import __version__
from open_r1_ext.server.batcher import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_WAIT_MS, Batcher
from open_r1_ext.server.engine import DTYPES, GenerationTask, LoraSettings, ModelEngine
from open_r1_ext.server.weight_receiver import DEFAULT_WEIGHT_UPDATE_TIMEOUT_S, NO_SESSION, WeightReceiver
from open_r1_ext.server.limits import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    GENERATE_FIELDS,
    BadRequest,
    Limits,
    check_request,
    check_token_ids,
)
from open_r1_ext.server.responses import (
    SSE_DONE,
    CompletionAsk,
    GenerateAsk,
    PromptLogprobs,
    chat_choice,
    chat_delta,
    chat_logprobs,
    completion_choice,
    generate_output,
    output_text,
    prompt_logprobs,
    request_id,
    sse,
    usage,
)
from open_r1_ext.protocol import (
    ADMIN_ROUTES,
    LORA_TARGET_ALL,
    SGLANG_LORA_TARGET_MODULES,
    BeginWeightUpdateReqInput,
    ChatCompletionRequest,
    CompletionRequest,
    ContinueGenerationReqInput,
    DestroyWeightsUpdateGroupReqInput,
    EndWeightUpdateReqInput,
    GenerateReqInput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    LoadLoRAAdapterFromTensorsReqInput,
    LoadLoRAAdapterReqInput,
    SamplingParams,
    StreamOptions,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    error_body,
    lora_update_output,
    max_req_input_len,
)
from open_r1_ext.named_tensors import deserialize_named_tensors
from open_r1_ext.weight_files import WeightFileError

logger = logging.getLogger("open_r1_ext.server.app")
HEALTH_TIMEOUT_S = 20.0
HEALTH_SAMPLING = SamplingParams(max_new_tokens=1, temperature=0.0)  # /health_generate: one greedy token
DETERMINISTIC_DEFAULT_SEED = 42  # SGLang's seed for a request without `sampling_seed` in deterministic mode
LOAD_FORMATS = (None, "auto", "safetensors")
TENSOR_LORA_PATH = "__tensor__"  # SGLang's `lora_path` of an adapter loaded from tensors (`io_struct.py` ~2567)
LORA_DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."  # SGLang's words
# SGLang's answer to a reload that flushes the cache while requests paused in place keep theirs
# (`scheduler_components/weight_updater.py` ~120-133); the weights and version have changed all the same.
CACHE_NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or queued. "
                     "Retract or finish them, then call /flush_cache.")


FLUSH_TIMED_OUT = "Timed out waiting for idle state."  # SGLang's `/flush_cache?timeout=` that waited in vain
FLUSH_POLL_S = 0.05


class CacheNotFlushed(RuntimeError):
    """A reload with `flush_cache` while requests paused `in_place` hold a KV cache of the old weights."""


# pydantic names the member of a union it tried, or a validator, in an error's location ("SamplingParams", "list[int]",
# "float", "function-after[...]"): types, not fields, so they are left out of the field path a message names.
_UNION_MEMBER = re.compile(r"^(int|float|str|bool|none|[A-Z]\w*|[\w-]+\[.*\])$")


def _describe_validation_error(err: RequestValidationError) -> str:
    """One `field.path: what is wrong` per field (a union's alternatives joined by "or"; a field whose
    subfields failed is named by those only)."""
    problems: dict[str, list[str]] = {}
    for e in err.errors():
        if e.get("type") == "json_invalid":
            return f"body is not valid JSON ({e.get('ctx', {}).get('error', 'decode error')})"
        loc = list(e.get("loc", ()))
        loc = loc[1:] if loc[:1] == ["body"] else loc
        if "field" in e.get("ctx", {}):  # a key refused by `protocol._Strict`: the field itself is the path's end
            loc.append(e["ctx"]["field"])
        path = ""
        for item in loc:
            if isinstance(item, int):
                path += f"[{item}]"
            elif not _UNION_MEMBER.match(str(item)):
                path += f".{item}" if path else str(item)
        messages = problems.setdefault(path or "body", [])
        if e.get("msg") not in messages:
            messages.append(e.get("msg"))
    deepest = [p for p in problems if not any(q.startswith((p + ".", p + "[")) for q in problems)]
    return "; ".join(f"{p}: {' or '.join(problems[p])}" for p in deepest)


REF_PREFIX = "/ref"


def create_app(slots: dict[str, tuple[ModelEngine, Batcher]], api_key: Optional[str] = None, random_seed: int = 0,
               context_length: Optional[int] = None, limits: Optional[Limits] = None,
               weight_dirs: Optional[list[str]] = None, deterministic: bool = False, text_only: bool = False,
               incremental_streaming: bool = False, admin_api_key: Optional[str] = None,
               weight_update_timeout: float = DEFAULT_WEIGHT_UPDATE_TIMEOUT_S) -> FastAPI:
    """The FastAPI application serving each `(engine, batcher)` slot under its URL prefix ("" is the root).
    `api_key`, `admin_api_key`: SGLang's `--api-key` and `--admin-api-key` (the admin routes, `ADMIN_ROUTES`, then
    take only the admin key).
    `limits`: what one request may ask for (default: `Limits()`); `weight_dirs`: the directories
    `/update_weights_from_disk` may read below (None: any); `deterministic` (`--enable-deterministic-inference`):
    `sampling_seed` is honoured (else ignored, as SGLang does); `text_only` (`--openai-text-only`): `/v1/completions`
    imitates a plain OpenAI-compatible server (text prompts only, one choice per prompt whatever `n`, no token ids);
    `incremental_streaming` (`--incremental-streaming-output`): a `/generate` stream chunk carries only what is new;
    `weight_update_timeout` (`--weight-update-timeout`): the bound of a distributed weight update's collectives."""
    app = FastAPI(title="open_r1_ext built-in server", version=__version__)
    limits = limits or Limits()
    allowed = None if weight_dirs is None else [os.path.realpath(d) for d in weight_dirs]
    for prefix, (engine, batcher) in slots.items():
        app.include_router(slot_router(engine, batcher, random_seed, context_length, limits, allowed, deterministic,
                                       text_only, incremental_streaming, weight_update_timeout), prefix=prefix)

    if api_key or admin_api_key:  # only then: the middleware costs every request a little
        normal = api_key.encode() if api_key else None
        admin = admin_api_key.encode() if admin_api_key else None
        admin_routes = {f"{prefix}{route}" for prefix in slots for route in ADMIN_ROUTES}

        @app.middleware("http")
        async def check_api_key(request: Request, call_next):
            """As SGLang (`utils/auth.py`): /health* open; with an admin key the admin routes take only it; every
            other route takes the API key, when there is one, as `Bearer KEY` (the scheme in any case, RFC 7235)."""
            path = request.url.path
            if not path.rsplit("/", 1)[-1].startswith("health"):
                expected = admin if admin is not None and path in admin_routes else normal
                scheme, _, given = request.headers.get("Authorization", "").partition(" ")
                given_key = given.encode("latin-1")  # how the header was decoded
                if expected is not None and not (hmac.compare_digest(given_key, expected)  # constant time
                                                 and scheme.lower() == "bearer"):
                    return JSONResponse(status_code=401, content={"error": "Unauthorized"})
            return await call_next(request)

    work_routes = {f"{prefix}{route}": batcher for prefix, (_, batcher) in slots.items() for route in WORK_ROUTES}
    app.add_middleware(AnnounceWork, batchers=work_routes)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)  # outermost: before anything reads the body

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_request: Request, err: RequestValidationError):
        return JSONResponse(status_code=400, content=error_body(_describe_validation_error(err)))

    @app.exception_handler(BadRequest)
    async def on_bad_request(_request: Request, err: BadRequest):
        return JSONResponse(status_code=400, content=error_body(str(err)))

    return app


WORK_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


class OrjsonRequest(Request):
    """A request whose JSON body is parsed by orjson (its decode errors are `json.JSONDecodeError`s, so FastAPI's
    400 for a malformed body is unchanged)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


class OrjsonRoute(APIRoute):
    """FastAPI's documented way to swap the request class of a route (here: `OrjsonRequest`). A route with a body
    also refuses a body not sent as JSON, missing `Content-Type` included, with a message that says so (FastAPI
    would validate the raw bytes and say "body: Input should be a valid dictionary")."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        takes_body = self.body_field is not None

        async def orjson_handler(request: Request):
            content_type = request.headers.get("content-type")
            if takes_body and not _is_json(content_type or ""):
                message = f"Content-Type: {content_type or 'missing'!r} is not JSON; send the body as application/json"
                return JSONResponse(status_code=400, content=error_body(message))
            return await handler(OrjsonRequest(request.scope, request.receive))

        return orjson_handler


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` (`--max-body-bytes`) gets 400 before it is read, by its
    Content-Length; a body sent without one (chunked) is read here up to the limit, then handed on."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if int(length) > self.max_bytes:
                return await self._refuse(scope, receive, send, int(length))
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send, f"at least {size}")
        await self.app(scope, _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive), send)

    async def _refuse(self, scope, receive, send, size) -> None:
        message = f"body: {size} bytes, more than the server's limit (--max-body-bytes {self.max_bytes})"
        await JSONResponse(status_code=400, content=error_body(message))(scope, receive, send)


def _replay(messages: list[dict], then=None):
    """An ASGI `receive` that returns `messages`, then defers to `then` (e.g. to hear of a disconnect)."""
    pending = list(messages)

    async def receive():
        if pending:
            return pending.pop(0)
        return await then() if then is not None else {"type": "http.disconnect"}

    return receive


class AnnounceWork:
    """ASGI middleware: from the moment a work request (`WORK_ROUTES`) comes in until its route has queued its work
    (`_handed_in`), its slot's batcher knows more work is on its way, so a batch being collected waits for it (at
    most `--max-batch-wait-ms`). When nothing is on its way a batch starts at once: a lone request does not wait."""

    def __init__(self, app, batchers: dict[str, Batcher]):
        self.app = app
        self.batchers = batchers

    async def __call__(self, scope, receive, send):
        batcher = self.batchers.get(scope["path"]) if scope["type"] == "http" else None
        if batcher is None:
            return await self.app(scope, receive, send)
        arrival = batcher.expect()
        scope.setdefault("state", {})["arrival"] = arrival
        try:
            await self.app(scope, receive, send)
        finally:
            arrival.done()  # a request refused before it queued anything


def _handed_in(request: Request) -> None:
    """This request's work is all queued: the batch being collected need not wait for it any longer."""
    arrival = getattr(request.state, "arrival", None)
    if arrival is not None:
        arrival.done()


def slot_router(engine: ModelEngine, batcher: Batcher, random_seed: int, context_length: Optional[int], limits: Limits,
                weight_dirs: Optional[list[str]], deterministic: bool = False, text_only: bool = False,
                incremental: bool = False, weight_update_timeout: float = DEFAULT_WEIGHT_UPDATE_TIMEOUT_S) -> APIRouter:
    """The routes of one model slot."""
    app = APIRouter(route_class=OrjsonRoute)
    seeds = random.Random(random_seed)
    max_len = context_length or engine.context_length
    max_input = max_req_input_len(max_len, limits.max_request_tokens)  # SGLang's bound (see max_total_num_tokens)
    started = int(time.time())
    in_flight: set[GenerationTask] = set()  # what a reload with abort_all_requests aborts
    reported: dict[str, str] = {}  # after a reload refused for an in-place pause: the model and version of the last good one
    loras: dict[str, tuple[str, str]] = {}  # LoRA adapters served: lora_name -> (the engine's adapter id, lora_path)
    lora_names_busy: set[str] = set()  # names being loaded
    lora_names_unloaded: set[str] = set()  # names unloaded (and not loaded again): a request naming one is told so

    def seed_of(sampling_seed: Optional[int]) -> int:
        """As SGLang: `sampling_seed` counts only with `--enable-deterministic-inference` (then a request without one
        samples with seed 42); otherwise every sample draws its own seed from the server's generator."""
        if deterministic:
            return DETERMINISTIC_DEFAULT_SEED if sampling_seed is None else sampling_seed
        return seeds.getrandbits(63)

    def check(prompts, sampling, starts, fields) -> None:
        check_request(prompts, sampling, starts, fields, limits, engine.vocab_size, max_len, max_input)
        for params in sampling:
            if params.logit_bias:
                check_token_ids([[int(t) if t.lstrip("-").isdigit() else t for t in params.logit_bias]],
                                "sampling_params.logit_bias", engine.vocab_size)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if batcher.alive() else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        task = GenerationTask(prompt=[0], params=HEALTH_SAMPLING, seed=0)
        try:
            await asyncio.wait_for(asyncio.wrap_future(batcher.generate([task])), HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            logger.exception("health check generation failed")
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict:
        config = engine.model.config
        return {
            "model_path": reported.get("model_path", engine.loaded_path),
            "tokenizer_path": engine.model_path,
            "is_generation": True,
            "weight_version": reported.get("weight_version", engine.weight_version),
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }  # as SGLang's: no vocab_size (clients read it from the config at model_path)

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict:
        return {
            "version": f"open_r1_ext-{__version__}",
            "engine": "builtin",
            "model_path": engine.model_path,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "device": str(engine.device),
            "random_seed": random_seed,
            "context_length": max_len,
            "max_req_input_len": max_input,  # as SGLang: an input of at least this many tokens is refused
            # SGLang's KV-cache size in tokens; the built-in server keeps no cache across requests, so its bound is
            # what one request may hold (--max-request-tokens)
            "max_total_num_tokens": limits.max_request_tokens,
            "max_batch_wait_ms": batcher.max_wait * 1000.0,
            "batches_run": batcher.batches_run,
            "sequences_generated": batcher.sequences_generated,
            "sequences_scored": batcher.sequences_scored,
            "weight_version": reported.get("weight_version", engine.weight_version),
            "enable_deterministic_inference": deterministic,
            "supports_weight_mixup": True,  # `mixup_alpha` on /update_weights_from_disk (SGLang has none)
            "openai_text_only": text_only,
            "enable_lora": engine.lora is not None,
            "max_lora_rank": engine.lora.max_rank if engine.lora else None,
            "lora_target_modules": (sorted(engine.lora.target_modules or [LORA_TARGET_ALL]) if engine.lora else None),
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = Query(0.0, ge=0.0)) -> Response:
        """As SGLang (no prefix cache here): refused while requests paused `in_place` keep a KV cache; with `timeout`,
        answered once they ended (`/continue_generation`), or refused after that many seconds."""
        deadline = time.monotonic() + timeout
        while batcher.holds_kv():
            if time.monotonic() >= deadline:
                return PlainTextResponse(FLUSH_TIMED_OUT if timeout else "Flush cache failed.\n", status_code=400)
            await asyncio.sleep(FLUSH_POLL_S)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(obj: UpdateWeightFromDiskReqInput) -> JSONResponse:
        if obj.load_format not in LOAD_FORMATS:
            raise BadRequest(f"load_format {obj.load_format!r} is not supported by the built-in server; use 'auto'")
        aborted = abort_in_flight(in_flight) if obj.abort_all_requests else 0

        def reload() -> str:
            before = {"model_path": engine.loaded_path, "weight_version": engine.weight_version}
            message = engine.load_weights(_allowed(obj.model_path, weight_dirs), obj.weight_version, obj.mixup_alpha)
            if obj.flush_cache and batcher.holds_kv():
                # as SGLang: the weights changed and samples say the new version, while /model_info keeps reporting
                # the last reload that succeeded
                reported.setdefault("model_path", before["model_path"])
                reported.setdefault("weight_version", before["weight_version"])
                raise CacheNotFlushed(CACHE_NOT_FLUSHED)
            reported.clear()
            return message

        try:
            message = await asyncio.wrap_future(batcher.call_exclusive(reload))
        except (WeightFileError, OSError, CacheNotFlushed) as err:
            logger.warning("weight update from %s refused: %s", obj.model_path, err)
            content = {"success": False, "message": str(err), "num_paused_requests": 0}
            return JSONResponse(status_code=400, content=content)
        logger.info("%s (weight_version=%s, %d requests aborted)", message, engine.weight_version, aborted)
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    @app.post("/pause_generation")
    async def pause_generation(obj: PauseGenerationReqInput) -> JSONResponse:
        """As SGLang 0.5.23 (`tokenizer_manager.py` ~2267, `scheduler.py` ~5817): answered once the pause is in force
        (with `abort`, once the aborted requests are answered); pausing again is fine."""
        await asyncio.wrap_future(batcher.pause(obj.mode))
        logger.info("generation paused (%s)", obj.mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(obj: ContinueGenerationReqInput) -> JSONResponse:
        """As SGLang: requests retracted by the pause are prefilled again with the weights now served; a no-op when not
        paused."""
        await asyncio.wrap_future(batcher.resume())
        logger.info("generation continued")
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    def lora_answer(error: Optional[str] = None) -> JSONResponse:
        """SGLang's answer to a LoRA load/unload: HTTP 400 when it failed."""
        loaded = {name: path for name, (_, path) in loras.items()}
        return JSONResponse(status_code=400 if error else 200, content=lora_update_output(error, loaded))

    async def load_lora(name: str, source: str, load: Callable[[], str]) -> JSONResponse:
        """A LoRA load, as SGLang: a name already served is refused. `load()` (on a worker thread: reading and checking
        the adapter, then the engine's load between two decode steps, as SGLang's scheduler loads one between batches,
        `scheduler.py` ~6052) returns the engine's adapter id; the requests under way go on with the adapters they
        named. `source`: the adapter's path, as `loaded_adapters` lists it."""
        if engine.lora is None:
            return lora_answer(LORA_DISABLED)
        if name in loras or name in lora_names_busy:
            return lora_answer(f"Failed to load LoRA adapter {name} because it is already loaded")
        lora_names_busy.add(name)
        try:
            adapter = await asyncio.to_thread(load)
        except (WeightFileError, OSError, ValueError) as err:
            logger.warning("LoRA adapter %s from %s refused: %s", name, source, err)
            return lora_answer(f"Failed to load LoRA adapter {name}: {err}")
        finally:
            lora_names_busy.discard(name)
        loras[name] = (adapter, source)
        lora_names_unloaded.discard(name)
        logger.info("LoRA adapter %s loaded from %s", name, source)
        return lora_answer()

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(obj: LoadLoRAAdapterReqInput) -> JSONResponse:
        """As SGLang: the adapter directory must lie below --weight-dirs (see `load_lora`)."""
        def load() -> str:
            path = _allowed(obj.lora_path, weight_dirs, "lora_path")
            return batcher.call_between_steps(lambda: engine.load_adapter(path)).result()

        return await load_lora(obj.lora_name, obj.lora_path, load)

    @app.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors(obj: LoadLoRAAdapterFromTensorsReqInput) -> JSONResponse:
        """As SGLang (`io_struct.py` ~2548): the adapter's tensors in the body (`named_tensors`: only tensors are
        unpickled), its `adapter_config.json` as `config_dict`; listed as `__tensor__` in `loaded_adapters`, as SGLang
        lists it (see `load_lora`)."""
        def load() -> str:
            tensors = deserialize_named_tensors(obj.serialized_named_tensors[0])  # one tensor-parallel rank here
            return batcher.call_between_steps(
                lambda: engine.load_adapter_tensors(obj.config_dict, tensors, "config_dict", "serialized_named_tensors")
            ).result()

        return await load_lora(obj.lora_name, TENSOR_LORA_PATH, load)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(obj: UnloadLoRAAdapterReqInput) -> JSONResponse:
        """As SGLang: from now on a request naming the adapter is refused; the requests already queued that use it
        finish with it, then it is removed."""
        if engine.lora is None:
            return lora_answer(LORA_DISABLED)
        if obj.lora_name not in loras:
            return lora_answer(f"LoRA with name {obj.lora_name} does not exist. Loaded LoRAs: {', '.join(loras) or 'none'}")
        adapter, _ = loras.pop(obj.lora_name)
        lora_names_unloaded.add(obj.lora_name)
        await asyncio.wrap_future(batcher.call_exclusive(lambda: engine.unload_adapter(adapter)))
        logger.info("LoRA adapter %s unloaded", obj.lora_name)
        return lora_answer()

    def adapter_of(name: Optional[str]) -> Optional[str]:
        """The engine's adapter id for a request's `lora_path` (None: the base model); 400 for a name not served."""
        if name is None:
            return None
        if engine.lora is None:
            raise BadRequest(f"lora_path: the LoRA adapter {name!r} was requested, but LoRA is not enabled; start the "
                             "server with --enable-lora and load adapters with /load_lora_adapter")
        if name not in loras:
            state = "was unloaded" if name in lora_names_unloaded else "is not loaded"
            raise BadRequest(f"lora_path: the LoRA adapter {name!r} {state} (loaded: {', '.join(loras) or 'none'}); "
                             "load it with /load_lora_adapter")
        return loras[name][0]

    def tokenize(text: str) -> list[int]:
        return engine.tokenizer(text)["input_ids"]

    async def run(tasks: list[GenerationTask], to_score: list[list[int]], detailed: list, request: Request,
                  adapters: Optional[list[Optional[str]]] = None):
        """Queue `tasks` (sampling) and `to_score` (prompt log-probs, each with its LoRA adapter from `adapters`),
        then `detailed` (top / chosen log-probs of prompts, `(prompt, top_n, ids, adapter)`); await them all. Returns
        the scores and the detailed lists."""
        in_flight.update(tasks)
        try:
            gen_future = asyncio.wrap_future(batcher.generate(tasks)) if tasks else None
            score_future = asyncio.wrap_future(batcher.score(to_score, adapters)) if to_score else None
            detail_future = asyncio.wrap_future(batcher.call_between_steps(
                lambda: [engine.score_top(*entry) for entry in detailed])) if detailed else None
            _handed_in(request)
            scored = await score_future if score_future is not None else []
            details = await detail_future if detail_future is not None else []
            if gen_future is not None:
                await gen_future
            return scored, details
        finally:
            in_flight.difference_update(tasks)

    def prompt_inputs(prompts, want, starts, tops, token_ids, want_text, scored, details):
        """Each prompt's `PromptLogprobs` from the scores and detailed lists `run` returned."""
        scored_iter, detail_iter = iter(scored), iter(details)
        out = []
        for prompt, w, start, top, ids in zip(prompts, want, starts, tops, token_ids):
            if not (w and start >= 0):
                out.append(PromptLogprobs())
                continue
            top_lists, chosen = next(detail_iter) if (top or ids is not None) else ([], [])
            out.append(prompt_logprobs(engine, prompt, next(scored_iter), start, want_text, top_lists, chosen))
        return out

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(obj: GenerateReqInput, request: Request) -> Any:
        prompts = obj.prompts(tokenize)
        count = len(prompts)
        try:
            sampling = obj.per_prompt(obj.sampling_params, "sampling_params", count, SamplingParams())
            want = obj.per_prompt(obj.return_logprob, "return_logprob", count, False)
            starts = obj.per_prompt(obj.logprob_start_len, "logprob_start_len", count, -1)
            tops = obj.per_prompt(obj.top_logprobs_num, "top_logprobs_num", count, 0)
            token_ids = obj.per_prompt(obj.token_ids_logprob, "token_ids_logprob", count, None)
            rids = obj.per_prompt(obj.rid, "rid", count, None)
            loras_asked = obj.per_prompt(obj.lora_path, "lora_path", count, None)
        except ValueError as err:
            raise BadRequest(str(err)) from err
        adapters = [adapter_of(name) for name in loras_asked]
        check(prompts, sampling, starts, GENERATE_FIELDS)
        check_token_ids(token_ids, "token_ids_logprob", engine.vocab_size)
        asks = [GenerateAsk(w, top, ids, obj.return_text_in_logprobs) for w, top, ids in zip(want, tops, token_ids)]
        tasks, outputs_of = [], []
        for prompt, params, ask, rid, adapter in zip(prompts, sampling, asks, rids, adapters):
            for copy in range(params.n):
                tasks.append(GenerationTask(prompt=list(prompt), params=params, seed=seed_of(params.sampling_seed),
                                            adapter=adapter, top_logprobs_num=top_of(ask), token_ids_logprob=ids_of(ask)))
                outputs_of.append((ask, rid if rid is not None and params.n == 1 else request_id()))
        wants_input = [w and start >= 0 for w, start in zip(want, starts)]
        to_score = [p for p, w in zip(prompts, wants_input) if w]
        score_adapters = [adapter for adapter, w in zip(adapters, wants_input) if w]
        detailed = [(p, top_of(a), ids_of(a), adapter) for p, a, w, adapter in zip(prompts, asks, wants_input, adapters)
                    if w and (top_of(a) or ids_of(a) is not None)]
        many = obj.is_batch or len(tasks) > 1

        def task_inputs(scored, details) -> list[PromptLogprobs]:
            """Each task's `PromptLogprobs` (those of its prompt)."""
            inputs = prompt_inputs(prompts, want, starts, tops, token_ids, obj.return_text_in_logprobs, scored, details)
            return [inputs[p] for p, params in enumerate(sampling) for _ in range(params.n)]

        if obj.stream:
            async def chunks():
                per_task = task_inputs(*(await run([], to_score, detailed, request, score_adapters) if to_score else ([], [])))
                sent = [0] * len(tasks)
                async for index, n in stream_tasks(tasks, request):
                    ask, rid = outputs_of[index]
                    out = generate_output(engine, tasks[index], ask, per_task[index], rid, n,
                                          since=sent[index] if incremental else 0)
                    sent[index] = n
                    if many:
                        out["index"] = index
                    yield sse(out)
                yield SSE_DONE

            return StreamingResponse(ending_with_error_event(chunks()), media_type="text/event-stream")

        per_task = task_inputs(*await run(tasks, to_score, detailed, request, score_adapters))
        outputs = [generate_output(engine, task, ask, inp, rid) for task, (ask, rid), inp in zip(tasks, outputs_of, per_task)]
        # orjson straight to bytes: FastAPI's own path would validate and serialise thousands of entries again.
        return Response(orjson.dumps(outputs if many else outputs[0]), media_type="application/json")

    async def stream_tasks(tasks: list[GenerationTask], request: Request):
        """Run `tasks`, yielding `(index, tokens so far)` after every sampled token, and once more for each task whose
        end was not yet sent. A client that goes away aborts what is left; a failed batch ends the stream with an
        error event (the answer's status, 200, is sent by then)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        for index, task in enumerate(tasks):
            task.on_token = lambda t, i=index: loop.call_soon_threadsafe(events.put_nowait, (i, len(t.output_ids)))
        in_flight.update(tasks)
        future = batcher.generate(tasks)
        _handed_in(request)
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(events.put_nowait, None))
        sent_end = [False] * len(tasks)
        try:
            while (event := await events.get()) is not None:
                index, n = event
                sent_end[index] = tasks[index].finish is not None and n >= len(tasks[index].output_ids)
                yield index, n
            if future.exception() is not None:
                raise StreamFailed(str(future.exception()))
            for index, task in enumerate(tasks):
                if not sent_end[index]:
                    yield index, len(task.output_ids)
        finally:
            for task in tasks:
                task.abort()
            in_flight.difference_update(tasks)

    card = {"id": engine.model_path, "object": "model", "created": started, "owned_by": "open_r1_ext",
            "root": engine.model_path, "max_model_len": max_len}

    @app.get("/v1/models")
    async def list_models() -> dict:
        """The model, then the LoRA adapters loaded, as SGLang lists them (`http_server.py` `available_models`)."""
        adapters = [{"id": name, "object": "model", "created": started, "owned_by": "open_r1_ext", "root": path,
                     "parent": engine.model_path, "max_model_len": None} for name, (_, path) in loras.items()]
        return {"object": "list", "data": [card, *adapters]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> JSONResponse:
        if model != engine.model_path:
            message = f"The model '{model}' does not exist (this server serves {engine.model_path})"
            return JSONResponse(status_code=404, content={"error": {"message": message, "type": "NotFoundError"}})
        return JSONResponse(card)

    def weight_version_metadata() -> dict:
        """The weights an OpenAI answer was sampled with, as SGLang says them (`serving_completions.py` ~645,
        `serving_chat.py` ~3049) and as `/generate`'s `meta_info` does here (a reload runs after the batches queued
        before it)."""
        return {"weight_version": engine.weight_version}

    @app.post("/v1/completions")
    async def completions(obj: CompletionRequest, request: Request) -> Any:
        if text_only and not obj.text_prompts:
            raise BadRequest("prompt: this server (--openai-text-only) takes text prompts only")
        prompts = obj.prompts(tokenize)
        params = openai_sampling(obj.sampling)
        n = 1 if text_only else obj.n  # a server like llama.cpp's answers one choice per prompt
        params = params.model_copy(update={"n": n})
        check(prompts, [params] * len(prompts), [-1] * len(prompts), COMPLETION_FIELDS)
        ask = CompletionAsk(obj.logprobs, obj.echo, obj.return_token_ids and not text_only,
                            obj.return_tokens_as_token_ids and not text_only)
        top = obj.logprobs or 0
        tasks = [GenerationTask(prompt=list(prompts[i // n]), params=params, seed=seed_of(obj.seed), top_logprobs_num=top)
                 for i in range(len(prompts) * n)]
        echo_logprobs = obj.echo and bool(obj.logprobs)
        to_score = prompts if echo_logprobs else []
        detailed = [(p, top, None) for p in prompts] if echo_logprobs else []

        def echo_inputs(scored, details) -> list[PromptLogprobs]:
            count = len(prompts)
            return prompt_inputs(prompts, [echo_logprobs] * count, [0] * count, [top] * count, [None] * count, False,
                                 scored, details)

        def echo_text(i: int) -> str:
            if not obj.echo:
                return ""
            if obj.text_prompts:
                return obj.prompt if isinstance(obj.prompt, str) else obj.prompt[i // n]
            return engine.tokenizer.decode(prompts[i // n], skip_special_tokens=True)

        rid = obj.rid if isinstance(obj.rid, str) else request_id("cmpl-")  # as SGLang: a given rid is the id
        options = obj.stream_options or StreamOptions()
        created = int(time.time())
        model = obj.model or engine.model_path

        def body(choices, **extra) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices, **extra}

        if obj.stream:
            async def chunks():
                inputs = echo_inputs(*(await run([], to_score, detailed, request) if to_score else ([], [])))
                sent = [0] * len(tasks)
                text_sent = [0] * len(tasks)
                async for index, count in stream_tasks(tasks, request):
                    task = tasks[index]
                    choice = completion_choice(engine, index, task, ask, echo_text(index), inputs[index // n],
                                               start=sent[index], count=count, text_from=text_sent[index])
                    text_sent[index] += len(choice["text"]) - (len(echo_text(index)) if sent[index] == 0 else 0)
                    sent[index] = count
                    extra = {"usage": usage([task.prompt], [task], count)} if options.continuous_usage_stats else {}
                    yield sse(body([choice], **extra))
                if options.include_usage:
                    yield sse(body([], usage=usage(prompts, tasks)))
                yield SSE_DONE

            return StreamingResponse(ending_with_error_event(chunks()), media_type="text/event-stream")

        inputs = echo_inputs(*await run(tasks, to_score, detailed, request))
        choices = [completion_choice(engine, i, task, ask, echo_text(i), inputs[i // n]) for i, task in enumerate(tasks)]
        answer = body(choices, usage=usage(prompts, tasks), metadata=weight_version_metadata())
        return Response(orjson.dumps(answer), media_type="application/json")

    def chat_prompt(obj: ChatCompletionRequest) -> list[int]:
        """The messages through the model's chat template, with the assistant's turn opened (as SGLang), then the
        tokens of a final assistant message to continue (`continue_final_message`)."""
        if not engine.tokenizer.chat_template:
            raise BadRequest(f"messages: the model {engine.model_path} has no chat template; use /v1/completions")
        messages, prefix = obj.template_messages()
        try:
            ids = list(engine.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                            return_dict=False))
        except TemplateError as err:
            raise BadRequest(f"messages: the model's chat template refused them: {err}") from err
        return ids + engine.tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else ids

    @app.post("/v1/chat/completions")
    async def chat_completions(obj: ChatCompletionRequest, request: Request) -> Any:
        prompt = chat_prompt(obj)
        params = openai_sampling(lambda: obj.sampling(max_len - len(prompt)))
        if len(prompt) + params.max_new_tokens > max_len:  # named here: the prompt is the messages after the template
            raise BadRequest(f"messages: {len(prompt)} tokens after the chat template, plus max_completion_tokens "
                             f"({params.max_new_tokens}), is longer than the model's context length ({max_len} tokens)")
        check([prompt], [params], [-1], CHAT_FIELDS)
        top = obj.top_logprobs_num
        tasks = [GenerationTask(prompt=list(prompt), params=params, seed=seed_of(obj.seed), top_logprobs_num=top)
                 for _ in range(obj.n)]
        rid = obj.rid or request_id("chatcmpl-")
        created = int(time.time())
        model = obj.model or engine.model_path

        def body(kind: str, choices, **extra) -> dict:
            return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices, **extra}

        if obj.stream:
            options = obj.stream_options or StreamOptions()

            async def chunks():
                """As SGLang: per choice a first chunk with the role, then chunks of new text (with the log-probs of
                their tokens), then, once all are done, one chunk per choice with its finish reason."""
                started, tokens_sent, text_sent = [False] * len(tasks), [0] * len(tasks), [0] * len(tasks)
                async for index, count in stream_tasks(tasks, request):
                    task = tasks[index]
                    if not started[index]:
                        started[index] = True
                        yield sse(body("chat.completion.chunk", [chat_delta(index, {"role": "assistant", "content": ""})]))
                    done = task.finish is not None and count >= len(task.output_ids)
                    piece = output_text(engine, task, None if done else count)[text_sent[index]:]
                    # tokens whose text is held back (part of a character, a possible stop string) wait for it
                    if piece or (done and count > tokens_sent[index]):
                        logprobs = chat_logprobs(engine, task, tokens_sent[index], count, bool(top)) if obj.logprobs else None
                        extra = {"usage": usage([prompt], [task], count)} if options.continuous_usage_stats else {}
                        yield sse(body("chat.completion.chunk", [chat_delta(index, {"content": piece}, logprobs)], **extra))
                        tokens_sent[index], text_sent[index] = count, text_sent[index] + len(piece)
                for index, task in enumerate(tasks):
                    yield sse(body("chat.completion.chunk", [chat_delta(index, {}, finish=task)]))
                if options.include_usage:
                    yield sse(body("chat.completion.chunk", [], usage=usage([prompt], tasks)))
                yield SSE_DONE

            return StreamingResponse(ending_with_error_event(chunks()), media_type="text/event-stream")

        await run(tasks, [], [], request)
        choices = [chat_choice(engine, i, task, obj.logprobs, bool(top)) for i, task in enumerate(tasks)]
        answer = body("chat.completion", choices, usage=usage([prompt], tasks), metadata=weight_version_metadata())
        return Response(orjson.dumps(answer), media_type="application/json")

    weight_update_routes(app, engine, batcher, WeightReceiver(engine.device, weight_update_timeout), in_flight)
    return app


def abort_in_flight(in_flight: set[GenerationTask]) -> int:
    """As SGLang's `abort_all_requests` on a weight update: the requests in flight end now, with finish reason
    "abort"; returns how many."""
    aborted = 0
    for task in list(in_flight):
        if task.finish is None:
            task.abort()
            aborted += 1
    return aborted


def weight_update_routes(app: APIRouter, engine: ModelEngine, batcher: Batcher, receiver: WeightReceiver,
                         in_flight: set[GenerationTask]) -> None:
    """SGLang's distributed weight update on one model slot: `/init_weights_update_group`,
    `/destroy_weights_update_group`, `/begin_weight_update`, `/end_weight_update`, `/update_weights_from_distributed`,
    each answering `{success, message}` (HTTP 400 when not successful), as SGLang 0.5.23 (`weight_receiver`)."""

    def answer(success: bool, message: str) -> JSONResponse:
        return JSONResponse(status_code=200 if success else 400, content={"success": success, "message": message})

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(obj: InitWeightsUpdateGroupReqInput) -> JSONResponse:
        return answer(*await asyncio.to_thread(receiver.init_group, obj))  # generation goes on meanwhile

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(obj: DestroyWeightsUpdateGroupReqInput) -> JSONResponse:
        return answer(*await asyncio.to_thread(receiver.destroy_group, obj.group_name))

    @app.post("/begin_weight_update")
    async def begin_weight_update(obj: BeginWeightUpdateReqInput) -> JSONResponse:
        return answer(*receiver.begin(obj.selector))

    @app.post("/end_weight_update")
    async def end_weight_update(obj: EndWeightUpdateReqInput) -> JSONResponse:
        return answer(*receiver.end())

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(obj: UpdateWeightsFromDistributedReqInput) -> JSONResponse:
        if receiver.session is None:
            return answer(False, NO_SESSION)
        if obj.abort_all_requests:
            abort_in_flight(in_flight)
        receiver.updating = receiver.updating or asyncio.Lock()
        async with receiver.updating:  # the received tensors live in a buffer the next update reuses
            try:
                tensors = await asyncio.to_thread(receiver.receive, obj)  # beside generation, bounded by its timeout
            except Exception as err:  # noqa: BLE001 - SGLang's answer names it
                logger.error("Failed to receive weights: %s", err)
                return answer(False, f"Failed to receive weights: {err}")
            try:
                await asyncio.wrap_future(batcher.call_exclusive(
                    lambda: engine.load_tensors(dict(tensors), obj.weight_version)))
            except (WeightFileError, RuntimeError) as err:
                message = (f"Failed to update parameter online: {err}. The full weights of the ModelRunner are "
                           "partially updated. Please discard the whole weights.")
                logger.error(message)
                return answer(False, message)
        message = "Succeeded to update parameter online."
        if obj.weight_version is not None:
            message += f" Weight version updated to {obj.weight_version}."
        return answer(True, message)


class StreamFailed(RuntimeError):
    """The batch of a streamed request failed after its answer began."""


async def ending_with_error_event(chunks):
    """A stream's events; if its work fails, an error event and `[DONE]` end it, as SGLang ends a failed stream."""
    try:
        async for chunk in chunks:
            yield chunk
    except StreamFailed as err:
        yield sse({"error": {"message": str(err), "type": "internal_error", "code": 500}})
        yield SSE_DONE


OPENAI_NAMES = {"min_new_tokens": "min_tokens", "max_new_tokens": "max_tokens"}  # SGLang's sampling_params -> OpenAI's


def openai_sampling(build: Callable[[], SamplingParams]) -> SamplingParams:
    """A `/v1/*` request's settings as SGLang `sampling_params`; what SGLang refuses there (`top_k` 0, `min_tokens`
    above the completion's length) is a 400 naming the request's field."""
    try:
        return build()
    except ValidationError as err:
        error = err.errors()[0]
        name = error.get("ctx", {}).get("field") or str(error["loc"][-1] if error["loc"] else "body")
        raise BadRequest(f"{OPENAI_NAMES.get(name, name)}: {error['msg']}") from err


def top_of(ask: GenerateAsk) -> int:
    """Top log-probs are computed only for a request that asks for log-probs (as SGLang)."""
    return ask.top_logprobs_num if ask.return_logprob else 0


def ids_of(ask: GenerateAsk) -> Optional[list[int]]:
    return ask.token_ids_logprob if ask.return_logprob else None


def _allowed(path: str, weight_dirs: Optional[list[str]], key: str = "model_path") -> str:
    """`path` (the request's `key`) if it lies below one of `weight_dirs` (after resolving links; None allows any),
    else `WeightFileError`: a client with the API key still cannot make the server read other paths."""
    if "\0" in path:
        raise WeightFileError(f"{key}: {path!r} contains a NUL character")
    if weight_dirs is not None:
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, d]) == d for d in weight_dirs):
            raise WeightFileError(f"{key}: {path} is not below a directory this server may read weights from "
                                  f"(--weight-dirs {' '.join(weight_dirs)})")
    return path


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m open_r1_ext.server", description="The built-in SGLang-protocol server.")
    parser.add_argument("--model-path", required=True, help="transformers model directory (or hub name, if reachable)")
    parser.add_argument("--ref-model-path", default=None, help="model of the /ref slot (default: --model-path)")
    parser.add_argument("--no-ref-slot", action="store_true", help="serve one model only (no /ref slot)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health*")
    parser.add_argument("--admin-api-key", default=None,
                        help="as SGLang: /update_weights_from_disk, /flush_cache and the LoRA load and unload routes "
                             "take only this key (the other routes keep --api-key)")
    parser.add_argument("--dtype", default="auto", choices=sorted(DTYPES))
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--random-seed", type=int, default=0, help="seeds the server's sampling (without --enable-deterministic-inference)")
    parser.add_argument("--enable-deterministic-inference", action="store_true",
                        help="honour each request's sampling_seed (as SGLang: without this flag it is ignored; with it, a "
                             "request without one samples with seed 42)")
    parser.add_argument("--context-length", type=int, default=None, help="default: the model's max_position_embeddings")
    parser.add_argument("--max-batch-wait-ms", type=float, default=DEFAULT_MAX_WAIT_MS,
                        help="how long a batch waits for requests already being received (a lone request does not wait)")
    parser.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS, help="padded tokens per scoring forward")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch CPU threads (default on CPU: half the cores, leaving the rest to a trainer beside it)")
    parser.add_argument("--max-n", type=int, default=Limits.max_n, help="most copies (n) per prompt")
    parser.add_argument("--max-batch-items", type=int, default=Limits.max_batch_items, help="most prompts per request")
    parser.add_argument("--max-request-tokens", type=int, default=Limits.max_request_tokens,
                        help="most tokens per request: the sum over its prompts of n x (prompt + max_new_tokens)")
    parser.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes, help="largest request body")
    parser.add_argument("--weight-dirs", nargs="+", default=None, metavar="DIR",
                        help="/update_weights_from_disk and /load_lora_adapter read only below these directories "
                             "(default: anywhere); launchers pass the run's sync_dir")
    parser.add_argument("--weight-update-timeout", type=float, default=DEFAULT_WEIGHT_UPDATE_TIMEOUT_S,
                        help="seconds a distributed weight update's collective may take (forming a group, receiving a "
                             "broadcast) before it fails; SGLang's groups use torch's default, 30 minutes")
    parser.add_argument("--enable-lora", action="store_true",
                        help="as SGLang: serve LoRA adapters loaded with /load_lora_adapter (needs peft), named by "
                             "lora_path on /generate; a request without one uses the base model")
    parser.add_argument("--max-lora-rank", type=int, default=None, help="the largest rank of an adapter (with --enable-lora)")
    parser.add_argument("--lora-target-modules", nargs="+", default=None, choices=[*SGLANG_LORA_TARGET_MODULES, LORA_TARGET_ALL],
                        metavar="MODULE", help="the modules adapters may adapt, by the last part of their name, or "
                                               "'all' (with --enable-lora; SGLang's names)")
    parser.add_argument("--incremental-streaming-output", action="store_true",
                        help="as SGLang: each /generate stream chunk carries only the new tokens and text (default: all so far)")
    parser.add_argument("--openai-text-only", action="store_true",
                        help="for tests of the OpenAI backend: /v1/completions behaves like a plain OpenAI-compatible "
                             "server (e.g. llama.cpp's): text prompts only, one choice per prompt whatever n, no token ids")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="flags from a YAML mapping, as SGLang's --config (e.g. `api-key: KEY`, which then stays off "
                             "the command line, where ps shows it); flags on the command line win")
    args = parser.parse_args(argv)
    if args.config:
        import yaml

        with open(args.config) as file:
            values = {str(k).replace("-", "_"): v for k, v in (yaml.safe_load(file) or {}).items()}
        unknown = sorted(set(values) - {action.dest for action in parser._actions} - {"config", "help"})
        if unknown:
            parser.error(f"--config {args.config}: unknown flag(s) {', '.join(unknown)}")
        parser.set_defaults(**values)
        args = parser.parse_args(argv)
    _check_lora_args(parser, args)
    return args


def _check_lora_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """SGLang's rule (arg_groups/lora_hook.py ~152): without adapters at start-up, --enable-lora needs the rank and
    the modules adapters will have; and peft, here."""
    if not args.enable_lora:
        given = [flag for flag, value in (("--max-lora-rank", args.max_lora_rank),
                                          ("--lora-target-modules", args.lora_target_modules)) if value is not None]
        if given:
            parser.error(f"{' and '.join(given)} {'take' if len(given) > 1 else 'takes'} effect only with --enable-lora")
        return
    if args.max_lora_rank is None or not args.lora_target_modules:
        parser.error("--enable-lora needs both --max-lora-rank and --lora-target-modules (as SGLang when it starts "
                     "without --lora-paths), e.g. --max-lora-rank 16 --lora-target-modules all")
    if args.max_lora_rank < 1:
        parser.error(f"--max-lora-rank {args.max_lora_rank}: must be at least 1")
    if LORA_TARGET_ALL in args.lora_target_modules and len(args.lora_target_modules) > 1:
        parser.error("--lora-target-modules: 'all' must be the only module named (as SGLang)")
    if importlib.util.find_spec("peft") is None:
        parser.error("--enable-lora needs peft, which is not installed: pip install peft")


def lora_settings(args: argparse.Namespace) -> Optional[LoraSettings]:
    """The engines' LoRA settings from the flags (None: LoRA not enabled)."""
    if not args.enable_lora:
        return None
    modules = None if args.lora_target_modules == [LORA_TARGET_ALL] else frozenset(args.lora_target_modules)
    return LoraSettings(max_rank=args.max_lora_rank, target_modules=modules)


def main(argv: Optional[list[str]] = None) -> None:
    import torch
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.manual_seed(args.random_seed)
    if args.num_threads or (args.device in (None, "cpu") and not torch.cuda.is_available()):
        torch.set_num_threads(args.num_threads or max(1, (os.cpu_count() or 2) // 2))
    paths = {"": args.model_path}
    if not args.no_ref_slot:
        paths[REF_PREFIX] = args.ref_model_path or args.model_path
    slots = {}
    for prefix, path in paths.items():
        engine = ModelEngine(path, dtype=args.dtype, device=args.device, lora=lora_settings(args))
        slots[prefix] = (engine, Batcher(engine, max_wait_ms=args.max_batch_wait_ms, max_batch_tokens=args.max_batch_tokens))
        logger.info("slot %s: %s (%s, %s)", prefix or "/", path, engine.dtype, engine.device)
    # whatever the log level: which GPUs this server was given (an embedded server gets its own, `train.bind_gpus`)
    print(f"open_r1_ext.server: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}, models on "
          f"{engine.device}", file=sys.stderr, flush=True)
    limits = Limits(max_n=args.max_n, max_batch_items=args.max_batch_items, max_request_tokens=args.max_request_tokens,
                    max_body_bytes=args.max_body_bytes)
    app = create_app(slots, api_key=args.api_key, admin_api_key=args.admin_api_key, random_seed=args.random_seed, context_length=args.context_length,
                     limits=limits, weight_dirs=args.weight_dirs, deterministic=args.enable_deterministic_inference,
                     text_only=args.openai_text_only, incremental_streaming=args.incremental_streaming_output,
                     weight_update_timeout=args.weight_update_timeout)
    # The hundreds of thousands of objects torch, transformers and FastAPI leave on the heap are permanent: keep the
    # garbage collector from re-scanning them after every response (measured: ~90 ms of CPU per 32x256 request).
    gc.collect()
    gc.freeze()
    logger.info("serving on http://%s:%d", args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())


if __name__ == "__main__":
    main()
