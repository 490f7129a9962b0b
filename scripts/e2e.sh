#!/usr/bin/env bash
# The real-ComfyUI check, on three ComfyUIs: 0.3.64 (Comfy-Org/ComfyUI, Oct 2025), the LTS fork 0.12.1
# (hiddenswitch/pip-and-uv-installable-ComfyUI, Feb 2026) and upstream 0.33.0 (yzkee/ComfyUI mirror, Aug 2026). For each:
#   1. tests/test_comfyui_e2e.py against a server started from that checkout: every shipped workflow over HTTP
#      (the file loaders and the ComfyUI-native MODEL workflows with tiny LoRAs), MODEL path == the pack's loaders,
#      LoRA == offline merge, GGUF Q8_0 == its dequantised reference, interrupt, replay, queue-time errors, and every
#      UI workflow loaded into the server's own frontend in headless Chromium (screenshots in .e2e/screenshots/<name>/);
#   2. tests/test_comfy_model.py (the MODEL adapter in process) and tests/test_load_order.py (load order and room:
#      real-size models, simulated cards) under that ComfyUI's interpreter, when present;
#   3. on 0.3.64 the UI check again in the current frontend (comfyui-frontend-package 1.58.1, --front-end-root); the
#      LTS fork's own frontend is that package already.
#
# Ready installs are reused; missing ones are built (network needed then):
#   .e2e/ComfyUI + .e2e/venv      ComfyUI 0.3.64 (COMFYUI_PATH overrides the checkout), torch 2.14.1, ComfyUI's
#                                 requirements (no torchaudio: no build for that torch; only core audio nodes need it),
#                                 gguf, this pack (editable), Playwright
#   .e2e/lts + .e2e/lts-venv      the LTS fork at LTS_COMMIT (SDVG_E2E_LTS_PATH overrides), installed editable with the
#                                 constraints below (about 4.5 min from scratch)
#   .e2e/upstream + .e2e/upstream-venv   ComfyUI 0.33.0 (SDVG_E2E_UP33_PATH overrides the checkout), torch 2.14.1 and
#                                 torchaudio (0.33.0's comfy.sd imports it), its requirements (comfy-aimdo, comfy-kitchen,
#                                 frontend 1.49.6), gguf, this pack (editable), Playwright
#   <checkout>/custom_nodes/ComfyUI-GGUF   city96/ComfyUI-GGUF at GGUF_COMMIT, in 0.3.64 and 0.33.0: it does not import
#                                 in the LTS fork (its folder_names_and_paths.get(key, default) raises there), whose core
#                                 reads .gguf files itself (Load Diffusion Model loads them). Without access to GitHub,
#                                 SDVG_E2E_GGUF_GIT names a local clone (any clone that has GGUF_COMMIT).
# Chromium: Debian's (apt-get install chromium) or SDVG_CHROMIUM.
# SDVG_E2E_COMFYUIS="0.3.64 lts 0.33.0" picks which to run; extra arguments go to pytest (e.g. -k native).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
mkdir -p .e2e

