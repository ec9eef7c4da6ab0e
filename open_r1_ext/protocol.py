"""The subset of SGLang's native HTTP protocol that the trainer uses, as validated request types.

Field names, defaults and response shapes follow SGLang 0.5.23 (`sglang/srt/managers/io_struct.py`,
`sglang/srt/entrypoints/http_server.py`). This is the one module that knows those names: the built-in
server parses requests with the models below, and the clients build their bodies and read the answers with the
functions at the end (`generate_request`, `completion_from_generate`, ...).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from itertools import repeat
from typing import Annotated, Any, Callable, ClassVar, Iterable, Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator
from pydantic_core import PydanticCustomError

# The SGLang release this protocol follows (setup.cfg's `sglang` extra pins it; the preflight refuses another).
SGLANG_VERSION = "0.5.23"
# SGLang's `temperature` below this means greedy decoding.
GREEDY_TEMPERATURE = 1e-6
# SGLang's `/get_model_info` reports this `weight_version` until an update sets one.
DEFAULT_WEIGHT_VERSION = "default"
# `--dtype` values both the built-in server and SGLang accept (the recipe's `dtype` field offers these).
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")

Number = Union[StrictInt, StrictFloat]
# Ranges checked at the edge, so that no value that passes validation overflows later inside a shared batch.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # SGLang's `sampling_seed` is an i64
TOP_K_MAX = 1 << 30  # SGLang's TOP_K_ALL; -1 disables top-k


def max_req_input_len(context_length: int, max_total_tokens: int) -> int:
    """SGLang 0.5.23's `/server_info.max_req_input_len`: it refuses an input (a prompt; for reference log-probs, prompt
    and completion) of at least this many tokens, min(context - 1, KV-cache tokens - 1) - 5 (`managers/tp_worker.py`
    ~568-572, `managers/utils.py` ~272-287). The built-in server takes the same bound."""
    return min(context_length - 1, max_total_tokens - 1) - 5


# The ranges SGLang 0.5.23 takes (`sampling/sampling_params.py` ~255-294; any other value: HTTP 400 for the whole
# request): name -> (test, what the value must be). `min_new_tokens` must also be at most `max_new_tokens`.
SGLANG_SAMPLING_RANGES = {
    "temperature": (lambda v: v >= 0, ">= 0"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "top_k": (lambda v: v == -1 or v >= 1, "-1 (no top-k) or >= 1 (0 is refused)"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "repetition_penalty": (lambda v: 0 < v <= 2, "in (0, 2] (1.0: no penalty)"),
    "min_new_tokens": (lambda v: v >= 0, ">= 0"),
}


def sampling_range_problems(params: dict, max_new_tokens: Optional[int] = None) -> list[tuple[str, str]]:
    """`(name, what its value must be)` for each value of `params` (SGLang `sampling_params` names) that SGLang 0.5.23
    refuses (`SGLANG_SAMPLING_RANGES`; `min_new_tokens` above `max_new_tokens`)."""
    problems = []
    for name, value in params.items():
        if name not in SGLANG_SAMPLING_RANGES or value is None:
            continue
        test, must = SGLANG_SAMPLING_RANGES[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append((name, f"a number {must}"))
        elif not (math.isfinite(value) and test(value)):
            problems.append((name, must))
        elif name == "min_new_tokens" and max_new_tokens is not None and value > max_new_tokens:
            problems.append((name, f"at most max_new_tokens ({max_new_tokens})"))
    return problems


# What SGLang 0.5.23 knows and the built-in server does not do, with SGLang's default: a request may send the default
# (or null), anything else is refused with 400 naming the field as unsupported (never silently ignored). Read from
# `managers/io_struct.py` (`GenerateReqInput`), `sampling/sampling_params.py`, `entrypoints/openai/protocol.py`.
UNSUPPORTED_GENERATE_FIELDS: dict[str, Any] = {
    "session_id": None, "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None,
    "mm_hashes": None, "mm_content_hashes": None, "use_audio_in_video": False, "video_config": None, "watermark": None,
    "return_sampling_mask": None, "sampling_logprobs_mode": None, "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False, "log_metrics": True,
    "return_hidden_states": False, "return_routed_experts": False, "routed_experts_start_len": 0,
    "return_indexer_topk": False, "modalities": None, "session_params": None, "lora_id": None,
    "custom_logit_processor": None, "positional_embed_overrides": None, "bootstrap_host": None, "bootstrap_port": None,
    "bootstrap_room": None, "bootstrap_pair_key": None, "decode_tp_size": None, "routed_dp_rank": None,
    "data_parallel_rank": None, "disagg_prefill_dp_rank": None, "routing_key": None, "conversation_id": None,
    "http_worker_ipc": None, "background": False, "require_reasoning": False, "max_thinking_tokens": None,
    "priority": None, "extra_key": None, "no_logs": False, "custom_labels": None, "return_bytes": False,
    "return_entropy": False, "return_prompt_token_ids": False, "external_trace_header": None, "received_time": None,
    "need_wait_for_mm_inputs": None, "num_items_assigned": None, "encoder_urls": None, "max_dynamic_patch": None,
    "min_dynamic_patch": None, "image_max_dynamic_patch": None, "video_max_dynamic_patch": None, "images_config": None,
    "mm_processor_kwargs": None, "multi_item_delimiter_indices": None, "token_indices_to_pool": None,
    "cache_salt": None, "kv_hints": None,
}
UNSUPPORTED_SAMPLING_FIELDS: dict[str, Any] = {
    "stop_regex": None, "beam_width": None, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "stream_interval": None, "custom_params": None, "watermark": None,
}
UNSUPPORTED_COMPLETION_FIELDS: dict[str, Any] = {
    "best_of": None, "frequency_penalty": 0.0, "presence_penalty": 0.0, "suffix": None, "return_hidden_states": False,
    "return_routed_experts": False, "routed_experts_start_len": 0, "return_cached_tokens_details": False,
    "return_spec_tokens_details": False, "json_schema": None, "regex": None, "ebnf": None, "repetition_penalty": 1.0,
    "stop_regex": None, "lora_path": None, "session_id": None, "session_params": None, "response_format": None,
    "custom_params": None, "custom_logit_processor": None, "watermark": None, "images_config": None,
    "mm_processor_kwargs": None, "data_parallel_rank": None, "extra_key": None, "cache_salt": None, "priority": None,
    "custom_labels": None,
}
UNSUPPORTED_CHAT_FIELDS: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "response_format": None,
    "tools": None, "tool_choice": "none", "parallel_tool_calls": True, "return_hidden_states": False,
    "return_routed_experts": False, "routed_experts_start_len": 0, "return_cached_tokens_details": False,
    "return_spec_tokens_details": False, "return_prompt_token_ids": False, "return_token_ids": False,
    "return_meta_info": False, "return_input_ids_in_sglext": False, "return_output_ids_in_sglext": False,
    "return_sampling_mask": False, "sampling_logprobs_mode": None, "return_flat_raw_output_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": True, "reasoning_effort": None, "reasoning": None, "thinking": None,
    "task": None, "regex": None, "ebnf": None, "stop_regex": None,
    "lora_path": None, "session_id": None, "session_params": None, "separate_reasoning": True,
    "stream_reasoning": True, "chat_template_kwargs": None, "max_dynamic_patch": None, "min_dynamic_patch": None,
    "use_audio_in_video": False, "images_config": None, "video_config": None, "mm_processor_kwargs": None,
    "custom_logit_processor": None, "custom_params": None, "watermark": None, "input_ids": None, "extra_key": None,
    "cache_salt": None, "priority": None, "data_parallel_rank": None, "bootstrap_host": None, "bootstrap_port": None,
    "bootstrap_room": None, "routed_dp_rank": None, "disagg_prefill_dp_rank": None,
}
UNSUPPORTED_MESSAGE_FIELDS: dict[str, Any] = {"tool_calls": None, "tool_call_id": None, "reasoning_content": None}
UNSUPPORTED_CONTENT_PART_FIELDS: dict[str, Any] = {"image_url": None, "input_audio": None, "video_url": None, "file": None}
UNSUPPORTED_RELOAD_FIELDS: dict[str, Any] = {
    "is_async": False, "torch_empty_cache": False, "keep_pause": False, "recapture_cuda_graph": False, "token_step": 0,
    "manifest": None,
}
UNSUPPORTED_LORA_FIELDS: dict[str, Any] = {"rid": None, "http_worker_ipc": None, "lora_id": None}
# SGLang's `--lora-target-modules` choices (`utils/common.py` ~4700-4724), "all" being every one the model has.
SGLANG_LORA_TARGET_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "wq_b", "wk",
    "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj", "embed_tokens", "lm_head", "qkvr",
    "wo_ud",
)
LORA_TARGET_ALL = "all"
# Routes that SGLang's `--admin-api-key` locks to the admin key (`http_server.py` ~1026, ~1301, ~1404-1488, ~1653,
# ~1664, ~1677, ~1832, ~1845, all `AuthLevel.ADMIN_OPTIONAL`; `utils/auth.py` ~130): the clients send it there, the
# built-in server checks it there.
ADMIN_ROUTES = ("/update_weights_from_disk", "/flush_cache", "/load_lora_adapter", "/load_lora_adapter_from_tensors",
                "/unload_lora_adapter", "/init_weights_update_group", "/destroy_weights_update_group",
                "/begin_weight_update", "/end_weight_update", "/update_weights_from_distributed", "/pause_generation",
                "/continue_generation")
# OpenAI's legacy completions return at most this many `top_logprobs` per token.
MAX_COMPLETION_LOGPROBS = 5
# OpenAI's chat completions return at most this many `top_logprobs` per token.
MAX_CHAT_TOP_LOGPROBS = 20


class _Strict(BaseModel):
    """A request body: its fields, plus SGLang's fields this server does not support (`unsupported`, with SGLang's
    default: sending the default or null is fine, anything else is refused naming the field). Any other key is not
    SGLang's and is refused too."""

    model_config = ConfigDict(extra="forbid")
    unsupported: ClassVar[dict[str, Any]] = {}
    what: ClassVar[str] = "this request"

    @model_validator(mode="before")
    @classmethod
    def _only_supported_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key, value in data.items():
            if key in cls.model_fields:
                continue
            if key in cls.unsupported:
                if value is not None and value != cls.unsupported[key]:
                    raise PydanticCustomError("unsupported", "not supported by the built-in server (an SGLang field: leave "
                                              "it out or send its default, {default})",
                                              {"field": key, "default": json.dumps(cls.unsupported[key])})
            else:
                raise PydanticCustomError("unknown_field", "not a field of {what} (the built-in server takes: {fields})",
                                          {"field": key, "what": cls.what, "fields": ", ".join(cls.model_fields)})
        return {k: v for k, v in data.items() if k in cls.model_fields}


