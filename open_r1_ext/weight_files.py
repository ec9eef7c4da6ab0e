"""The on-disk format of a weight dump: publishing it atomically, sealing it, reading it all-or-nothing.

A dump is a standard transformers directory (safetensors shards `model-0000k-of-0000n.safetensors` and their
index, `config.json`) plus `manifest.json`, written last, that lists every file with its size. It is written in a
temporary sibling `.<name>.tmp-<pid>` (several processes may write shards into it) and appears in one rename, so a
reader sees no directory, an ignored temporary one, or a complete one; every reader checks the manifest's file list
and sizes (free). Temporary directories a crash left behind are removed at the next start (`remove_temporary_dirs`).

`seal_weight_dir` then adds each file's xxh3-128 checksum to the manifest and fsyncs the dump. It is a separate
step so that a trainer runs it in the background after the servers reloaded (`weight_sync.WeightSync` records a
sync only once its dump is sealed): a crash of the machine before the fsync can leave damaged files behind a
published name, and the checksums are what tell them apart when a dump is reused (`check_manifest(checksums=True)`,
e.g. restoring the reference on resume; `check_reloadable` before any reload of a sealed dump). A plain
`save_pretrained` directory without a manifest is read as it is. Files are read with plain reads, never mapped: a
file that shrinks under a mapping (truncated, or a network file system's read error) raises SIGBUS, which kills
the process; a read raises `WeightFileError` naming the file.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import xxhash
from safetensors import SafetensorError

if TYPE_CHECKING:  # torch (~1.5 s to import) comes with safetensors.torch where tensors are read or written: the
    import torch  # launchers and `open-r1-ext status` check dumps and talk to servers without it

MANIFEST = "manifest.json"
INDEX = "model.safetensors.index.json"
# Present while a dump is being written; removed just before the rename that publishes it.
INCOMPLETE = "WRITE_IN_PROGRESS"
TEMPORARY = ".tmp-"  # `.step-7.tmp-<pid>`: a dump being written; removed at the next start if a crash left it
DEFAULT_BUCKET_MB = 1024.0  # a dump's largest shard by default: `sync.bucket_mb` (RemoteGRPOConfig.bucket_mb)
CHECKSUM = "xxh3_128"  # ~10 GB/s in memory here, 9x sha256; it guards against damage, not against an attacker
READ_CHUNK = 4 << 20  # bytes a checksum reads at a time into one reused buffer (xxhash releases the GIL above 64 KiB)
REMEMBERED_CHECKSUMS = 4096  # files whose checksum one process remembers while they do not change


def default_sync_dir(output_dir: str) -> str:
    """Where a run's weight dumps go unless `sync_dir` says otherwise."""
    return f"{output_dir}/weights"


class WeightFileError(ValueError):
    """A weight directory that cannot be loaded; the message names the directory and the problem."""


def checksum_of(path: Path, size: int) -> str:
    """xxh3-128 of a file that must hold `size` bytes (its manifest's), read in chunks of `READ_CHUNK` into one
    buffer (xxhash's streaming API, the GIL released while each chunk is hashed). `WeightFileError` naming the file
    if it cannot be read, or is cut short, grows or is deleted while it is read."""
    digest, buffer = xxhash.xxh3_128(), memoryview(bytearray(max(1, min(size, READ_CHUNK))))
    read = 0
    try:
        with open(path, "rb", buffering=0) as handle:
            while read < size and (count := handle.readinto(buffer[:min(size - read, len(buffer))])):
                digest.update(buffer[:count])
                read += count
            now = os.fstat(handle.fileno())
    except OSError as err:
        raise WeightFileError(f"{path.parent}: cannot read {path.name}: {err.strerror or err}") from err
    if now.st_nlink == 0:
        raise WeightFileError(f"{path.parent}: file {path.name} was deleted while its checksum was computed")
    if read != size or now.st_size != size:
        raise WeightFileError(f"{path.parent}: file {path.name} changed while its checksum was computed: it has "
                              f"{now.st_size} bytes, {MANIFEST} says {size}")
    return digest.hexdigest()


_remembered: dict[tuple, str] = {}  # `remembered_checksum`'s: (path, device, inode, size, mtime, ctime) -> checksum
_remembered_lock = threading.Lock()  # the seal runs on a background thread, the checks before a reload on another


def remembered_checksum(path: Path, size: int, reuse: bool) -> str:
    """`checksum_of`, remembered by this process for a file while it does not change (the same inode, size, mtime and
    ctime); with `reuse`, a file remembered is not read again: `check_reloadable` before each reload (a restore to
    every replica of a pool) reads a dump that this process sealed or verified at most once. Up to
    `REMEMBERED_CHECKSUMS` files, the oldest forgotten first."""
    key = _identity(path)
    with _remembered_lock:
        if reuse and key in _remembered:
            return _remembered[key]
    digest = checksum_of(path, size)
    if _identity(path) == key:  # not changed while it was read
        with _remembered_lock:
            while len(_remembered) >= REMEMBERED_CHECKSUMS:
                del _remembered[next(iter(_remembered))]
            _remembered[key] = digest
    return digest


