"""The recipe: one YAML file per run, validated in one place into dataclasses.

Sections: `model`, `data`, `rewards`, `trainer` (any `RemoteGRPOConfig` field), `server`, `sync`, `slurm`,
`accelerate_config`. `load_recipe` reads the file, applies `key.path=value` overrides, and checks every key
and value; a problem raises `RecipeError` listing each one with the file, the key and the fix. The trainer,
the server scripts and the launcher read the resulting `Recipe`, never the YAML.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

ENGINES = ("builtin", "sglang", "openai")
LAYOUTS = ("shared", "separate")
DTYPES = ("auto", "float32", "bfloat16", "float16")
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class RecipeError(ValueError):
    """An invalid recipe; `problems` holds one `(key, message)` pair per problem."""

    def __init__(self, path: Union[str, Path], problems: list[tuple[str, str]]):
        self.path, self.problems = str(path), problems
        lines = [f"{self.path}: {key}: {message}" for key, message in problems]
        super().__init__(f"invalid recipe ({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n" + "\n".join(lines))


# --------------------------------------------------------------------------------------------- sections
@dataclass
class ModelSection:
    """The policy: `name_or_path` is a hub id (`org/name`) or a local directory (`/...`, `./...`, `../...`)."""

    name_or_path: str
    dtype: str = "auto"
    attn_implementation: Optional[str] = None
    trust_remote_code: bool = False


@dataclass
class DataSection:
    """The prompts: a hub dataset or a local `.json`/`.jsonl`/`.csv`/`.parquet` file."""

    dataset: str
    split: str = "train"
    config: Optional[str] = None
    prompt_column: str = "prompt"
    system_prompt: Optional[str] = None


@dataclass
class RewardSpec:
    """A reward: a built-in name or `package.module:function`, its weight, and keyword arguments."""

    name: str
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)


@dataclass
class ServerSection:
    """Where the reference and generation run.

    `engine`: `builtin` (this package's server), `sglang`, or `openai` (an existing `/v1/completions` server at
    `url`, generation only). `layout`: `shared` (one server hosts both roles) or `separate` (a second server, at
    `ref_url` or started by the launcher, hosts the reference). `url`/`ref_url` point at servers already running;
    otherwise the launcher starts them.
    """

    engine: str = "builtin"
    model_path: Optional[str] = None
    layout: str = "shared"
    url: Optional[str] = None
    ref_url: Optional[str] = None
    reference: bool = True
    generation: bool = True
    port: int = 30000
    tp_size: int = 1
    dp_size: int = 1
    mem_fraction_static: Optional[float] = None
    dtype: str = "auto"
    api_key: Optional[str] = None
    extra_args: list = field(default_factory=list)


@dataclass
class SlurmJob:
    """Resources of one job: nodes, GPUs per node, processes per node (default: one per GPU, or 1 on CPU)."""

    nodes: int = 1
    gpus_per_node: int = 8
    processes_per_node: Optional[int] = None
    cpus_per_task: Optional[int] = None
    mem: Optional[str] = None

    @property
    def num_processes(self) -> int:
        return self.nodes * (self.processes_per_node or max(1, self.gpus_per_node))


@dataclass
class SlurmSection:
    """sbatch settings shared by both jobs, and each job's resources."""

    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time: str = "1-00:00:00"
    constraint: Optional[str] = None
    exclusive: bool = False
    job_name: str = "grpo"
    extra_sbatch: list = field(default_factory=list)
    trainer: SlurmJob = field(default_factory=SlurmJob)
    server: SlurmJob = field(default_factory=SlurmJob)


