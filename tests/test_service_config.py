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


def test_store_defaults_to_the_embedded_model_as_the_worker_does(monkeypatch):
    """The operator contract starts the store with --listen and --adapters-dir only: the base
    whose shapes it validates against is then the worker's default, the embedded tiny model;
    --base-config wins over --model."""
    from services.adapter_store.config import from_args, parser
    monkeypatch.chdir(ROOT)
    cfg = from_args(parser().parse_args(["--adapters-dir", "models/adapters"]), {})
    assert cfg.base_config == MODEL_DIR.relative_to(ROOT) / "config.json"
    other = ROOT / "models" / "adapters"
    with pytest.raises(ValueError, match="base model config"):
        from_args(parser().parse_args(["--base-config", str(other / "nope.json")]), {})
