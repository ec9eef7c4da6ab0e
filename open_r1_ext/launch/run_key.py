"""The run's API key: random per launch, kept owner-only (0600) in the run directory, read from there by every server
the launchers start and by the trainer; never on a command line, in a job name or in a line we log.

The file is a server flag file, `api-key: "KEY"`, which SGLang 0.5.23 reads with `--config FILE` (its
`server_args.py` ~683, `utils/server_args_config_parser.py`) and the built-in server with its own `--config`.
`servers.api_key` in the recipe: unset, a key generated per run; a string, that key (also written to the file, so it
stays off command lines too); `none`, no key at all (with a warning).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from pathlib import Path
from typing import Callable, Optional

import yaml

from open_r1_ext.config.recipe import Recipe

logger = logging.getLogger(__name__)
FLAG = "api-key"  # the servers' flag, as the file's one key


def key_file(run_dir: Path) -> Path:
    return Path(run_dir) / "api_key.yaml"  # .yaml: SGLang's --config takes no other suffix


def new_key() -> str:
    """A random key of 256 bits in hex: never starting with `-`, which SGLang's `--config` would pass on as a flag
    (`api-key: -x` becomes `--api-key -x`, and SGLang exits "expected one argument"; `secrets.token_urlsafe` starts
    with `-` once in 64)."""
    return secrets.token_hex(32)


def write_run_key(recipe: Recipe, run_dir: Path, warn: Callable[[str], None] = logger.warning) -> Optional[Path]:
    """A launch's key file: the recipe's key, else a new random one (256 bits). With `api_key: none` none is
    written (an old one is removed) and `warn` says what that leaves open. Returns the file, or None."""
    path = key_file(run_dir)
    path.unlink(missing_ok=True)
    if not recipe.servers.uses_key:
        warn(f"{recipe.path}: servers.api_key: none: the servers started for this run accept every client that reaches "
             "their port, including /update_weights_from_disk; remove the key to get a per-run one")
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # owner-only from its first byte
    with os.fdopen(descriptor, "w") as file:
        file.write(f"{FLAG}: {json.dumps(recipe.servers.api_key or new_key())}\n")
    os.replace(tmp, path)
    return path


def read_run_key(recipe: Recipe, run_dir: Path) -> Optional[str]:
    """The key the trainer sends: the recipe's, else the run's key file's (None without either, or with `none`)."""
    if not recipe.servers.uses_key:
        return None
    if recipe.servers.api_key:
        return recipe.servers.api_key
    path = key_file(run_dir)
    return yaml.safe_load(path.read_text())[FLAG] if path.is_file() else None
