# The two commands of the README. Both create .venv on first use and install rocktune into it.
# torch: if the venv already has a torch build (ROCm/CUDA, installed by you first — see README), it is kept;
# otherwise the pinned CPU build below is installed.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.rocktune-installed

.PHONY: demo test install clean llama-cpp

demo: $(STAMP)
	$(BIN)/rocktune demo

# The linter first (seconds): style and import mistakes fail before the 8-minute suite starts.
test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -c "import torch; print('torch', torch.__version__, '(hip', torch.version.hip, ', cuda', torch.version.cuda, ')')"
	touch $@

# llama.cpp through llama-cpp-python, built from source for this CPU (about 6 minutes on 2 cores): k-quant GGUF
# exports and the tests that load exported files in llama.cpp (pytest -m llama_cpp). Add CMAKE_ARGS for a GPU build.
llama-cpp: $(STAMP)
	$(BIN)/python -m pip install "llama-cpp-python>=0.3"

clean:
	rm -rf $(VENV) runs .pytest_cache