LTS_REPO=https://github.com/hiddenswitch/pip-and-uv-installable-ComfyUI
LTS_COMMIT=87606c5f028b7e8d474ea78279c75a788c04267c   # 0.12.1
UPSTREAM_REPO=https://github.com/Comfy-Org/ComfyUI
UPSTREAM_TAG=v0.3.64
GGUF_REPO=${SDVG_E2E_GGUF_GIT:-https://github.com/city96/ComfyUI-GGUF}
GGUF_COMMIT=795e45156ece99afbc3efef911e63fcb46e6a20d
FE_VERSION=${SDVG_E2E_FRONTEND_VERSION:-1.58.1}

say() { printf '\n== %s\n' "$*"; }
die() { echo "make e2e: $*" >&2; exit 2; }

CHROMIUM=${SDVG_CHROMIUM:-$(command -v chromium || true)}
[ -n "$CHROMIUM" ] || die "no chromium on PATH; install Debian's: apt-get install chromium (or set SDVG_CHROMIUM)"

# ---- ComfyUI 0.3.64 ----------------------------------------------------------------------------------------------
prepare_upstream() {
  UP_PATH=${COMFYUI_PATH:-$ROOT/.e2e/ComfyUI}
  if [ ! -f "$UP_PATH/main.py" ]; then
    say "ComfyUI $UPSTREAM_TAG: not in $UP_PATH; cloning $UPSTREAM_REPO (set COMFYUI_PATH to use another checkout)"
    git clone -q --depth 1 --branch "$UPSTREAM_TAG" "$UPSTREAM_REPO" "$UP_PATH" \
      || die "could not clone ComfyUI $UPSTREAM_TAG into $UP_PATH; clone it yourself and set COMFYUI_PATH"
  fi
  UP_PATH=$(cd "$UP_PATH" && pwd)
  UP_ENV=${SDVG_E2E_ENV:-$ROOT/.e2e/venv}
  build_requirements_env "$UPSTREAM_TAG" "$UP_PATH" "$UP_ENV"
  "$UP_ENV/bin/python" -c "import gguf" 2>/dev/null || "$UP_ENV/bin/pip" install -q gguf || die "pip install gguf failed"
  install_gguf_nodes "$UP_PATH"
}

build_requirements_env() {  # label, checkout, venv, extra torch packages...: a venv from the checkout's requirements.txt
  local label=$1 path=$2 env=$3; shift 3
  local stamp="$env/.sdvg-e2e-$(cat "$path/requirements.txt" pyproject.toml | sha256sum | cut -c1-16)"
  if [ -f "$stamp" ]; then
    echo "ComfyUI $label: reusing $path and $env"
    return
  fi
  say "building the ComfyUI $label environment in $env (once; several GB)"
  python3 -m venv "$env" || die "python3 -m venv failed"
  "$env/bin/pip" install -q "torch==2.14.1" "torchvision==0.29.1" "$@" || die "torch install failed"
  grep -v -E '^(torch|torchvision|torchaudio)([<>=!~ ].*)?$' "$path/requirements.txt" > "$env/comfyui-requirements.txt"
  "$env/bin/pip" install -q -r "$env/comfyui-requirements.txt" || die "ComfyUI $label's requirements failed to install"
  "$env/bin/pip" install -q -e ".[test,video]" playwright gguf || die "the pack / playwright / gguf failed to install"
  touch "$stamp"
}

install_gguf_nodes() {  # city96/ComfyUI-GGUF into $1/custom_nodes, at GGUF_COMMIT
  local dest="$1/custom_nodes/ComfyUI-GGUF"
  if [ -f "$dest/nodes.py" ]; then
    echo "ComfyUI-GGUF: reusing $dest"
    return
  fi
  say "ComfyUI-GGUF: cloning $GGUF_REPO into $dest"
  local tmp="$ROOT/.e2e/gguf-src"
  rm -rf "$tmp"
  git clone -q "$GGUF_REPO" "$tmp" && git -C "$tmp" -c advice.detachedHead=false checkout -q "$GGUF_COMMIT" \
    || die "could not get ComfyUI-GGUF from $GGUF_REPO (set SDVG_E2E_GGUF_GIT to a local clone)"
  mkdir -p "$dest" && git -C "$tmp" archive HEAD | tar x -C "$dest"
  rm -rf "$tmp"
}

# ---- the LTS fork 0.12.1 -----------------------------------------------------------------------------------------
write_lts_constraints() {
  # The fork pins protobuf<5 while opentelemetry-proto >= 1.28 needs protobuf >= 5 (a plain install is
  # ResolutionImpossible): the OpenTelemetry family is held at 1.27.0 / 0.48b0. Instrumentation 0.48b0 imports
  # pkg_resources (setuptools<81); sentencepiece > 0.2.0 ships protobuf-5 code, imported at start.
  cat > "$1" <<'EOF'
torch==2.14.1
torchvision==0.29.1
protobuf<5
setuptools<81
sentencepiece==0.2.0
aio-pika<10
opentelemetry-api==1.27.0
opentelemetry-sdk==1.27.0
opentelemetry-proto==1.27.0
opentelemetry-exporter-otlp==1.27.0
opentelemetry-exporter-otlp-proto-common==1.27.0
opentelemetry-exporter-otlp-proto-grpc==1.27.0
opentelemetry-exporter-otlp-proto-http==1.27.0
opentelemetry-propagator-jaeger==1.27.0
opentelemetry-semantic-conventions==0.48b0
opentelemetry-instrumentation==0.48b0
opentelemetry-instrumentation-aio-pika==0.48b0
opentelemetry-instrumentation-requests==0.48b0
opentelemetry-instrumentation-aiohttp-server==0.48b0
opentelemetry-instrumentation-aiohttp-client==0.48b0
opentelemetry-instrumentation-asyncio==0.48b0
opentelemetry-instrumentation-urllib3==0.48b0
opentelemetry-distro==0.48b0
opentelemetry-util-http==0.48b0
opentelemetry-processor-baggage==0.48b0
EOF
}

prepare_lts() {
  LTS_PATH=${SDVG_E2E_LTS_PATH:-$ROOT/.e2e/lts}
  if [ ! -f "$LTS_PATH/main.py" ]; then
    say "LTS fork: not in $LTS_PATH; cloning $LTS_REPO at $LTS_COMMIT"
    # A clone writes every file but a few large ones (sageattention wheels, a webp, a tokenizer json, an npz) and then
    # reports a failed checkout where those blobs are unavailable: harmless for a CPU server, so main.py decides.
    git clone -q --no-checkout "${SDVG_E2E_LTS_GIT:-$LTS_REPO}" "$LTS_PATH" || die "could not clone $LTS_REPO"
    git -C "$LTS_PATH" -c advice.detachedHead=false checkout -q "$LTS_COMMIT" 2>/dev/null \
      || echo "(some large files of the fork were not checked out; not needed on the CPU)"
    [ -f "$LTS_PATH/main.py" ] || die "the LTS checkout in $LTS_PATH has no main.py"
  fi
  LTS_PATH=$(cd "$LTS_PATH" && pwd)
  LTS_ENV=${SDVG_E2E_LTS_ENV:-$ROOT/.e2e/lts-venv}
  local stamp="$LTS_ENV/.sdvg-e2e-$(cat "$LTS_PATH/pyproject.toml" pyproject.toml | sha256sum | cut -c1-16)"
  if [ ! -f "$stamp" ]; then
    say "building the LTS fork's environment in $LTS_ENV (once; about 4.5 min, several GB)"
    python3 -m venv "$LTS_ENV" || die "python3 -m venv failed"
    write_lts_constraints "$LTS_ENV/constraints.txt"
    local pip=("$LTS_ENV/bin/pip" install -q -c "$LTS_ENV/constraints.txt")
    "${pip[@]}" torch==2.14.1 torchvision==0.29.1 torchaudio || die "torch install failed"
    "${pip[@]}" -e "$LTS_PATH" || die "installing the LTS fork failed"
    "${pip[@]}" -e ".[test,video]" gguf playwright || die "the pack / gguf / playwright failed to install"
    touch "$stamp"
  else
    echo "LTS fork: reusing $LTS_PATH and $LTS_ENV"
  fi
  if [ -d "$LTS_PATH/custom_nodes/ComfyUI-GGUF" ]; then
    echo "note: $LTS_PATH/custom_nodes/ComfyUI-GGUF fails to import in the LTS fork; the GGUF tests use core's GGUF loading there"
  fi
}

# ---- upstream ComfyUI 0.33.0 -------------------------------------------------------------------------------------
# A plain mirror of upstream at 0.33.0 (Aug 2026): core's causal Wan (comfy/ldm/wan/ar_model.py), dynamic VRAM
# (comfy-aimdo; off on the CPU) and mixed-precision ops. Two large tokenizer blobs are missing from the mirror; nothing
# here reads them. ComfyUI-GGUF is installed there as in 0.3.64.
UP33_REPO=${SDVG_E2E_UP33_GIT:-https://github.com/yzkee/ComfyUI}
prepare_upstream33() {
  UP33_PATH=${SDVG_E2E_UP33_PATH:-$ROOT/.e2e/upstream}
  if [ ! -f "$UP33_PATH/main.py" ]; then
    say "ComfyUI 0.33.0: not in $UP33_PATH; cloning $UP33_REPO"
    git clone -q --no-checkout "$UP33_REPO" "$UP33_PATH" || die "could not clone $UP33_REPO"
    git -C "$UP33_PATH" checkout -q HEAD -- . 2>/dev/null || echo "(some large files were not checked out; not needed)"
    [ -f "$UP33_PATH/main.py" ] || die "the 0.33.0 checkout in $UP33_PATH has no main.py"
  fi
  UP33_PATH=$(cd "$UP33_PATH" && pwd)
  grep -q '"0.33.0"' "$UP33_PATH/comfyui_version.py" || echo "note: $UP33_PATH is not 0.33.0: $(tail -1 "$UP33_PATH/comfyui_version.py")"
  UP33_ENV=${SDVG_E2E_UP33_ENV:-$ROOT/.e2e/upstream-venv}
  # torchaudio too: 0.33.0's comfy/sd.py imports it at start (an LTX audio VAE); its newest build (2.11.1) asks for
  # torch>=2.11 and imports with 2.14.1.
  build_requirements_env 0.33.0 "$UP33_PATH" "$UP33_ENV" torchaudio
  "$UP33_ENV/bin/python" -c "import torchaudio" 2>/dev/null || "$UP33_ENV/bin/pip" install -q "torch==2.14.1" torchaudio \
    || die "pip install torchaudio failed (0.33.0's comfy.sd imports it)"
  install_gguf_nodes "$UP33_PATH"
}

# ---- runs --------------------------------------------------------------------------------------------------------
SUMMARY=()
FAILED=0
run_pytest() {  # label, python, comfyui path, basetemp, env..., -- pytest args
  local label=$1 py=$2 path=$3 base=$4; shift 4
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local log="$ROOT/.e2e/$(echo "$label" | tr ' /:' '___').log"
  rm -rf "$base"
  local started=$(date +%s)
  env "${envs[@]}" COMFYUI_PATH="$path" COMFYUI_PYTHON="$py" "$py" -m pytest -q -s -p no:cacheprovider \
    --basetemp="$base" "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  local seconds=$(( $(date +%s) - started ))
  local result=$(grep -E '^[0-9]+ (passed|failed)|^=* *[0-9]+ (passed|failed)|(passed|failed|error|skipped).* in [0-9.]+s' "$log" | tail -1)
  SUMMARY+=("$label: ${result:-no result} (${seconds} s, exit $rc; log $log)")
  [ "$rc" -eq 0 ] || FAILED=1
}

check_comfyui() {  # name, checkout, venv
  local name=$1 path=$2 env=$3 shots="$ROOT/.e2e/screenshots/$1"
  local common=(SDVG_E2E_UI=1 SDVG_CHROMIUM="$CHROMIUM" SDVG_E2E_SCREENSHOTS="$shots")
  case "$name" in 0.3.64|0.33.0) common+=(SDVG_E2E_REQUIRE_GGUF=1) ;; esac
  say "ComfyUI $name ($path): the server-level check"
  run_pytest "ComfyUI $name: server e2e" "$env/bin/python" "$path" "$ROOT/.e2e/run-$name" "${common[@]}" -- \
    tests/test_comfyui_e2e.py "${PYTEST_ARGS[@]}"
  if [ -f tests/test_comfy_model.py ]; then
    say "ComfyUI $name: tests/test_comfy_model.py in process"
    run_pytest "ComfyUI $name: test_comfy_model.py" "$env/bin/python" "$path" "$ROOT/.e2e/run-$name-inproc" -- \
      tests/test_comfy_model.py "${PYTEST_ARGS[@]}"
  fi
  if [ -f tests/test_load_order.py ]; then
    say "ComfyUI $name: tests/test_load_order.py in process (load order and room, real-size models on simulated cards)"
    run_pytest "ComfyUI $name: test_load_order.py" "$env/bin/python" "$path" "$ROOT/.e2e/run-$name-load-order" -- \
      tests/test_load_order.py "${PYTEST_ARGS[@]}"
  fi
  say "ComfyUI $name: scripts/gpu_model_path.py --tiny (make gpu-check's MODEL path, an fp8 card emulated)"
  local started=$(date +%s)
  "$env/bin/python" scripts/gpu_model_path.py --comfyui "$path" --tiny --repeats 1 --out "$ROOT/.e2e/model-path-$name" \
    > "$ROOT/.e2e/model-path-$name.log" 2>&1
  local rc=$?
  SUMMARY+=("ComfyUI $name: gpu_model_path.py --tiny: exit $rc ($(( $(date +%s) - started )) s; log .e2e/model-path-$name.log)")
  [ "$rc" -eq 0 ] || FAILED=1
  if [ "$name" = "0.3.64" ] && [ "$FE_VERSION" != none ]; then
    # The UI check again in the current frontend, served by the same server with --front-end-root:
    # SDVG_E2E_FRONTEND_VERSION picks it, SDVG_E2E_FRONTEND_ROOT names an unpacked static/ folder, none skips it.
    local fe_root=${SDVG_E2E_FRONTEND_ROOT:-$ROOT/.e2e/fe/$FE_VERSION/comfyui_frontend_package/static}
    if [ ! -f "$fe_root/index.html" ]; then
      "$env/bin/pip" download -q --no-deps "comfyui-frontend-package==$FE_VERSION" -d "$ROOT/.e2e/fe" \
        || die "could not download comfyui-frontend-package==$FE_VERSION"
      "$env/bin/python" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
        "$ROOT/.e2e/fe/comfyui_frontend_package-$FE_VERSION-py3-none-any.whl" "$ROOT/.e2e/fe/$FE_VERSION"
    fi
    say "ComfyUI $name: the UI check in frontend $FE_VERSION"
    run_pytest "ComfyUI $name: UI in frontend $FE_VERSION" "$env/bin/python" "$path" "$ROOT/.e2e/run-$name-fe" \
      "${common[@]}" SDVG_E2E_FRONTEND_ROOT="$fe_root" SDVG_E2E_SCREENSHOTS="$shots/frontend-$FE_VERSION" -- \
      tests/test_comfyui_e2e.py -k test_ui_workflows_load_in_the_real_frontend "${PYTEST_ARGS[@]}"
  fi
}

PYTEST_ARGS=("$@")
# SDVG_E2E_PREPARE_ONLY=1 builds the checkouts and environments and runs nothing.
check() { [ -n "${SDVG_E2E_PREPARE_ONLY:-}" ] || check_comfyui "$@"; }
for which in ${SDVG_E2E_COMFYUIS:-0.3.64 lts 0.33.0}; do
  case "$which" in
    0.3.64) prepare_upstream && check 0.3.64 "$UP_PATH" "$UP_ENV" ;;
    lts) prepare_lts && check 0.12.1-lts "$LTS_PATH" "$LTS_ENV" ;;
    0.33.0) prepare_upstream33 && check 0.33.0 "$UP33_PATH" "$UP33_ENV" ;;
    *) die "SDVG_E2E_COMFYUIS: unknown '$which' (use 0.3.64, lts and/or 0.33.0)" ;;
  esac
done

say "summary"
printf '%s\n' "${SUMMARY[@]}"
echo "screenshots: .e2e/screenshots/<ComfyUI>/ (look at them)"
exit $FAILED
