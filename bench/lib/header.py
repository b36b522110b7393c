"""Where the checkout is and what every result says about its run: ROOT (the repository, the
cwd services are started from and git is asked in), RESULTS (bench/results) and base_header
(date, card, device, CPUs, versions, commit, argv). Plain Python: no torch, no CUDA."""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import pathlib
import platform
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
PACKAGES = ("torch", "triton", "grpcio", "protobuf", "transformers", "peft")


def card(device: str) -> str:
    """The GPU's name (nvidia-smi: this process never touches CUDA) or the CPU model."""
    if device.startswith("cuda") and shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip().splitlines()
        if out:
            return out[0].strip()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def card_slug(card: str, device: str) -> str:
    """The short name of a card for result file names (saturation-h100.json): h200, h100, a100,
    b200, l40s; else cpu or gpu by the device."""
    for name in ("H200", "H100", "A100", "B200", "L40S"):
        if name in card.upper():
            return name.lower()
    return "cpu" if device == "cpu" else "gpu"


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def base_header(device: str, commit: str | None = None) -> dict:
    """commit: what the run's code is, when the checkout's git does not know (a copy of a
    working tree shipped to another machine); else git's HEAD, +dirty with local changes."""
    dirty = ""
    if commit is None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "card": card(device), "device": device, "cpus": os.cpu_count(),
            "versions": versions(),
            "commit": commit + ("+dirty" if dirty else ""), "argv": sys.argv[1:]}
