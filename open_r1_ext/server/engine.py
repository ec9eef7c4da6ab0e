"""The built-in server's model work: batched log-prob scoring, batched sampling, weight reloads and LoRA adapters.

A `ModelEngine` owns one transformers causal LM on CPU or one GPU, and with `--enable-lora` the PEFT LoRA adapters
loaded beside it (peft's multi-adapter model: each row of a batch runs with its own adapter, or none). Sampling runs
in a `DecodeBatch` (continuous batching: sequences join at a step boundary and leave once finished). It knows nothing
of HTTP; the batcher (`open_r1_ext.server.batcher`) calls it from a single worker thread, so weights never change
under a forward.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from open_r1_ext.protocol import DEFAULT_WEIGHT_VERSION, DTYPE_NAMES, SamplingParams
from open_r1_ext.weight_files import WeightFileError, read_shard, read_weight_dir

logger = logging.getLogger(__name__)

# A stop string is looked for in the text of the last this many output tokens (SGLang keeps a window of text, too).
STOP_STRING_TAIL_TOKENS = 32
DTYPES = {name: None if name == "auto" else getattr(torch, name) for name in DTYPE_NAMES}
# A PEFT adapter directory (what `PeftModel.save_pretrained` writes); only safetensors weights are read.
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
BASE_ROW = "__base__"  # peft's name for a row of a mixed batch that runs without an adapter


@dataclass(frozen=True)
class LoraSettings:
    """What adapters the server takes (SGLang's `--max-lora-rank`, `--lora-target-modules`): rank at most
    `max_rank`, adapting only modules named in `target_modules` (the last part of a module's name; None: any)."""

    max_rank: int
    target_modules: Optional[frozenset[str]] = None


@dataclass(eq=False)  # compared and hashed by identity: the server keeps the tasks in flight in a set
class GenerationTask:
    """One sequence to sample: a prompt, its settings and the seed of its own random generator.

    `top_logprobs_num` / `token_ids_logprob` ask for each step's most likely tokens / the given tokens with their
    log-probs (`output_top_logprobs`, `output_token_ids_logprobs`: `(logprob, id)` pairs). `on_token`, if set, is
    called on the worker thread after every sampled token (streaming). `abort()` stops it at the next step with
    finish reason `abort`. `adapter`: the id of the LoRA adapter it samples with (`ModelEngine.load_adapter`; None:
    the base model). `version_events`: `(weight version, tokens sampled by then)` for each weight change while it was
    under way (SGLang's `weight_version_events`, from which its answer's `weight_versions` spans are computed)."""

    prompt: list[int]
    params: SamplingParams
    seed: int
    adapter: Optional[str] = None
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[list[int]] = None
    on_token: Optional[Callable[["GenerationTask"], None]] = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_token_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    finish: Optional[tuple[str, Any]] = None
    aborted: bool = False
    version_events: list[tuple[str, int]] = field(default_factory=list)
    generator: Optional[torch.Generator] = None  # its own random stream, made when it first joins a `DecodeBatch`

    def abort(self) -> None:
        self.aborted = True


class ModelEngine:
    """A causal LM that scores and samples token ids, reloads its weights from a directory, and (with `lora`) serves
    LoRA adapters loaded from directories beside its own weights."""

    def __init__(self, model_path: str, dtype: str = "auto", device: Optional[str] = None,
                 lora: Optional[LoraSettings] = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = str(model_path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch_dtype = DTYPES[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=torch_dtype if torch_dtype is not None else "auto"
        ).to(self.device)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.context_length = int(getattr(config, "max_position_embeddings", 2048))
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self.live_tasks: set[GenerationTask] = set()  # sampling under way (running or paused): see `load_weights`
        self.loaded_path = self.model_path
        self.lora = lora
        self.peft: Any = None  # the `PeftModel` around `model`, from the first adapter on (peft injects in place)
        self.adapters: set[str] = set()  # ids of the adapters loaded
        self._adapters_made = 0
        # unloaded adapters whose LoRA modules are kept (by id: its config), for the next adapter of the same shapes
        self._retired: dict[str, Any] = {}

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # ---------------------------------------------------------------- scoring
    def _forward(self, adapters: Sequence[Optional[str]], **inputs: Any) -> Any:
        """The model's forward, each row with its LoRA adapter (`adapters`, one id or None per row: the base model)."""
        gone = sorted({a for a in adapters if a is not None} - self.adapters)
        if gone:  # peft would run such a row on the base model without a word
            raise ValueError(f"lora_path: the LoRA adapter ({', '.join(gone)}) was unloaded before this request ran")
        if not self.adapters and not self._retired:  # no adapter left: peft's layers, if any are left, do nothing
            return self.model(**inputs)
        # (a retired adapter, see unload_adapter, is still in the layers: each row names what it runs, __base__ too)
        return self.peft(**inputs, adapter_names=[BASE_ROW if a is None else a for a in adapters])

    @torch.inference_mode()
    def score(self, sequences: list[list[int]], adapters: Optional[Sequence[Optional[str]]] = None) -> list[list[float]]:
        """For each sequence, `log p(t_i | t_<i)` for i = 1..len-1, from one right-padded forward (each sequence with
        its adapter from `adapters`, default none)."""
        lengths = [len(s) for s in sequences]
        longest = max(lengths)
        pad = [self.pad_token_id]
        # One tensor from the padded lists and one `tolist` at the end: no per-row tensor calls.
        ids = torch.tensor([s if n == longest else [*s, *pad * (longest - n)] for s, n in zip(sequences, lengths)], dtype=torch.long)
        mask = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]).long()
        ids, mask = ids.to(self.device), mask.to(self.device)
        logits = self._forward(adapters or [None] * len(sequences), input_ids=ids, attention_mask=mask,
                               use_cache=False).logits[:, :-1].float()
        token_logprobs = _gather_logprobs(logits, ids[:, 1:]).tolist()
        return [row if n == longest else row[: n - 1] for row, n in zip(token_logprobs, lengths)]

    @torch.inference_mode()
    def score_top(self, sequence: list[int], top_n: int, token_ids: Optional[list[int]],
                  adapter: Optional[str] = None) -> tuple[list, list]:
        """For token i = 1..len-1 of `sequence`: its `top_n` most likely tokens and the `token_ids` given, each as
        `(logprob, id)` pairs of `log p(. | t_<i)` (SGLang's `input_top_logprobs` / `input_token_ids_logprobs`)."""
        ids = torch.tensor([sequence], dtype=torch.long, device=self.device)
        logprobs = F.log_softmax(self._forward([adapter], input_ids=ids, use_cache=False).logits[0, :-1].float(), dim=-1)
        tops: list = []
        if top_n:
            top = logprobs.topk(min(top_n, logprobs.shape[-1]), dim=-1)
            tops = [list(zip(v, i)) for v, i in zip(top.values.tolist(), top.indices.tolist())]
        chosen: list = []
        if token_ids is not None:
            chosen = [list(zip(row, token_ids)) for row in logprobs[:, token_ids].tolist()]
        return tops, chosen

    # ------------------------------------------------------------- generation
    @torch.inference_mode()
    def generate(self, tasks: list[GenerationTask]) -> list[GenerationTask]:
        """Sample all tasks together (a `DecodeBatch` run to its end), each from scratch.

        Each task draws from its own `torch.Generator` seeded with `task.seed`, so a sample depends only on
        its prompt, settings, seed and the weights, not on what it was batched with.
        """
        batch = DecodeBatch(self)
        batch.add(tasks)
        while batch:
            batch.step()
        return tasks

    def _next_tokens(self, tasks: list[GenerationTask], logits: torch.Tensor, generators) -> torch.Tensor:
        """One decode step for all rows at once: pick each unfinished task's token (greedy, or sampled with its own
        generator by the Gumbel-max trick over its top-k/top-p/min-p set), record its log-prob (temperature-scaled,
        after the penalties and `logit_bias`, as SGLang returns them) and whether it finished. Finished rows get the pad token."""
        next_ids = torch.full((len(tasks),), self.pad_token_id, dtype=torch.long, device=self.device)
        for task in tasks:
            if task.aborted and task.finish is None:
                task.finish = ("abort", len(task.output_ids))
        rows = [i for i, t in enumerate(tasks) if t.finish is None]
        if not rows:
            return next_ids
        params = [tasks[i].params for i in rows]
        logits = logits[rows]
        self._adjust_logits(logits, [tasks[i] for i in rows])
        greedy = torch.tensor([p.greedy for p in params], device=self.device)
        temperature = torch.tensor([1.0 if p.greedy else float(p.temperature) for p in params], device=self.device)
        logprobs = F.log_softmax(logits / temperature[:, None], dim=-1)
        filtered = _top_k_top_p(logprobs, [p.top_k for p in params], [float(p.top_p) for p in params],
                                [float(p.min_p) for p in params])
        uniform = torch.stack([torch.rand(logits.shape[-1], generator=generators[i], device=self.device) for i in rows])
        gumbel = -torch.log(-torch.log(uniform.clamp(1e-20, 1.0 - 1e-7)))
        chosen = torch.where(greedy, logits.argmax(-1), (filtered + gumbel).argmax(-1))
        chosen_logprobs = logprobs.gather(-1, chosen[:, None])[:, 0]
        next_ids[rows] = chosen
        most = max(tasks[i].top_logprobs_num for i in rows)
        top = logprobs.topk(min(most, logprobs.shape[-1]), dim=-1) if most else None
        for k, (row, token, logprob) in enumerate(zip(rows, chosen.tolist(), chosen_logprobs.tolist())):
            task = tasks[row]
            task.output_ids.append(token)
            task.output_logprobs.append(logprob)
            if task.top_logprobs_num:
                n = task.top_logprobs_num
                task.output_top_logprobs.append(list(zip(top.values[k, :n].tolist(), top.indices[k, :n].tolist())))
            if task.token_ids_logprob is not None:
                ids = task.token_ids_logprob
                task.output_token_ids_logprobs.append(list(zip(logprobs[k, ids].tolist(), ids)))
            task.finish = self._finished(task, token)
            if task.on_token is not None:
                task.on_token(task)
        return next_ids

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        """The token ids that end a completion: `stop_token_ids` and the model's EOS; none with `ignore_eos`, which in
        SGLang 0.5.23 turns off every token-based stop (`schedule_batch.py` ~1856-1858)."""
        return set() if params.ignore_eos else set(params.stop_token_ids or ()) | self.eos_token_ids

    def _adjust_logits(self, logits: torch.Tensor, tasks: list[GenerationTask]) -> None:
        """In place, per row, in SGLang's order: the penalties on the tokens sampled so far (`_penalize`), then
        `logit_bias` added; the stop tokens masked while fewer than `min_new_tokens` are out."""
        for k, task in enumerate(tasks):
            params = task.params
            if params.penalizes and task.output_ids:
                _penalize(logits[k], task.prompt[-1:] + task.output_ids[:-1], params)
            if params.logit_bias:
                ids = torch.tensor([int(t) for t in params.logit_bias], device=self.device)
                logits[k, ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=self.device)
            if len(task.output_ids) < params.min_new_tokens:
                stops = sorted(self._stop_ids(params))
                if stops:
                    logits[k, stops] = float("-inf")

    def _finished(self, task: GenerationTask, token: int) -> Optional[tuple[str, Any]]:
        """`("stop", token id or stop string)`, `("length", n)` or None (goes on)."""
        params = task.params
        if token in self._stop_ids(params):
            return ("stop", token)
        if params.stop_strings:
            tail = self.tokenizer.decode(task.output_ids[-STOP_STRING_TAIL_TOKENS:])
            matched = next((s for s in params.stop_strings if s in tail), None)
            if matched is not None:
                return ("stop", matched)
        if len(task.output_ids) >= params.max_new_tokens:
            return ("length", len(task.output_ids))
        return None

    # ----------------------------------------------------------------- weights
    @torch.inference_mode()
    def load_weights(self, path: str, weight_version: Optional[str], mixup_alpha: Optional[float] = None) -> str:
        """Replace the weights with those in `path` (a transformers directory), all or nothing.

        Every tensor is read and checked against the model's names and shapes, and to be floating point with finite
        values (NaN or Inf would poison every log-prob after it), before any parameter changes;
        on a problem `WeightFileError` is raised and the old weights stay in service. With `mixup_alpha`,
        each parameter becomes `alpha * new + (1 - alpha) * old`.
        """
        count = self._load(read_weight_dir(Path(path)), str(path), weight_version, mixup_alpha, whole=True)
        self.loaded_path = str(path)
        how = f"mixed with alpha={mixup_alpha}" if mixup_alpha not in (None, 1.0) else "loaded"
        return f"Succeeded to update model weights: {how} {count} tensors from {path}."

    @torch.inference_mode()
    def load_tensors(self, tensors: dict[str, torch.Tensor], weight_version: Optional[str]) -> int:
        """Load some of the weights (a bucket received over torch.distributed), with the checks of `load_weights`
        (all or nothing for these tensors); returns how many were loaded."""
        return self._load(tensors, "the received tensors", weight_version, None, whole=False)

    def _load(self, tensors: dict[str, torch.Tensor], where: str, weight_version: Optional[str],
              mixup_alpha: Optional[float], whole: bool) -> int:
        """Check `tensors` (every parameter there if `whole`), then copy them into the parameters."""
        params = _own_names(self.model.named_parameters())
        tied = set(_own_names((name, None) for name in self.model.state_dict())) - set(params)
        unknown = sorted(set(tensors) - set(params) - tied)
        missing = sorted(set(params) - set(tensors)) if whole else []
        if unknown:
            raise WeightFileError(f"{where}: tensors not in the served model: {', '.join(unknown[:5])}")
        if missing:
            raise WeightFileError(f"{where}: missing tensors: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
        loaded = {name: param for name, param in params.items() if name in tensors}
        for name, param in loaded.items():
            tensor = tensors[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise WeightFileError(
                    f"{where}: tensor {name} has shape {tuple(tensor.shape)}, the served model needs {tuple(param.shape)}"
                )
            if not tensor.is_floating_point():
                raise WeightFileError(f"{where}: tensor {name} is {tensor.dtype}, not floating point (would be cast to {param.dtype})")
            if not _all_finite(tensor):
                raise WeightFileError(f"{where}: tensor {name} has NaN or Inf values")
        for name, param in loaded.items():
            new = tensors[name].to(device=param.device, dtype=param.dtype)
            if mixup_alpha is None or mixup_alpha == 1.0:
                param.copy_(new)
            else:
                param.mul_(1.0 - mixup_alpha).add_(new, alpha=mixup_alpha)
        self.note_weight_version(weight_version)
        return len(loaded)

    def note_weight_version(self, version: Optional[str]) -> None:
        """The weights are now of `version` (None: unchanged): each task under way that sampled tokens records that
        its tokens so far came from the version before (SGLang's `record_weight_version_change`, scheduler.py ~5636)."""
        if version is None or version == self.weight_version:
            return
        for task in self.live_tasks:
            if task.output_ids:
                task.version_events.append((self.weight_version, len(task.output_ids)))
        self.weight_version = version

    # ------------------------------------------------------------ LoRA adapters
    def load_adapter(self, path: str) -> str:
        """Load the PEFT LoRA adapter directory `path` (`adapter_config.json` + `adapter_model.safetensors`); see
        `load_adapter_tensors`."""
        path_ = Path(path)
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            if not (path_ / name).is_file():
                raise WeightFileError(f"{path}: no {name} (a PEFT adapter directory holds {ADAPTER_CONFIG} and "
                                      f"{ADAPTER_WEIGHTS}, as PeftModel.save_pretrained writes them)")
        try:
            raw = json.loads((path_ / ADAPTER_CONFIG).read_text())
        except ValueError as err:
            raise WeightFileError(f"{path_ / ADAPTER_CONFIG}: not a readable PEFT config: {err}") from err
        # read as every dump is (`read_shard`), not by peft's loader, which maps the file (SIGBUS if it shrinks)
        return self.load_adapter_tensors(raw, read_shard(path_ / ADAPTER_WEIGHTS), str(path_ / ADAPTER_CONFIG),
                                         str(path_ / ADAPTER_WEIGHTS))

    @torch.no_grad()  # not inference_mode: peft sets requires_grad on adapter weights when another one is removed
    def load_adapter_tensors(self, raw_config: Any, tensors: dict[str, torch.Tensor], config_source: str,
                             tensors_source: str) -> str:
        """Load a PEFT LoRA adapter (`raw_config`: its `adapter_config.json`; `tensors`: its weights, as peft names them)
        beside the adapters already loaded; returns its id (for `GenerationTask.adapter`, `score`, `unload_adapter`).
        All or nothing: an adapter this server cannot serve (rank above `--max-lora-rank`, a module outside
        `--lora-target-modules`, tensors that fit no module, missing or not finite, ...) raises `WeightFileError`,
        naming `config_source` or `tensors_source`, and leaves no trace. Needs `lora` (the server's `--enable-lora`)."""
        from peft import PeftModel
        from peft.utils import set_peft_model_state_dict

        config = self._adapter_config(raw_config, config_source)
        weights = {name: tensor.to(self.device) for name, tensor in tensors.items()}
        adapter = next((a for a, kept in self._retired.items() if _same_layers(kept, config)), None)
        reused = adapter is not None
        where = config_source  # the modules are built from the config, then take the tensors
        try:
            if reused:  # a retired adapter's modules take these weights: no new modules to build
                del self._retired[adapter]
            else:
                adapter = f"adapter-{self._adapters_made}"
                self._adapters_made += 1
                if self.peft is None:
                    self.peft = PeftModel(self.model, config, adapter_name=adapter)
                else:
                    self.peft.add_adapter(adapter, config)
            where = tensors_source
            result = set_peft_model_state_dict(self.peft, weights, adapter_name=adapter)
            self._check_adapter(tensors_source, adapter, result)
        except Exception as err:  # noqa: BLE001 - the adapter's fault: no such module, a config value of the wrong
            # type (a string for `lora_alpha`: peft meets it building the modules), a tensor of another shape, ...
            if self.peft is not None and adapter in self.peft.peft_config:
                self.peft.delete_adapter(adapter)
            if isinstance(err, WeightFileError):
                raise
            raise WeightFileError(f"{where}: {err}") from err
        finally:
            (self.model if self.peft is None else self.peft).eval()  # as peft's `load_adapter` leaves it
        if not reused:  # peft needs one active (a walk over every module); each row names its own anyway
            self.peft.set_adapter(adapter, inference_mode=True)
        self.adapters.add(adapter)
        return adapter

    def unload_adapter(self, adapter: str) -> None:
        """Stop serving the adapter `adapter` (an id `load_adapter` returned). Its LoRA modules are kept for the next
        adapter of the same shapes (building them is most of a load: 0.19 of 0.33 s on a 100M model, r=16, every
        linear layer); an older retired adapter is removed with its weights, so at most one is kept."""
        self.adapters.discard(adapter)
        for old in list(self._retired):
            del self._retired[old]
            self.peft.delete_adapter(old)
        self._retired[adapter] = self.peft.peft_config[adapter]

    def _adapter_config(self, raw: Any, where: str):
        """The adapter's `LoraConfig` from its `adapter_config.json` (`raw`, read from `where`), once it is a LoRA this
        server can serve."""
        from peft import LoraConfig

        kind = raw.get("peft_type") if isinstance(raw, dict) else None
        if kind != "LORA":
            raise WeightFileError(f"{where}: peft_type {kind!r}; the server takes LoRA adapters only")
        try:  # as `LoraConfig.from_pretrained` builds it from the file; a value of the wrong type fails here or below
            config = LoraConfig.from_peft_type(**LoraConfig.check_kwargs(**raw))
            rank = max([config.r, *(config.rank_pattern or {}).values()])
            too_high = rank > self.lora.max_rank
        except Exception as err:  # noqa: BLE001 - the config's fault, whatever peft raises for it
            raise WeightFileError(f"{where}: not a readable PEFT config: {err}") from err
        if config.use_dora:
            raise WeightFileError(f"{where}: a DoRA adapter (use_dora); the server takes plain LoRA")
        if config.modules_to_save:
            raise WeightFileError(f"{where}: modules_to_save {config.modules_to_save}: whole modules "
                                  "trained beside the adapter are not served; train the adapter without them")
        if too_high:
            raise WeightFileError(f"{where}: rank {rank} is above the server's --max-lora-rank "
                                  f"{self.lora.max_rank}; start the server with --max-lora-rank {rank} or more")
        return config

    def _check_adapter(self, where: str, adapter: str, loaded: Any) -> None:
        """After loading (`loaded`: what `load_state_dict` reported): every tensor of the adapter (read from `where`)
        went into a module and every module the adapter adapts got its tensors, only modules `--lora-target-modules`
        names are adapted, and every weight is finite."""
        from peft.tuners.lora import LoraLayer

        if loaded.unexpected_keys:
            raise WeightFileError(f"{where}: tensors that fit no module of the served model: "
                                  f"{', '.join(sorted(loaded.unexpected_keys)[:5])}")
        missing = sorted(k.replace(f".{adapter}", "") for k in loaded.missing_keys if f".{adapter}." in k and ".lora_" in k)
        if missing:
            raise WeightFileError(f"{where}: no tensor for {', '.join(missing[:5])}"
                                  + (" ..." if len(missing) > 5 else ""))
        adapted = {name.rsplit(".", 1)[-1] for name, module in self.model.named_modules()
                   if isinstance(module, LoraLayer) and (adapter in module.lora_A or adapter in module.lora_embedding_A)}
        allowed = self.lora.target_modules
        outside = sorted(adapted - allowed) if allowed is not None else []
        if outside:
            raise WeightFileError(f"{where}: adapts {', '.join(outside)}, outside the server's --lora-target-modules "
                                  f"{' '.join(sorted(allowed))}; start the server with them included (or 'all')")
        for name, param in self.model.named_parameters():
            if f".{adapter}." in f"{name}." and ".lora_" in name and not _all_finite(param):
                raise WeightFileError(f"{where}: {name.replace(f'.{adapter}', '')} has NaN or Inf values")


class DecodeBatch:
    """The sequences a `ModelEngine` is sampling together, continuously batched: tasks join at a step boundary (`add`:
    a prefill of their prompt and the tokens they sampled so far, with the weights of that moment, then their next
    token), `step()` samples one more token for every row, and finished rows leave at once (their KV with them).

    The KV cache is left-padded: `mask` covers the cache plus each row's last sampled token (`next_input`, not in the
    cache yet), and positions count only unmasked columns, so rows of any length share it. `retract()` gives the tasks
    back without their KV (SGLang's `/pause_generation` mode `retract`): added again later, they are prefilled anew,
    with the weights then served."""

    def __init__(self, engine: "ModelEngine"):
        self.engine = engine
        self.tasks: list[GenerationTask] = []
        self.cache: Any = None
        self.mask: Optional[torch.Tensor] = None  # [rows, cached columns + 1]
        self.next_input: Optional[torch.Tensor] = None  # [rows]

    def __len__(self) -> int:
        return len(self.tasks)

    @torch.inference_mode()
    def add(self, tasks: list[GenerationTask], resume: bool = False) -> list[GenerationTask]:
        """Prefill `tasks` and sample each one's next token: from scratch (its generator seeded with its seed), or,
        with `resume` (tasks `retract()` gave back), from the tokens it sampled so far and its generator's state.
        Returns the tasks that finished (at once, or with that token)."""
        from transformers import DynamicCache

        engine = self.engine
        for task in tasks:
            if not resume or task.generator is None:
                task.output_ids, task.output_logprobs, task.output_top_logprobs = [], [], []
                task.output_token_ids_logprobs, task.version_events = [], []
                task.generator = torch.Generator(device=engine.device).manual_seed(task.seed)
                task.finish = None
            if task.aborted and task.finish is None:
                task.finish = ("abort", len(task.output_ids))
            elif task.params.max_new_tokens <= len(task.output_ids) and task.finish is None:
                task.finish = ("length", len(task.output_ids))
        rows = [t for t in tasks if t.finish is None]
        done = [t for t in tasks if t.finish is not None]
        engine.live_tasks.difference_update(done)
        if not rows:
            return done
        sequences = [t.prompt + t.output_ids for t in rows]
        longest = max(len(seq) for seq in sequences)
        ids = torch.full((len(rows), longest), engine.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, longest - len(seq):] = torch.tensor(seq)
            mask[row, longest - len(seq):] = 1
        ids, mask = ids.to(engine.device), mask.to(engine.device)
        cache = DynamicCache()
        out = engine._forward([t.adapter for t in rows], input_ids=ids, attention_mask=mask,
                              position_ids=(mask.cumsum(-1) - 1).clamp(min=0), past_key_values=cache, use_cache=True)
        engine.live_tasks.update(rows)
        next_ids = engine._next_tokens(rows, out.logits[:, -1].float(), [t.generator for t in rows])
        mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=engine.device)], dim=1)
        self._join(rows, out.past_key_values, mask, next_ids)
        return done + self._leave_finished()

    @torch.inference_mode()
    def step(self) -> list[GenerationTask]:
        """One more token for every row; returns the tasks that finished (they leave)."""
        if not self.tasks:
            return []
        engine = self.engine
        position_ids = (self.mask.cumsum(-1) - 1)[:, -1:]
        out = engine._forward([t.adapter for t in self.tasks], input_ids=self.next_input[:, None], attention_mask=self.mask,
                              position_ids=position_ids, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.next_input = engine._next_tokens(self.tasks, out.logits[:, -1].float(), [t.generator for t in self.tasks])
        self.mask = torch.cat([self.mask, torch.ones((len(self.tasks), 1), dtype=self.mask.dtype,
                                                     device=engine.device)], dim=1)
        return self._leave_finished()

    def retract(self) -> list[GenerationTask]:
        """Every task, without its KV (the batch is empty after); they stay live for the weight-version record."""
        tasks, self.tasks = self.tasks, []
        self.cache = self.mask = self.next_input = None
        return tasks

    def abort(self, tasks: list[GenerationTask]) -> list[GenerationTask]:
        """End `tasks` (not in the batch: `retract()`'s) now with finish reason `abort` and what they sampled."""
        for task in tasks:
            task.aborted = True
            if task.finish is None:
                task.finish = ("abort", len(task.output_ids))
        self.engine.live_tasks.difference_update(tasks)
        return tasks

    def _join(self, tasks: list[GenerationTask], cache: Any, mask: torch.Tensor, next_input: torch.Tensor) -> None:
        """Append rows (their cache, mask and next input) to the batch, left-padding the shorter side."""
        if not self.tasks:
            self.tasks, self.cache, self.mask, self.next_input = list(tasks), cache, mask, next_input
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, width - 1, -2), _left_pad(theirs.keys, width - 1, -2)])
            mine.values = torch.cat([_left_pad(mine.values, width - 1, -2), _left_pad(theirs.values, width - 1, -2)])
        self.mask = torch.cat([_left_pad(self.mask, width, -1), _left_pad(mask, width, -1)])
        self.next_input = torch.cat([self.next_input, next_input])
        self.tasks += tasks

    def _leave_finished(self) -> list[GenerationTask]:
        """Drop the finished rows (returned), and the leading columns no remaining row uses."""
        keep = [i for i, task in enumerate(self.tasks) if task.finish is None]
        if len(keep) == len(self.tasks):
            return []
        done = [t for t in self.tasks if t.finish is not None]
        self.engine.live_tasks.difference_update(done)
        if not keep:
            self.retract()
            return done
        index = torch.tensor(keep, device=self.engine.device)
        self.tasks = [self.tasks[i] for i in keep]
        self.mask, self.next_input = self.mask[index], self.next_input[index]
        unused = int((self.mask.cumsum(-1) == 0).sum(-1).min())  # leading columns masked in every row
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index, :, unused:], layer.values[index, :, unused:]
        self.mask = self.mask[:, unused:]
        return done


