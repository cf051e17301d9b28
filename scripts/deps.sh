#!/usr/bin/env bash
# Installs what a target needs when it is missing, from Debian's packages:
#   run   - PostgreSQL binaries, unless a server answers on 127.0.0.1:5432 or DATABASE_URL is set
#   test  - the above, plus Bazel (bazel-bootstrap, and libnetty-tcnative-jni for its TLS) for the
#           end-to-end tests, Chromium for the console's browser tests, and protoc
#   proto - protoc (protobuf-compiler)
# Without root it only says what is missing.
set -euo pipefail

need=()
have_pg_server() { [ -n "${DATABASE_URL:-}" ] || (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null; }
have_pg_bins() { command -v pg_ctl >/dev/null || ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; }

case "${1:-run}" in
  run)   have_pg_server || have_pg_bins || need+=(postgresql) ;;
  test)  have_pg_server || have_pg_bins || need+=(postgresql)
         command -v bazel >/dev/null || need+=(bazel-bootstrap)
         # Bazel 4.2.3 as Debian packs it speaks TLS (grpcs:// BES) only
         # through OpenSSL: without this JNI library it fails with "JDK
         # provider does not support ALPN protocol".
         ls /usr/lib/*/jni/libnetty-tcnative.so >/dev/null 2>&1 || need+=(libnetty-tcnative-jni)
         command -v chromium >/dev/null || command -v chromium-browser >/dev/null || need+=(chromium)
         command -v protoc >/dev/null || need+=(protobuf-compiler) ;;
  proto) command -v protoc >/dev/null || need+=(protobuf-compiler) ;;
  *) echo "usage: deps.sh run|test|proto" >&2; exit 2 ;;
esac

[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "deps: missing ${need[*]}; install them with: sudo apt-get install ${need[*]}" >&2
  exit 0
fi
echo "deps: installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
