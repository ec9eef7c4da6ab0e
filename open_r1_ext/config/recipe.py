"""The recipe: one YAML file per run, validated in one place into pydantic models.

Sections: `model`, `data`, `rewards`, `trainer` (any `RemoteGRPOConfig` field), `sync` (its weight- and
reference-sync fields), `servers` (one spec per role: generation, reference), `slurm`, `accelerate_config`.
`load_recipe` reads the file, applies `key.path=value` overrides, and checks every key and value; a problem raises
`RecipeError` listing each one with the file, the key and the fix. The trainer, the server scripts and the
launchers read the resulting `Recipe`, never the YAML.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import re
import sys
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import (BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, ValidationError, create_model,
                      field_validator, model_validator)

from open_r1_ext.config.data_files import LOCAL_FORMATS, local_columns
from open_r1_ext.protocol import (DTYPE_NAMES, SGLANG_LORA_TARGET_MODULES, SGLANG_VERSION, max_req_input_len,
                                  sampling_range_problems)
from open_r1_ext.weight_files import default_sync_dir

DType = Literal[DTYPE_NAMES]
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
REFERENCE_PORT_OFFSET = 1  # a reference server listens on the generation server's port + this, unless its spec says
NO_KEY = "none"  # servers.api_key: none: the servers started for the run take no API key
# how a venv gets each engine's server, as the README's install says (the fix of an interpreter that lacks it)
INSTALLS = {"sglang": f"python3 -m venv .venv-sglang && .venv-sglang/bin/pip install sglang=={SGLANG_VERSION}; on the "
                      "CPU: tools/sglang_cpu/install.sh VENV",
            "builtin": "this package: pip install -e ."}


class RecipeError(ValueError):
    """An invalid recipe; `problems` holds one `(key, message)` pair per problem."""

    def __init__(self, path: Union[str, Path], problems: list[tuple[str, str]]):
        self.path, self.problems = str(path), problems
        lines = [f"{self.path}: {key}: {message}" for key, message in problems]
        super().__init__(f"invalid recipe ({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n" + "\n".join(lines))


# --------------------------------------------------------------------------------------------- sections
class Section(BaseModel):
    """A recipe mapping: unknown keys are errors, and values are not coerced (`"4"` is not an integer)."""

    model_config = ConfigDict(extra="forbid", strict=True)


ALL_LINEAR = "all-linear"  # peft's lora_target_modules for every linear layer but the output head


def _trl_model_default(name: str):
    """A default factory reading TRL's `ModelConfig` default of `name`: the one place it lives."""

    def default() -> Any:
        from trl import ModelConfig

        return ModelConfig.__dataclass_fields__[name].default

    return default


class ModelSection(Section):
    """The policy: `name_or_path` is a hub id (`org/name`) or a local directory (`/...`, `./...`, `../...`).

    `use_peft` trains a LoRA adapter (TRL's `ModelConfig` names and defaults: `lora_r`, `lora_alpha`, `lora_dropout`,
    `lora_target_modules`); weight syncs then ship the adapter alone and the servers keep the base model."""

    name_or_path: str
    dtype: DType = "auto"
    attn_implementation: Optional[str] = None
    trust_remote_code: bool = False
    use_peft: bool = Field(default_factory=_trl_model_default("use_peft"))
    lora_r: int = Field(default_factory=_trl_model_default("lora_r"), ge=1)
    lora_alpha: int = Field(default_factory=_trl_model_default("lora_alpha"), ge=1)
    lora_dropout: float = Field(default_factory=_trl_model_default("lora_dropout"), ge=0.0, lt=1.0)
    lora_target_modules: Optional[Union[str, list[str]]] = Field(default_factory=_trl_model_default("lora_target_modules"))

    def peft_config(self):
        """TRL's `get_peft_config` of these settings (a `peft.LoraConfig`), or None without `use_peft`."""
        if not self.use_peft:
            return None
        from trl import ModelConfig, get_peft_config

        model_args = ModelConfig(model_name_or_path=self.name_or_path, use_peft=True, lora_r=self.lora_r,
                                 lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout)
        model_args.lora_target_modules = self.lora_target_modules  # as given: TRL's __post_init__ turns a list of one
        return get_peft_config(model_args)  # name into a string, which peft reads as a regular expression

    def lora_server_flags(self) -> list[str]:
        """The start flags a server needs to load this run's adapters (SGLang's, which the built-in server shares;
        none without `use_peft`). Where peft picks the modules (`all-linear`, or unset: its default for the model
        type), the server takes them `all`."""
        if not self.use_peft:
            return []
        modules = self.lora_target_modules
        named = [modules] if isinstance(modules, str) else modules
        modules = named if named and named != [ALL_LINEAR] else ["all"]
        return ["--enable-lora", "--max-lora-rank", str(self.lora_r), "--lora-target-modules", *modules]


class DataSection(Section):
    """The prompts: a hub dataset or a local `.json`/`.jsonl`/`.csv`/`.parquet` file."""

    dataset: str
    split: str = "train"
    config: Optional[str] = None
    prompt_column: str = "prompt"
    system_prompt: Optional[str] = None


class RewardSpec(Section):
    """A reward: a built-in name or `package.module:function`, its weight, and keyword arguments."""

    name: str
    weight: float = 1.0
    kwargs: dict = {}


class Resources(Section):
    """The SLURM resources of one job: nodes, GPUs per node, CPUs per task, memory, and a partition of its own
    (default: `slurm.partition`)."""

    partition: Optional[str] = None
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=0)
    cpus_per_task: Optional[int] = Field(None, ge=1)
    mem: Optional[str] = None


class TrainerResources(Resources):
    """The trainer job's resources, and its processes per node (default: one per GPU, or 1 on CPU)."""

    processes_per_node: Optional[int] = Field(None, ge=1)

    @property
    def num_processes(self) -> int:
        return self.nodes * (self.processes_per_node or max(1, self.gpus_per_node))


# the two forms of a server spec's `resources`: one mapping for every replica, or a list of one mapping per replica
ONE_FOR_ALL, PER_REPLICA = "one-for-all", "per-replica"


def _resources_form(value: Any) -> str:
    return PER_REPLICA if isinstance(value, list) else ONE_FOR_ALL


