# `make test` and `make demo` are self-contained on a fresh machine: they build .venv first.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv test demo bench clean e2e gpu-check

# --no-compile: byte-compiling every installed file (torch alone has thousands) cost ~30 s of CPU on a fresh clone;
# Python compiles the few modules a run imports as it imports them.
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q --no-compile "$(TORCH_SPEC)"
	$(VPY) -m pip install -q --no-compile -e ".[test,video]"
	touch $@

venv: $(VENV)/.installed

# One pytest worker per core (tests/conftest.py keeps torch to one thread each). Whole files go to a worker, so a
# module's fixtures are built once, in collection order, files holding `slow` tests first (tests/conftest.py).
# The ten slowest tests are listed at the end. `make test PYTEST_WORKERS=0` runs in one process.
PYTEST_WORKERS ?= 2
test: venv
	$(VPY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10

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
	$(VPY) bench/bench_prompt_switch.py
	PYTHONPATH=. $(VPY) bench/dry_run.py
	$(VPY) bench/bench_routing.py --time --repeats 3 --time-prompts 8 --threads 1 --out outputs/routing_timed.json

# The pack in two real ComfyUIs (0.3.64 in .e2e/ComfyUI or COMFYUI_PATH, and the LTS fork 0.12.1 in .e2e/lts; built
# there when missing) and its UI workflows in the real frontends: see scripts/e2e.sh.
e2e:
	bash scripts/e2e.sh

# On a lent GPU: the CUDA-only tests and bench/real_size.py (resident, fp8, offload, 2 lanes) in <= 9 min -> outputs/gpu_check/.
# With COMFYUI_PATH (a ComfyUI checkout) and GPU_CHECK_PYTHON (a Python that runs it), the MODEL path there first:
# ComfyUI's loader, a scaled-fp8 target with real fp8 matmuls, a bf16 drafter (scripts/gpu_model_path.py).
GPU_CHECK_PYTHON ?= $(VPY)
gpu-check: venv
	$(GPU_CHECK_PYTHON) scripts/gpu_check.py --out outputs/gpu_check $(if $(COMFYUI_PATH),--comfyui $(COMFYUI_PATH))

clean:
	rm -rf $(VENV) build *.egg-info

demo: venv
	$(VPY) -m sdvg_engine.toy.demo --out outputs
