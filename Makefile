# `make test` and `make demo` are self-contained on a fresh machine: they build .venv first.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv test bench clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "$(TORCH_SPEC)"
	$(VPY) -m pip install -q -e ".[test,video]"
	touch $@

venv: $(VENV)/.installed

test: venv
	$(VPY) -m pytest -q

bench: venv
	$(VPY) bench/bench_kv_cache.py

clean:
	rm -rf $(VENV) build *.egg-info