class ServerSpec(Section):
    """A role's own server: one the launchers start (`engine`, with `resources`), or one already running (`url`).

    `engine`: `builtin` (this package's server, one device), `sglang`, or `openai` (an OpenAI-compatible
    `/v1/completions` server already running at `url`; generation only). `deterministic` starts the server with
    `--enable-deterministic-inference`, without which SGLang and the built-in server ignore `sampling_seed`.
    `device: cpu` runs the server on the CPU (SGLang too: for tests and small models); `python` is the interpreter
    that runs it (e.g. the one of a venv with SGLang; default: the job's own).
    `replicas` server jobs are started (each its own allocation, with `resources`, or its entry of a `resources`
    list); the trainer starts once `min_replicas` of them are healthy, and trains while that many serve.
    """

    engine: Literal["builtin", "sglang", "openai"] = "builtin"
    url: Optional[str] = None
    device: Optional[Literal["cpu", "cuda"]] = None
    python: Optional[str] = None
    model_path: Optional[str] = None
    port: int = Field(30000, ge=1, le=65535)
    tp_size: int = Field(1, ge=1)
    dp_size: int = Field(1, ge=1)
    mem_fraction_static: Optional[float] = Field(None, gt=0, le=1)
    dtype: DType = "auto"
    deterministic: bool = False
    extra_args: list[Union[str, int, float]] = []
    replicas: int = Field(1, ge=1)
    min_replicas: int = Field(1, ge=1)
    resources: Annotated[Union[Annotated[Resources, Tag(ONE_FOR_ALL)], Annotated[list[Resources], Tag(PER_REPLICA)]],
                         Discriminator(_resources_form)] = Field(default_factory=Resources)

    def replica_resources(self, index: int) -> Resources:
        """The resources of the server job of replica `index` (or of resources entry `index`, for `add-server`)."""
        return self.resources[index] if isinstance(self.resources, list) else self.resources

    def resource_entries(self) -> list[tuple[str, Resources]]:
        """`(key suffix, resources)` of each distinct entry: `("resources", r)`, or `("resources[i]", r)` of a list."""
        if isinstance(self.resources, list):
            return [(f"resources[{i}]", r) for i, r in enumerate(self.resources)]
        return [("resources", self.resources)]

    def extra_arg(self, *flags: str) -> Optional[str]:
        """The value `extra_args` gives one of `flags` (`--flag V` or `--flag=V`), if any."""
        words = [str(a) for a in self.extra_args]
        for i, word in enumerate(words):
            name, sep, value = word.partition("=")
            if name in flags:
                return value if sep else (words[i + 1] if i + 1 < len(words) else "")
        return None

    @property
    def started(self) -> bool:
        """Whether the launchers start this server (no `url` given)."""
        return self.url is None

    def interpreter(self) -> str:
        """The python that runs this server: `python` (a path made absolute from the launch directory; a bare name is
        found on the job's PATH), else the launcher's own interpreter."""
        python = self.python or sys.executable
        return os.path.abspath(os.path.expanduser(python)) if "/" in python else python


def _spec_or_placement(value: Any) -> str:
    return "spec" if isinstance(value, (dict, ServerSpec)) else "placement"


def _role(*placements: str):
    """A role's field: one of `placements`, or a `ServerSpec` mapping (its own server)."""
    return Annotated[Union[Annotated[Literal[placements], Tag("placement")], Annotated[ServerSpec, Tag("spec")]],
                     Discriminator(_spec_or_placement)]


GenerationRole = _role("local")
ReferenceRole = _role("generation", "local", "none")


class Servers(Section):
    """Where each role runs. `generation`: a server spec, or `local` (TRL generates on the trainer). `reference`:
    `generation` (a slot of the generation server: the built-in server's `/ref`), `local` (TRL builds it on the
    trainer), `none` (no reference: `beta: 0`), or a server spec of its own."""

    api_key: Optional[str] = None
    generation: GenerationRole = Field(default_factory=ServerSpec)
    reference: ReferenceRole = "generation"

    @model_validator(mode="after")
    def _reference_port(self) -> "Servers":
        """A reference server without a port listens next to the generation server, so both fit on one node."""
        if isinstance(self.reference, ServerSpec) and "port" not in self.reference.model_fields_set:
            base = self.generation.port if isinstance(self.generation, ServerSpec) else ServerSpec.model_fields["port"].default
            self.reference.port = base + REFERENCE_PORT_OFFSET
        return self

    @property
    def uses_key(self) -> bool:
        """Whether the run's servers take an API key: false only for `api_key: none` (unset: a key per run, written
        by the launchers, `launch/run_key.py`)."""
        return self.api_key is None or self.api_key.lower() != NO_KEY

    def specs(self) -> dict[str, ServerSpec]:
        """The roles on servers of their own: `{"generation": spec, "reference": spec}`, or fewer."""
        roles = {"generation": self.generation, "reference": self.reference}
        return {role: spec for role, spec in roles.items() if isinstance(spec, ServerSpec)}

    def describe(self) -> str:
        """`generation on a builtin server, reference in the generation server`: for humans."""
        parts = []
        for role, place in (("generation", self.generation), ("reference", self.reference)):
            if isinstance(place, str):
                where = {"local": "on the trainer", "generation": "in the generation server", "none": "not used"}[place]
            elif place.url:
                where = f"on the {place.engine} server at {place.url}"
            else:
                where = (f"on {place.replicas} {place.engine} server replicas" if place.replicas > 1
                         else f"on a {place.engine} server") + (" of its own" if role == "reference" else "")
            parts.append(f"{role} {where}")
        return ", ".join(parts)


class SlurmSection(Section):
    """sbatch settings shared by every job, and the trainer's resources (a server's are in its spec)."""

    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time: str = "1-00:00:00"
    constraint: Optional[str] = None
    exclusive: bool = False
    job_name: str = "grpo"
    extra_sbatch: list[str] = []
    trainer: TrainerResources = Field(default_factory=TrainerResources)


