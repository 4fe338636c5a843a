#!/bin/sh
# Run a command with a Docker engine answering: when `docker info` fails, start dockerd (as
# root; its log in /var/tmp), wait until it answers, run the command, then stop the dockerd it
# started (by its PID) and wait for it to exit. An engine that was already running is used and
# left running. The command's exit status is this script's.
#
#   docker/with_engine.sh make images
set -u
if docker info >/dev/null 2>&1; then
    exec "$@"
fi
command -v dockerd >/dev/null 2>&1 || { echo "error: no dockerd (make deploy-deps)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "error: starting dockerd needs root" >&2; exit 2; }
log=$(mktemp /var/tmp/fedcompress-dockerd.XXXXXX.log)
dockerd >"$log" 2>&1 &
pid=$!
stop() {
    kill "$pid" 2>/dev/null || true
    i=0
    while kill -0 "$pid" 2>/dev/null && [ $i -lt 60 ]; do sleep 1; i=$((i + 1)); done
    kill -9 "$pid" 2>/dev/null || true
}
trap stop EXIT INT TERM
i=0
until docker info >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null || [ $i -ge 60 ]; then
        echo "error: dockerd did not answer within 60 s; its log: $log" >&2
        tail -20 "$log" >&2
        exit 1
    fi
    sleep 1
    i=$((i + 1))
done
echo "started dockerd (pid $pid, log $log); it is stopped at the end"
"$@"
status=$?
exit $status
