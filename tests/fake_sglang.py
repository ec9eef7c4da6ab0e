"""A fake SGLang 0.5.23 HTTP server, for what real SGLang (which runs on this machine's CPU: `shared_sglang`) cannot be
made to show from outside, or only at a cost a unit test should not pay: aborting chosen items, a reload that takes
seconds, LoRA (its CPU path dies at start with `--enable-lora`), pools of several replicas going down and up. It
answers as SGLang's source does, each behaviour citing its lines (paths under `sglang/srt/` of the 0.5.23 wheel); it
has no model: completions are a fixed function of the prompt.

`with FakeSGLang(...) as fake:` serves `fake.url` on a free port in a thread (real HTTP, `helpers.http_server`);
`fake.calls` lists `(method, path, body, authorization)` of every request it received.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler
from typing import Optional

from open_r1_ext.sglang_client import SGLANG_SAMPLING_PARAMS
from tests.helpers import http_server

DEPRECATED = {"/get_model_info": "/model_info", "/get_server_info": "/server_info"}  # http_server.py ~802-863
# http_server.py ~1026, ~1301, ~1653, ~1677
ADMIN_OPTIONAL = ("/update_weights_from_disk", "/flush_cache", "/load_lora_adapter", "/unload_lora_adapter")
LORA_DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."  # tokenizer_control_mixin.py ~666


class FakeSGLang:
    """SGLang's answers for a model with `architectures` and `model_type`, `vocab_size` tokens and `context_length`
    (null in `/server_info` unless `report_context_length`, as when SGLang was started without `--context-length`).
    `enable_lora`: started with `--enable-lora` (dynamic LoRA: `/load_lora_adapter`, `/unload_lora_adapter`, and
    `lora_path` on `/generate`; `fake.adapters` maps each loaded name to its path). `reload_s`: a reload takes that
    long, and meanwhile `/health` answers 503 after `busy_health_s` (SGLang's runs a one-token generation that waits
    behind the reload and answers 503 after 20 s without scheduler output: http_server.py ~721-800, environ.py ~344)."""

    def __init__(self, architectures=("Qwen2ForCausalLM",), model_type: str = "qwen2", vocab_size: int = 300,
                 context_length: int = 2048, report_context_length: bool = False, api_key: Optional[str] = None,
                 admin_api_key: Optional[str] = None, aborts: int = 0, enable_lora: bool = False,
                 reload_s: float = 0.0, busy_health_s: float = 1.0):
        self.architectures, self.model_type, self.vocab_size = list(architectures), model_type, vocab_size
        self.context_length, self.report_context_length = context_length, report_context_length
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.aborts = aborts  # the next this many generated items are aborted
        self.weight_version = "default"
        self.enable_lora = enable_lora
        self.reload_s, self.busy_health_s = reload_s, busy_health_s
        self.reloading = threading.Event()
        self.adapters: OrderedDict[str, str] = OrderedDict()  # loaded: name -> path (lora_registry.py ~89)
        self.sent_adapters: dict[str, list[str]] = {}  # loaded from tensors: name -> serialized_named_tensors
        self.ever_loaded: dict[str, str] = {}  # tokenizer_manager.py's lora_ref_cache: never cleared on unload
        self.calls: list[tuple[str, str, Optional[dict], Optional[str]]] = []
        self.lock = threading.Lock()
        self._serving = contextlib.ExitStack()
        self.url = ""

    def __enter__(self) -> "FakeSGLang":
        self.url = self._serving.enter_context(http_server(self._handler()))
        return self

    def __exit__(self, *exc) -> None:
        self._serving.close()

    def paths(self, method: Optional[str] = None) -> list[str]:
        return [path for m, path, _, _ in self.calls if method in (None, m)]

    # ------------------------------------------------------------------ routes
    def model_info(self) -> dict:  # http_server.py ~812-849: no vocab_size
        return {"model_path": "fake/model", "served_model_name": "fake/model", "tokenizer_path": "fake/model",
                "is_generation": True, "preferred_sampling_params": None, "weight_version": self.weight_version,
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": self.model_type, "architectures": self.architectures}

    def server_info(self) -> dict:  # http_server.py ~863-891: the resolved server args plus scheduler info
        return {"context_length": self.context_length if self.report_context_length else None,
                "max_total_num_tokens": 100000, "max_req_input_len": self.context_length - 6,
                "enable_deterministic_inference": False, "version": "0.5.23", "internal_states": [{}]}

    def generate(self, body: dict) -> tuple[int, object]:
        prompts = body["input_ids"] if body["input_ids"] and isinstance(body["input_ids"][0], list) else [body["input_ids"]]
        lora_error = self._resolve_lora(body.get("lora_path"))
        if lora_error:
            return 400, {"error": {"message": lora_error}}
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(prompts)
        out = []
        for ids, sampling in zip(prompts, params):
            unknown = sorted(set(sampling) - set(SGLANG_SAMPLING_PARAMS))
            if unknown:  # SamplingParams(**kwargs) raises (tokenizer_manager.py ~1565): HTTP 400
                return 400, {"error": {"message": f"Unexpected keyword argument {unknown[0]!r}"}}
            max_new = sampling.get("max_new_tokens", 128)
            if len(ids) >= self.context_length or len(ids) + max_new > self.context_length:  # tokenizer_manager ~1338-1378
                return 400, {"error": {"message": f"Requested token count exceeds the model's maximum context length "
                                                  f"of {self.context_length} tokens."}}
            out.append(self._one(ids, max_new, body))
        return 200, out if isinstance(body["input_ids"][0], list) else out[0]

    def _one(self, ids: list[int], max_new: int, body: dict) -> dict:
        output = [(sum(ids) + 7 * j) % self.vocab_size for j in range(max_new)]
        meta = {"prompt_tokens": len(ids), "completion_tokens": max_new, "weight_version": self.weight_version,
                "finish_reason": {"type": "length", "length": max_new}}
        with self.lock:
            abort, self.aborts = self.aborts > 0, max(self.aborts - 1, 0)
        if abort:  # an abort without a status code: HTTP 200, partial output (tokenizer_manager.py ~3594-3640)
            output = output[:1]
            meta.update(finish_reason={"type": "abort", "message": "Abort in waiting queue"}, completion_tokens=len(output))
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-1.0, t, None] for t in output]
            meta["input_token_logprobs"] = [[None if i == 0 else -2.0, t, None] for i, t in enumerate(ids)]
        return {"text": "", "output_ids": output, "meta_info": meta}

    def completions(self, body: dict) -> tuple[int, dict]:
        """`/v1/completions` with token-id prompts (`entrypoints/openai/serving_completions.py` ~560-646): `n` choices
        per prompt, prompt-major; `token_ids` with `return_token_ids`; the sampled tokens' log-probs with `logprobs`;
        an aborted item answers `finish_reason: "abort"` with its partial output (~604-611, as real SGLang 0.5.23 on
        the CPU answered a request cut by `/abort_request`); `metadata.weight_version` (~645). Unknown fields are
        dropped (its request model ignores them)."""
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        choices = []
        for ids in prompts:
            for _ in range(body.get("n", 1)):
                item = self._one(ids, body.get("max_tokens", 16), {"return_logprob": True})
                meta = item["meta_info"]
                logprobs = {"tokens": [f"t{t}" for t in item["output_ids"]],
                            "token_logprobs": [e[0] for e in meta["output_token_logprobs"]]}
                text = "".join(chr(ord("a") + t % 26) for t in item["output_ids"])
                choices.append({"index": len(choices), "text": text, "finish_reason": meta["finish_reason"]["type"],
                                "logprobs": logprobs if body.get("logprobs") is not None else None,
                                "token_ids": item["output_ids"] if body.get("return_token_ids") else None})
        return 200, {"object": "text_completion", "model": body.get("model"), "choices": choices,
                     "metadata": {"weight_version": self.weight_version}}

    def update_weights_from_disk(self, body: dict) -> tuple[int, dict]:
        # Unknown keys (e.g. mixup_alpha) are dropped (utils/msgspec_utils.py ~95-99); the loader takes whatever
        # tensors the directory holds and reports success (weight_updater.py ~174-255).
        self.reloading.set()
        time.sleep(self.reload_s)
        self.reloading.clear()
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def health(self) -> tuple[int, str]:
        if self.reloading.is_set():
            time.sleep(self.busy_health_s)
            return (503, "") if self.reloading.is_set() else (200, "")
        return 200, ""

    def _resolve_lora(self, lora_path) -> Optional[str]:
        """tokenizer_manager.py ~3723-3791: LoRA not enabled; a name never loaded; a name unloaded since is loaded
        again, implicitly, from the path it was loaded from (its `lora_ref_cache` entry)."""
        names = [lora_path] if isinstance(lora_path, str) else [n for n in lora_path or () if n]
        if not names:
            return None
        if not self.enable_lora:
            return (f"LoRA adapter '{names[0]}' was requested, but LoRA is not enabled. Please launch the server with "
                    "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint.")
        for name in dict.fromkeys(names):
            if name in self.adapters:
                continue
            if name not in self.ever_loaded:
                return (f"Got LoRA adapter that has never been loaded: {name}\n"
                        f"All loaded adapters: {self.ever_loaded.keys()}.")
            status, result = self.load_lora_adapter({"lora_name": name, "lora_path": self.ever_loaded[name]})
            if status != 200:
                return f"Failed to implicitly load LoRA adapter {name}: {result['error_message']}"
        return None

    def _lora_result(self, error: Optional[str] = None, adapters: bool = True) -> tuple[int, dict]:
        """io_struct.py ~2572 `LoRAUpdateOutput` through `msgspec_to_builtins` (with BaseReq's rid, http_worker_ipc);
        HTTP 400 when not successful (http_server.py ~1659, ~1683)."""
        body = {"rid": None, "http_worker_ipc": None, "success": error is None, "error_message": error or "",
                "loaded_adapters": dict(self.adapters) if adapters else None}
        return (400 if error else 200), body

    def load_lora_adapter(self, body: dict) -> tuple[int, dict]:
        """tokenizer_control_mixin.py ~659-743, lora_manager.py ~275-365. The missing-path message is the fake's own
        (SGLang's comes from its config loader)."""
        if not self.enable_lora:
            return self._lora_result(LORA_DISABLED, adapters=False)
        name, path = body["lora_name"], body["lora_path"]
        if name in self.adapters:
            return self._lora_result(f"Failed to load LoRA adapter {name} because it is already loaded")
        if not os.path.isdir(path):
            return self._lora_result(f"LoRA adapter path {path} does not exist")
        self.adapters[name] = self.ever_loaded[name] = path
        return self._lora_result()

    def load_lora_adapter_from_tensors(self, body: dict) -> tuple[int, dict]:
        """As `load_lora_adapter`, the adapter in the body (io_struct.py ~2548-2569: listed as `__tensor__`); the fake
        keeps the payload it got in `sent_adapters`."""
        if not self.enable_lora:
            return self._lora_result(LORA_DISABLED, adapters=False)
        name = body["lora_name"]
        if name in self.adapters:
            return self._lora_result(f"Failed to load LoRA adapter {name} because it is already loaded")
        self.adapters[name] = self.ever_loaded[name] = "__tensor__"
        self.sent_adapters[name] = body["serialized_named_tensors"]
        return self._lora_result()

    def unload_lora_adapter(self, body: dict) -> tuple[int, dict]:
        """tokenizer_control_mixin.py ~634-657, ~831-860; lora_registry.py ~109-124 for an unknown name."""
        if not self.enable_lora:
            return self._lora_result(LORA_DISABLED, adapters=False)
        name = body["lora_name"]
        if name not in self.adapters:
            return self._lora_result(f"LoRA with name {name} does not exist. Loaded LoRAs: {self.adapters.keys()}",
                                     adapters=False)
        del self.adapters[name]
        return self._lora_result()

    # ------------------------------------------------------------------ HTTP
    def _allowed(self, path: str, authorization: Optional[str]) -> bool:
        """utils/auth.py ~100-151: /health* open; admin routes take only the admin key when one is set."""
        if path.startswith("/health"):
            return True
        if path in ADMIN_OPTIONAL and self.admin_api_key:
            return authorization == f"Bearer {self.admin_api_key}"
        return self.api_key is None or authorization == f"Bearer {self.api_key}"

    def _answer(self, method: str, path: str, body: Optional[dict]) -> tuple[int, object]:
        path = DEPRECATED.get(path, path)  # the deprecated routes log a warning, then answer as the new ones
        routes = {("GET", "/health"): self.health, ("GET", "/model_info"): lambda: (200, self.model_info()),
                  ("GET", "/server_info"): lambda: (200, self.server_info()),
                  ("POST", "/generate"): lambda: self.generate(body),
                  ("GET", "/v1/models"): lambda: (200, {"object": "list", "data": [{"id": "fake/model", "object": "model"}]}),
                  ("POST", "/v1/completions"): lambda: self.completions(body),
                  ("POST", "/update_weights_from_disk"): lambda: self.update_weights_from_disk(body),
                  ("POST", "/load_lora_adapter"): lambda: self.load_lora_adapter(body),
                  ("POST", "/load_lora_adapter_from_tensors"): lambda: self.load_lora_adapter_from_tensors(body),
                  ("POST", "/unload_lora_adapter"): lambda: self.unload_lora_adapter(body),
                  ("POST", "/flush_cache"): lambda: (200, "Cache flushed.\n")}
        route = routes.get((method, path))
        return route() if route else (404, {"detail": "Not Found"})

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                authorization = self.headers.get("Authorization")
                fake.calls.append((method, self.path, body, authorization))
                if not fake._allowed(self.path, authorization):
                    status, answer = 401, {"error": "Unauthorized"}
                else:
                    status, answer = fake._answer(method, self.path, body)
                data = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if isinstance(answer, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

        return Handler