class Recipe(Section):
    """A whole run. `trainer` and `sync` stay mappings of `RemoteGRPOConfig` fields (checked by `load_recipe`);
    `trainer_config` builds the config, `setting` reads one value with the config's default."""

    model: ModelSection
    data: DataSection
    rewards: list[RewardSpec]
    trainer: dict
    sync: dict = {}
    servers: Servers = Field(default_factory=Servers)
    slurm: SlurmSection = Field(default_factory=SlurmSection)
    accelerate_config: Optional[str] = None
    _path: str = PrivateAttr("")

    @field_validator("rewards", mode="before")
    @classmethod
    def _reward_names(cls, rewards: Any) -> Any:
        """A reward given by its name alone is `{name: NAME}`."""
        if not isinstance(rewards, list) or not rewards:
            raise ValueError("give a list of rewards, e.g. [{name: accuracy}]")
        return [{"name": r} if isinstance(r, str) else r for r in rewards]

    @property
    def path(self) -> str:
        return self._path

    @property
    def output_dir(self) -> str:
        return self.trainer["output_dir"]

    @property
    def sync_dir(self) -> str:
        """Where the trainer writes its weight dumps (the config's `sync_dir`, default `<output_dir>/weights`), as an
        absolute path from the directory launched in: what servers are allowed to reload (`--weight-dirs`)."""
        return str(Path(self.sync.get("sync_dir") or default_sync_dir(self.output_dir)).resolve())

    def model_path(self, spec: ServerSpec) -> str:
        """What a server loads: its spec's `model_path`, else the policy."""
        return spec.model_path or self.model.name_or_path

    def setting(self, name: str) -> Any:
        """A `RemoteGRPOConfig` field as the recipe sets it (`trainer:` or `sync:`), else the config's default."""
        return self.trainer.get(name, self.sync.get(name, _config_defaults()[name]))

    def ref_slot(self, role: str) -> bool:
        """Whether `role`'s built-in server keeps its second model slot (`/ref`): only the generation server that the
        reference lives in, and not with `use_peft` (the reference is then its base model, served without an
        adapter); any other starts with `--no-ref-slot`, holding no second copy of the model."""
        return role == "generation" and self.servers.reference == "generation" and not self.model.use_peft

    def role_urls(self, generation_url: Optional[str], ref_url: Optional[str]) -> tuple[Optional[str], Optional[str]]:
        """`(generation_url, ref_model_url)` from the servers' URLs. A reference in the built-in generation server is
        its second model slot (`/ref`), so syncing the policy leaves it alone; with `use_peft` it is the server's base
        model (requests without an adapter)."""
        generation, reference = self.servers.generation, self.servers.reference
        if reference == "generation":
            in_slot = isinstance(generation, ServerSpec) and generation.engine == "builtin" and generation_url
            return generation_url, f"{generation_url.rstrip('/')}/ref" if in_slot and self.ref_slot("generation") else generation_url
        return generation_url, ref_url if isinstance(reference, ServerSpec) else None

    def trainer_config(self, generation_url: Union[str, list[str], None] = None,
                       ref_model_url: Union[str, list[str], None] = None, on_this_machine: bool = True,
                       api_key: Optional[str] = None, **servers: Any):
        """The `RemoteGRPOConfig` of this run, with the servers' URLs (one, or a list: a pool of replicas), API key
        (`launch.run_key.read_run_key`) and further server settings (`servers`: the replica pools' address directories
        and min replicas, `train.pool_settings`) filled in. `on_this_machine=False` (validation on a login node) leaves
        out the settings transformers checks against the local hardware (bf16, fp16, tf32)."""
        from open_r1_ext.config.grpo_config import RemoteGRPOConfig

        kwargs = dict(self.trainer, **self.sync)
        if not on_this_machine:
            kwargs.update(bf16=False, fp16=False, tf32=None, use_cpu=True)
        kwargs["model_init_kwargs"] = dict(kwargs.get("model_init_kwargs") or {}, **self.model_init_kwargs())
        kwargs["reward_weights"] = [r.weight for r in self.rewards]
        generation = self.servers.generation
        if isinstance(generation, ServerSpec):
            kwargs["generation_url"] = generation_url
            kwargs["generation_backend"] = "openai" if generation.engine == "openai" else "sglang"
        if self.servers.reference not in ("local", "none") and self.setting("beta") != 0.0:
            kwargs["ref_model_url"] = ref_model_url
        if api_key:
            kwargs.setdefault("server_api_key", api_key)
        return RemoteGRPOConfig(**{**kwargs, **servers})

    def model_init_kwargs(self) -> dict:
        kwargs: dict[str, Any] = {"dtype": self.model.dtype, "trust_remote_code": self.model.trust_remote_code}
        if self.model.attn_implementation:
            kwargs["attn_implementation"] = self.model.attn_implementation
        return kwargs


# What replaced the keys of the old `server:` section (one server with a layout) and of `slurm.server`.
_SPEC_KEY = "moved to servers.generation.{key} (and servers.reference.{key} for a reference server of its own)"
REPLACED = {
    "server": "replaced by servers: {generation: SPEC, reference: generation | local | none | SPEC}, one spec per role",
    "server.layout": "replaced by servers.reference: `shared` is `reference: generation` (a slot of the generation "
                     "server), `separate` is `reference: {engine: ...}` (a server of its own)",
    "server.ref_url": "replaced by servers.reference: {url: URL}",
    "server.reference": "replaced by servers.reference: `false` is `reference: local`",
    "server.generation": "replaced by servers.generation: `false` is `generation: local`",
    "server.api_key": "moved to servers.api_key",
    "slurm.server": "moved to servers.generation.resources (and servers.reference.resources for a reference server "
                    "of its own): {nodes, gpus_per_node, cpus_per_task, mem}",
}