@dataclass
class Recipe:
    model: ModelSection
    data: DataSection
    rewards: list[RewardSpec]
    trainer: dict
    server: ServerSection = field(default_factory=ServerSection)
    sync: dict = field(default_factory=dict)
    slurm: SlurmSection = field(default_factory=SlurmSection)
    accelerate_config: Optional[str] = None
    path: str = ""

    @property
    def output_dir(self) -> str:
        return self.trainer["output_dir"]

    @property
    def server_model_path(self) -> str:
        return self.server.model_path or self.model.name_or_path

    def role_urls(self, server_url: Optional[str], ref_url: Optional[str]) -> tuple[Optional[str], Optional[str]]:
        """`(generation_url, ref_model_url)` from the server URL(s). With `layout: shared` on the built-in engine,
        the reference is the server's second model slot (`/ref`), so syncing the policy leaves it alone."""
        if self.server.layout == "separate":
            return server_url, ref_url
        if self.server.engine == "builtin" and self.server.generation and self.server.reference and server_url:
            return server_url, f"{server_url.rstrip('/')}/ref"
        return server_url, server_url

    def trainer_config(self, generation_url: Optional[str] = None, ref_model_url: Optional[str] = None,
                       on_this_machine: bool = True):
        """The `RemoteGRPOConfig` of this run, with the servers' URLs filled in. `on_this_machine=False` (validation
        on a login node) leaves out the settings transformers checks against the local hardware (bf16, fp16, tf32)."""
        from open_r1_ext.trainer.config import RemoteGRPOConfig

        kwargs = dict(self.trainer, **self.sync)
        if not on_this_machine:
            kwargs.update(bf16=False, fp16=False, tf32=None, use_cpu=True)
        kwargs.setdefault("model_init_kwargs", {})
        kwargs["model_init_kwargs"] = dict(kwargs["model_init_kwargs"], **self.model_init_kwargs())
        kwargs["reward_weights"] = [r.weight for r in self.rewards]
        if self.server.generation:
            kwargs["generation_url"] = generation_url
            kwargs["generation_backend"] = "openai" if self.server.engine == "openai" else "sglang"
        if self.server.reference and kwargs.get("beta", 0.0) != 0.0:
            kwargs["ref_model_url"] = ref_model_url
        if self.server.api_key:
            kwargs.setdefault("server_api_key", self.server.api_key)
        return RemoteGRPOConfig(**kwargs)

    def model_init_kwargs(self) -> dict:
        kwargs: dict[str, Any] = {"dtype": self.model.dtype, "trust_remote_code": self.model.trust_remote_code}
        if self.model.attn_implementation:
            kwargs["attn_implementation"] = self.model.attn_implementation
        return kwargs


SECTIONS = {"model": ModelSection, "data": DataSection, "server": ServerSection, "slurm": SlurmSection}
REQUIRED = ("model", "data", "rewards", "trainer")
# `sync:` keys: the weight- and reference-sync fields of the trainer config (validated with it).
SYNC_KEYS = ("weight_sync_steps", "sync_dir", "keep_last_dumps", "sync_ref_model", "ref_model_sync_steps",
             "ref_model_sync_epochs", "ref_model_mixup_alpha", "max_weight_staleness", "async_generation")


# ------------------------------------------------------------------------------------------ loading
def load_recipe(path: Union[str, Path], overrides: Optional[list[str]] = None, check_paths: bool = True) -> Recipe:
    """Read, override and validate a recipe; raise `RecipeError` naming every problem."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(path, [("(file)", "no such file")])
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise RecipeError(path, [("(yaml)", f"not valid YAML: {err}")]) from None
    if not isinstance(raw, dict):
        raise RecipeError(path, [("(top level)", "a recipe is a mapping of sections (model:, data:, ...)")])
    problems: list[tuple[str, str]] = []
    for item in overrides or []:
        _apply_override(raw, item, problems)
    recipe = _build_recipe(raw, problems)
    if recipe is not None:
        recipe.path = str(path)
        _check_recipe(recipe, problems, check_paths)
    if problems:
        raise RecipeError(path, problems)
    return recipe  # type: ignore[return-value]


def _apply_override(raw: dict, item: str, problems: list) -> None:
    """`section.key=value` (value parsed as YAML) set into the raw mapping."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        problems.append((item, "an override reads section.key=value, e.g. trainer.max_steps=5"))
        return
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            problems.append((key, f"{part} is not a section"))
            return
    node[parts[-1]] = yaml.safe_load(value)


def _build_recipe(raw: dict, problems: list) -> Optional[Recipe]:
    known = [f.name for f in dataclasses.fields(Recipe) if f.name != "path"]
    for key in raw:
        if key not in known:
            problems.append((key, f"unknown section{_did_you_mean(key, known)}"))
    for key in REQUIRED:
        if key not in raw:
            problems.append((key, f"missing section (a recipe needs {', '.join(REQUIRED)})"))
    if any(key in REQUIRED for key, _ in problems):
        return None
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        sections[name] = _build_dataclass(cls, raw.get(name, {}), name, problems)
    rewards = raw["rewards"]
    if not isinstance(rewards, list) or not rewards:
        problems.append(("rewards", "give a list of rewards, e.g. [{name: accuracy}]"))
        rewards = []
    sections["rewards"] = [
        _build_dataclass(RewardSpec, {"name": r} if isinstance(r, str) else r, f"rewards[{i}]", problems)
        for i, r in enumerate(rewards)
    ]
    sections["trainer"] = _check_trainer_keys(raw["trainer"], "trainer", problems, exclude=SYNC_KEYS)
    sections["sync"] = _check_trainer_keys(raw.get("sync") or {}, "sync", problems, only=SYNC_KEYS)
    accelerate = raw.get("accelerate_config")
    if accelerate is not None and not isinstance(accelerate, str):
        problems.append(("accelerate_config", "give a path to an accelerate config file"))
    if any(v is None for v in sections.values()):
        return None
    return Recipe(accelerate_config=accelerate, **sections)


