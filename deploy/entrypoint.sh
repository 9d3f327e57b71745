#!/usr/bin/env bash
# Container start: prefer the node's own kernel headers (the host's /lib/modules and /usr/src, mounted
# read-only under /host), else the node half of scripts/install links the image's Debian headers; then
# mounts tracefs if needed, and runs rankscope. The cluster analyzer needs none of it.
set -euo pipefail
cd /opt/rankscope
if [ "${1:-}" = agent ]; then
    kernel=$(uname -r)
    build=/host/lib/modules/$kernel/build
    if [ ! -e "/lib/modules/$kernel/build" ] && [ -e "$build" ]; then
        target=$(readlink "$build" || true)  # absolute on the host: /usr/src/linux-headers-...
        case "$target" in /*) target=/host$target ;; "") target=$build ;; *) target=$build ;; esac
        if [ -e "$target/Makefile" ]; then
            mkdir -p "/lib/modules/$kernel"
            ln -sfn "$target" "/lib/modules/$kernel/build"
        fi
    fi
    scripts/install --node
fi
exec rankscope "$@"
