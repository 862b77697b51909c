#!/usr/bin/env bash
# Make (or refresh) the virtual environment that every make target uses.
#
# torch: a torch the environment can already import is kept as it is (a user's CUDA build
# included). Otherwise the CPU build of torch 2.13.0 is installed: pip prefers the local "+cpu"
# wheel where the machine holds one, and TORCH_INDEX_URL (for example
# https://download.pytorch.org/whl/cpu) points pip at a CPU-only index elsewhere, so a CPU machine
# never downloads a multi-gigabyte CUDA build by accident.
set -euo pipefail

venv=${VENV:-.venv}
python=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x "$venv/bin/python" ]; then
  venv_flags=()
  # Reuse a torch the host Python already has (typically a CUDA build) instead of replacing it.
  if "$python" -c 'import torch' >/dev/null 2>&1; then
    venv_flags+=(--system-site-packages)
    echo "setup: reusing the host's torch $("$python" -c 'import torch; print(torch.__version__)')"
  fi
  "$python" -m venv "${venv_flags[@]}" "$venv"
fi

pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
if "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
  echo "setup: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') already present, kept"
else
  echo "setup: installing $torch_spec (CPU build)"
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${pip[@]}" install "$torch_spec" --index-url "$TORCH_INDEX_URL"
  else
    "${pip[@]}" install "$torch_spec"
  fi
fi

echo "setup: installing interlace and its development tools"
"${pip[@]}" install -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
"$venv/bin/python" -c 'import interlace, torch; print(f"setup: interlace {interlace.__version__} with torch {torch.__version__} ready in '"$venv"'")'
