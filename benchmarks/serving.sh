# Sourced by the benchmark scripts that serve Conveyor themselves.

# start_server LOG ARGS...: `conveyor serve ARGS` in the background, writing LOG; sets $server.
# Exits the script if http://127.0.0.1:$PORT/health does not answer within 300 s.
start_server() {
    local log=$1
    shift
    conveyor serve "$@" > "$log" 2>&1 &
    server=$!
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && return
        sleep 1
    done
    echo "the server did not start; see $log" >&2
    exit 1
}

# stop_server: SIGTERM (a drain) and wait for it to exit.
stop_server() {
    kill -TERM "$server"
    wait "$server" || true
}