class SamplingParams(_Strict):
    """Per-prompt sampling settings (SGLang `sampling_params`)."""

    unsupported = UNSUPPORTED_SAMPLING_FIELDS
    what = "SGLang's sampling_params"

    max_new_tokens: StrictInt = Field(128, ge=0)
    temperature: Number = Field(1.0, ge=0.0)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(-1, ge=-1, le=TOP_K_MAX)
    min_p: Number = Field(0.0, ge=0.0, le=1.0)
    min_new_tokens: StrictInt = Field(0, ge=0)
    frequency_penalty: Number = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: Number = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: Number = Field(1.0, gt=0.0, le=2.0)
    stop: Union[StrictStr, list[StrictStr], None] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    logit_bias: Optional[dict[StrictStr, Number]] = None
    n: StrictInt = Field(1, ge=1)
    sampling_seed: Optional[StrictInt] = Field(None, ge=SEED_MIN, le=SEED_MAX)

    @model_validator(mode="after")
    def _as_sglang(self) -> "SamplingParams":
        """What SGLang refuses beyond the bounds above: `top_k` 0, `min_new_tokens` above `max_new_tokens`."""
        for name, must in sampling_range_problems({"top_k": self.top_k, "min_new_tokens": self.min_new_tokens},
                                                  self.max_new_tokens):
            raise PydanticCustomError("sglang_range", "must be {must} (SGLang's range)", {"field": name, "must": must})
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalizes(self) -> bool:
        """Whether the tokens sampled so far change the next token's logits (`frequency_penalty`, `presence_penalty`,
        `repetition_penalty`)."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop or () if s]


TokenIds = list[StrictInt]


class GenerateReqInput(_Strict):
    """Body of `POST /generate`: one prompt (`input_ids: [int]` or `text: str`) or a batch (`[[int]]`, `[str]`)."""

    unsupported = UNSUPPORTED_GENERATE_FIELDS
    what = "SGLang's /generate"

    text: Union[StrictStr, list[StrictStr], None] = None
    input_ids: Union[TokenIds, list[TokenIds], None] = None
    sampling_params: Union[SamplingParams, list[SamplingParams], None] = None
    return_logprob: Union[StrictBool, list[StrictBool], None] = False
    logprob_start_len: Union[StrictInt, list[StrictInt], None] = -1
    top_logprobs_num: Union[Annotated[StrictInt, Field(ge=0)], list[Annotated[StrictInt, Field(ge=0)]], None] = 0
    token_ids_logprob: Union[TokenIds, list[TokenIds], None] = None
    return_text_in_logprobs: StrictBool = False
    stream: StrictBool = False
    rid: Union[StrictStr, list[StrictStr], None] = None
    lora_path: Union[StrictStr, list[Optional[StrictStr]], None] = None  # a loaded adapter's lora_name (per prompt)

    @model_validator(mode="after")
    def _one_input(self) -> "GenerateReqInput":
        if (self.text is None) == (self.input_ids is None):
            raise PydanticCustomError("input", "give either input_ids or text", {"field": "input_ids"})
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def prompts(self, tokenize: Callable[[str], list[int]]) -> list[list[int]]:
        """The prompts as token ids (`text` through `tokenize`)."""
        if self.text is not None:
            return [tokenize(t) for t in (self.text if isinstance(self.text, list) else [self.text])]
        return self.input_ids if self.is_batch else [self.input_ids]  # type: ignore[return-value]

    def per_prompt(self, value: Any, name: str, count: int, default: Any = None) -> list[Any]:
        """Broadcast a scalar-or-list request field to one value per prompt (null: `default`)."""
        if isinstance(value, list) and (name != "token_ids_logprob" or (value and isinstance(value[0], list))):
            if len(value) != count:
                raise ValueError(f"{name}: {len(value)} entries for {count} prompts")
            return [default if v is None else v for v in value]
        return [default if value is None else value] * count


class UpdateWeightFromDiskReqInput(_Strict):
    """Body of `POST /update_weights_from_disk`.

    `mixup_alpha` is an extension of the built-in server (SGLang has no such field): the loaded weights
    become `alpha * new + (1 - alpha) * old`, TRL's soft reference update.
    """

    unsupported = UNSUPPORTED_RELOAD_FIELDS
    what = "SGLang's /update_weights_from_disk"

    model_path: StrictStr = Field(min_length=1)
    load_format: Optional[StrictStr] = None
    weight_version: Optional[StrictStr] = None
    abort_all_requests: StrictBool = False
    flush_cache: StrictBool = True
    mixup_alpha: Optional[Number] = Field(None, gt=0.0, le=1.0)


class LoadLoRAAdapterReqInput(_Strict):
    """Body of `POST /load_lora_adapter`: the PEFT adapter directory `lora_path`, served under `lora_name`
    (`pinned`: kept from eviction in SGLang; the built-in server evicts none)."""

    unsupported = UNSUPPORTED_LORA_FIELDS
    what = "SGLang's /load_lora_adapter"

    lora_name: StrictStr = Field(min_length=1)
    lora_path: StrictStr = Field(min_length=1)
    pinned: StrictBool = False


class LoadLoRAAdapterFromTensorsReqInput(_Strict):
    """Body of `POST /load_lora_adapter_from_tensors` (`io_struct.py` ~2548): the adapter's tensors
    (`serialized_named_tensors`, one copy per tensor-parallel rank: `named_tensors`) and its `adapter_config.json`
    (`config_dict`), served under `lora_name`."""

    unsupported = {**UNSUPPORTED_LORA_FIELDS, "added_tokens_config": None, "load_format": None,
                   "expected_checksums": None}
    what = "SGLang's /load_lora_adapter_from_tensors"

    lora_name: StrictStr = Field(min_length=1)
    config_dict: dict[str, Any]
    serialized_named_tensors: list[StrictStr] = Field(min_length=1)
    pinned: StrictBool = False


class UnloadLoRAAdapterReqInput(_Strict):
    """Body of `POST /unload_lora_adapter`."""

    unsupported = UNSUPPORTED_LORA_FIELDS
    what = "SGLang's /unload_lora_adapter"

    lora_name: StrictStr = Field(min_length=1)


# SGLang 0.5.23's weight update over torch.distributed (`io_struct.py` ~2002-2215, `http_server.py` ~1404-1505): a
# group is formed once (`/init_weights_update_group`, the trainer rank 0, the server's TP ranks from `rank_offset`),
# then each update is a session: `/begin_weight_update`, one `/update_weights_from_distributed` per broadcast,
# `/end_weight_update`. Every answer is `{"success": bool, "message": str}`, HTTP 400 when not successful.
DEFAULT_WEIGHT_UPDATE_GROUP = "weight_update_group"  # SGLang's default `group_name`
FLATTENED_BUCKET = "flattened_bucket"  # `load_format`: one uint8 broadcast of a bucket's tensors, back to back
UNSUPPORTED_WEIGHT_UPDATE_FIELDS: dict[str, Any] = {"rid": None, "http_worker_ipc": None}
# The trainer's convention on `weight_version`: every bucket of an update but the last carries `<N>-partial`, so a
# server whose update stopped half-way (mixed weights), and anything it sampled meanwhile, says so.
PARTIAL = "-partial"


def partial_version(version: str) -> str:
    """The version a server reports while (or after stopping) half-way through the update to `version`."""
    return f"{version}{PARTIAL}"


def is_partial(version: Optional[str]) -> bool:
    return str(version).endswith(PARTIAL)


class InitWeightsUpdateGroupReqInput(_Strict):
    """Body of `POST /init_weights_update_group`: join the group whose rank 0 (the trainer) listens at
    `master_address:master_port`, as rank `rank_offset` (SGLang: plus each TP rank's index)."""

    unsupported = UNSUPPORTED_WEIGHT_UPDATE_FIELDS
    what = "SGLang's /init_weights_update_group"

    master_address: StrictStr = Field(min_length=1)
    master_port: StrictInt = Field(ge=1, le=65535)
    rank_offset: StrictInt = Field(ge=1)
    world_size: StrictInt = Field(ge=2)
    group_name: StrictStr = Field(DEFAULT_WEIGHT_UPDATE_GROUP, min_length=1)
    backend: StrictStr = "nccl"


class DestroyWeightsUpdateGroupReqInput(_Strict):
    """Body of `POST /destroy_weights_update_group`."""

    unsupported = UNSUPPORTED_WEIGHT_UPDATE_FIELDS
    what = "SGLang's /destroy_weights_update_group"

    group_name: StrictStr = DEFAULT_WEIGHT_UPDATE_GROUP


class BeginWeightUpdateReqInput(_Strict):
    """Body of `POST /begin_weight_update` (opens the session the updates run in)."""

    unsupported = UNSUPPORTED_WEIGHT_UPDATE_FIELDS
    what = "SGLang's /begin_weight_update"

    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdateReqInput(_Strict):
    """Body of `POST /end_weight_update` (closes the session)."""

    unsupported = UNSUPPORTED_WEIGHT_UPDATE_FIELDS
    what = "SGLang's /end_weight_update"


class UpdateWeightsFromDistributedReqInput(_Strict):
    """Body of `POST /update_weights_from_distributed`: receive the tensors `names` (with their `dtypes` and `shapes`)
    that rank 0 of `group_name` broadcasts now, one broadcast per tensor, or one for all (`load_format:
    "flattened_bucket"`: their bytes back to back in one uint8 tensor), and load them."""

    unsupported = UNSUPPORTED_WEIGHT_UPDATE_FIELDS
    what = "SGLang's /update_weights_from_distributed"

    names: list[StrictStr] = Field(min_length=1)
    dtypes: list[StrictStr] = Field(min_length=1)
    shapes: list[list[StrictInt]] = Field(min_length=1)
    group_name: StrictStr = DEFAULT_WEIGHT_UPDATE_GROUP
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: Optional[StrictStr] = None
    load_format: Optional[StrictStr] = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: StrictBool = False

    @model_validator(mode="after")
    def _one_entry_per_name(self) -> "UpdateWeightsFromDistributedReqInput":
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"names, dtypes and shapes must have one entry per tensor: {len(self.names)}, "
                             f"{len(self.dtypes)} and {len(self.shapes)}")
        return self


PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's PauseGenerationReqInput.mode (io_struct.py ~1946)


class PauseGenerationReqInput(_Strict):
    """Body of `POST /pause_generation` (SGLang 0.5.23, `io_struct.py` ~1927-1946): `abort` ends the requests under
    way (finish reason `abort`, partial output); `retract` keeps them and drops their KV cache, recomputed with the
    weights served at `/continue_generation`; `in_place` keeps them with their KV cache (a reload then needs
    `flush_cache: false`). New requests wait until `/continue_generation`."""

    unsupported = UNSUPPORTED_LORA_FIELDS
    what = "SGLang's /pause_generation"

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(_Strict):
    """Body of `POST /continue_generation` (`io_struct.py` ~1949-1955; `torch_empty_cache` frees CUDA's cached
    blocks first, nothing to do on a CPU)."""

    unsupported = UNSUPPORTED_LORA_FIELDS
    what = "SGLang's /continue_generation"

    torch_empty_cache: StrictBool = True


class StreamOptions(_Strict):
    what = "OpenAI's stream_options"

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _OpenAIRequest(_Strict):
    """The fields `/v1/completions` and `/v1/chat/completions` share, with the same meaning and default."""

    min_tokens: StrictInt = Field(0, ge=0)
    stop: Union[StrictStr, list[StrictStr], None] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    logit_bias: Optional[dict[StrictStr, Number]] = None
    ignore_eos: StrictBool = False
    no_stop_trim: StrictBool = False
    skip_special_tokens: StrictBool = True
    seed: Optional[StrictInt] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[StrictStr] = None  # OpenAI's end-user id: no effect on the answer (as in SGLang)


