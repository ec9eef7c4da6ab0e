"""The on-disk format of a weight dump: publishing it atomically, sealing it, reading it all-or-nothing.

A dump is a standard transformers directory (safetensors shards, `config.json`) plus `manifest.json`, written
last, that lists every file with its size. It appears in one rename, so a reader sees no directory, an ignored
temporary one, or a complete one; every reader checks the manifest's file list and sizes (free).

`seal_weight_dir` then adds each file's xxh3-128 checksum to the manifest and fsyncs the dump. It is a separate
step so that a trainer runs it in the background after the servers reloaded (`weight_sync.WeightSync` records a
sync only once its dump is sealed): a crash of the machine before the fsync can leave damaged files behind a
published name, and the checksums are what tell them apart when a dump is reused (`check_manifest(checksums=True)`,
e.g. restoring the reference on resume). A plain `save_pretrained` directory without a manifest is read as it is.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
import xxhash
from safetensors import SafetensorError
from safetensors.torch import load_file

MANIFEST = "manifest.json"
INDEX = "model.safetensors.index.json"
# Present while a dump is being written; removed just before the rename that publishes it.
INCOMPLETE = "WRITE_IN_PROGRESS"
CHECKSUM = "xxh3_128"  # ~10 GB/s in memory here, 9x sha256; it guards against damage, not against an attacker


class WeightFileError(ValueError):
    """A weight directory that cannot be loaded; the message names the directory and the problem."""


def checksum_of(path: Path) -> str:
    """xxh3-128 of a file's bytes, read through mmap (no copy; xxhash releases the GIL while it hashes)."""
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return xxhash.xxh3_128(b"").hexdigest()
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return xxhash.xxh3_128(mapped).hexdigest()


def check_manifest(directory: Path, checksums: bool) -> None:
    """Raise `WeightFileError` unless every file in the manifest is present with its size (and, if `checksums`,
    its checksum: the dump must be sealed)."""
    for name, expected in _manifest_files(directory).items():
        path = directory / name
        if not path.is_file():
            raise WeightFileError(f"{directory}: file {name} listed in {MANIFEST} is missing")
        size = path.stat().st_size
        if size != expected["size"]:
            raise WeightFileError(f"{directory}: file {name} has {size} bytes, {MANIFEST} says {expected['size']}")
        if not checksums:
            continue
        if CHECKSUM not in expected:
            raise WeightFileError(f"{directory}: {MANIFEST} has no {CHECKSUM} checksums: the dump was never sealed "
                                  "(its sync was not logged); use a logged dump")
        if expected[CHECKSUM] != checksum_of(path):
            raise WeightFileError(f"{directory}: file {name} does not match its {CHECKSUM} checksum in {MANIFEST} "
                                  "(damaged after it was written)")


def _manifest_files(directory: Path) -> dict[str, dict]:
    return json.loads((directory / MANIFEST).read_text())["files"]


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
    """All tensors of a weight directory on CPU, after checking its manifest's file list and sizes when it has one."""
    if not directory.is_dir():
        raise WeightFileError(f"{directory}: no such directory")
    if (directory / INCOMPLETE).exists():
        raise WeightFileError(f"{directory}: an unfinished weight dump ({INCOMPLETE} is present); use a finished one")
    if (directory / MANIFEST).is_file():
        check_manifest(directory, checksums=False)
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
    except OSError as err:
        raise OSError(err.errno, f"fsync failed: {err.strerror}", str(path)) from err
    finally:
        os.close(fd)


def seal_weight_dir(directory: Path) -> None:
    """Add each file's checksum to a published dump's manifest (once; the manifest is replaced atomically), then
    fsync every file, the directory and its parent (the rename). `OSError` or `WeightFileError` on failure."""
    directory = Path(directory)
    files = _manifest_files(directory)
    if any(CHECKSUM not in entry for entry in files.values()):
        check_manifest(directory, checksums=False)  # never checksum a file that changed since it was published
        for name, entry in files.items():
            entry[CHECKSUM] = checksum_of(directory / name)
        _write_manifest(directory, files)
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        _fsync(path)
    _fsync(directory)
    _fsync(directory.parent)


def _write_manifest(directory: Path, files: dict[str, dict]) -> None:
    """Write (or replace) the manifest in one rename: a reader sees the old one or the new one, never half."""
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"files": files}, indent=1))
    os.replace(tmp, directory / MANIFEST)


def write_weight_dir(directory: Path, write: Callable[[Path], None]) -> Path:
    """Publish `directory` atomically: `write(tmp)` fills a temporary sibling, the manifest (file sizes) is written
    last, then one rename makes it visible. Neither checksummed nor durable yet: see `seal_weight_dir`."""
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / INCOMPLETE).touch()
    write(tmp)
    files = {
        str(path.relative_to(tmp)): {"size": path.stat().st_size}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file() and p.name != INCOMPLETE)
    }
    _write_manifest(tmp, files)
    (tmp / INCOMPLETE).unlink()
    if directory.exists():
        shutil.rmtree(directory)
    os.rename(tmp, directory)
    return directory
