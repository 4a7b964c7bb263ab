"""Workers for a sweep: N processes on this node, or Slurm jobs, started by submitit.

Engine: submitit (pinned, 1.5.4), imported only when workers are asked for.
Its LocalExecutor runs a job the way its SlurmExecutor does (the same pickled
call, run by ``python -m submitit.core._submit`` in a fresh process, with the
same JobEnvironment: job id, task rank, visible GPUs), so what the tests run
on CPU with local workers is the code path a cluster job runs. It needs no
server or scheduler of its own (Ray does), keeps everything in files in one
folder (which Slurm needs on a shared filesystem anyway) and is small and
pure Python. What it does not do, work stealing, we do with claim files.

- A worker owns one GPU: CUDA_VISIBLE_DEVICES narrowed to it before CUDA
  starts, so its records still say device "cuda". On CPU it owns its share of
  the cores: `Launch.threads` torch threads (default: the node's cores divided
  by its workers), so workers never oversubscribe. Threads are part of a
  record's fingerprint (momlab.results), so a 2-thread serial run and
  1-thread workers record different keys, as they should.
- Workers pick work themselves: `claim` creates a file with
  O_CREAT | O_EXCL, which one process wins. Exclusive create is atomic on a
  local filesystem and on NFSv3 and later (part of the protocol), where
  flock is not reliable; so nothing here depends on a lock across hosts.
- Under Slurm, ``workers`` is the number of GPUs in all: a job array of
  ceil(workers / gpus_per_job) jobs, each with one task (worker) per GPU.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

LAUNCHERS = ("local", "slurm")
# How `make figures` hands a launch to the sweeps its notebooks run (papermill kernels inherit the environment)
ENV_VAR = "MOMLAB_SWEEP_LAUNCH"
# A local job has no scheduler to give it a limit; submitit's default (2 minutes) would kill real sweeps.
LOCAL_TIME_MIN = 7 * 24 * 60


@dataclass(frozen=True)
class Launch:
    """How a sweep's configurations are spread over workers.

    - ``workers``: how many workers (GPUs under cuda; CPU shares under cpu).
    - ``launcher``: "local" (processes of this node) or "slurm" (a job array).
    - ``threads``: torch threads per worker (default: cores // workers on a
      local node; Slurm: cpus_per_task when given, else the job's allocation).
    - ``partition``, ``time_min``: Slurm partition and time limit per job (minutes).
    - ``gpus_per_job``: Slurm only: GPUs (and so workers) in one job of the array.
    - ``array_parallelism``: Slurm only: at most this many array jobs at once.
    - ``folder``: submitit's pickles and logs (default: beside the store).
    """

    workers: int = 1
    launcher: str = "local"
    threads: int | None = None
    partition: str | None = None
    time_min: int | None = None
    gpus_per_job: int = 1
    array_parallelism: int | None = None
    folder: str | None = None

    def __post_init__(self):
        for name in ("workers", "gpus_per_job", "threads", "time_min", "array_parallelism"):
            v = getattr(self, name)
            if v is None and name not in ("workers", "gpus_per_job"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"unknown launcher {self.launcher!r}; valid: {', '.join(LAUNCHERS)}")
        if self.launcher == "slurm" and self.time_min is None:
            raise ValueError("a slurm launch needs a time limit per job (time_min / --time-min); submitit's "
                             "default of 5 minutes would cut most sweeps")
        if self.launcher == "local" and (self.partition is not None or self.gpus_per_job != 1
                                         or self.array_parallelism is not None):
            raise ValueError("partition, gpus_per_job and array_parallelism are slurm options; "
                             "give launcher='slurm' or drop them")

    @classmethod
    def of(cls, value) -> "Launch":
        """A Launch from a Launch, a mapping of its fields, or a number of local workers."""
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(workers=value)
        if isinstance(value, dict):
            fields = [f.name for f in dataclasses.fields(cls)]
            bad = [k for k in value if k not in fields]
            if bad:
                raise ValueError(f"unknown launch option(s) {', '.join(bad)}; valid: {', '.join(fields)}")
            return cls(**value)
        raise ValueError(f"launch must be a Launch, a mapping of its fields or a number of workers, got {value!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def jobs(self) -> int:
        """Jobs submitted: one per worker locally, an array of ceil(workers / gpus_per_job) under Slurm."""
        return self.workers if self.launcher == "local" else math.ceil(self.workers / self.gpus_per_job)

    def tasks_per_job(self) -> int:
        return 1 if self.launcher == "local" else min(self.gpus_per_job, self.workers)


def local_threads(launch: Launch) -> int:
    """Torch threads of one local worker: its share of this node's cores (at least 1)."""
    if launch.threads is not None:
        return launch.threads
    return max(1, len(os.sched_getaffinity(0)) // launch.workers)


def executor(launch: Launch, folder, device: str):
    """The submitit executor for `launch`, its parameters set (nothing submitted yet)."""
    import submitit

    cuda = device.split(":")[0] == "cuda"
    if launch.launcher == "local":
        if cuda:
            import torch

            n = torch.cuda.device_count()
            if launch.workers > n:
                raise ValueError(f"{launch.workers} local workers on cuda need {launch.workers} GPUs; "
                                 f"this node has {n}")
        ex = submitit.LocalExecutor(folder=str(folder))
        ex.update_parameters(timeout_min=launch.time_min or LOCAL_TIME_MIN, gpus_per_node=1 if cuda else 0,
                             tasks_per_node=1)
        return ex
    ex = submitit.SlurmExecutor(folder=str(folder))  # raises off a cluster (no srun)
    ex.update_parameters(**slurm_parameters(launch, device))
    return ex


def slurm_parameters(launch: Launch, device: str) -> dict:
    """The SlurmExecutor parameters of `launch` (sbatch options, submitit's spelling)."""
    tasks = launch.tasks_per_job()
    params = dict(job_name="momlab-sweep", time=launch.time_min, ntasks_per_node=tasks,
                  array_parallelism=launch.array_parallelism or launch.jobs)
    if device.split(":")[0] == "cuda":
        params["gpus_per_node"] = tasks  # one task (worker) per GPU of the job
    if launch.partition is not None:
        params["partition"] = launch.partition
    if launch.threads is not None:
        params["cpus_per_task"] = launch.threads
    return params


def submit(fn, launch: Launch, folder, device: str, *args) -> list:
    """Start ``fn(job_index, *args)`` in each of `launch`'s jobs; the submitit jobs, one per job index."""
    ex = executor(launch, folder, device)
    if launch.launcher == "slurm":
        return ex.map_array(fn, range(launch.jobs), *[[a] * launch.jobs for a in args])
    jobs = []
    for k in range(launch.jobs):
        if device.split(":")[0] == "cuda":
            ex.update_parameters(visible_gpus=[k])  # worker k owns GPU k
        jobs.append(ex.submit(fn, k, *args))
    return jobs


def wait(jobs: list, poll=None, every_s: float = 0.5) -> list[str]:
    """Wait for `jobs` (calling `poll()` meanwhile); one line per job that failed or was killed."""
    try:
        while not all(j.done() for j in jobs):
            if poll is not None:
                poll()
            time.sleep(every_s)
    except KeyboardInterrupt:
        for j in jobs:
            j.cancel(check=False)
        raise
    if poll is not None:
        poll()
    failures = []
    for j in jobs:
        try:
            j.results()
        except Exception as exc:  # noqa: BLE001 - every way a job can fail is reported the same way
            lines = str(exc).strip().splitlines()
            failures.append(f"job {j.job_id}: {type(exc).__name__}: {lines[-1] if lines else ''}")
    return failures


def results(jobs: list) -> list:
    """The return values of the jobs that finished (a job with several tasks gives one per task)."""
    out = []
    for j in jobs:
        try:
            out.extend(j.results())
        except Exception:  # noqa: BLE001 - failed jobs are reported by `wait`
            pass
    return out


def enter_worker(job_index: int, launch: Launch, device: str) -> dict:
    """Run first in a worker: own one GPU or a share of cores; return its provenance (index, host, gpu, job)."""
    import submitit
    import torch

    env = submitit.JobEnvironment()
    index = job_index * launch.tasks_per_job() + env.local_rank
    visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    if device.split(":")[0] == "cuda" and len(visible) > 1:
        # a Slurm job with several GPUs runs one task per GPU; each keeps its own (CUDA starts lazily, later)
        visible = [visible[env.local_rank % len(visible)]]
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[0]
    if launch.launcher == "local":
        threads = local_threads(launch)
    else:
        threads = launch.threads or int(os.environ.get("SLURM_CPUS_PER_TASK", torch.get_num_threads()))
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # fresh-process measurements inherit it
    return {"index": index, "host": socket.gethostname(), "gpu": ",".join(visible) or None,
            "job_id": str(env.job_id), "pid": os.getpid(), "threads": threads, "launcher": launch.launcher}


def run_id() -> str:
    """A name for one launch of a sweep (UTC time, host, pid): its claims and shards carry it."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{now}-{socket.gethostname()}-{os.getpid()}"


def claim(directory, name: str, info: dict | None = None) -> bool:
    """Create ``directory/name`` unless it exists: True for the one process that created it."""
    path = Path(directory) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, json.dumps(info or {}).encode())
    finally:
        os.close(fd)
    return True


def claimed(directory, prefix: str) -> list[str]:
    """Names of the claims in `directory` that start with `prefix`."""
    try:
        return sorted(n for n in os.listdir(directory) if n.startswith(prefix))
    except FileNotFoundError:
        return []