# ------------------------------------------------------------------------------------------ loading
def load_recipe(path: Union[str, Path], overrides: Optional[list[str]] = None, check_paths: bool = True,
                checked: bool = True) -> Recipe:
    """Read, override and validate a recipe; raise `RecipeError` naming every problem. `checked=False` is for the job
    steps of a run whose submission checked it (`launch.jobs`): the recipe's own sections are validated, but not
    `trainer:` and `sync:` against `RemoteGRPOConfig` nor the checks across sections, which import TRL and torch
    (~4.5 s of CPU at every job and node start); the trainer checks them all again when it starts."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(path, [("(file)", "a directory, not a recipe file" if path.is_dir() else "no such file")])
    text = _read_text(path)
    try:
        raw = yaml.safe_load(text) or {}
        problems: list[tuple[str, str]] = _duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError as err:
        raise RecipeError(path, [("(yaml)", f"not valid YAML: {err}")]) from None
    if not isinstance(raw, dict):
        raise RecipeError(path, [("(top level)", "a recipe is a mapping of sections (model:, data:, ...)")])
    for item in overrides or []:
        _apply_override(raw, item, problems)
    _replaced_keys(raw, problems)
    recipe = _build_recipe(raw, problems, checked)
    if recipe is not None:
        recipe._path = str(path)
        if "output_dir" not in recipe.trainer:  # every launch path reads it first (the run directory)
            problems.append(("trainer.output_dir", "required: where checkpoints, weight dumps and logs go"))
        if checked:
            _check_recipe(recipe, problems, check_paths)
    if problems:
        raise RecipeError(path, problems)
    return recipe  # type: ignore[return-value]


def _read_text(path: Path) -> str:
    """The recipe's text; a file that is not UTF-8 (or cannot be read) is one problem naming the line."""
    try:
        data = path.read_bytes()
        return data.decode("utf-8")
    except OSError as err:
        raise RecipeError(path, [("(file)", f"cannot be read: {err.strerror}")]) from None
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise RecipeError(path, [("(file)", f"not UTF-8 text (byte 0x{data[err.start]:02x} on line {line}); save the "
                                            "file as UTF-8")]) from None


def _duplicate_keys(node: Optional[yaml.Node], key: str = "") -> list[tuple[str, str]]:
    """Keys given twice in one mapping, which YAML would resolve silently by keeping the last."""
    found: list[tuple[str, str]] = []
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            name, line = str(key_node.value), key_node.start_mark.line + 1
            where = f"{key}.{name}" if key else name
            if name in lines:
                found.append((where, f"given twice (lines {lines[name]} and {line}); YAML would keep only the last: "
                                     "remove one"))
            lines.setdefault(name, line)
            found += _duplicate_keys(value_node, where)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found += _duplicate_keys(item, f"{key}[{i}]")
    return found


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
    try:
        node[parts[-1]] = yaml.safe_load(value)
    except yaml.YAMLError as err:
        problems.append((key, f"the value {value!r} is not valid YAML: {err}"))


def _replaced_keys(raw: dict, problems: list) -> None:
    """Name what replaced each old key (and drop it, so it is not reported twice)."""
    old = raw.pop("server", None)
    if old is not None:
        for key in [f"server.{key}" for key in old] if isinstance(old, dict) and old else ["server"]:
            name = key.removeprefix("server.")
            spec_key = name in ServerSpec.model_fields and _SPEC_KEY.format(key=name)
            problems.append((key, REPLACED.get(key) or spec_key or REPLACED["server"]))
    slurm = raw.get("slurm")
    if isinstance(slurm, dict) and "server" in slurm:
        del slurm["server"]
        problems.append(("slurm.server", REPLACED["slurm.server"]))


def _build_recipe(raw: dict, problems: list, checked: bool) -> Optional[Recipe]:
    recipe = None
    for section in ("trainer", "sync"):
        for key, value in (raw.get(section) if isinstance(raw.get(section), dict) else {}).items():
            if key.endswith("_strategy") and value is False:  # YAML reads `save_strategy: no` as false
                raw[section][key] = "no"
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as err:
        problems += _problems(err, Recipe)
    for section in ("trainer", "sync") if checked else ():
        if isinstance(raw.get(section), dict):
            try:
                _config_sections()[section].model_validate(raw[section])
            except ValidationError as err:
                problems += _problems(err, _config_sections()[section], where=section)
                recipe = None
    return recipe


@functools.cache
def _config_defaults() -> dict[str, Any]:
    """Every `RemoteGRPOConfig` field's default (TRL's for TRL's fields): the one place they live."""
    from open_r1_ext.config.grpo_config import RemoteGRPOConfig

    return {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(RemoteGRPOConfig) if f.init}


@functools.cache
def _config_sections() -> dict[str, type[BaseModel]]:
    """`trainer:` and `sync:` as models of `RemoteGRPOConfig`'s fields: names and types are checked here, values by
    the config itself. `sync:` holds the fields the config tags `section: sync`; `trainer:` all the others."""
    from open_r1_ext.config.grpo_config import RemoteGRPOConfig

    hints = typing.get_type_hints(RemoteGRPOConfig)
    fields = [f for f in dataclasses.fields(RemoteGRPOConfig) if f.init]
    config = ConfigDict(extra="forbid", strict=True, arbitrary_types_allowed=True)
    return {section: create_model(section, __config__=config, **{
                f.name: (hints[f.name], None) for f in fields if (f.metadata.get("section") == "sync") == (section == "sync")})
            for section in ("trainer", "sync")}


def _problems(err: ValidationError, model: type[BaseModel], where: str = "") -> list[tuple[str, str]]:
    """pydantic's errors as `(key, message)`: `servers.generation.tp_size`, `rewards[2].name`. The errors of one
    value that fits no member of a union are one problem: `expected an integer or a number, got 'x'`."""
    messages: dict[str, list[str]] = {}
    for error in err.errors():
        key, parent, current, placement = where, model, model, False
        for item in error["loc"]:
            if isinstance(item, int):
                key += f"[{item}]"
            elif item in ("spec", "placement"):  # the tags of a role's field
                placement = item == "placement"
            elif item in (ONE_FOR_ALL, PER_REPLICA):  # the tags of a server spec's resources
                continue
            elif current is not None:  # past a plain value, the items name union members
                key, parent, current = f"{key}.{item}" if key else item, current, _submodel(current, item)
        messages.setdefault(key, []).append(_message(error, parent, placement))
    return [(key, _merged(found)) for key, found in messages.items()]


def _merged(messages: list[str]) -> str:
    expected = [m.removeprefix("expected ").rpartition(", got ") for m in messages if m.startswith("expected ")]
    if len(expected) < 2 or len(expected) < len(messages):
        return "; ".join(dict.fromkeys(messages))
    return f"expected {' or '.join(dict.fromkeys(e[0] for e in expected))}, got {expected[0][2]}"


def _submodel(model: type[BaseModel], name: str) -> Optional[type[BaseModel]]:
    """The model of field `name` of `model` (`ServerSpec` for a role), or None for a plain value."""
    field = model.model_fields.get(name)
    pending = [field.annotation] if field else []
    while pending:
        hint = pending.pop()
        if isinstance(hint, type) and issubclass(hint, BaseModel):
            return hint
        pending += typing.get_args(hint)
    return None


