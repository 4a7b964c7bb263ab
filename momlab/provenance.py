"""Where and how a number was measured: the stamp every record carries."""

from __future__ import annotations

import datetime
import functools
import os
import platform
import socket
import subprocess

import torch


@functools.lru_cache(maxsize=None)
def _git() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    return {"commit": commit or None, "dirty": dirty}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str | torch.device = "cpu") -> dict:
    """Device name, CPU/GPU model, versions, git commit, host and UTC time."""
    import transformers

    import momlab

    dev = torch.device(device)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    return {
        "device": dev.type,
        "device_name": gpu or _cpu_model(),
        "cpu": _cpu_model(),
        "gpu": gpu,
        "cuda": torch.version.cuda if dev.type == "cuda" else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "momlab": momlab.__version__,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **_git(),
    }