def _left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`tensor` zero-padded on the left of `dim` to `width`."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _same_layers(kept: Any, config: Any) -> bool:
    """Whether an adapter of LoRA config `config` fits the modules built for `kept`: same modules, ranks and scaling
    (dropout does nothing at inference)."""
    fields = ("r", "lora_alpha", "target_modules", "exclude_modules", "rank_pattern", "alpha_pattern", "use_rslora",
              "layers_to_transform", "layers_pattern", "bias", "fan_in_fan_out", "init_lora_weights")
    return all(getattr(kept, name, None) == getattr(config, name, None) for name in fields)


def _own_names(named):
    """`(name, value)` pairs of the model by the names transformers gives them: peft's LoRA layers hold a module's
    own weights under `base_layer` and add the adapters' (`lora_*`), which are left out."""
    return {name.replace(".base_layer.", "."): value for name, value in named if ".lora_" not in name}


def _all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or Inf in `tensor`. A NaN or Inf makes the sum non-finite; the sum (one fast pass, no temporary) can
    also overflow on finite values (float16), so only then is every element checked."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _gather_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits)[targets]` without materialising the full log-softmax twice."""
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _penalize(logits: torch.Tensor, penalized: list[int], params: SamplingParams) -> None:
    """SGLang 0.5.23's penalties (`sampling/penaltylib/`), in place on one row of raw logits (before temperature and
    the top-k/top-p/min-p filters, so the returned log-probs are the penalized ones): each token of `penalized` has
    its logit lowered by `frequency_penalty` times its count and by `presence_penalty`, then, with
    `repetition_penalty` p, divided by p where positive, multiplied by p where negative (additive before scaling, the
    order of SGLang's default overlap scheduler).

    Which tokens, as SGLang's default (overlap) scheduler counts them (`ScheduleBatch.cumulate_penalty_output_tokens`,
    fed at each decode step the last token the request has recorded, one step behind): for output token t >= 1, the
    prompt's last token and output tokens 0 .. t-2; none for token 0. So the prompt counts for its last token only,
    and the token just sampled is penalized from the step after next (greedy outputs and log-probs checked equal to
    SGLang's on the CPU, tests/test_trl_habits.py)."""
    ids, counts = torch.tensor(penalized, device=logits.device).unique(return_counts=True)
    seen = logits[ids] - (float(params.frequency_penalty) * counts + float(params.presence_penalty))
    penalty = float(params.repetition_penalty)
    logits[ids] = torch.where(seen < 0, seen * penalty, seen / penalty)


def _top_k_top_p(logprobs: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Per row, mask (to -inf) the tokens outside its top-k (k <= 0: none), outside the smallest set whose
    probability reaches its top-p, and below `min_p` times the most likely token's probability."""
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
    rank = torch.arange(logprobs.shape[-1], device=logprobs.device)[None, :]
    k = torch.tensor([kk if kk > 0 else logprobs.shape[-1] for kk in top_k], device=logprobs.device)[:, None]
    p = torch.tensor(top_p, device=logprobs.device)[:, None]
    probs = sorted_lp.softmax(-1)
    floor = torch.tensor(min_p, device=logprobs.device)[:, None] * probs[:, :1]
    drop_sorted = (rank >= k) | (probs.cumsum(-1) - probs >= p) | (probs < floor)
    drop_sorted[:, 0] = False  # the most likely token always stays (a top_p that underflows float32 would drop all)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logprobs.masked_fill(drop, float("-inf"))