def _identity(path: Path) -> tuple:
    try:
        found = os.stat(path)
    except OSError as err:
        raise WeightFileError(f"{path.parent}: cannot read {path.name}: {err.strerror or err}") from err
    return os.fspath(path), found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns


def check_manifest(directory: Path, checksums: bool) -> None:
    """Raise `WeightFileError` unless every file in the manifest is present with its size (and, if `checksums`,
    its checksum, each file read: the dump must be sealed)."""
    _check_files(directory, _manifest_files(directory), checksums)


def check_reloadable(directory: Path) -> None:
    """What is checked before a server is asked to load the dump `directory` (`sglang_client`, on every reload):
    its manifest's files and sizes, and their checksums once it is sealed. A dump is reloaded moments after it was
    written, before its seal; a sealed one is being reused (a restored or joining server, a resume), and only the
    checksums tell a damaged file of the right size from a good one: SGLang's scheduler dies on a damaged
    safetensors file. A file this process sealed or verified and that has not changed since is not read again."""
    files = _manifest_files(directory)
    _check_files(directory, files, checksums=all(CHECKSUM in entry for entry in files.values()), reuse=True)


def _check_files(directory: Path, files: dict[str, dict], checksums: bool, reuse: bool = False) -> None:
    for name, expected in files.items():
        path = directory / name
        if not os.path.lexists(path):
            raise WeightFileError(f"{directory}: file {name} listed in {MANIFEST} is missing")
        size = _regular_file(path).stat().st_size
        if size != expected["size"]:
            raise WeightFileError(f"{directory}: file {name} has {size} bytes, {MANIFEST} says {expected['size']}")
        if not checksums:
            continue
        if CHECKSUM not in expected:
            raise WeightFileError(f"{directory}: {MANIFEST} has no {CHECKSUM} checksums: the dump was never sealed "
                                  "(its sync was not logged); use a logged dump")
        if expected[CHECKSUM] != remembered_checksum(path, size, reuse):
            raise WeightFileError(f"{directory}: file {name} does not match its {CHECKSUM} checksum in {MANIFEST} "
                                  "(damaged after it was written)")


def _regular_file(path: Path) -> Path:
    """`path`, if it is a regular file (links followed). Nothing else is ever opened: a FIFO would block the reader
    forever, a device would never end."""
    try:
        mode = path.stat().st_mode
    except OSError as err:
        raise WeightFileError(f"{path.parent}: cannot read {path.name}: {err.strerror}") from err
    if not stat.S_ISREG(mode):
        raise WeightFileError(f"{path.parent}: {path.name} is not a regular file")
    return path


