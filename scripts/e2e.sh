#!/usr/bin/env bash
# The real-ComfyUI check: tests/test_comfyui_e2e.py against a ComfyUI server built from the checkout named by
# COMFYUI_PATH (every shipped workflow run over HTTP, interrupt, tau-only replay, queue-time errors), and every UI
# workflow loaded into ComfyUI's own frontend in headless Chromium (screenshots in .e2e/screenshots/).
#
# Builds its environment once, in .e2e/venv (ignored by git; about 6.5 GB): torch 2.14.1 + torchvision 0.29.1,
# ComfyUI's requirements (torchaudio left out: no build for that torch; only core audio nodes need it), this pack
# (editable) and Playwright, which drives Debian's chromium (apt-get install chromium).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
ENV=${SDVG_E2E_ENV:-$ROOT/.e2e/venv}

if [ -z "${COMFYUI_PATH:-}" ] || [ ! -f "$COMFYUI_PATH/main.py" ]; then
  echo "make e2e: set COMFYUI_PATH to a ComfyUI checkout (tested: v0.3.64, Comfy-Org/ComfyUI a125cd84)," >&2
  echo "  e.g. a clone of Comfy-Org/ComfyUI at tag v0.3.64: COMFYUI_PATH=~/ComfyUI make e2e" >&2
  exit 2
fi
COMFYUI_PATH=$(cd "$COMFYUI_PATH" && pwd)
CHROMIUM=${SDVG_CHROMIUM:-$(command -v chromium || true)}
if [ -z "$CHROMIUM" ]; then
  echo "make e2e: no chromium on PATH; install Debian's: apt-get install chromium (or set SDVG_CHROMIUM)" >&2
  exit 2
fi

stamp="$ENV/.sdvg-e2e-$(cat "$COMFYUI_PATH/requirements.txt" pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "building the ComfyUI environment in $ENV (once; several GB)"
  python3 -m venv "$ENV"
  "$ENV/bin/pip" install -q "torch==2.14.1" "torchvision==0.29.1"
  grep -v -E '^(torch|torchvision|torchaudio)([<>=!~ ].*)?$' "$COMFYUI_PATH/requirements.txt" > "$ENV/comfyui-requirements.txt"
  "$ENV/bin/pip" install -q -r "$ENV/comfyui-requirements.txt"
  "$ENV/bin/pip" install -q -e ".[test,video]" playwright
  touch "$stamp"
fi

mkdir -p .e2e
rm -rf .e2e/run
started=$(date +%s)
COMFYUI_PATH="$COMFYUI_PATH" COMFYUI_PYTHON="$ENV/bin/python" SDVG_E2E_UI=1 SDVG_CHROMIUM="$CHROMIUM" \
  SDVG_E2E_SCREENSHOTS="$ROOT/.e2e/screenshots" \
  "$ENV/bin/python" -m pytest -q -s -p no:cacheprovider --basetemp=.e2e/run tests/test_comfyui_e2e.py "$@"
echo "real-ComfyUI check: $(( $(date +%s) - started )) s; screenshots in .e2e/screenshots/"

# The UI check again in the current frontend (comfyui-frontend-package from PyPI, served by the same server with
# --front-end-root): SDVG_E2E_FRONTEND_VERSION picks it, SDVG_E2E_FRONTEND_ROOT names an unpacked static/ folder
# instead, SDVG_E2E_FRONTEND_VERSION=none skips it.
FE_VERSION=${SDVG_E2E_FRONTEND_VERSION:-1.58.1}
if [ "$FE_VERSION" != none ]; then
  FE_ROOT=${SDVG_E2E_FRONTEND_ROOT:-$ROOT/.e2e/fe/$FE_VERSION/comfyui_frontend_package/static}
  if [ ! -f "$FE_ROOT/index.html" ]; then
    "$ENV/bin/pip" download -q --no-deps "comfyui-frontend-package==$FE_VERSION" -d "$ROOT/.e2e/fe"
    "$ENV/bin/python" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
      "$ROOT/.e2e/fe/comfyui_frontend_package-$FE_VERSION-py3-none-any.whl" "$ROOT/.e2e/fe/$FE_VERSION"
  fi
  started=$(date +%s)
  rm -rf .e2e/run-fe
  COMFYUI_PATH="$COMFYUI_PATH" COMFYUI_PYTHON="$ENV/bin/python" SDVG_E2E_UI=1 SDVG_CHROMIUM="$CHROMIUM" \
    SDVG_E2E_FRONTEND_ROOT="$FE_ROOT" SDVG_E2E_SCREENSHOTS="$ROOT/.e2e/screenshots/frontend-$FE_VERSION" \
    "$ENV/bin/python" -m pytest -q -s -p no:cacheprovider --basetemp=.e2e/run-fe tests/test_comfyui_e2e.py \
    -k test_ui_workflows_load_in_the_real_frontend "$@"
  echo "UI check in frontend $FE_VERSION: $(( $(date +%s) - started )) s; screenshots in .e2e/screenshots/frontend-$FE_VERSION/"
fi
