#!/usr/bin/env bash
# Make (or refresh) the virtual environment that every make target uses.
#
# torch, in this order:
#   1. a torch the environment can already import is kept as it is (a user's CUDA build
#      included): the venv sees the host Python's packages when the host has torch;
#   2. TORCH_INDEX_URL, when set, is the index torch is installed from (for example
#      https://download.pytorch.org/whl/cu128 for a CUDA 12.8 build);
#   3. on Linux without an NVIDIA GPU (no nvidia-smi, no /dev/nvidia*), the CPU build from
#      PyTorch's CPU index (https://download.pytorch.org/whl/cpu), so a CPU machine never
#      downloads the multi-gigabyte CUDA build and nvidia-* packages that PyPI's Linux torch brings;
#      where that index cannot be reached, the "+cpu" release (torch==2.13.0+cpu) from the
#      sources pip is configured with: PyPI has no "+cpu" releases, so this too can only be a
#      CPU build, and pip stops with an error if no source has one;
#   4. otherwise (an NVIDIA GPU, or macOS, whose PyPI wheels have no CUDA) torch from PyPI.
# pip's own configuration (find-links, extra indexes, constraints) applies in every case, so a
# machine that keeps wheels on local disk still installs from them.
set -euo pipefail

venv=${VENV:-.venv}
python=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
cpu_index=https://download.pytorch.org/whl/cpu

has_nvidia_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && return 0
  compgen -G '/dev/nvidia[0-9]*' >/dev/null
}

reachable() {  # whether the URL answers within a few seconds (pip would retry for minutes)
  "$venv/bin/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
    "$1" >/dev/null 2>&1
}

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
elif [ -n "${TORCH_INDEX_URL:-}" ]; then
  echo "setup: installing $torch_spec from $TORCH_INDEX_URL (TORCH_INDEX_URL)"
  "${pip[@]}" install "$torch_spec" --index-url "$TORCH_INDEX_URL"
elif [ "$(uname -s)" = Linux ] && ! has_nvidia_gpu; then
  if reachable "$cpu_index/"; then
    echo "setup: no NVIDIA GPU found: installing $torch_spec, CPU build, from $cpu_index"
    "${pip[@]}" install "$torch_spec" --index-url "$cpu_index"
  else
    cpu_spec=$torch_spec
    [[ $torch_spec =~ ^torch==[0-9.]+$ ]] && cpu_spec="$torch_spec+cpu"
    echo "setup: no NVIDIA GPU found and $cpu_index cannot be reached: installing $cpu_spec from pip's configured sources"
    "${pip[@]}" install "$cpu_spec" || {
      echo "setup: no CPU build of torch found; set TORCH_INDEX_URL to an index that has one, or install torch first" >&2
      exit 1
    }
  fi
else
  echo "setup: installing $torch_spec from PyPI (the CUDA build on Linux)"
  "${pip[@]}" install "$torch_spec"
fi

echo "setup: installing interlace and its development tools"
"${pip[@]}" install -e ".[dev]" 2>&1 | { grep -v "^WARNING: Location" || true; }
"$venv/bin/python" -c 'import interlace, torch; print(f"setup: interlace {interlace.__version__} with torch {torch.__version__} ready in '"$venv"'")'
