"""Reading a weight dump while its files are cut short or deleted: the seal, the checksum check and the built-in
server's load raise `WeightFileError` naming the file, and the process lives on. Each case runs in a child process,
so that a SIGBUS (what reading a file through a mapping did when the file shrank under it) fails the test instead of
killing pytest."""

import contextlib
import json
import multiprocessing
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import save_file

from open_r1_ext import weight_files
from open_r1_ext.weight_files import (MANIFEST, READ_CHUNK, WeightFileError, check_manifest, check_reloadable,
                                      read_weight_dir, seal_weight_dir, write_weight_dir)

SHARD = "model.safetensors"
SHARD_BYTES = 3 * READ_CHUNK  # several reads of a checksum (and many pages of a mapping)
DAMAGES = ("truncate", "delete")
ROUNDS = 8  # of each damage and operation


def make_shard(directory: Path) -> Path:
    """A safetensors file of `SHARD_BYTES` of tensor data, and a config beside it: what a dump is written from."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"weight": torch.arange(SHARD_BYTES // 4, dtype=torch.float32)}, str(directory / SHARD))
    (directory / "config.json").write_text("{}")
    return directory


def fresh_dump(source: Path, target: Path) -> Path:
    return write_weight_dir(target, lambda tmp: [shutil.copy(p, tmp) for p in source.iterdir()])


def damage(path: Path, how: str) -> None:
    if how == "truncate":
        with open(path, "r+b") as handle:
            handle.truncate(path.stat().st_size // 2)
    else:
        path.unlink()


class DamagingXXHash:
    """Stands in for the `xxhash` module in `weight_files`: the first time a piece of the shard (a large buffer: a
    chunk read, or the whole file when it is mapped) is handed to xxh3-128, the shard is cut short or deleted first,
    so that the damage always lands while the checksum is being computed."""

    def __init__(self, shard: Path, how: str):
        self.shard, self.how, self.done = shard, how, False

    def xxh3_128(self, data=b""):
        digest = _Digest(self)
        if len(data):
            digest.update(data)
        return digest

    def damage_once(self, data) -> None:
        if not self.done and len(data) >= READ_CHUNK // 2:
            self.done = True
            damage(self.shard, self.how)


class _Digest:
    def __init__(self, owner: DamagingXXHash):
        self.owner, self.real = owner, xxhash.xxh3_128()

    def update(self, data) -> None:
        self.owner.damage_once(data)
        self.real.update(data)

    def hexdigest(self) -> str:
        return self.real.hexdigest()


def outcome(fn, *args) -> str:
    try:
        fn(*args)
    except (WeightFileError, OSError) as err:
        return f"{type(err).__name__}: {err}"
    return "ok"


def damaged_while_hashing(work: str, out: str) -> None:
    """Child: for each damage and each of seal and verify, `ROUNDS` fresh dumps whose shard is damaged while its
    checksum is computed; one JSON line per round in `out`, written as it goes (a SIGBUS ends the file early)."""
    work_dir = Path(work)
    source = make_shard(work_dir / "source")
    with open(out, "w") as lines:
        for how in DAMAGES:
            for operation in ("seal", "verify"):
                for index in range(ROUNDS):
                    dump = fresh_dump(source, work_dir / f"{how}-{operation}-{index}")
                    if operation == "verify":
                        seal_weight_dir(dump)
                    weight_files.xxhash = DamagingXXHash(dump / SHARD, how)
                    try:
                        if operation == "seal":
                            result = outcome(seal_weight_dir, dump)
                        else:
                            result = outcome(check_manifest, dump, True)
                    finally:
                        weight_files.xxhash = xxhash
                    lines.write(json.dumps({"how": how, "operation": operation, "dump": str(dump), "outcome": result}) + "\n")
                    lines.flush()
                    shutil.rmtree(dump)


def read_while_watched(work: str, out: str, connection) -> None:
    """Child: seal, verify and load (`read_weight_dir`, the built-in server's reload) fresh dumps, `2 * ROUNDS` of
    each; before each read it sends the shard's path to the parent, which damages the shard as soon as this process
    has it open or mapped; the child waits for the parent to watch, and to stop watching before the dump is removed.
    One JSON line per round in `out`, as above."""
    work_dir = Path(work)
    source = make_shard(work_dir / "source")
    operations = {"seal": seal_weight_dir, "verify": lambda d: check_manifest(d, True), "load": read_weight_dir}
    with open(out, "w") as lines:
        for index in range(2 * ROUNDS):
            for name, operation in operations.items():
                how = DAMAGES[index % 2]
                dump = fresh_dump(source, work_dir / f"{name}-{index}")
                if name == "verify":
                    seal_weight_dir(dump)
                connection.send((str(dump / SHARD), how))
                connection.recv()  # watching
                result = outcome(operation, dump)
                connection.send(None)
                connection.recv()  # no longer watching: the dump may go
                lines.write(json.dumps({"how": how, "operation": name, "dump": str(dump), "outcome": result}) + "\n")
                lines.flush()
                shutil.rmtree(dump)
    connection.send("done")


def holds(pid: int, path: str) -> bool:
    """Whether process `pid` has `path` open or mapped (/proc)."""
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                    return True
        with open(f"/proc/{pid}/maps") as maps:
            return path in maps.read()
    except OSError:  # the child ended
        return False


def damage_while_held(child, connection) -> None:
    """Parent side of `read_while_watched`: per round, watch the child until it holds the shard (or the round ends)
    and damage it then."""
    while (message := connection.recv()) != "done":
        path, how = message
        connection.send("watching")
        while not connection.poll():
            if holds(child.pid, path):
                damage(Path(path), how)
                break
        connection.recv()
        connection.send("round over")


def run_child(target, tmp_path: Path, parent=None) -> list[dict]:
    """Run `target(work, out[, connection])` in a fresh process, and `parent(child, connection)` here meanwhile;
    the child's rounds, once it exited normally."""
    out, context = tmp_path / "rounds.jsonl", multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=target, args=(str(tmp_path), str(out), *([theirs] if parent else [])))
    child.start()
    theirs.close()  # the child's end: once the child is gone, a read here ends (EOFError) instead of waiting
    if parent is not None:
        with contextlib.suppress(EOFError):  # the child died: its exit status says how
            parent(child, ours)
    child.join(timeout=240)
    rounds = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if child.exitcode is None:
        child.kill()
        child.join()
    died = f"killed by {signal.Signals(-child.exitcode).name}" if (child.exitcode or 0) < 0 else f"exit {child.exitcode}"
    assert child.exitcode == 0, f"the child process {died} after {len(rounds)} round(s)"
    return rounds