class CompletionRequest(_OpenAIRequest):
    """Body of `POST /v1/completions` (OpenAI, with SGLang's extensions `top_k`, `min_p`, `min_tokens`,
    `stop_token_ids`, `ignore_eos`, `skip_special_tokens`, `no_stop_trim`, `return_token_ids` and `rid`, and vLLM's
    `return_tokens_as_token_ids`, which makes `logprobs.tokens` read `"token_id:N"`)."""

    unsupported = UNSUPPORTED_COMPLETION_FIELDS
    what = "SGLang's /v1/completions"

    model: Optional[StrictStr] = None
    prompt: Union[TokenIds, list[TokenIds], StrictStr, list[StrictStr]]
    n: StrictInt = Field(1, ge=1)
    max_tokens: StrictInt = Field(16, ge=0)
    temperature: Number = Field(1.0, ge=0.0)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(-1, ge=-1, le=TOP_K_MAX)
    min_p: Number = Field(0.0, ge=0.0, le=1.0)
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: StrictBool = False
    return_token_ids: StrictBool = False
    return_tokens_as_token_ids: StrictBool = False
    rid: Union[StrictStr, list[StrictStr], None] = None

    @property
    def text_prompts(self) -> bool:
        return isinstance(self.prompt, str) or bool(self.prompt) and isinstance(self.prompt[0], str)

    def prompts(self, tokenize: Callable[[str], list[int]]) -> list[list[int]]:
        """The prompts as token ids (text through `tokenize`)."""
        if isinstance(self.prompt, str):
            return [tokenize(self.prompt)]
        if self.text_prompts:
            return [tokenize(p) for p in self.prompt]  # type: ignore[arg-type]
        return self.prompt if self.prompt and isinstance(self.prompt[0], list) else [self.prompt]  # type: ignore[return-value]

    def sampling(self) -> SamplingParams:
        """The settings of every prompt, as SGLang's `/v1/completions` builds them (`seed` is every copy's seed)."""
        return SamplingParams(max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, min_new_tokens=self.min_tokens, stop=self.stop,
                              stop_token_ids=self.stop_token_ids, logit_bias=self.logit_bias, ignore_eos=self.ignore_eos,
                              no_stop_trim=self.no_stop_trim, n=self.n, sampling_seed=self.seed,
                              skip_special_tokens=self.skip_special_tokens)


