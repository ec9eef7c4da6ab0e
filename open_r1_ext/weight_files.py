"""The on-disk format of a weight dump, and reading it all-or-nothing.

A dump is a standard transformers directory (safetensors shards, `config.json`) plus `manifest.json`,
written last, that lists every file with its size and sha256. A reader that finds a manifest checks it, so a
half-written dump is refused; a plain `save_pretrained` directory without a manifest is read as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

MANIFEST = "manifest.json"
INDEX = "model.safetensors.index.json"
# Present while a dump is being written; removed just before the rename that publishes it.
INCOMPLETE = "WRITE_IN_PROGRESS"


class WeightFileError(ValueError):
    """A weight directory that cannot be loaded; the message names the directory and the problem."""


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_manifest(directory: Path) -> None:
    """Raise `WeightFileError` unless every file in the manifest is present with its size and checksum."""
    manifest = json.loads((directory / MANIFEST).read_text())
    for name, expected in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise WeightFileError(f"{directory}: file {name} listed in {MANIFEST} is missing")
        size = path.stat().st_size
        if size != expected["size"]:
            raise WeightFileError(f"{directory}: file {name} has {size} bytes, {MANIFEST} says {expected['size']}")
        if sha256_of(path) != expected["sha256"]:
            raise WeightFileError(f"{directory}: file {name} does not match its checksum in {MANIFEST}")


def safetensors_files(directory: Path) -> list[Path]:
    """The shards of a transformers directory: those its index names, else every `*.safetensors` file."""
    index = directory / INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise WeightFileError(f"{directory}: shards named in {INDEX} are missing: {', '.join(missing)}")
        return [directory / n for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightFileError(f"{directory}: no *.safetensors files (is this a transformers model directory?)")
    return files


def read_weight_dir(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a weight directory on CPU, after checking its manifest when it has one."""
    if not directory.is_dir():
        raise WeightFileError(f"{directory}: no such directory")
    if (directory / INCOMPLETE).exists():
        raise WeightFileError(f"{directory}: an unfinished weight dump ({INCOMPLETE} is present); use a finished one")
    if (directory / MANIFEST).is_file():
        check_manifest(directory)
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(directory):
        try:
            tensors.update(load_file(str(path), device="cpu"))
        except (SafetensorError, OSError, ValueError) as err:
            raise WeightFileError(f"{directory}: cannot read {path.name} (truncated or not safetensors): {err}") from err
    return tensors


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_weight_dir(directory: Path, write: Callable[[Path], None]) -> Path:
    """Create `directory` atomically: `write(tmp)` fills a temporary sibling, every file is fsynced, the manifest
    (sizes and sha256) is written last, then one rename publishes it. A reader never sees a partial dump: it sees
    no directory, a temporary one (ignored), or a complete one with a manifest."""
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / INCOMPLETE).touch()
    write(tmp)
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file() and p.name != INCOMPLETE):
        _fsync(path)
        files[str(path.relative_to(tmp))] = {"size": path.stat().st_size, "sha256": sha256_of(path)}
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({"files": files}, indent=1))
    _fsync(manifest)
    (tmp / INCOMPLETE).unlink()
    if directory.exists():
        shutil.rmtree(directory)
    os.rename(tmp, directory)
    _fsync(directory.parent)
    return directory
