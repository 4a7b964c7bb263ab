"""The results store and sweeps: atomic appends, resumable sweeps, kill -9 safety.

Sweeps here run a fake measure (test_search.fake_measure: memory a known
function of batch and size); the kill test runs the sweep in a subprocess
whose measure sleeps, kills it with SIGKILL mid-run, resumes, and checks
every point is recorded exactly once and no line is partial.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from momlab import results
from momlab.record import Measurement
from momlab.results import Store, config_key, fingerprint, load, make_record, recorded_keys
from momlab.sweep import auto_points, read_params, search_store_path, sweep, sweep_from_file
from test_search import BASE, CALLS, budget_for, fake_measure

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
ENV = {"device": "cpu", "device_name": "test-cpu", "cpu": "test-cpu", "gpu": None, "threads": 2,
       "torch": "2.13.0+cpu", "transformers": "5.24.0", "host": "h1", "date": "2026-01-01T00:00:00+00:00"}


def params(**kw) -> dict:
    p = dict(model="fake", mom="exact", batch_size=4, device="cpu", precision="fp32", size={}, budget=None,
             steps=3, warmup=1, seed=0)
    p.update(kw)
    return p


def slow_measure(model, mom="exact", **kw) -> Measurement:
    """fake_measure, slowed by MOMLAB_TEST_SLEEP seconds (so a kill lands mid-sweep)."""
    time.sleep(float(os.environ.get("MOMLAB_TEST_SLEEP", "0")))
    return fake_measure(model, mom, **kw)


@pytest.fixture(autouse=True)
def _clear_calls():
    CALLS.clear()


def lines_of(path) -> list[bytes]:
    data = Path(path).read_bytes()
    assert data == b"" or data.endswith(b"\n"), "a partial line was left behind"
    return data.splitlines()


# -- keys and records -----------------------------------------------------------------

def test_config_key_identifies_a_configuration_in_an_environment():
    k = config_key(params(budget="1GiB", mom="quant4+ckpt"), ENV)
    assert k == config_key(params(budget=2**30, mom="ckpt+quant4"), ENV)  # same thing, other spelling
    assert k == config_key(params(budget="1GiB", mom="quant4+ckpt"), {**ENV, "host": "h2", "date": "later"})
    for other in (params(budget="1GiB", mom="quant4+ckpt", steps=1), params(budget="2GiB", mom="quant4+ckpt"),
                  params(budget="1GiB", mom="quant4+ckpt", size={"num_layers": 2}),
                  params(budget="1GiB", mom="quant4+ckpt", batch_size=5)):
        assert config_key(other, ENV) != k
    for changed in ({"torch": "2.14.0"}, {"device_name": "NVIDIA H100"}, {"threads": 1}):
        assert config_key(params(budget="1GiB", mom="quant4+ckpt"), {**ENV, **changed}) != k
    with pytest.raises(ValueError, match="lacks steps"):
        config_key({k: v for k, v in params().items() if k != "steps"}, ENV)


def test_environment_stamp():
    env = results.environment("cpu")
    for k in ("device", "device_name", "cpu", "torch", "transformers", "momlab", "commit", "dirty", "host", "date"):
        assert k in env
    assert env["device"] == "cpu" and env["date"].endswith("+00:00")
    assert set(fingerprint(env)) == set(results.FINGERPRINT_KEYS)


def record(batch_size=4, env=ENV, **kw):
    m = fake_measure("fake", batch_size=batch_size, budget=budget_for(6))
    return make_record(m, params(batch_size=batch_size, budget=budget_for(6), **kw), env)


def test_record_roundtrip_with_nan(tmp_path):
    store = tmp_path / "r.jsonl"
    ok, oom = record(4), record(7)
    assert results.append(store, ok) and results.append(store, oom)
    back = results.read_records(store)
    assert [r["key"] for r in back] == [ok["key"], oom["key"]]
    assert math.isnan(back[1]["throughput"]) and back[1]["fits"] is False
    assert Measurement.from_dict(back[0]) == Measurement.from_dict(ok)
    assert back[0]["env"]["host"] == "h1" and back[0]["params"]["batch_size"] == 4


def test_append_refuses_a_recorded_key(tmp_path):
    store = tmp_path / "r.jsonl"
    assert results.append(store, record(4))
    assert not results.append(store, record(4))
    assert len(lines_of(store)) == 1
    assert results.append(store, record(4), unique=False)  # explicit duplicates are possible
    assert len(lines_of(store)) == 2


def test_reader_ignores_a_trailing_fragment_and_the_next_append_cuts_it(tmp_path):
    store = tmp_path / "r.jsonl"
    results.append(store, record(1))
    with open(store, "ab") as f:  # what a writer killed mid-line would leave
        f.write(json.dumps(record(2))[:57].encode())
    assert [r["batch_size"] for r in results.read_records(store)] == [1]
    results.append(store, record(3))
    assert [json.loads(x)["batch_size"] for x in lines_of(store)] == [1, 3]


def test_recorded_keys_by_environment(tmp_path):
    store = tmp_path / "r.jsonl"
    a, b = record(1), record(2, env={**ENV, "torch": "2.14.0"})
    results.append(store, a)
    results.append(store, b)
    assert recorded_keys(store, ENV) == {a["key"]}
    assert recorded_keys(store, {**ENV, "torch": "2.14.0"}) == {b["key"]}
    assert recorded_keys(store) == {a["key"], b["key"]}
    assert recorded_keys(tmp_path / "missing.jsonl", ENV) == set()


def test_load_flattens_size(tmp_path):
    store = tmp_path / "r.jsonl"
    results.append(store, record(2, size={"num_layers": 3}))
    m = fake_measure("fake", batch_size=2, budget=10**6, num_layers=3, hidden_size=128)
    results.append(store, make_record(m, params(batch_size=2, size={"num_layers": 3, "hidden_size": 128}), ENV))
    df = load(store)
    assert list(df["batch_size"]) == [2, 2]
    assert list(df["size.hidden_size"].fillna(0)) == [0, 128]
    assert df["size"].iloc[1] == {"num_layers": 3, "hidden_size": 128}
    assert df["env.host"].iloc[0] == "h1"
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.jsonl")
    assert "peak_bytes" in results.to_frame([]).columns


def test_load_keeps_one_machine_s_runs_of_a_store_two_machines_wrote(tmp_path):
    """A committed store measured on one CPU, resumed on another, holds both machines' runs of the same points
    (their fingerprints differ, so the resumed sweep measured again); a summary over both has two rows per
    (model, MOM). `env` keeps the runs of the machine it describes."""
    from momlab import metrics

    store = tmp_path / "r.jsonl"
    other = {**ENV, "cpu": "other-cpu", "device_name": "other-cpu", "host": "h2"}
    for env in (ENV, other):
        for b in (2, 4, 7):
            results.append(store, {**record(b, env=env), "run": {"name": "s1"}})
    assert len(load(store, run="s1")) == 6
    assert len(metrics.s1_summary(load(store, run="s1"))) == 2  # the same configuration, once per machine
    mine = load(store, run="s1", env=other)
    assert len(mine) == 3 and set(mine["env.host"]) == {"h2"}
    assert len(metrics.s1_summary(mine)) == 1
    assert load(store, env={**ENV, "torch": "2.11.0"}).empty


def _append_many(path, writer, n, pad):
    store = Store(path)
    for i in range(n):
        assert store.append({"key": f"{writer}-{i}", "writer": writer, "i": i, "pad": "x" * pad})


def test_concurrent_appends_never_interleave(tmp_path):
    store = tmp_path / "r.jsonl"
    ctx = multiprocessing.get_context("fork")
    # 20 kB lines: above PIPE_BUF, so only the lock keeps writers from interleaving
    procs = [ctx.Process(target=_append_many, args=(store, w, 25, 20_000)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    recs = [json.loads(x) for x in lines_of(store)]
    assert len(recs) == 100 and len({r["key"] for r in recs}) == 100
    for w in range(4):  # each writer's records in its own order
        assert [r["i"] for r in recs if r["writer"] == w] == list(range(25))


# -- sweeps with a fake measure ----------------------------------------------------------

def test_sweep_explicit_batches_records_and_resumes(tmp_path):
    store = tmp_path / "s.jsonl"
    kw = dict(batch_sizes=[1, 2, 40], budget=budget_for(12), store=store, progress=False, measure_fn=fake_measure)
    df = sweep(["fake"], ["exact", "ckpt"], **kw)
    assert list(zip(df["mom"], df["batch_size"], df["fits"])) == [
        ("exact", 1, True), ("exact", 2, True), ("exact", 40, False),
        ("ckpt", 1, True), ("ckpt", 2, True), ("ckpt", 40, True)]
    assert len(CALLS) == 6 and len(lines_of(store)) == 6
    assert set(df["scan"]) == {"batch_size"} and set(df["role"]) == {"point"}
    assert all(c["steps"] == 3 and c["warmup"] == 1 for c in CALLS)
    CALLS.clear()
    again = sweep(["fake"], ["exact", "ckpt"], **kw)
    assert CALLS == [] and len(lines_of(store)) == 6  # everything was recorded: nothing runs
    assert (again.attrs["measured"], again.attrs["skipped"], again.attrs["store"]) == (0, 6, str(store))
    assert list(again["key"]) == list(df["key"])
    sweep(["fake"], ["exact", "ckpt"], **{**kw, "batch_sizes": [1, 2, 3]})
    assert [c["batch_size"] for c in CALLS] == [3, 3]  # only the new points


def test_sweep_auto_measures_a_geometric_grid_to_the_oom(tmp_path):
    store = tmp_path / "s.jsonl"
    budget = budget_for(12)  # exact fits 12; ckpt (a quarter per sample) fits 48
    df = sweep("fake", ["exact", "ckpt"], batch_sizes="auto", budget=budget, steps=2, store=store,
               progress=False, measure_fn=fake_measure)
    exact, ckpt = df[df["mom"] == "exact"], df[df["mom"] == "ckpt"]
    assert list(exact["batch_size"]) == [1, 2, 4, 8, 12, 13]
    assert list(exact["fits"]) == [True] * 5 + [False]
    assert list(ckpt["batch_size"]) == [1, 2, 4, 8, 16, 32, 48, 49]
    trials = results.read_records(search_store_path(store))
    assert search_store_path(store).name == "s.search.jsonl"
    assert [r["batch_size"] for r in trials if r["mom"] == "exact"] == [1, 2, 4, 8, 16, 12, 14, 13]
    assert {r["params"]["steps"] for r in trials} == {1}  # search trials: one timed step
    assert {p["steps"] for p in df["params"]} == {2}  # points: the sweep's steps
    CALLS.clear()
    sweep("fake", ["exact", "ckpt"], batch_sizes="auto", budget=budget, steps=2, store=store, progress=False,
          measure_fn=fake_measure)
    assert CALLS == []  # the searches replay from the trial store


def test_sweep_sizes_fixed_batch_and_auto_size(tmp_path):
    store = tmp_path / "s.jsonl"
    budget = BASE + 64 * 64 + 4 * 100 * 6  # exact at batch 4 fits 6 layers
    df = sweep("fake", "exact", batch_sizes=[4], sizes={"num_layers": [2, 6, 7]}, budget=budget, store=store,
               progress=False, measure_fn=fake_measure)
    assert list(df["size.num_layers"]) == [2, 6, 7] and list(df["fits"]) == [True, True, False]
    assert set(df["scan"]) == {"num_layers"}
    from momlab import search

    real_step = search.size_step
    search.size_step = lambda model, dim, **size: 1  # the fake model is not in the catalog
    try:
        df = sweep("fake", "exact", batch_sizes=[4], sizes={"num_layers": "auto"}, budget=budget, store=store,
                   progress=False, measure_fn=fake_measure)
    finally:
        search.size_step = real_step
    assert list(df["size.num_layers"]) == [1, 2, 4, 6, 7]


def test_sweep_rejects_bad_grids(tmp_path):
    kw = dict(store=tmp_path / "s.jsonl", progress=False, measure_fn=fake_measure)
    with pytest.raises(ValueError, match="budget"):
        sweep("fake", batch_sizes="auto", **kw)
    with pytest.raises(ValueError, match="batch_sizes"):
        sweep("fake", batch_sizes=[0, 2], **kw)
    with pytest.raises(ValueError, match="depth"):
        sweep("fake", batch_sizes=[2], sizes={"depth": [1]}, **kw)
    with pytest.raises(ValueError, match="list"):
        sweep("fake", batch_sizes="auto", sizes={"num_layers": "auto"}, budget=10**6, **kw)
    with pytest.raises(ValueError, match="unknown model"):
        sweep("no-such-model", batch_sizes=[2], store=tmp_path / "s.jsonl", progress=False)


def test_auto_points():
    from types import SimpleNamespace

    from momlab.search import find_max

    assert auto_points(find_max(lambda v: SimpleNamespace(fits=False))) == [1]
    assert auto_points(find_max(lambda v: SimpleNamespace(fits=v <= 1))) == [1, 2]
    assert auto_points(find_max(lambda v: SimpleNamespace(fits=v <= 8))) == [1, 2, 4, 8, 9]
    assert auto_points(find_max(lambda v: SimpleNamespace(fits=v <= 37), step=4)) == [4, 8, 16, 32, 36, 40]
    assert auto_points(find_max(lambda v: SimpleNamespace(fits=True), limit=6)) == [1, 2, 4, 6]


# -- parameter files ---------------------------------------------------------------------

def test_param_file_unknown_key_names_it_and_the_valid_ones(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("models: [fake]\nbatch_size: [1, 2]\n")
    with pytest.raises(ValueError) as info:
        read_params(f)
    assert "'batch_size'" in str(info.value) and "batch_sizes" in str(info.value) and "moms" in str(info.value)
    f.write_text("moms: [exact]\n")
    with pytest.raises(ValueError, match="models"):
        read_params(f)


@pytest.mark.parametrize("text, where", [
    ("models: [bert-base\nmoms: [exact]\n", "line 2, column 5: expected ',' or ']', but got ':' "
                                            "(while parsing a flow sequence started at line 1)"),
    ("models: bert-base\n  moms: exact\n", "line 2, column 7: mapping values are not allowed here"),
    ("models: bert-base\nmoms: @exact\n", "line 2, column 7: found character '@' that cannot start any token"),
    ("- bert-base\n- gpt2\n", "line 1, column 1: the top level is a list, not a mapping of keys (name, store, "),
    ("", "line 1, column 1: the top level is empty, not a mapping"),
])
def test_malformed_param_file_names_file_and_position(tmp_path, text, where):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ValueError) as info:
        read_params(f)
    message = str(info.value)
    assert message.startswith(f"params file {f}: {where}") and "\n" not in message, message


def test_cli_sweep_of_a_malformed_param_file_is_one_line_and_exit_2(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("models: [bert-base\nmoms: [exact]\n")
    missing = tmp_path / "missing.yaml"
    for path, says in ((f, "line 2, column 5"), (missing, "No such file or directory")):
        r = subprocess.run([sys.executable, "-m", "momlab", "sweep", str(path), "--no-progress"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr  # one line, no traceback
        assert lines[0].startswith(f"python -m momlab sweep: error: params file {path}: ") and says in lines[0]
        assert r.stdout == ""


def test_sweep_from_file(tmp_path):
    f = tmp_path / "s1_fake.yaml"
    store = tmp_path / "out.jsonl"
    f.write_text(f"""