class ChatContentPart(_Strict):
    """One part of a chat message's `content` list: text only (SGLang joins a message's text parts with spaces)."""

    unsupported = UNSUPPORTED_CONTENT_PART_FIELDS
    what = "a text content part"

    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    """One message of `messages`: a role and its text (a string, a list of text parts, or null)."""

    unsupported = UNSUPPORTED_MESSAGE_FIELDS
    what = "a chat message"

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[ChatContentPart], None] = None
    name: Optional[StrictStr] = None

    def for_template(self) -> dict:
        """The message as a chat template reads it (content as one string)."""
        content = self.content if not isinstance(self.content, list) else " ".join(p.text for p in self.content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_OpenAIRequest):
    """Body of `POST /v1/chat/completions` (OpenAI, with SGLang's extensions `top_k`, `min_p`, `min_tokens`,
    `stop_token_ids`, `ignore_eos`, `skip_special_tokens`, `no_stop_trim`, `continue_final_message` and `rid`). Without `max_completion_tokens`
    (or the deprecated `max_tokens`) a completion may run to the end of the context, as in SGLang."""

    unsupported = UNSUPPORTED_CHAT_FIELDS
    what = "SGLang's /v1/chat/completions"

    messages: list[ChatMessage] = Field(min_length=1)
    model: Optional[StrictStr] = None
    n: StrictInt = Field(1, ge=1)
    max_tokens: Optional[StrictInt] = Field(None, ge=0)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=0)
    temperature: Optional[Number] = Field(None, ge=0.0)
    top_p: Optional[Number] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[StrictInt] = Field(None, ge=-1, le=TOP_K_MAX)
    min_p: Optional[Number] = Field(None, ge=0.0, le=1.0)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    continue_final_message: StrictBool = False
    rid: Optional[StrictStr] = None

    def template_messages(self) -> tuple[list[dict], Optional[str]]:
        """The messages for the chat template and the text to append after it. As SGLang: a last assistant message
        with string content is, with `continue_final_message`, taken out and its text appended after the opened
        assistant turn (the answer continues it); without, it is sent as a user message."""
        messages = [m.for_template() for m in self.messages]
        last = self.messages[-1]
        if last.role != "assistant" or not isinstance(last.content, str):
            return messages, None
        if self.continue_final_message:
            return messages[:-1], last.content
        return messages[:-1] + [{**messages[-1], "role": "user"}], None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("top_logprobs", "needs logprobs: true", {"field": "top_logprobs"})
        return self

    @property
    def top_logprobs_num(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    def sampling(self, room: int) -> SamplingParams:
        """The settings of every choice; `room`: the context left after the prompt (the default completion length)."""
        limit = next((v for v in (self.max_completion_tokens, self.max_tokens) if v is not None), max(room, 0))
        defaults = SamplingParams.model_fields
        return SamplingParams(
            max_new_tokens=limit, min_new_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            logit_bias=self.logit_bias, ignore_eos=self.ignore_eos, no_stop_trim=self.no_stop_trim, n=self.n,
            sampling_seed=self.seed, skip_special_tokens=self.skip_special_tokens,
            **{name: getattr(self, name) if getattr(self, name) is not None else defaults[name].default
               for name in ("temperature", "top_p", "top_k", "min_p")})


def logprob_entries(logprobs: Iterable[Optional[float]], token_ids: Iterable[int], texts: Optional[Iterable[Optional[str]]] = None):
    """SGLang's `[logprob, token_id, text-or-null]` triples, as tuples (JSON arrays all the same): `zip` builds them
    without a Python step per entry, and a reference answer has thousands."""
    return list(zip(logprobs, token_ids, repeat(None) if texts is None else texts))


def finish_reason(kind: str, value: Any) -> dict:
    """SGLang's `finish_reason` object: `{"type": "stop", "matched": id or string}`, `{"type": "length", "length": n}`
    or, for a request aborted (e.g. by a reload with `abort_all_requests`), `{"type": "abort", "message": ...}`."""
    if kind == "stop":
        return {"type": "stop", "matched": value}
    if kind == "abort":
        return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    return {"type": "length", "length": value}


def lora_update_output(error: Optional[str], loaded_adapters: Optional[dict[str, str]]) -> dict:
    """SGLang's answer to a LoRA load or unload (`LoRAUpdateOutput`): `success`, `error_message` and the adapters then
    loaded (name -> path)."""
    return {"success": error is None, "error_message": error or "", "loaded_adapters": loaded_adapters}


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
    """One sampled completion: token ids, their sampling log-probs, why it stopped, and the weights used:
    `weight_version` the last (the server's at the end), `weight_versions` each `(version, start, end)` span of its
    tokens when the server reports them (SGLang's `meta_info.weight_versions`: the weights changed while it was being
    sampled, e.g. under `/pause_generation`)."""

    token_ids: list[int]
    logprobs: Optional[list[float]]
    finish_reason: str
    weight_version: Optional[str]
    weight_versions: Optional[list[tuple[str, int, int]]] = None

    @property
    def versions(self) -> list[Optional[str]]:
        """The weight versions its tokens came from, oldest first (`[weight_version]` without spans)."""
        return [span[0] for span in self.weight_versions] if self.weight_versions else [self.weight_version]


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


def generate_request(prompts: list[list[int]], sampling: list[dict], lora_path: Optional[str] = None) -> dict:
    """`/generate` body sampling one completion per prompt, with its own `sampling_params`, and their log-probs;
    `lora_path`: the loaded LoRA adapter every item samples with (its `lora_name`; None: the base model)."""
    body = {"input_ids": prompts, "sampling_params": sampling, "return_logprob": True}
    if lora_path is not None:
        body["lora_path"] = [lora_path] * len(prompts)
    return body


def with_seed(sampling: dict, seed: Optional[int]) -> dict:
    return sampling if seed is None else {**sampling, "sampling_seed": int(seed)}


def completion_from_generate(result: dict) -> Completion:
    meta = result["meta_info"]
    return Completion(
        token_ids=list(result["output_ids"]),
        logprobs=[float(e[0]) for e in meta["output_token_logprobs"]],
        finish_reason=(meta.get("finish_reason") or {}).get("type", "length"),
        weight_version=meta.get("weight_version"),
        weight_versions=[(str(span["version"]), int(span["start"]), int(span["end"]))
                         for span in meta.get("weight_versions") or ()] or None,
    )


def update_weights_request(model_path: str, weight_version: Optional[str] = None, **extra: Any) -> dict:
    """`/update_weights_from_disk` body; `extra` e.g. the built-in server's `mixup_alpha`."""
    body = {"model_path": str(model_path), **extra}
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return body


def init_weights_update_group_request(master_address: str, master_port: int, rank_offset: int, world_size: int,
                                      group_name: str, backend: str) -> dict:
    """`/init_weights_update_group` body."""
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def update_weights_from_distributed_request(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                                            group_name: str, weight_version: Optional[str], flush_cache: bool,
                                            load_format: Optional[str] = FLATTENED_BUCKET) -> dict:
    """`/update_weights_from_distributed` body for one broadcast (by default one flattened bucket)."""
    body = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(map(int, s)) for s in shapes],
            "group_name": group_name, "flush_cache": bool(flush_cache), "load_format": load_format}
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return body


