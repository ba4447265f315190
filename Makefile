# Each target builds .venv when it is missing. torch==2.13.0 goes in first: it is the
# CPU wheel on local disk, and installing it first stops `torch>=2.4` from pulling a CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck bench docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/torchscope doctor --out torchscope-report

test: $(STAMP)
	@# The report's browser test needs headless Chromium; install it where apt-get can.
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then \
		$$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -q && \
		$$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y -q chromium || \
		echo "chromium not installed: the browser test will be skipped"; fi
	$(BIN)/python -m ruff check src tests benchmarks
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -n 2 --dist loadfile

lint: $(STAMP)
	$(BIN)/python -m ruff check src tests benchmarks
	$(BIN)/python -m mypy
	$(BIN)/torchscope lint src

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

# The documentation site, built strictly (a broken link, anchor or API reference fails) into
# site/. The `docs` extra (mkdocs-material, mkdocstrings) goes into .venv when it is missing.
docs: $(STAMP)
	$(BIN)/python -c "import material, mkdocstrings_handlers.python" 2>/dev/null || \
		$(BIN)/python -m pip install -q -e '.[dev,docs]'
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) torchscope-report site .pytest_cache .mypy_cache .ruff_cache
