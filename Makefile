# lorafleet: `make run` serves, `make test` tests. Everything else is created on demand.
PY       ?= python3
VENV     := .venv
VPY      := $(VENV)/bin/python
STAMP    := $(VENV)/.installed
GEN      := services/common/gen
MODEL    := models/tiny-llama
TORCH    ?= torch==2.13.0

.PHONY: venv stubs model run test test-policy test-fast bench clean k8s browser

venv: $(STAMP) stubs

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q -e ".[engine,dev,otlp]"
	@# the `kernels` distribution (transformers >= 5.25 needs it) shares our kernels/ import name
	@$(VPY) -m pip uninstall -q -y kernels >/dev/null 2>&1 || true
	touch $(STAMP)

stubs: $(GEN)/.stamp

$(GEN)/.stamp: $(STAMP) $(wildcard protos/lorafleet/v1/*.proto) tools/gen_protos.py
	$(VPY) tools/gen_protos.py
	touch $@

model: $(MODEL)/.complete

$(MODEL)/.complete: venv tools/make_tiny_model.py
	$(VPY) tools/make_tiny_model.py --out models

# make run HOST=0.0.0.0 PORT_BASE=7101 HTTP_PORT=8180 METRICS_BASE=9201 (defaults: 127.0.0.1,
# gRPC 7001-7003, HTTP 8080, /metrics 9101-9103; METRICS_BASE=0 turns them off)
RUN_ARGS = $(if $(HOST),--host $(HOST)) $(if $(PORT_BASE),--port-base $(PORT_BASE)) \
           $(if $(HTTP_PORT),--http-port $(HTTP_PORT)) \
           $(if $(METRICS_BASE),--metrics-base $(METRICS_BASE))
run: venv model
	$(VPY) -m services.devstack $(RUN_ARGS)

# the suite in TEST_PROCS processes, each taking a whole test file at a time (a module's stack
# is started once); TEST_PROCS=0 runs it in this one
TEST_PROCS ?= 2
test: venv model
	-@$(MAKE) -s browser
	$(VPY) -m pytest -q -p no:cacheprovider $(if $(filter-out 0,$(TEST_PROCS)),-n $(TEST_PROCS) --dist loadfile) tests

# headless Chromium for tests/test_status_page.py, from Debian's packages when it is missing and
# apt-get can run (root); otherwise that one test is skipped and says why
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } || \
	  echo "browser: no Chromium and cannot install it (apt-get as root): the status page's browser test will be skipped"

# the torch-free tests, run with torch unimportable (tests/no_torch.py)
POLICY_TESTS = $(shell grep -l "^pytestmark = pytest.mark.policy" tests/test_*.py)
test-policy: venv
	$(VPY) -m pytest -q -p tests.no_torch -m policy $(POLICY_TESTS)

test-fast: venv
	$(VPY) -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) $(GEN) models
