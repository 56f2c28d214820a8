# joader's everyday commands. Every target creates and uses its own .venv, so a fresh clone needs
# only python3.11 (or python3 >= 3.11) and make.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
DEMO_DIR ?= demo-data
DEMO_ITEMS ?= 1200
# One stamp per set of packages: the base (torch and joader) and each extra on top of it, so a
# target installs only what it runs (`make demo` no extra, `make test` the test extra, ...), and
# each set is installed again when pyproject.toml changes.
BASE := $(VENV)/.joader-base
EXTRA := $(VENV)/.joader-extra-

.PHONY: venv test test-fast demo bench bench-full lint proto clean
.PRECIOUS: $(EXTRA)%

# The packages install through uv, bootstrapped with pip inside the venv: it unpacks and compiles
# on both cores at once, where pip took 60-130 s of `make test` on a fresh clone here (uv 20-30 s).
# --compile-bytecode as pip does: without .pyc files every process (PYTHONDONTWRITEBYTECODE is set
# on this machine) would compile torch's modules again.
UV := $(VENV)/bin/uv
UV_INSTALL = $(UV) pip install --quiet --python $(PY) --compile-bytecode

$(UV):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv

# torch is installed first, pinned, because a bare `torch` requirement on a machine without it
# pulls the newest CUDA build (gigabytes); the project's own range then admits it and the
# installer leaves it be (docs/install.md; docs/architecture.md, "Lessons already paid for").
# pip fetches the pinned wheel, so that pip's configuration (a local wheel, an index, a
# constraint) still picks it; uv, which reads no pip configuration, installs that file.
$(BASE): pyproject.toml | $(UV)
	rm -rf $(VENV)/torch-wheel
	$(PY) -m pip download --quiet --no-deps --dest $(VENV)/torch-wheel $(TORCH)
	$(UV_INSTALL) $(VENV)/torch-wheel/*.whl -e .
	rm -rf $(VENV)/torch-wheel
	touch $@

# $(EXTRA)test, $(EXTRA)bench, $(EXTRA)dev: pyproject.toml's extra of that name (via $(BASE),
# a change of pyproject.toml installs it again)
$(EXTRA)%: $(BASE)
	$(UV_INSTALL) -e '.[$*]'
	touch $@

# The project is installed editable, so pip compiled none of its modules; where
# PYTHONDONTWRITEBYTECODE is set (as on this machine) every process - each job, lease keeper, CLI
# call and test subprocess - compiled them again (30-50 ms of CPU each). compileall writes the
# .pyc files whatever that setting, and recompiles only what changed. Every target runs it.
COMPILE = @$(PY) -m compileall -q joader server client bench tests >/dev/null

venv: $(BASE)
	$(COMPILE)

# The suite runs in TEST_WORKERS pytest processes at once (pytest-xdist): one at a time, its tests
# leave a core idle while they wait on the processes they start (joaderd, jobs, torchrun); three
# kept both cores busy 91% of the time (17.5 minutes became about 9, most of it CPU: each job
# imports torch), four fill more of the waits (polls, leases, sleeps of emulated steps): a fresh
# clone's `make test` took 10 min 9 s with three and 9 min 33 s with four, one after the other. The few
# tests marked `serial` need the machine to themselves (an idle core, no other joaderd starting,
# jobs running in step) and run after, alone.
# pytest exits 5 when it collects no test: that is a failure here, not a silent pass.
TEST_WORKERS ?= 4
test: $(EXTRA)test
	$(COMPILE)
	@rc=0; \
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal -m "not serial" tests || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; rc=1; fi; \
	$(PY) -m pytest -q -p no:cacheprovider -m serial tests || rc2=$$?; \
	if [ "$${rc2:-0}" -eq 5 ]; then echo "make test: pytest collected no serial tests" >&2; rc2=1; fi; \
	if [ $$rc -ne 0 ]; then exit $$rc; fi; exit $${rc2:-0}

test-fast: $(EXTRA)test
	$(COMPILE)
	$(PY) -m pytest -q -x tests/unit

demo: $(BASE)
	$(COMPILE)
	$(PY) -m joader.client.tools.demo --data $(DEMO_DIR) --items $(DEMO_ITEMS)

# Quick: a few minutes, fewer repetitions and sizes. Full: about an hour.
bench: $(EXTRA)bench
	$(COMPILE)
	$(PY) -m bench.micro.sampler --quick
	$(PY) -m bench.system.multi_job --quick
	$(PY) -m bench.system.async_jobs --quick
	$(PY) -m bench.micro.delivery --quick
	$(PY) -m bench.system.identical_jobs --reps 1
	$(PY) -m bench.system.analyze --quick
	$(PY) -m bench.system.autoscale --quick
	$(PY) -m bench.system.four_jobs --reps 1 --name four_jobs-quick

bench-full: $(EXTRA)bench
	$(COMPILE)
	$(PY) -m bench.micro.sampler
	$(PY) -m bench.system.multi_job --decoder pil
	$(PY) -m bench.system.async_jobs
	$(PY) -m bench.micro.delivery
	$(PY) -m bench.system.identical_jobs
	$(PY) -m bench.system.analyze
	$(PY) -m bench.system.autoscale
	$(PY) -m bench.system.four_jobs

# mypy must see joader.server and joader.client where they install (server/ and client/ inside
# the joader package: pyproject's package-dir). An editable install hides that mapping from it,
# and every import of them was taken as Any, unchecked; so it reads a temporary tree of symlinks
# in the installed layout.
lint: $(EXTRA)dev
	$(VENV)/bin/ruff check joader server client tests bench
	@tree=$$(mktemp -d) && mkdir $$tree/joader && \
	for f in joader/*; do ln -s "$(CURDIR)/$$f" $$tree/joader/; done && \
	ln -s "$(CURDIR)/server" $$tree/joader/server && ln -s "$(CURDIR)/client" $$tree/joader/client && \
	echo "mypy -p joader (joader/, server/ as joader.server, client/ as joader.client)" && \
	(cd $$tree && $(abspath $(PY)) -m mypy --config-file $(CURDIR)/pyproject.toml \
		--cache-dir $(CURDIR)/.mypy_cache -p joader); rc=$$?; rm -rf $$tree; exit $$rc

proto: $(EXTRA)dev
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. joader/proto/joader.proto

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