def load_lora_request(lora_name: str, lora_path: str, pinned: bool = False) -> dict:
    """`/load_lora_adapter` body: load the PEFT adapter directory `lora_path` under the name `lora_name`."""
    return {"lora_name": str(lora_name), "lora_path": str(lora_path), "pinned": bool(pinned)}


def load_lora_tensors_request(lora_name: str, serialized: str, config: dict, copies: int = 1) -> dict:
    """`/load_lora_adapter_from_tensors` body: an adapter's tensors (`serialized`: `named_tensors.
    serialize_named_tensors`), once per tensor-parallel rank of the server (`copies`), and its `adapter_config.json`."""
    return {"lora_name": str(lora_name), "config_dict": config, "serialized_named_tensors": [serialized] * copies,
            "pinned": False}


def unload_lora_request(lora_name: str) -> dict:
    """`/unload_lora_adapter` body."""
    return {"lora_name": str(lora_name)}


# SGLang `sampling_params` keys as SGLang 0.5.23's `/v1/completions` fields (`entrypoints/openai/protocol.py` ~367-408;
# `serving_completions.py` ~150-175 builds `sampling_params` back from them): the same name unless renamed here. Those
# in `OPENAI_COMPLETIONS_FIELDS` are OpenAI's own, every compatible server takes them; the others are SGLang's
# extensions (vLLM takes the common ones: `top_k`, `min_p`, `min_tokens`, `repetition_penalty`, `stop_token_ids`, ...).
# `max_new_tokens`, `n` and `sampling_seed` are the request's own (`max_tokens`, `n`, `seed`).
COMPLETIONS_RENAMED = {"min_new_tokens": "min_tokens"}
OPENAI_COMPLETIONS_FIELDS = ("temperature", "top_p", "stop", "presence_penalty", "frequency_penalty", "logit_bias")
COMPLETIONS_EXTENSIONS = ("top_k", "min_p", "min_tokens", "repetition_penalty", "stop_token_ids", "stop_regex",
                          "no_stop_trim", "ignore_eos", "skip_special_tokens", "json_schema", "regex", "ebnf",
                          "custom_params", "watermark")
