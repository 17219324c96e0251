#!/usr/bin/env bash
# The README's test command (.ci/run) as a machine that has never run blink would run it: a new clone of the
# repository's committed HEAD, an empty /tmp (a private tmpfs, in a mount namespace of its own) and an empty HOME (no
# pip, model, llama.cpp wheel, Ray or browser caches; only pip's configuration is copied, so the package registries
# stay reachable). Nothing an earlier run left behind can then hide a missing step. Run it after any change to setup,
# caches, Ray or servers (docs/testing.md).
#   --twice  then .ci/run again from a second new clone on the same "machine" (the same HOME and /tmp): what the first
#            run left behind must not break the second.
# After the runs it lists what was left in /tmp and what HOME holds, so a temp folder a run forgot shows up.
# Usage: bash tools/fresh-machine.sh [--twice] [REPO_DIR]   (as root: unshare and mount need it)
set -u
runs=1
[ "${1:-}" = "--twice" ] && { runs=2; shift; }
repo=$(cd "${1:-.}" && git rev-parse --show-toplevel) || exit 2
[ "$(id -u)" = 0 ] || { echo "run as root (unshare --mount and mount need it)" >&2; exit 2; }
work=$(mktemp -d /var/tmp/blink-fresh.XXXX)
mkdir -p "$work/home"
if [ -d "$HOME/.config/pip" ]; then mkdir -p "$work/home/.config" && cp -r "$HOME/.config/pip" "$work/home/.config/"; fi
echo "fresh machine: $(git -C "$repo" log --oneline -1 | cut -c1-80)"
echo "work folder $work (clones, HOME, logs); /tmp empty; $runs run(s) of .ci/run"
unshare --mount --propagation private bash -c '
  repo=$1 work=$2 runs=$3
  mount -t tmpfs -o size=8g tmpfs /tmp || { echo "could not mount an empty /tmp"; exit 3; }
  rc=0
  for n in $(seq 1 "$runs"); do
    git clone -q "$repo" "$work/clone-$n" || exit 2
    start=$(date +%s)
    (cd "$work/clone-$n" && HOME="$work/home" CI=true bash .ci/run </dev/null >"$work/ci-$n.log" 2>&1)
    rc=$?
    echo "run $n: rc=$rc in $(( $(date +%s) - start )) s, log $work/ci-$n.log"
    grep -v "^WARNING: Location" "$work/ci-$n.log" | tail -n 2
    [ $rc = 0 ] || break
  done
  echo "left in /tmp:"; (cd /tmp && find . -mindepth 1 -maxdepth 2 | sort | sed "s/^/  /")
  echo "in HOME:"; (cd "$work/home" && du -sh $(find . -mindepth 2 -maxdepth 2 | sort) 2>/dev/null | sed "s/^/  /")
  exit $rc' _ "$repo" "$work" "$runs"
