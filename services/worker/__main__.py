"""python -m services.worker: serve one base model and its adapters on one device (the worker is
assembled in services.worker.app)."""
from __future__ import annotations

import os
import sys

from services.common.runtime import exit_process
from services.worker.app import main

if __name__ == "__main__":
    exit_process(main(sys.argv[1:], dict(os.environ)))