models: fake
moms: [exact, ckpt]
batch_sizes: auto
budget: {budget_for(3)}
steps: 1
store: {store}
""")
    df = sweep_from_file(f, progress=False, measure_fn=fake_measure)
    assert list(df[df["mom"] == "exact"]["batch_size"]) == [1, 2, 3, 4]
    assert df["run"].iloc[0] == {"name": "s1_fake", "params_file": str(f)}


# -- kill -9 mid-sweep, then resume --------------------------------------------------------

PLAN = dict(models=["fake-a", "fake-b"], moms=["exact", "ckpt"], batch_sizes="auto", budget=budget_for(12))
PLAN_POINTS = 2 * (6 + 8)  # per model: exact 1,2,4,8,12,13; ckpt 1,2,4,8,16,32,48,49

CHILD = """
import sys
sys.path.insert(0, {tests!r})
import test_results
from momlab.sweep import sweep
sweep(**test_results.PLAN, store={store!r}, progress=False, measure_fn=test_results.slow_measure)
"""


def _start_child(store, sleep):
    env = {**os.environ, "MOMLAB_TEST_SLEEP": str(sleep)}
    return subprocess.Popen([sys.executable, "-c", CHILD.format(tests=str(TESTS), store=str(store))], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_lines(path, n, proc, timeout=120):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"sweep ended early: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.01)
    raise AssertionError("sweep made no progress")


def _assert_clean(path):
    recs = [json.loads(x) for x in lines_of(path)]  # every line complete JSON
    keys = [r["key"] for r in recs]
    assert len(keys) == len(set(keys)), "a configuration was recorded twice"
    return recs


def test_sweep_killed_with_sigkill_resumes_with_every_point_once(tmp_path):
    store = tmp_path / "killed.jsonl"
    for n in (7,):  # (kill points; each costs a child that imports torch, ~5 s)
        proc = _start_child(store, sleep=0.05)
        _wait_lines(store, n, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        before = _assert_clean(store)
        _assert_clean(search_store_path(store))
        assert n <= len(before) < PLAN_POINTS
    df = sweep(**PLAN, store=store, progress=False, measure_fn=slow_measure)
    recs = _assert_clean(store)
    assert len(recs) == PLAN_POINTS == len(df)
    assert recs[:len(before)] == before  # what was there is untouched
    assert set(df["key"]) == {r["key"] for r in recs}
    # the resume measured exactly the points that were missing (search trials run with steps=1)
    assert len([c for c in CALLS if c["steps"] == 3]) == PLAN_POINTS - len(before)
    trials = _assert_clean(search_store_path(store))
    assert len(trials) == 2 * (8 + 12)  # exact: 8 trials, ckpt: 12, per model; none twice


@pytest.mark.slow
def test_two_sweeps_on_one_store_record_each_point_once(tmp_path):
    store = tmp_path / "shared.jsonl"
    procs = [_start_child(store, sleep=0.02) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    recs = _assert_clean(store)
    assert len(recs) == PLAN_POINTS
    assert len(_assert_clean(search_store_path(store))) == 2 * (8 + 12)
