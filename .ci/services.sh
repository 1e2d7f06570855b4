#!/usr/bin/env bash
# Services the test suite uses: installs redis-server (Debian package) if it is missing. CI runs this before
# pytest. Idempotent and quiet; always exits 0: when it cannot install, it says why and the Redis tests skip
# with that reason. It starts nothing (the tests start their own server on a loopback port).
set -u
if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
        SUDO="sudo -n"
    else
        echo "services.sh: redis-server is missing and this user is not root (no passwordless sudo): Redis tests will skip"
        exit 0
    fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "services.sh: redis-server is missing and apt-get is not available: Redis tests will skip"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
log="$(mktemp)"
if ! $SUDO apt-get update -qq >"$log" 2>&1; then
    echo "services.sh: apt-get update failed (offline?): Redis tests will skip; last lines:"
    tail -n 3 "$log"
    rm -f "$log"
    exit 0
fi
if ! $SUDO apt-get install -y -qq --no-install-recommends redis-server >"$log" 2>&1; then
    echo "services.sh: apt-get install redis-server failed: Redis tests will skip; last lines:"
    tail -n 3 "$log"
    rm -f "$log"
    exit 0
fi
rm -f "$log"
command -v redis-server >/dev/null 2>&1 || echo "services.sh: redis-server still not on PATH after install"
exit 0
