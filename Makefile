# Two commands for a newcomer: `make serve` and `make test`. Both set up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test serve bench-decode clean

setup: $(STAMP)

# torch first, then the project; Triton pinned only beside a CPU build of torch (requirements/triton-cpu.txt)
$(STAMP): pyproject.toml requirements/cpu.txt requirements/triton-cpu.txt scripts/ensure_ffmpeg.sh \
          scripts/check_python.py
	@scripts/ensure_ffmpeg.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) scripts/check_python.py
	$(PY) -m pip install -q -r requirements/cpu.txt
	$(PY) -m pip install -q -r requirements/cpu.txt -e '.[torchcodec,test,ray]' \
	  $$($(PY) -c 'import torch; print("" if torch.version.cuda else "-r requirements/triton-cpu.txt")' 2>/dev/null)
	@touch $(STAMP)

test: setup
	$(PY) -m pytest -q

# The server on the demo model (CPU when there is no GPU), with a generated sample video to ask about.
# Extra flags: make serve ARGS="--port 8080"
serve: setup
	$(PY) scripts/serve_demo.py $(ARGS)

bench-decode: setup
	$(PY) -m pip install -q -r requirements/bench.txt
	$(PY) bench/decode/bench_decode.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