def test_a_file_cut_short_or_deleted_while_its_checksum_is_computed_is_named(tmp_path):
    """The shard of a fresh dump truncated or deleted while the seal or the check of a sealed dump hashes it, 8
    times each: every time `WeightFileError` names the dump and the file, and says what happened. (Through a
    mapping, the truncated file killed the process with SIGBUS; a deleted one was sealed as if whole.)"""
    rounds = run_child(damaged_while_hashing, tmp_path)
    assert len(rounds) == len(DAMAGES) * 2 * ROUNDS
    for entry in rounds:
        what = "was deleted" if entry["how"] == "delete" else "changed"
        assert re.fullmatch(rf"WeightFileError: {re.escape(entry['dump'])}: file {SHARD} {what} while its checksum "
                            r"was computed.*", entry["outcome"]), entry


def test_a_file_cut_short_or_deleted_by_another_process_while_read_is_named(tmp_path):
    """Another process truncates or deletes the shard as soon as it sees it open or mapped by the seal, the check of
    a sealed dump or the built-in server's load (`read_weight_dir`), 16 times each: each read ends normally (the
    damage came after it) or with `WeightFileError` (or, for a file deleted before the seal's fsync,
    `FileNotFoundError`) naming the dump and the shard, and the process lives on. (Through mappings, the hash and
    safetensors' `load_file`, a truncation killed the process with SIGBUS.)"""
    rounds = run_child(read_while_watched, tmp_path, damage_while_held)
    assert len(rounds) == 3 * 2 * ROUNDS
    for entry in rounds:
        named = rf"WeightFileError: {re.escape(entry['dump'])}: |FileNotFoundError: .*'{re.escape(entry['dump'])}/{SHARD}'"
        assert entry["outcome"] == "ok" or re.match(named, entry["outcome"]), entry


def test_checksum_is_of_the_whole_file_read_in_chunks(tmp_path):
    """The streamed checksum is xxh3-128 of the whole file (several reads), as one call over its bytes gives; a file
    holding more bytes than its manifest says is refused, not hashed in part."""
    dump = fresh_dump(make_shard(tmp_path / "source"), tmp_path / "step-1")
    seal_weight_dir(dump)
    for name, entry in json.loads((dump / MANIFEST).read_text())["files"].items():
        assert entry[weight_files.CHECKSUM] == xxhash.xxh3_128((dump / name).read_bytes()).hexdigest()
    check_manifest(dump, checksums=True)
    size = (dump / SHARD).stat().st_size
    with open(dump / SHARD, "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(WeightFileError, match=rf"{re.escape(str(dump))}: file {SHARD} changed while its checksum was "
                                              rf"computed: it has {size + 1} bytes, {MANIFEST} says {size}"):
        weight_files.checksum_of(dump / SHARD, size)


def test_a_dump_checked_before_each_reload_is_read_once_while_unchanged(tmp_path, monkeypatch):
    """`check_reloadable` (before every reload: a restore reloads each replica of a pool) reads no file that this
    process sealed or verified and that has not changed since; a file rewritten since, even with the same size, is
    read again and its damage found. `check_manifest(checksums=True)` always reads."""
    dump = fresh_dump(make_shard(tmp_path / "source"), tmp_path / "step-1")
    seal_weight_dir(dump)
    reads = []
    real = weight_files.checksum_of
    monkeypatch.setattr(weight_files, "checksum_of", lambda path, size: reads.append(path.name) or real(path, size))
    for _ in range(3):
        check_reloadable(dump)
    assert reads == []
    check_manifest(dump, checksums=True)
    assert sorted(reads) == sorted(json.loads((dump / MANIFEST).read_text())["files"])
    reads.clear()
    with open(dump / SHARD, "r+b") as handle:  # the same size, one byte changed
        handle.seek(SHARD_BYTES // 2)
        handle.write(b"\xff")
    with pytest.raises(WeightFileError, match=rf"file {SHARD} does not match its xxh3_128 checksum"):
        check_reloadable(dump)
    assert reads == [SHARD]