def _message(error: dict, parent: type[BaseModel], placement: bool) -> str:
    """One error in recipe words; `parent` holds the key, `placement` says a role's field was given a string."""
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx", {})
    if kind == "extra_forbidden":
        if parent in _config_sections().values() and error["loc"][-1] in _config_defaults():
            other = "trainer" if parent.__name__ == "sync" else "sync"
            return f"unknown key (it belongs in the {other}: section)"
        return f"unknown {'section' if parent is Recipe else 'key'}{_did_you_mean(str(error['loc'][-1]), list(parent.model_fields))}"
    if kind == "missing":
        if parent is Recipe:
            return "missing section (a recipe needs model, data, rewards, trainer)"
        return "required key is missing"
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", ctx["expected"])
        close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.6)
        spec = ", or a server spec mapping ({engine: ..., ...})" if placement else ""
        return f"{value!r} is not one of {', '.join(choices)}{spec}" + (f" (did you mean '{close[0]}'?)" if close else "")
    if kind == "value_error":
        return str(ctx["error"])
    bounds = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le")}
    if kind in bounds:
        sign, name = bounds[kind]
        return f"must be {sign} {ctx[name]}, got {value!r}"
    expected = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false", "string_type": "a string",
                "list_type": "a list", "dict_type": "a mapping", "model_type": "a mapping", "model_attributes_type": "a mapping"}
    if kind in expected:
        return f"expected {expected[kind]}, got {value!r}"
    return f"{error['msg'][0].lower()}{error['msg'][1:]}, got {value!r}"


def _did_you_mean(key: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(key, choices, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(sorted(choices)[:12])}{', ...' if len(choices) > 12 else ''})"


# ---------------------------------------------------------------------------------------- semantics
def is_local_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or not HUB_ID.match(value)


def _check_recipe(recipe: Recipe, problems: list, check_paths: bool) -> None:
    if check_paths:
        paths = [("model.name_or_path", recipe.model.name_or_path), ("data.dataset", recipe.data.dataset),
                 ("accelerate_config", recipe.accelerate_config),
                 *((f"servers.{role}.model_path", spec.model_path) for role, spec in recipe.servers.specs().items())]
        for key, value in paths:
            if value and is_local_path(value) and not Path(value).expanduser().exists():
                problems.append((key, f"local path {value} does not exist (hub ids look like org/name)"))
        _check_data(recipe.data, problems)
        _check_context(recipe, problems)
        _check_interpreters(recipe, problems)
    _check_rewards(recipe, problems)
    _check_lora(recipe, problems)
    _check_values(recipe, problems)
    _check_servers(recipe, problems)
    _check_transport(recipe, problems)
    _check_trainer_processes(recipe, problems)
    _check_batch(recipe, problems)
    if not problems:
        try:
            recipe.trainer_config(generation_url="http://validate:0", ref_model_url="http://validate:0", on_this_machine=False)
        except Exception as err:  # noqa: BLE001 - TRL's and transformers' own checks: any of them is the recipe's problem
            problems.append((_config_error_key(str(err)), f"{err}"))


def _config_error_key(message: str) -> str:
    """Where a config check's `name=value: ...` (or `name.key...: ...`) message belongs: `sync.name` or
    `trainer.name`, with the key below it (`trainer.generation_kwargs.top_k`); else `trainer`."""
    key = re.match(r"[\w.]*", message).group(0)
    for section, model in _config_sections().items():
        if key.partition(".")[0] in model.model_fields:
            return f"{section}.{key}"
    return "trainer"


REWARD_REFERENCE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")  # package.module:function


def _check_rewards(recipe: Recipe, problems: list) -> None:
    """Each reward is a built-in or a `package.module:function` that imports (whatever the module raises); the
    reward `trainer.dynamic_sampling_reward` names is one of them (by its function's name, as TRL logs it)."""
    from open_r1_ext.rewards import BUILTIN, resolve_reward

    names = []
    for i, reward in enumerate(recipe.rewards):
        key = f"rewards[{i}].name"
        if ":" in reward.name and not REWARD_REFERENCE.match(reward.name):
            problems.append((key, f"{reward.name!r} is not a reference package.module:function (e.g. "
                                  f"my_rewards.math:exact_match) nor a built-in ({', '.join(BUILTIN)})"))
            continue
        try:
            names.append(resolve_reward(reward.name).__name__)
        except ValueError as err:
            problems.append((key, str(err)))
        except Exception as err:  # noqa: BLE001 - the user's module failed while importing
            problems.append((key, f"importing {reward.name.partition(':')[0]} failed: {type(err).__name__}: {err}; "
                                  "fix the module (run: python -c 'import MODULE')"))
    decisive = recipe.setting("dynamic_sampling_reward")
    if decisive is not None and len(names) == len(recipe.rewards) and decisive not in names:
        problems.append(("trainer.dynamic_sampling_reward",
                         f"{decisive!r} is none of the rewards ({', '.join(names)}): name one of them, or remove it "
                         "for the weighted sum of the rewards"))


def _check_lora(recipe: Recipe, problems: list) -> None:
    """`model.use_peft`: peft is installed, the reference is not synced (it is the base model, which never changes:
    TRL refuses the same), and a generation server the launchers start can load the adapters (modules among SGLang's
    `--lora-target-modules` choices; SGLang with dp_size 1)."""
    if not recipe.model.use_peft:
        return
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        problems.append(("model.use_peft", "needs the peft library, which is not installed: pip install peft"))
    if recipe.setting("sync_ref_model"):
        problems.append(("sync.sync_ref_model", "with model.use_peft the reference is the base model (the policy without "
                                                "its adapter), which never changes: set it to false"))
    modules = recipe.model.lora_target_modules
    if isinstance(modules, str) and modules != ALL_LINEAR:
        problems.append(("model.lora_target_modules", f"{modules!r}: peft reads a string as a regular expression, which "
                                                      "a server's --lora-target-modules cannot take: give a list of "
                                                      f"module names (e.g. [q_proj, v_proj]) or {ALL_LINEAR}"))
    generation = recipe.servers.generation
    if not isinstance(generation, ServerSpec) or not generation.started:
        return
    unknown = [m for m in modules if m not in (*SGLANG_LORA_TARGET_MODULES, ALL_LINEAR)] if isinstance(modules, list) else []
    if unknown:  # the built-in server takes SGLang's choices too
        problems.append(("model.lora_target_modules", f"{', '.join(map(repr, unknown))}: not a module the generation "
                                                      "server can adapt (SGLang's --lora-target-modules choices, "
                                                      f"arg_groups/fields/lora.py: {', '.join(SGLANG_LORA_TARGET_MODULES)}"
                                                      f"); the server would not start: name those, or {ALL_LINEAR}"))
    if generation.engine == "sglang" and generation.dp_size > 1:
        problems.append(("servers.generation.dp_size", f"{generation.dp_size}: SGLang loads LoRA adapters only with "
                                                       "dp_size 1 (an assertion, HTTP 500 on /load_lora_adapter: "
                                                       "tokenizer_control_mixin.py ~672), which adapter-only sync "
                                                       "(model.use_peft) needs: set dp_size 1, and replicas: N for "
                                                       "more servers"))