def _read_json(path: Path) -> Any:
    _regular_file(path)
    try:
        return json.loads(path.read_bytes())
    except (ValueError, OSError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise WeightFileError(f"{path.parent}: {path.name} is not valid JSON: {err}") from err


def _file_name(directory: Path, listing: str, name: Any) -> str:
    """`name` from a manifest or index, if it names a file inside `directory` (relative, no `..`)."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise WeightFileError(f"{directory}: {listing} names {name!r}, not a file name inside the directory")
    return name


def _manifest_files(directory: Path) -> dict[str, dict]:
    """The manifest's `files` (name -> `{"size": int, "xxh3_128"?: str}`), checked to have that shape."""
    manifest = _read_json(directory / MANIFEST)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        got = type(files if isinstance(manifest, dict) else manifest).__name__
        raise WeightFileError(f"{directory}: {MANIFEST}: 'files' must be a non-empty object (file name -> size), got {got}")
    for name, entry in files.items():
        _file_name(directory, MANIFEST, name)
        size = entry.get("size") if isinstance(entry, dict) else None
        if type(size) is not int or size < 0:
            raise WeightFileError(f"{directory}: {MANIFEST}: files[{name!r}].size must be a non-negative integer, got {size!r}")
        if not isinstance(entry.get(CHECKSUM, ""), str):
            raise WeightFileError(f"{directory}: {MANIFEST}: files[{name!r}].{CHECKSUM} must be a string")
    return files


def safetensors_files(directory: Path) -> list[Path]:
    """The shards of a transformers directory: those its index names, else every `*.safetensors` file."""
    index = directory / INDEX
    if os.path.lexists(index):
        content = _read_json(index)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightFileError(f"{directory}: {INDEX}: 'weight_map' must be a non-empty object (tensor name -> file), "
                                  f"got {type(weight_map if isinstance(content, dict) else content).__name__}")
        names = sorted({_file_name(directory, INDEX, n) for n in weight_map.values()})
        missing = [n for n in names if not os.path.lexists(directory / n)]
        if missing:
            raise WeightFileError(f"{directory}: shards named in {INDEX} are missing: {', '.join(missing)}")
        return [_regular_file(directory / n) for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightFileError(f"{directory}: no *.safetensors files (is this a transformers model directory?)")
    return [_regular_file(f) for f in files]


def read_weight_dir(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a weight directory on CPU, after checking its manifest's file list and sizes when it has one."""
    if not directory.is_dir():
        raise WeightFileError(f"{directory}: no such directory")
    if (directory / INCOMPLETE).exists():
        raise WeightFileError(f"{directory}: an unfinished weight dump ({INCOMPLETE} is present); use a finished one")
    if os.path.lexists(directory / MANIFEST):
        check_manifest(directory, checksums=False)
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(directory):
        tensors.update(read_shard(path))
    return tensors


def read_shard(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors on CPU, read with a plain read (`safetensors.torch.load` of its bytes; its
    `load_file` maps the file, and a file that shrinks under a mapping kills the process with SIGBUS). Costs a
    second copy of the file in memory while it is parsed, and fresh memory for it (docs/benchmarks.md)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise WeightFileError(f"{path.parent}: cannot read {path.name}: {err.strerror or err}") from err
    from safetensors.torch import load

    try:
        return load(data)
    except (SafetensorError, ValueError) as err:
        raise WeightFileError(f"{path.parent}: cannot read {path.name} (truncated or not safetensors): {err}") from err


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
    fsync every file it lists and itself, the directory and its parent (the rename). `OSError` or `WeightFileError`
    naming the file on failure (one changed or deleted meanwhile among them). The files' fsyncs run on a thread of
    their own while their checksums are computed (both release the GIL): a fresh dump's seal takes about as long as
    writing it back, not that plus reading it; the manifest is fsynced after them."""
    directory = Path(directory)
    files = _manifest_files(directory)
    with ThreadPoolExecutor(1, thread_name_prefix="fsync") as background:
        flushed = background.submit(lambda: [_fsync(directory / name) for name in sorted(files)])
        if any(CHECKSUM not in entry for entry in files.values()):
            check_manifest(directory, checksums=False)  # never checksum a file that changed since it was published
            for name, entry in files.items():
                entry[CHECKSUM] = remembered_checksum(directory / name, entry["size"], reuse=False)
            _write_manifest(directory, files)
        flushed.result()
    _fsync(directory / MANIFEST)
    _fsync(directory)
    _fsync(directory.parent)


def _write_manifest(directory: Path, files: dict[str, dict]) -> None:
    """Write (or replace) the manifest in one rename: a reader sees the old one or the new one, never half."""
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"files": files}, indent=1))
    os.replace(tmp, directory / MANIFEST)


def shard_name(index: int, count: int) -> str:
    """The file name transformers gives shard `index` (0-based) of `count`."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_shard(path: Path, tensors: dict[str, torch.Tensor], durable: bool = False) -> int:
    """Write one safetensors shard (no copy of CPU tensors: safetensors writes from their memory); with `durable`,
    fsync it (a writer on another machine than the one that seals the dump). Returns its bytes of tensor data."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    if durable:
        _fsync(path)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> None:
    """`model.safetensors.index.json`: which shard holds each tensor, as transformers writes it."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX).write_text(json.dumps(index, indent=1))


def temporary_dir(directory: Path) -> Path:
    """Create the temporary sibling a dump of `directory` is written in (marked unfinished), empty."""
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}{TEMPORARY}{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / INCOMPLETE).touch()
    return tmp


def publish(tmp: Path, directory: Path) -> Path:
    """Make the dump written in `tmp` visible as `directory`: the manifest (file sizes) last, then one rename.
    Neither checksummed nor durable yet: see `seal_weight_dir`."""
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


def write_weight_dir(directory: Path, write: Callable[[Path], None]) -> Path:
    """Publish `directory` atomically: `write(tmp)` fills a temporary sibling, then `publish`. If anything fails
    before the rename, the temporary directory is removed and the error raised: nothing half-written stays."""
    directory = Path(directory)
    tmp = temporary_dir(directory)
    try:
        write(tmp)
        return publish(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_temporary_dirs(parent: Path) -> list[Path]:
    """Remove the temporary dumps a crash left in `parent` (never published, never loaded); returns them."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    leftovers = sorted(p for p in parent.iterdir()
                       if p.name.startswith(".") and TEMPORARY in p.name and p.is_dir() and not p.is_symlink())
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


def is_disk_full(error: BaseException) -> bool:
    """True for 'no space left on device' (or over a quota), whoever raised it: `OSError` from Python,
    `SafetensorError` (its message carries the OS error), or an error caused by one of them."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if re.search(r"No space left on device|Disk quota exceeded|os error (28|122)\b", str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False
