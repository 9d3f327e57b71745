# Sourced by the scripts that need root (eBPF, uprobes, apt): a user goes through sudo; root runs on, which a
# fresh machine logged in as root needs, for it may have no sudo at all.
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "$(basename "$0"): must run as root (no sudo here)" >&2; exit 1; }
    exec sudo -- "$0" "$@"
fi