def _build_dataclass(cls, mapping: Any, where: str, problems: list):
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, dict):
        problems.append((where, f"expected a mapping of {cls.__name__} fields, got {type(mapping).__name__}"))
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in mapping.items():
        if key not in fields:
            problems.append((f"{where}.{key}", f"unknown key{_did_you_mean(key, list(fields))}"))
            continue
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            built = _build_dataclass(hint, value, f"{where}.{key}", problems)
            if built is not None:
                values[key] = built
            continue
        problem = _type_problem(value, hint)
        if problem:
            problems.append((f"{where}.{key}", problem))
        else:
            values[key] = value
    for name, f in fields.items():
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if no_default and name not in mapping:
            problems.append((f"{where}.{name}", "required key is missing"))
            return None
    try:
        return cls(**values)
    except TypeError as err:
        problems.append((where, str(err)))
        return None


def _check_trainer_keys(mapping: Any, where: str, problems: list, exclude=(), only=None) -> Optional[dict]:
    """Check names and types of `RemoteGRPOConfig` fields (the values are validated by the config itself)."""
    from open_r1_ext.trainer.config import RemoteGRPOConfig

    if not isinstance(mapping, dict):
        problems.append((where, "expected a mapping of trainer settings"))
        return None
    fields = {f.name: f for f in dataclasses.fields(RemoteGRPOConfig) if f.init}
    hints = typing.get_type_hints(RemoteGRPOConfig)
    allowed = [k for k in fields if (only is None or k in only) and k not in exclude]
    for key, value in mapping.items():
        if key not in allowed:
            hint = f" (it belongs in the {'sync' if key in SYNC_KEYS else 'trainer'}: section)" if key in fields else ""
            problems.append((f"{where}.{key}", f"unknown key{hint or _did_you_mean(key, allowed)}"))
            continue
        problem = _type_problem(value, hints.get(key, Any))
        if problem:
            problems.append((f"{where}.{key}", problem))
    return dict(mapping)


def _did_you_mean(key: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(key, choices, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(sorted(choices)[:12])}{', ...' if len(choices) > 12 else ''})"


def _type_problem(value: Any, hint: Any) -> Optional[str]:
    """None when `value` fits the annotation `hint`, else what is wrong (only the shapes YAML can express)."""
    origin = typing.get_origin(hint)
    if hint is Any or hint is typing.Any:
        return None
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if any(_type_problem(value, option) is None for option in options):
            return None
        names = " or ".join(_type_name(o) for o in options)
        return f"expected {names}, got {type(value).__name__} {value!r}"
    if hint is type(None):
        return None if value is None else "expected null"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        allowed = [m.value for m in hint]
        return None if value in allowed else f"expected one of {allowed}, got {value!r}"
    if hint is bool:
        return None if isinstance(value, bool) else f"expected true or false, got {value!r}"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else f"expected an integer, got {value!r}"
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"expected a number, got {value!r}"
    if hint is str:
        return None if isinstance(value, str) else f"expected a string, got {type(value).__name__} {value!r}"
    if hint is list or origin is list:
        return None if isinstance(value, list) else f"expected a list, got {value!r}"
    if hint is dict or origin is dict:
        return None if isinstance(value, dict) else f"expected a mapping, got {value!r}"
    return None


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


# ---------------------------------------------------------------------------------------- semantics
def is_local_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or not HUB_ID.match(value)


def _check_recipe(recipe: Recipe, problems: list, check_paths: bool) -> None:
    server, slurm = recipe.server, recipe.slurm
    _choice(problems, "server.engine", server.engine, ENGINES)
    _choice(problems, "server.layout", server.layout, LAYOUTS)
    _choice(problems, "server.dtype", server.dtype, DTYPES)
    _choice(problems, "model.dtype", recipe.model.dtype, DTYPES)
    if "output_dir" not in recipe.trainer:
        problems.append(("trainer.output_dir", "required: where checkpoints, weight dumps and logs go"))
    if check_paths:
        for key, value in (("model.name_or_path", recipe.model.name_or_path), ("server.model_path", server.model_path),
                           ("data.dataset", recipe.data.dataset), ("accelerate_config", recipe.accelerate_config)):
            if value and is_local_path(value) and not Path(value).expanduser().exists():
                problems.append((key, f"local path {value} does not exist (hub ids look like org/name)"))
    for i, reward in enumerate(recipe.rewards):
        if reward is None:
            continue
        try:
            from open_r1_ext.trainer.rewards import resolve_reward

            resolve_reward(reward.name)
        except ValueError as err:
            problems.append((f"rewards[{i}].name", str(err)))
    for key, job in (("slurm.trainer", slurm.trainer), ("slurm.server", slurm.server)):
        if job.nodes < 1 or job.gpus_per_node < 0:
            problems.append((key, "nodes must be >= 1 and gpus_per_node >= 0"))
    _check_engine(recipe, problems)
    _check_batch(recipe, problems)
    if not problems:
        try:
            recipe.trainer_config(generation_url="http://validate:0", ref_model_url="http://validate:0", on_this_machine=False)
        except (ValueError, TypeError) as err:
            problems.append(("trainer", f"{err}"))


