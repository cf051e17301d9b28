#!/usr/bin/env bash
# Compares two revisions of millrace with the bench's A/B mode:
#
#   scripts/bench-ab.sh <rev-a> [<rev-b>] [-- <bench flags>]
#
# builds the millrace binary of rev-a (A) and of rev-b, or of the working
# tree when rev-b is not given (B), as `make build` does; a revision is
# built in a git worktree in a temporary directory outside the repository,
# removed afterwards. Then it runs the working tree's bench in A/B mode,
#   go run ./loadtest/cmd/bench -a A -b B <bench flags>
# (the bench itself and natsd are the working tree's: only the binary
# under test differs). See loadtest/README.md, "A/B: comparing two
# revisions".
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  echo "usage: scripts/bench-ab.sh <rev-a> [<rev-b>] [-- <bench flags>]" >&2
  exit 2
}
[ $# -ge 1 ] && [ "$1" != -- ] || usage
rev_a=$1
shift
rev_b=
if [ $# -gt 0 ] && [ "$1" != -- ]; then
  rev_b=$1
  shift
fi
if [ $# -gt 0 ]; then
  [ "$1" = -- ] || usage
  shift
fi

tmp=$(mktemp -d)
worktrees=()
cleanup() {
  for w in ${worktrees[@]+"${worktrees[@]}"}; do
    git worktree remove --force "$w" >/dev/null 2>&1 || true
  done
  git worktree prune
  rm -rf "$tmp"
}
trap cleanup EXIT

# build_rev <rev> <name>: $tmp/millrace-<name>, built from rev in a
# worktree of its own.
build_rev() {
  local rev=$1 name=$2 src
  if ! git rev-parse --verify --quiet "$rev^{commit}" >/dev/null; then
    echo "bench-ab: $rev is not a revision" >&2
    exit 2
  fi
  src="$tmp/src-$name"
  git worktree add --detach --quiet "$src" "$rev"
  worktrees+=("$src")
  echo "bench-ab: building $name from $rev ($(git rev-parse --short "$rev^{commit}"))"
  (cd "$src" && go build -ldflags "-X main.version=$(git describe --always)" -o "$tmp/millrace-$name" ./cmd/millrace)
  git worktree remove --force "$src"
}

build_rev "$rev_a" a
if [ -n "$rev_b" ]; then
  build_rev "$rev_b" b
else
  echo "bench-ab: building b from the working tree"
  go build -ldflags "-X main.version=$(git describe --always --dirty)" -o "$tmp/millrace-b" ./cmd/millrace
fi
go run ./loadtest/cmd/bench -a "$tmp/millrace-a" -b "$tmp/millrace-b" "$@"
