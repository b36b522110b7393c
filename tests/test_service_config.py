"""Every service refuses a bad configuration the same way: it exits 2 at once and names the
flag, before binding anything (the checks on the common flags are shared)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import MODEL_DIR, ROOT

SERVICES = {"worker": [], "router": [], "adapter_store": ["--model", str(MODEL_DIR)]}
BAD = [(["--tls-cert", "server.pem"], "--tls-cert and --tls-key go together"),
       (["--grace", "-1"], "--grace"),
       (["--listen", "7001"], "--listen"),
       (["--metrics-port", "70000"], "--metrics-port")]


@pytest.mark.parametrize("service", list(SERVICES))
@pytest.mark.parametrize("flags,named", BAD)
def test_bad_common_flag_exits_2_naming_it(service, flags, named):
    proc = subprocess.run([sys.executable, "-m", f"services.{service}", *SERVICES[service],
                           "--metrics-port", "0", *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert named in proc.stderr