def _choice(problems: list, key: str, value: str, choices: tuple) -> None:
    if value not in choices:
        problems.append((key, f"{value!r} is not one of {', '.join(choices)}{_did_you_mean(value, list(choices))}"))


def _check_engine(recipe: Recipe, problems: list) -> None:
    server, trainer, sync = recipe.server, recipe.trainer, recipe.sync
    gpus = recipe.slurm.server.nodes * recipe.slurm.server.gpus_per_node
    if server.engine == "sglang" and server.tp_size * server.dp_size > max(gpus, 1):
        problems.append(("server.tp_size", f"tp_size x dp_size = {server.tp_size * server.dp_size} needs more GPUs than "
                                           f"slurm.server gives ({recipe.slurm.server.nodes} node(s) x {recipe.slurm.server.gpus_per_node})"))
    if server.engine == "builtin":
        if server.tp_size != 1 or server.dp_size != 1 or recipe.slurm.server.nodes != 1:
            problems.append(("server.tp_size", "the built-in server runs on one device of one node: set tp_size 1, "
                                               "dp_size 1, slurm.server.nodes 1, or use engine: sglang"))
        for key in ("min_p",):
            if trainer.get(key) is not None:
                problems.append((f"trainer.{key}", "the built-in server does not support it; remove it or use engine: sglang"))
        if trainer.get("repetition_penalty", 1.0) != 1.0:
            problems.append(("trainer.repetition_penalty", "the built-in server does not support it; use engine: sglang"))
    if server.engine != "builtin" and sync.get("sync_ref_model") and sync.get("ref_model_mixup_alpha", 0.6) != 1.0 and server.reference:
        problems.append(("sync.ref_model_mixup_alpha", f"{server.engine} reloads weights as they are and cannot mix old "
                                                       "and new (soft update); set 1.0, or host the reference on engine: builtin"))
    if server.engine == "openai":
        if not server.url:
            problems.append(("server.url", "engine: openai uses an OpenAI-compatible server that is already running: give its URL"))
        if server.reference and trainer.get("beta", 0.0) != 0.0 and not (server.layout == "separate" and server.ref_url):
            problems.append(("server.reference", "an OpenAI-compatible server cannot give reference log-probs: set "
                                                 "reference: false (local reference), or layout: separate with ref_url"))
    if (server.engine == "sglang" and server.layout == "shared" and server.reference and server.generation
            and trainer.get("beta", 0.0) != 0.0):
        problems.append(("server.layout", "an SGLang server holds one model, and weight sync changes it to the policy: "
                                          "with both roles on SGLang use layout: separate (a second server for the reference)"))
    if server.layout == "separate" and not server.reference:
        problems.append(("server.layout", "layout: separate puts the reference on its own server; it needs reference: true"))
    if not server.reference and not server.generation:
        problems.append(("server", "reference: false and generation: false: the server would do nothing"))


def _check_batch(recipe: Recipe, problems: list) -> None:
    """The batch rule TRL enforces at start-up, checked here for the world size the recipe asks for."""
    trainer = recipe.trainer
    world = recipe.slurm.trainer.num_processes
    per_device = trainer.get("per_device_train_batch_size", 8)
    num_generations = trainer.get("num_generations", 8)
    steps = trainer.get("steps_per_generation") or trainer.get("gradient_accumulation_steps", 1)
    generation_batch = trainer.get("generation_batch_size") or per_device * world * steps
    if not all(isinstance(v, int) for v in (per_device, num_generations, steps, generation_batch)):
        return  # type problems were reported already
    if num_generations < 2:
        problems.append(("trainer.num_generations", f"{num_generations}: GRPO needs at least 2 completions per prompt"))
    elif generation_batch % num_generations:
        problems.append((
            "trainer.num_generations",
            f"the generation batch ({per_device} per device x {world} processes x {steps} steps = {generation_batch}) "
            f"is not divisible by num_generations={num_generations}; change per_device_train_batch_size, "
            "gradient_accumulation_steps or num_generations",
        ))