# Settings TRL and transformers accept at start-up that fail or do nothing later: (test, what the value must be)
VALUE_RULES: dict[str, tuple[Any, str]] = {
    **dict.fromkeys(("learning_rate", "per_device_train_batch_size", "per_device_eval_batch_size",
                     "gradient_accumulation_steps", "max_completion_length", "num_iterations", "steps_per_generation",
                     "generation_batch_size", "num_train_epochs", "save_steps", "logging_steps", "eval_steps",
                     "temperature", "repetition_penalty", "max_batch_tokens"), (lambda v: v > 0, "> 0")),
    "max_steps": (lambda v: v > 0 or v == -1, "> 0, or -1 to train num_train_epochs"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "top_k": (lambda v: v >= -1, ">= -1 (0 and -1 disable it)"),
    "warmup_steps": (lambda v: v >= 0, ">= 0"),
}


def _check_values(recipe: Recipe, problems: list) -> None:
    """The numeric ranges of `VALUE_RULES`, for the values the recipe sets (TRL's defaults are fine); with generation
    on a server, the ranges SGLang takes (`_check_sampling_ranges`)."""
    for section in ("trainer", "sync"):
        for name, value in getattr(recipe, section).items():
            if name in VALUE_RULES and isinstance(value, (int, float)) and not isinstance(value, bool):
                test, must = VALUE_RULES[name]
                if not (math.isfinite(value) and test(value)):
                    default = _config_defaults()[name]
                    fix = f"remove it for the default ({default})" if default is not None else "remove it"
                    problems.append((f"{section}.{name}", f"must be {must}, got {value!r}: set such a value, or {fix}"))
    if isinstance(recipe.servers.generation, ServerSpec):
        _check_sampling_ranges(recipe, problems)


def _check_sampling_ranges(recipe: Recipe, problems: list) -> None:
    """`repetition_penalty` and the `generation_kwargs` (SGLang `sampling_params`) in the ranges SGLang 0.5.23 takes
    (`protocol.sampling_range_problems`: e.g. `top_k: 0` in generation_kwargs, which SGLang refuses); the Python
    API (`RemoteGRPOConfig`) checks the same."""
    from open_r1_ext.sglang_client import SAMPLING_TWINS

    flagged = {key for key, _ in problems}
    penalty = recipe.setting("repetition_penalty")
    for name, must in sampling_range_problems({"repetition_penalty": penalty}):
        if f"trainer.{name}" not in flagged:
            problems.append((f"trainer.{name}", f"must be {must} with generation on a server (SGLang answers every "
                                                f"request with HTTP 400 otherwise), got {penalty!r}"))
    kwargs = recipe.setting("generation_kwargs")
    if isinstance(kwargs, dict):
        given = {SAMPLING_TWINS.get(key, key): (key, value) for key, value in kwargs.items()}
        for name, must in sampling_range_problems({name: value for name, (_, value) in given.items()},
                                                  recipe.setting("max_completion_length")):
            key, value = given[name]
            problems.append((f"trainer.generation_kwargs.{key}", f"must be {must} (SGLang answers every request with "
                                                                  f"HTTP 400 otherwise), got {value!r}"))


def _check_data(data: DataSection, problems: list) -> None:
    """A local data file: a type the loader reads, holding `prompt_column` (hub datasets are checked when loaded)."""
    path = Path(data.dataset).expanduser()
    if not is_local_path(data.dataset) or not path.exists():
        return
    if not path.is_file() or path.suffix not in LOCAL_FORMATS:
        problems.append(("data.dataset", f"{data.dataset}: unsupported {'directory' if path.is_dir() else 'file type'}; "
                                         f"give a {'/'.join(LOCAL_FORMATS)} file or a hub dataset id"))
        return
    try:
        columns = local_columns(path)
    except Exception as err:  # noqa: BLE001 - whatever the parser says about the file is the message
        problems.append(("data.dataset", f"{data.dataset} cannot be read as {path.suffix}: {err}"))
        return
    if data.prompt_column not in columns:
        problems.append(("data.prompt_column", f"{data.prompt_column!r} is not a column of {data.dataset} (its columns: "
                                               f"{', '.join(columns) or 'none'}); set data.prompt_column to one of them"))


def _check_interpreters(recipe: Recipe, problems: list) -> None:
    """A server's `python` given as a path is an executable file (a bare name is looked up on the job's PATH)."""
    for role, spec in recipe.servers.specs().items():
        if spec.started and spec.python and "/" in spec.python and not os.access(spec.interpreter(), os.X_OK):
            problems.append((f"servers.{role}.python", f"{spec.python} is not an executable file; give the python of a "
                                                       f"venv that has the {spec.engine} server ({INSTALLS[spec.engine]})"))


def _check_context(recipe: Recipe, problems: list) -> None:
    """The completion must fit the context (`max_position_embeddings`) of every local model the run loads, and where
    servers serve it, leave room for a prompt within what they take (SGLang refuses an input of the context - 6
    tokens or more, and scores prompt + completion as one input: `protocol.max_req_input_len`)."""
    completion = recipe.setting("max_completion_length")
    if not isinstance(completion, int):
        return
    served = bool(recipe.servers.specs())
    models = {recipe.model.name_or_path, *(recipe.model_path(spec) for spec in recipe.servers.specs().values())}
    for model in sorted(models):
        config = Path(model).expanduser() / "config.json"
        if not is_local_path(model) or not config.is_file():
            continue
        try:
            context = json.loads(config.read_text()).get("max_position_embeddings")
        except (OSError, ValueError):
            continue  # the model's own loader reports a broken config
        if not isinstance(context, int):
            continue
        limit = max_req_input_len(context, context) - 1 if served else context
        if completion >= limit:
            margin = f"; a server takes prompt + completion of at most {limit} tokens of it" if served else ""
            problems.append(("trainer.max_completion_length",
                             f"{completion} leaves no room for a prompt in the context of {model} ({context} tokens, "
                             f"max_position_embeddings in its config.json{margin}); set it below {limit}"))


def _check_servers(recipe: Recipe, problems: list) -> None:
    """What each engine can do, and where the reference can live; each message names the fix."""
    generation, reference = recipe.servers.generation, recipe.servers.reference
    beta = recipe.setting("beta")
    key = recipe.servers.api_key
    if key and key.startswith("-") and any(spec.started for spec in recipe.servers.specs().values()):
        problems.append(("servers.api_key", "starts with '-': the servers read the run's key from a --config file, "
                                            "which SGLang turns into `--api-key -...` and refuses to start with "
                                            "(\"expected one argument\"): choose a key that does not start with '-', "
                                            "or remove it for a key generated per run"))
    for role, spec in recipe.servers.specs().items():
        key = f"servers.{role}"
        _check_replicas(spec, key, problems)
        if spec.url is not None and not spec.url.startswith(("http://", "https://")):
            problems.append((f"{key}.url", f"{spec.url!r}: give a base URL such as http://node-3:30000"))
        if not 1 <= spec.port <= 65535:  # a reference server's default port: the generation server's + 1
            problems.append((f"{key}.port", f"{spec.port} is outside 1-65535; set servers.{role}.port"))
        flags = {"--api-key", "--config"} if recipe.servers.uses_key else {"--api-key"}  # --config: the run's key file
        if spec.started and flags & {str(a).split("=")[0] for a in spec.extra_args}:
            problems.append((f"{key}.extra_args", "the launchers give a server the run's API key in an owner-only file "
                                                  "(--config FILE) and keep it off the command line, where ps shows it: "
                                                  "remove --api-key / --config and set servers.api_key instead"))
        on_gpus = spec.engine == "sglang" and spec.device != "cpu"
        for where, job in spec.resource_entries():
            if on_gpus and spec.started and job.gpus_per_node == 0:
                problems.append((f"{key}.{where}.gpus_per_node", f"0: SGLang runs on GPUs; give the server job GPUs "
                                                                 f"(gpus_per_node >= 1), set {key}.device: cpu (SGLang "
                                                                 "on the CPU: for tests and small models) or use "
                                                                 "engine: builtin"))
            elif on_gpus and spec.tp_size * spec.dp_size > max(job.nodes * job.gpus_per_node, 1):
                problems.append((f"{key}.tp_size", f"tp_size x dp_size = {spec.tp_size * spec.dp_size} needs more GPUs "
                                                   f"than {key}.{where} gives ({job.nodes} node(s) x {job.gpus_per_node})"))
            if spec.engine == "builtin" and (spec.tp_size != 1 or spec.dp_size != 1 or job.nodes != 1):
                problems.append((f"{key}.tp_size", f"the built-in server runs on one device of one node: set tp_size 1, "
                                                   f"dp_size 1, {where}.nodes 1, or use engine: sglang"))
            if on_gpus and spec.started:
                _check_sglang_nodes(spec, job.nodes, key, problems)
        _check_device(spec, key, problems)
        if spec.extra_arg("--admin-api-key") is not None:
            problems.append((f"{key}.extra_args", "--admin-api-key locks /update_weights_from_disk and /flush_cache to "
                                                  "an admin key, which the launchers would have to put on the command "
                                                  "line (the run's API key is kept off it): remove it; for a server you "
                                                  "start yourself with an admin key, give its url and "
                                                  "trainer.server_admin_api_key"))
    if isinstance(generation, ServerSpec):
        if generation.engine == "openai" and generation.url is None:
            problems.append(("servers.generation.url", "engine: openai uses an OpenAI-compatible server that is already "
                                                       "running: give its URL"))
    if isinstance(reference, ServerSpec) and reference.engine == "openai":
        problems.append(("servers.reference.engine", "an OpenAI-compatible server cannot give reference log-probs: use "
                                                     "engine: builtin or sglang, or reference: local"))
    elif reference == "generation":
        if generation == "local":
            problems.append(("servers.reference", "`generation` is a slot of the generation server, and generation: local "
                                                  "runs none: give the reference a server of its own ({engine: builtin}) "
                                                  "or set local"))
        elif generation.engine == "sglang" and beta != 0.0 and not recipe.model.use_peft:
            problems.append(("servers.reference", "an SGLang server holds one model, and weight sync changes it to the "
                                                  "policy: give the reference a server of its own (reference: {engine: "
                                                  "sglang, ...}) or set local"))
        elif generation.engine == "openai" and beta != 0.0:
            problems.append(("servers.reference", "an OpenAI-compatible server cannot give reference log-probs: set "
                                                  "local, or give the reference a server of its own ({engine: sglang} "
                                                  "or {url: ...})"))
    elif reference == "none" and beta != 0.0:
        problems.append(("servers.reference", f"none, but beta={beta} needs a reference: set generation, local or a "
                                              "server spec, or trainer.beta: 0"))
    elif reference == "local" and generation == "local":
        problems.append(("servers", "generation: local and reference: local: no server plays a role; give one a server"))
    if isinstance(reference, ServerSpec) and reference.started and beta == 0.0:
        problems.append(("servers.reference", "beta: 0 uses no reference, and the launchers would start a server for it: "
                                              "set reference: none"))
    host = generation if reference == "generation" else reference
    soft = recipe.setting("sync_ref_model") and recipe.setting("ref_model_mixup_alpha") != 1.0
    if soft and isinstance(host, ServerSpec) and host.engine != "builtin":
        problems.append(("sync.ref_model_mixup_alpha", f"{host.engine} reloads weights as they are and cannot mix old "
                                                       "and new (soft update); set 1.0, or host the reference on engine: builtin"))


def _check_transport(recipe: Recipe, problems: list) -> None:
    """`sync.transport: distributed`: a generation server that takes a broadcast (SGLang refuses one with
    `dp_size > 1`)."""
    if recipe.setting("transport") != "distributed":
        return
    generation = recipe.servers.generation
    if not isinstance(generation, ServerSpec):
        problems.append(("sync.transport", "distributed sends the policy to the generation server, and generation: "
                                           "local runs none: remove sync.transport"))
    elif generation.engine == "sglang" and generation.dp_size > 1:
        problems.append(("servers.generation.dp_size", f"{generation.dp_size} with sync.transport: distributed: SGLang "
                                                       "refuses distributed weight updates with data parallelism; set "
                                                       "dp_size 1 (replicas: N for more servers) or sync.transport: disk"))


def _check_replicas(spec: ServerSpec, key: str, problems: list) -> None:
    """`replicas`, `min_replicas` and a `resources` list fit together, and only on servers the launchers start."""
    if not spec.started:
        given = [name for name in ("replicas", "min_replicas") if name in spec.model_fields_set]
        given += ["resources (a list)"] if isinstance(spec.resources, list) else []
        if given:
            problems.append((f"{key}.{given[0].split()[0]}",
                             f"a server already running at url ({spec.url}) is one server, no job is started for it: "
                             f"remove {', '.join(given)} (several running servers: give open-r1-ext train one "
                             "--server-url per server), or remove url to have the launchers start the replicas"))
        return
    if spec.min_replicas > spec.replicas:
        problems.append((f"{key}.min_replicas", f"{spec.min_replicas} is more than replicas ({spec.replicas}): the "
                                                "trainer would wait for servers that are never started; set it to at "
                                                f"most {spec.replicas}"))
    if isinstance(spec.resources, list) and len(spec.resources) != spec.replicas:
        problems.append((f"{key}.resources", f"a list of {len(spec.resources)} resource mapping(s) for replicas: "
                                             f"{spec.replicas}; give one per replica, or one mapping for all"))


def _check_device(spec: ServerSpec, key: str, problems: list) -> None:
    """`device` fits the server's jobs, and SGLang on the CPU is one process on one node (it is for tests and small
    models: `tp_size`/`dp_size` > 1 need settings of its CPU backend that are not made here)."""
    if not spec.started:
        given = [name for name in ("device", "python") if getattr(spec, name) is not None]
        if given:
            problems.append((f"{key}.{given[0]}", f"a server already running at url ({spec.url}) is not started by the "
                                                  f"launchers: remove {' and '.join(given)}"))
        return
    if spec.device is None:
        return
    for where, job in spec.resource_entries():  # device: cpu on a job with GPUs: a rehearsal of a GPU launch, allowed
        if spec.device == "cuda" and job.gpus_per_node == 0:
            problems.append((f"{key}.{where}.gpus_per_node", "0: device: cuda needs a GPU; give the server job GPUs "
                                                             "(gpus_per_node >= 1) or set device: cpu"))
        if spec.device == "cpu" and spec.engine == "sglang" and job.nodes != 1:
            problems.append((f"{key}.{where}.nodes", f"{job.nodes}: SGLang on the CPU runs on one node; set nodes: 1"))
    if spec.device == "cpu" and spec.engine == "sglang":
        if spec.tp_size * spec.dp_size != 1:
            problems.append((f"{key}.tp_size", "SGLang on the CPU (for tests and small models) runs with tp_size 1 and "
                                               "dp_size 1: set both to 1, or run it on GPUs (remove device: cpu); for "
                                               "more throughput, replicas"))
        if spec.deterministic:
            problems.append((f"{key}.deterministic", "SGLang on the CPU has no deterministic mode (its only CPU "
                                                     "attention backend, torch_native, refuses "
                                                     "--enable-deterministic-inference): set false"))


def _check_sglang_nodes(spec: ServerSpec, nodes: int, key: str, problems: list) -> None:
    """What SGLang 0.5.23 refuses at start with several nodes (`arg_groups/validation_hook.py` ~179-202)."""
    if nodes == 1:
        return
    pp = spec.extra_arg("--pp-size", "--pipeline-parallel-size")
    pp_size = int(pp) if pp and pp.isdigit() else 1
    if spec.dp_size != 1:
        problems.append((f"{key}.dp_size", f"SGLang runs no data-parallel replicas across nodes (nnodes={nodes}): set "
                                           "dp_size 1 and use tp_size, or one server job per node (resources.nodes 1, "
                                           "replicas: N)"))
    if (spec.tp_size * pp_size) % nodes:
        problems.append((f"{key}.tp_size", f"SGLang needs tp_size x pp_size ({spec.tp_size} x {pp_size}) divisible by "
                                           f"the number of nodes (nnodes={nodes}): change tp_size or resources.nodes"))


def _check_trainer_processes(recipe: Recipe, problems: list) -> None:
    """At most one trainer process a GPU: accelerate gives each rank of a node the GPU of its local index."""
    job = recipe.slurm.trainer
    if job.gpus_per_node and job.processes_per_node and job.processes_per_node > job.gpus_per_node:
        problems.append(("slurm.trainer.processes_per_node",
                         f"{job.processes_per_node} processes on {job.gpus_per_node} GPU(s) a node: each rank takes the "
                         "GPU of its local index, so the ranks beyond the GPUs fail at start; set at most "
                         "gpus_per_node, or remove it for one process per GPU"))


def _check_batch(recipe: Recipe, problems: list) -> None:
    """The batch rule TRL enforces at start-up, checked here for the world size the recipe asks for."""
    world = recipe.slurm.trainer.num_processes
    per_device = recipe.setting("per_device_train_batch_size")
    num_generations = recipe.setting("num_generations")
    steps = recipe.setting("steps_per_generation") or recipe.setting("gradient_accumulation_steps")
    if not all(isinstance(v, int) for v in (per_device, num_generations, steps)):
        return  # null where TRL allows it: the config's own check (below) reports it
    generation_batch = recipe.setting("generation_batch_size") or per_device * world * steps
    if num_generations < 2:
        problems.append(("trainer.num_generations", f"{num_generations}: GRPO needs at least 2 completions per prompt"))
    elif generation_batch % num_generations:
        problems.append((
            "trainer.num_generations",
            f"the generation batch ({per_device} per device x {world} processes x {steps} steps = {generation_batch}) "
            f"is not divisible by num_generations={num_generations}; change per_device_train_batch_size, "
            "gradient_accumulation_steps or num_generations",
        ))
