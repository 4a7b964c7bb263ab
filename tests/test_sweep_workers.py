"""Sweeps on workers (momlab.launch): one store, every point once, the same records as a serial run.

The local workers are real submitit jobs (fresh processes, one thread each);
the Slurm path is checked by the sbatch script and task placement it builds,
since no cluster is reachable here.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from momlab import catalog
from momlab.launch import Launch, enter_worker, executor, slurm_parameters
from momlab.results import Store, compact, config_key, environment, shards_dir
from momlab.sweep import SweepIncomplete, expected_cost, sweep

MEMORY = ("peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "workspace_bytes",
          "host_bytes", "fits")


@pytest.fixture
def one_thread():
    # the workers run 1 thread each; threads are in the fingerprint, so the serial reference must match
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_two_workers_record_what_a_serial_run_records(tmp_path, one_thread):
    kw = dict(models=["bert-base", "gpt2"], moms=["exact", "ckpt"], batch_sizes=[1, 2], size="tiny", steps=1,
              progress=False)
    serial = sweep(store=tmp_path / "serial.jsonl", **kw)
    par = sweep(store=tmp_path / "par.jsonl", workers=2, **kw)
    assert list(par["key"]) == list(serial["key"])  # same configurations, same plan order
    assert len(serial) == 8
    for field in MEMORY:
        assert list(par[field]) == list(serial[field]), field
    workers = {(w["index"], w["pid"]) for w in par["worker"]}
    assert {i for i, _ in workers} == {0, 1} and len(workers) == 2  # both workers measured, each its own process
    assert all(w["threads"] == 1 and w["host"] == par["env.host"].iloc[0] for w in par["worker"])
    # compacted: one file, each key once; no shards, claims or job folders left behind
    lines = _lines(tmp_path / "par.jsonl")
    assert sorted(r["key"] for r in lines) == sorted(serial["key"])
    assert not shards_dir(tmp_path / "par.jsonl").exists()
    again = sweep(store=tmp_path / "par.jsonl", workers=2, **kw)
    assert again.attrs["measured"] == 0 and again.attrs["skipped"] == 8


@pytest.mark.slow
def test_a_worker_killed_loses_only_its_point_and_a_rerun_completes(tmp_path, one_thread):
    store = tmp_path / "kill.jsonl"
    kw = dict(models=["bert-base", "gpt2"], moms=["exact", "ckpt"], batch_sizes=[1, 2, 3, 4], size="tiny",
              steps=1, progress=False, store=store)
    env = environment("cpu")  # 1 thread, as the workers: the keys a serial run would record
    expected = {config_key(dict(model=m, mom=o, batch_size=b, device="cpu", precision="fp32", budget=None,
                                steps=1, warmup=1, seed=0, size=catalog.tiny(m)), env)
                for m in kw["models"] for o in kw["moms"] for b in kw["batch_sizes"]}
    killed = {}

    def kill_worker_0_after_its_first_point():
        d = shards_dir(store)
        while not killed:
            pids = list(d.glob("claims-*/worker-0"))
            shard = list(d.glob("*-w0.jsonl"))
            if pids and shard and shard[0].read_text().count("\n") >= 1:
                pid = json.loads(pids[0].read_text())["pid"]
                os.kill(pid, signal.SIGKILL)
                killed["pid"] = pid
            time.sleep(0.02)

    watcher = threading.Thread(target=kill_worker_0_after_its_first_point, daemon=True)
    watcher.start()
    with pytest.raises(SweepIncomplete, match="1 of 2 jobs failed"):
        sweep(workers=2, **kw)
    watcher.join(timeout=5)
    assert killed
    first = _lines(store)
    assert len({r["key"] for r in first}) == len(first) < len(expected)  # some lost, none twice
    assert all(r["key"] in expected for r in first)
    rerun = sweep(workers=2, **kw)
    assert rerun.attrs["measured"] == len(expected) - len(first)
    lines = _lines(store)
    assert sorted(r["key"] for r in lines) == sorted(expected)  # every point exactly once
    assert set(rerun["key"]) == expected


def test_shards_read_as_one_store_and_compact_into_it(tmp_path):
    """The shared-filesystem choice: one writer per shard, merged on read, each key once."""
    path = tmp_path / "s.jsonl"
    Store(path).append({"key": "a", "v": 0})
    w0, w1 = Store(path, shard="run-w0"), Store(path, shard="run-w1")
    assert w0.append({"key": "b", "v": 1}) and w1.append({"key": "c", "v": 2})
    assert not w1.append({"key": "b", "v": 3})  # another worker's record counts
    assert (shards_dir(path) / "run-w1.jsonl").read_text().count("\n") == 1
    # a record both in the main file and in a shard (a compaction killed halfway) is read once
    assert not Store(path).append({"key": "b", "v": 1})  # the main file refuses it too
    Store(path, shards=False).append({"key": "b", "v": 1})
    with open(shards_dir(path) / "run-w0.jsonl", "ab") as f:
        f.write(b'{"key": "d", "v"')  # a worker killed mid-write: a fragment, never read
    reader = Store(path)
    assert [r["key"] for r in reader.records()] == ["a", "b", "c"]
    assert compact(path, prefix="run-") == 1  # only c moves; b was there already
    assert [r["key"] for r in _lines(path)] == ["a", "b", "c"]
    assert not shards_dir(path).exists()
    assert [r["key"] for r in reader.records()] == ["a", "b", "c"]  # a reader from before sees no change


def test_slurm_job_array_parameters(tmp_path):
    from submitit.slurm.slurm import _make_sbatch_string

    launch = Launch(workers=8, launcher="slurm", partition="gpu", time_min=90, gpus_per_job=4, threads=6,
                    array_parallelism=1)
    assert launch.jobs == 2 and launch.tasks_per_job() == 4
    text = _make_sbatch_string(command="python -m submitit.core._submit x", folder=str(tmp_path), map_count=2,
                               **slurm_parameters(launch, "cuda"))
    for line in ("#SBATCH --partition=gpu", "#SBATCH --time=90", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --ntasks-per-node=4", "#SBATCH --cpus-per-task=6", "#SBATCH --array=0-1%1",
                 "#SBATCH --job-name=momlab-sweep"):
        assert line in text, line
    cpu = slurm_parameters(Launch(workers=2, launcher="slurm", time_min=10), "cpu")
    assert "gpus_per_node" not in cpu and cpu["ntasks_per_node"] == 1 and cpu["array_parallelism"] == 2
    with pytest.raises(RuntimeError, match="srun"):  # what a user off a cluster is told
        executor(launch, tmp_path, "cuda")


def test_slurm_task_owns_one_gpu_of_its_job(monkeypatch, one_thread):
    # task 2 of array job 1 in a 4-GPU job: worker 6, which sees only the job's third GPU
    for k, v in dict(SUBMITIT_EXECUTOR="slurm", SLURM_JOB_ID="77_1", SLURM_ARRAY_JOB_ID="77", SLURM_ARRAY_TASK_ID="1",
                     SLURM_LOCALID="2", SLURM_PROCID="2", SLURM_NTASKS="4", SLURM_NODEID="0", SLURM_JOB_NUM_NODES="1",
                     SLURM_CPUS_PER_TASK="1", CUDA_VISIBLE_DEVICES="4,5,6,7").items():
        monkeypatch.setenv(k, v)
    w = enter_worker(1, Launch(workers=8, launcher="slurm", time_min=10, gpus_per_job=4), "cuda")
    assert (w["index"], w["gpu"], w["threads"]) == (6, "6", 1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"


def test_launch_options_are_checked():
    with pytest.raises(ValueError, match="valid: local, slurm"):
        Launch(launcher="ray")
    with pytest.raises(ValueError, match="time limit"):
        Launch(launcher="slurm")
    with pytest.raises(ValueError, match="slurm options"):
        Launch(workers=2, partition="gpu")
    with pytest.raises(ValueError, match="workers must be an int >= 1"):
        sweep(["bert-base"], batch_sizes=[1], workers=0)
    with pytest.raises(ValueError, match="unknown launch option"):
        Launch.of({"workers": 2, "gpus": 1})


def test_largest_expected_cost_first():
    base = dict(model="bert-base", mom="exact", device="cpu", precision="fp32", budget=None, steps=1, warmup=1,
                seed=0)
    small = dict(base=base, scan="batch_size", size={"num_layers": 1, "hidden_size": 32, "num_heads": 2},
                 batch_sizes=[1, 2], search_steps=1)
    wide = {**small, "size": {"num_layers": 1, "hidden_size": 256, "num_heads": 2}}
    half = {**small, "base": {**base, "precision": "bf16"}}
    assert expected_cost(wide) > expected_cost(small)
    assert expected_cost(half) == 125 * expected_cost(small)
    assert expected_cost({**small, "batch_sizes": [4]}) == expected_cost(small) * 4 / 3


def test_command_line_and_figures_take_the_launch(monkeypatch, tmp_path):
    from momlab import figures, launch
    from momlab.cli import launch_from, main, parser

    args = parser().parse_args(["sweep", "p.yaml", "--workers", "16", "--launcher", "slurm", "--partition", "gpu",
                                "--time-min", "360", "--gpus-per-job", "4", "--array-parallelism", "2"])
    assert launch_from(args) == Launch(workers=16, launcher="slurm", partition="gpu", time_min=360,
                                       gpus_per_job=4, array_parallelism=2)
    assert launch_from(parser().parse_args(["sweep", "p.yaml"])) is None  # this process, as before
    seen = []
    monkeypatch.setattr(figures, "run", lambda params, notebooks, launch=None: seen.append(launch))
    assert main(["figures", "--workers", "2", "--threads-per-worker", "1", "p.yaml", "a.ipynb"]) == 0
    assert seen == [Launch(workers=2, threads=1)]
    # what figures.run hands the notebooks' kernels: sweep() reads it when given no launch of its own
    monkeypatch.setenv(launch.ENV_VAR, json.dumps({"workers": 0}))
    with pytest.raises(ValueError, match="workers must be an int >= 1"):
        sweep(["bert-base"], batch_sizes=[1], store=tmp_path / "x.jsonl")


def test_figures_run_hands_the_launch_to_the_notebooks(monkeypatch, tmp_path):
    import sys
    import types

    from momlab import figures, launch

    seen = []
    fake = types.SimpleNamespace(execute_notebook=lambda *a, **k: seen.append(os.environ.get(launch.ENV_VAR)))
    monkeypatch.setitem(sys.modules, "papermill", fake)
    monkeypatch.delenv(launch.ENV_VAR, raising=False)
    params = tmp_path / "p.yaml"
    params.write_text("notebooks:\n  01_x: {a: 1}\n")
    figures.run(params, [tmp_path / "01_x.ipynb"], out_dir=tmp_path / "out", launch=2)
    assert [json.loads(s)["workers"] for s in seen] == [2]
    assert launch.ENV_VAR not in os.environ  # only for the run