# What a setting is when it does nothing: left out of a request (and so never refused by a strict server).
NEUTRAL_SAMPLING = {"top_k": (-1, 0), "min_p": (0.0,), "min_tokens": (0,), "repetition_penalty": (1.0,),
                    "stop_token_ids": ((), []), "presence_penalty": (0.0,), "frequency_penalty": (0.0,)}
REQUEST_OWN = ("max_new_tokens", "n", "sampling_seed")


def completions_field(key: str) -> Optional[str]:
    """The `/v1/completions` field of the SGLang `sampling_params` key `key`; None if SGLang's `/v1/completions` has
    none (e.g. `structural_tag`, `beam_width`, `spaces_between_special_tokens`, `stream_interval`)."""
    name = COMPLETIONS_RENAMED.get(key, key)
    return name if name in OPENAI_COMPLETIONS_FIELDS or name in COMPLETIONS_EXTENSIONS else None


def completions_sampling(sampling: dict, extensions: bool = True) -> tuple[dict, list[str]]:
    """`sampling` (SGLang `sampling_params`) as `/v1/completions` fields, and the keys of the settings left out: those
    SGLang's `/v1/completions` has no field for, and, without `extensions` (a strict OpenAI server), SGLang's
    extensions. Settings at their neutral value (`top_k: -1`, `repetition_penalty: 1.0`, ...) are not sent."""
    fields, left_out = {}, []
    for key, value in sampling.items():
        name = completions_field(key)
        if key in REQUEST_OWN or value is None or (name is not None and value in NEUTRAL_SAMPLING.get(name, ())):
            continue
        if name is None or (name not in OPENAI_COMPLETIONS_FIELDS and not extensions):
            left_out.append(key)
        else:
            fields[name] = value
    return fields, left_out


