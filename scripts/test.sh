#!/usr/bin/env bash
# The whole test suite: every package with the race detector, the Bazel
# end-to-end tests included (they say loudly when Bazel is missing).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v bazel >/dev/null; then
  echo "############################################################" >&2
  echo "# WARNING: bazel is not installed: the end-to-end tests with #" >&2
  echo "# the real Bazel client will be SKIPPED. As root, make test  #" >&2
  echo "# installs bazel-bootstrap; otherwise apt-get install it.    #" >&2
  echo "############################################################" >&2
fi

# -p 1: packages share one PostgreSQL and two cores; in parallel their
# timing-sensitive fault tests starve each other.
go test -race -count=1 -p 1 -timeout 20m ./... ./schemas/...
