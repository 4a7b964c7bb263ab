"""The results store: append-only JSON lines, one record per measured configuration.

A record is ``Measurement.to_dict()`` plus where and how it was measured:
``env`` (device name, CPU/GPU model, versions, git commit and dirty flag,
host, UTC date: `environment`), ``params`` (the configuration as requested:
model, mom, batch_size, device, precision, size, budget, steps, warmup,
seed), ``fingerprint`` (the part of ``env`` that changes what is measured)
and ``key`` (a hash of params and fingerprint: `config_key`). A sweep skips a
configuration whose key is already recorded, which is what makes it resumable.

Durability: a record is one line written by one ``os.write`` on an
``O_APPEND`` descriptor, then fsync'd, under an exclusive ``fcntl.flock`` on
``<store>.lock``, so concurrent writers never interleave and a line is either
all there or (killed mid-write, in principle) a trailing fragment without its
newline. Readers ignore such a fragment; the next writer cuts it off before
appending. Under the same lock a writer re-reads what others appended and
refuses a key already present, so two sweeps on one store record each
configuration once.

Workers (momlab.launch) do not share that lock: on a shared filesystem
(NFS, Lustre) flock may not exclude across hosts. Each worker appends only
to its own shard, ``<stem>.shards/<run>-w<i>.jsonl``, of which it is the one
writer; a `Store` reads the main file and every shard as one store, a key
counting once (the first file read that has it: the main file, then shards
by name). At the end of a launch the driver, one process, moves its shards'
records into the main file (`compact`) and deletes them, so results/ keeps
one file per store; killed between the two, the records are in both and
still read once, and the next `compact` skips them.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import warnings
from contextlib import contextmanager
from pathlib import Path

from momlab.moms import parse_mom
from momlab.units import parse_bytes
from momlab.workload import STACK_DEFAULTS

# What changes a measurement, and so separates otherwise equal configurations.
FINGERPRINT_KEYS = ("device", "device_name", "cpu", "gpu", "threads", "torch", "transformers")
PARAM_KEYS = ("model", "mom", "batch_size", "device", "precision", "size", "budget", "steps", "warmup", "seed")
# settings added later, with their defaults: part of the key only when not the default, so the keys of
# records stored before them stay what they were (a resumed sweep still skips them)
OPTIONAL_PARAMS = dict(STACK_DEFAULTS)
_FLATTEN = ("size", "env")


def environment(device="cpu") -> dict:
    """Where a record is measured: device, CPU/GPU model, versions, commit, host, UTC date.

    The same stamp `measure` puts in ``Measurement.env`` (momlab.provenance).

    >>> sorted(environment("cpu"))[:4]
    ['commit', 'cpu', 'cuda', 'date']
    """
    from momlab.provenance import environment as stamp

    return stamp(device)


def fingerprint(env: dict) -> dict:
    """The parts of an environment stamp that change what is measured (not date, host or commit)."""
    return {k: env.get(k) for k in FINGERPRINT_KEYS}


def canonical_params(params: dict) -> dict:
    """A configuration in one spelling: budget in bytes, the MOM canonical (`momlab.moms.Mom`), size sorted."""
    missing = [k for k in PARAM_KEYS if k not in params]
    if missing:
        raise ValueError(f"configuration lacks {', '.join(missing)}; a configuration has {', '.join(PARAM_KEYS)}")
    p = {k: params[k] for k in PARAM_KEYS}
    if not isinstance(p["model"], str):  # a transformers config or a user's module: its name
        p["model"] = p["model"].name
    p["mom"] = str(parse_mom(p["mom"]))  # quant4+ckpt == ckpt+quant4 (API.md)
    p["budget"] = None if p["budget"] is None else parse_bytes(p["budget"])
    p["size"] = {k: p["size"][k] for k in sorted(p["size"] or {})}
    for k, default in OPTIONAL_PARAMS.items():
        if params.get(k, default) != default:
            p[k] = params[k]
    return p


def config_key(params: dict, env: dict) -> str:
    """Identity of a configuration measured in an environment (hex digest of params + fingerprint).

    >>> p = dict(model="gpt2", mom="quant4+ckpt", batch_size=8, device="cpu", precision="fp32",
    ...          size={}, budget="1GiB", steps=3, warmup=1, seed=0)
    >>> config_key(p, {"torch": "2.13"}) == config_key({**p, "mom": "ckpt+quant4", "budget": 2**30},
    ...                                                 {"torch": "2.13", "host": "elsewhere"})
    True
    """
    p = canonical_params(params)
    # the key hashes the MOM's parts sorted by name, as stores written before the canonical order did:
    # a store's points keep their keys (the spelling is the same thing either way)
    p["mom"] = "+".join(sorted(p["mom"].split("+")))
    blob = json.dumps({"params": p, "fingerprint": fingerprint(env)}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def make_record(measurement, params: dict, env: dict, **extra) -> dict:
    """The line stored for `measurement`, run as `params` in environment `env`.

    ``env`` of the record is the measurement's own stamp where it has one (it
    is taken when measuring), else `env`; ``fingerprint`` and ``key`` always
    come from `env`, the environment the sweep planned with.
    """
    d = measurement.to_dict()
    d["env"] = {**env, **(d.get("env") or {})}
    d["params"] = canonical_params(params)
    d["fingerprint"] = fingerprint(env)
    d["key"] = config_key(params, env)
    d.update(extra)
    return d


def _parse_lines(data: bytes, where: str, first_line: int = 1) -> tuple[list[dict], int]:
    """Records in the complete lines of `data`, and how many bytes those lines span."""
    end = data.rfind(b"\n") + 1  # bytes after the last newline: a line still being written (or cut)
    records = []
    for i, line in enumerate(data[:end].split(b"\n")[:-1], start=first_line):
        s = line.strip()
        if not s or s.startswith(b"#"):
            continue
        try:
            rec = json.loads(s)
        except ValueError:
            warnings.warn(f"{where}:{i}: skipping a line that is not JSON", stacklevel=3)
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records, end


def shards_dir(path) -> Path:
    """Where workers of a launch keep their shards of the store at `path`: ``<stem>.shards/``."""
    p = Path(path)
    return p.with_name((p.name[:-6] if p.name.endswith(".jsonl") else p.name) + ".shards")


class _Tail:
    """One file read incrementally: the complete lines appended since the last read."""

    def __init__(self, path: Path):
        self.path, self.offset, self.lines = path, 0, 0

    def read(self) -> list[dict] | None:
        """New records; None when the file shrank below what was read (replaced or cut: read all again)."""
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:
                    return None
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        new, used = _parse_lines(data, str(self.path), self.lines + 1)
        self.offset += used
        self.lines += data[:used].count(b"\n")
        return new


def _cut_fragment(path: Path) -> None:
    # A trailing line without its newline can only be a write that was killed; appending
    # after it would glue two records into one bad line, so it goes (it was never complete).
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        return
    with open(path, "rb") as f:
        f.seek(max(0, size - 1))
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
    os.truncate(path, data.rfind(b"\n") + 1)


def _write_line(path: Path, data: bytes) -> None:
    created = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        while written < len(data):  # regular files take it all at once; be sure anyway
            written += os.write(fd, data[written:])
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:  # make the new directory entry durable too
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


class Store:
    """One store of records: its JSON-lines file and its workers' shards, appended atomically, read incrementally.

    `shard` names the shard this Store appends to (a worker's own file, no
    lock); without it appends go to the main file under the lock. `shards`
    False reads the main file alone.
    """

    def __init__(self, path, *, shard: str | None = None, shards: bool = True):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.shard_path = None if shard is None else shards_dir(self.path) / f"{shard}.jsonl"
        self.read_shards = shards
        self._reset()

    def _reset(self) -> None:
        self._tails: dict[Path, _Tail] = {}
        self._records: list[dict] = []
        self._by_key: dict[str, dict] = {}
        self._origin: dict[str, Path] = {}

    @contextmanager
    def _locked(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def files(self) -> list[Path]:
        """The main file, then the shards by name (the order a key's first record wins in)."""
        shards = sorted(shards_dir(self.path).glob("*.jsonl")) if self.read_shards else []
        return [self.path, *shards]

    def refresh(self) -> "Store":
        """Read what was appended since the last read (complete lines only)."""
        files = self.files()
        for path in files:
            tail = self._tails.setdefault(path, _Tail(path))
            new = tail.read()
            if new is None:
                self._reset()
                return self.refresh()
            for rec in new:
                key = rec.get("key")
                if key is not None and self._origin.get(key, path) != path:
                    continue  # the same record in another file: a shard being compacted
                self._records.append(rec)
                if key is not None:
                    self._by_key.setdefault(key, rec)
                    self._origin.setdefault(key, path)
        for path in [p for p in self._tails if p not in files]:
            del self._tails[path]  # a compacted shard: its records stay read (they are in the main file now)
        return self

    def records(self) -> list[dict]:
        return list(self.refresh()._records)

    def get(self, key: str) -> dict | None:
        return self.refresh()._by_key.get(key)

    def keys(self, env: dict | None = None) -> set[str]:
        """Keys recorded (only those measured with `env`'s fingerprint, when given)."""
        self.refresh()
        if env is None:
            return set(self._by_key)
        fp = fingerprint(env)
        return {k for k, r in self._by_key.items() if r.get("fingerprint") == fp}

    def append(self, record: dict, *, unique: bool = True) -> bool:
        """Append one record atomically; with `unique`, refuse (return False) a key already stored."""
        data = (json.dumps(record, sort_keys=True, allow_nan=True) + "\n").encode()
        if self.shard_path is not None:
            # one writer per shard: no lock needed (nor trusted, on a shared filesystem)
            self.shard_path.parent.mkdir(parents=True, exist_ok=True)
            _cut_fragment(self.shard_path)
            if unique and record.get("key") is not None and self.get(record["key"]) is not None:
                return False
            _write_line(self.shard_path, data)
            self.refresh()
            return True
        with self._locked():
            _cut_fragment(self.path)
            self.refresh()
            if unique and record.get("key") is not None and record["key"] in self._by_key:
                return False
            _write_line(self.path, data)
            self.refresh()
        return True


def compact(path, prefix: str = "") -> int:
    """Move the records of the shards whose names start with `prefix` into the main file; delete the shards.

    Run by one process, when no worker writes those shards any more (a sweep's
    driver after its workers ended). Returns how many records moved; a record
    whose key the main file has already is dropped, not copied twice.
    """
    main = Store(path, shards=False)
    moved = 0
    for shard in sorted(shards_dir(path).glob(f"{prefix}*.jsonl")):
        _cut_fragment(shard)
        for rec in _Tail(shard).read() or []:
            moved += main.append(rec, unique=True)
        shard.unlink()
    d = shards_dir(path)
    if d.exists() and not any(d.iterdir()):
        d.rmdir()
    return moved


def append(path, record: dict, *, unique: bool = True) -> bool:
    """Append `record` to the store at `path` (see `Store.append`)."""
    return Store(path).append(record, unique=unique)


def read_records(path) -> list[dict]:
    """Every complete record in the store at `path` (a missing file has none)."""
    return Store(path).records()


def recorded_keys(path, env: dict | None = None) -> set[str]:
    """Keys of the configurations recorded at `path` in `env`'s fingerprint (all, when env is None)."""
    return Store(path).keys(env)


def to_frame(records: list[dict]):
    """Records as a DataFrame: one row each, ``size`` and ``env`` also flattened (``size.num_layers``)."""
    import pandas as pd

    from momlab.record import Measurement

    rows = []
    for rec in records:
        row = dict(rec)
        for name in _FLATTEN:
            for k, v in (rec.get(name) or {}).items():
                row[f"{name}.{k}"] = v
        rows.append(row)
    if not rows:
        return pd.DataFrame(columns=[f.name for f in dataclasses.fields(Measurement)])
    return pd.DataFrame(rows)


def load(path, *, missing_ok: bool = False, run: str | None = None, env: dict | None = None):
    """The store at `path` (or several paths) as a DataFrame; see `to_frame`.
    A store not written yet raises FileNotFoundError, or reads as empty with `missing_ok`.
    `run` keeps only the records a sweep of that name measured (`sweep(name=...)`); `env` only those measured
    with its fingerprint (`environment(device)`: this machine's, as a resumed sweep reuses them), so a store
    that also holds another machine's runs of the same configurations yields one set.

    >>> df = load("results/s1_cpu.jsonl")  # doctest: +SKIP
    >>> df[["model", "mom", "batch_size", "size.num_layers", "fits", "throughput"]]  # doctest: +SKIP
    """
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    records = []
    for p in paths:
        if not Path(p).exists():
            if missing_ok:
                continue
            raise FileNotFoundError(f"no results store at {p}")
        records.extend(r for r in read_records(p) if run is None or (r.get("run") or {}).get("name") == run)
    if env is not None:
        fp = fingerprint(env)
        records = [r for r in records if r.get("fingerprint") == fp]
    return to_frame(records)
