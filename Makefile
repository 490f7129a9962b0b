# `make test` and `make demo` are self-contained on a fresh machine: they build .venv first.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv test demo bench clean e2e gpu-check

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "$(TORCH_SPEC)"
	$(VPY) -m pip install -q -e ".[test,video]"
	touch $@

venv: $(VENV)/.installed

test: venv
	$(VPY) -m pytest -q

# Every benchmark figure in README.md, each printed side by side in one run (CPU; see real_size.py for GPUs).
bench: venv
	$(VPY) bench/bench_kv_cache.py
	$(VPY) bench/bench_pipeline.py
	$(VPY) bench/bench_vae.py
	$(VPY) bench/bench_reward.py
	$(VPY) bench/bench_speed.py
	$(VPY) bench/memory_plan.py
	$(VPY) bench/cost_model.py
	$(VPY) bench/bench_overlap.py
	$(VPY) bench/bench_tau_sweep.py
	$(VPY) bench/bench_toy_settings.py
	$(VPY) bench/bench_replay_vae.py
	PYTHONPATH=. $(VPY) bench/dry_run.py
	$(VPY) bench/bench_routing.py --time --repeats 3 --time-prompts 8 --threads 1 --out outputs/routing_timed.json

# The pack in a real ComfyUI (COMFYUI_PATH=<checkout>) and its UI workflows in the real frontend: see scripts/e2e.sh.
e2e:
	bash scripts/e2e.sh

# On a lent GPU: the CUDA-only tests and bench/real_size.py (resident, fp8, offload, 2 lanes) in <= 9 min -> outputs/gpu_check/.
gpu-check: venv
	$(VPY) scripts/gpu_check.py --out outputs/gpu_check

clean:
	rm -rf $(VENV) build *.egg-info

demo: venv
	$(VPY) -m sdvg_engine.toy.demo --out outputs
