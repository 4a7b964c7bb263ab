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

from momlab.units import parse_bytes

# What changes a measurement, and so separates otherwise equal configurations.
FINGERPRINT_KEYS = ("device", "device_name", "cpu", "gpu", "threads", "torch", "transformers")
PARAM_KEYS = ("model", "mom", "batch_size", "device", "precision", "size", "budget", "steps", "warmup", "seed")
# settings added later, with their defaults: part of the key only when not the default, so the keys of
# records stored before them stay what they were (a resumed sweep still skips them)
OPTIONAL_PARAMS = {"attention": None, "setup": "default"}
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
    """A configuration in one spelling: budget in bytes, MOM parts sorted, size sorted."""
    missing = [k for k in PARAM_KEYS if k not in params]
    if missing:
        raise ValueError(f"configuration lacks {', '.join(missing)}; a configuration has {', '.join(PARAM_KEYS)}")
    p = {k: params[k] for k in PARAM_KEYS}
    p["mom"] = "+".join(sorted(str(p["mom"]).split("+")))  # quant4+ckpt == ckpt+quant4 (API.md)
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
    blob = json.dumps({"params": canonical_params(params), "fingerprint": fingerprint(env)}, sort_keys=True,
                      separators=(",", ":"))
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


class Store:
    """One JSON-lines file of records, appended atomically and read incrementally."""

    def __init__(self, path):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._offset = 0
        self._lines = 0
        self._records: list[dict] = []
        self._by_key: dict[str, dict] = {}

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

    def refresh(self) -> "Store":
        """Read what was appended since the last read (complete lines only)."""
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self._offset:  # replaced or cut below what we had read: start over
                    self.__init__(self.path)
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self
        new, used = _parse_lines(data, str(self.path), self._lines + 1)
        self._offset += used
        self._lines += data[:used].count(b"\n")
        for rec in new:
            self._records.append(rec)
            if "key" in rec:
                self._by_key.setdefault(rec["key"], rec)
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

    def _cut_fragment(self) -> None:
        # A trailing line without its newline can only be a write that was killed; appending
        # after it would glue two records into one bad line, so it goes (it was never complete).
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size == 0:
            return
        with open(self.path, "rb") as f:
            f.seek(max(0, size - 1))
            if f.read(1) == b"\n":
                return
            f.seek(0)
            data = f.read()
        os.truncate(self.path, data.rfind(b"\n") + 1)

    def append(self, record: dict, *, unique: bool = True) -> bool:
        """Append one record atomically; with `unique`, refuse (return False) a key already stored."""
        data = (json.dumps(record, sort_keys=True, allow_nan=True) + "\n").encode()
        with self._locked():
            self._cut_fragment()
            self.refresh()
            if unique and record.get("key") is not None and record["key"] in self._by_key:
                return False
            created = not self.path.exists()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                written = os.write(fd, data)
                while written < len(data):  # regular files take it all at once; be sure anyway
                    written += os.write(fd, data[written:])
                os.fsync(fd)
            finally:
                os.close(fd)
            if created:  # make the new directory entry durable too
                dfd = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            self.refresh()
        return True


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


def load(path, *, missing_ok: bool = False, run: str | None = None):
    """The store at `path` (or several paths) as a DataFrame; see `to_frame`.
    A store not written yet raises FileNotFoundError, or reads as empty with `missing_ok`.
    `run` keeps only the records a sweep of that name measured (`sweep(name=...)`).

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
    return to_frame(records)