def completions_request(model: str, prompts: Sequence[Sequence[int]], sampling: dict, n: int,
                        seed: Optional[int], extensions: bool = True) -> dict:
    """OpenAI `/v1/completions` body for SGLang-style `sampling` (`sampling_params` above, each setting under its
    `/v1/completions` name: `completions_sampling`), asking for the sampled tokens' log-probs and, with `extensions`,
    their ids both ways servers say them: SGLang's `return_token_ids` and vLLM's `return_tokens_as_token_ids` (each
    server ignores the other's), with special tokens kept in the text."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": [list(map(int, p)) for p in prompts],
        "n": n,
        "max_tokens": int(sampling.get("max_new_tokens", 128)),
        "logprobs": 0,
    }
    if extensions:
        body.update(return_token_ids=True, return_tokens_as_token_ids=True, skip_special_tokens=False)
    body.update(completions_sampling(sampling, extensions)[0])
    if seed is not None:
        body["seed"] = int(seed) % (2**31)
    return body


def completion_from_choice(choice: dict, weight_version: Optional[str] = None) -> Optional[Completion]:
    """An OpenAI choice as a `Completion` when the server said its token ids (SGLang's `token_ids`, or vLLM's
    `"token_id:N"` tokens); None if it gave text only. Log-probs when given, one per token; `weight_version`: the
    answer's (`completions_weight_version`)."""
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs")
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        tokens = logprobs.get("tokens")
        if not tokens or not all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in tokens):
            return None
        ids = [int(t[len(TOKEN_ID_PREFIX):]) for t in tokens]
    usable = isinstance(values, list) and len(values) == len(ids) and all(isinstance(v, (int, float)) for v in values)
    return Completion(list(map(int, ids)), [float(v) for v in values] if usable else None,
                      finish_reason_of_choice(choice), weight_version)


def completions_weight_version(answer: dict) -> Optional[str]:
    """The weight version a `/v1/completions` answer was sampled with: SGLang's `metadata.weight_version`
    (`serving_completions.py` ~645, its first item's; a reload waits for the requests in flight, so every item's);
    None from a server that does not say it."""
    version = (answer.get("metadata") or {}).get("weight_version")
    return None if version is None else str(version)


def finish_reason_of_choice(choice: dict) -> str:
    return choice.get("finish_reason") or "length"
