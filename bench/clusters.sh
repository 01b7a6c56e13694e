# Throwaway local clusters for the bench scripts (sourced, not run). Needs
# BINDIR (the server's binaries) and PSQL. Makes $work: 0700 and owned by the
# server's user (the native worker's socket admits only that uid, so
# trellara runs as it too); every cluster under it is stopped on exit.
work=$(mktemp -d /var/tmp/trellara-bench.XXXXXX)
chmod 0700 "$work"
chown trellara:trellara "$work"
as_pg() { runuser -u trellara -- "$@"; }
cleanup() {
    local pid
    # A script's own teardown (a writer to stop) goes first.
    if declare -F cleanup_first >/dev/null; then cleanup_first; fi
    for pid in "$work"/*/postmaster.pid; do
        [[ -f $pid ]] && as_pg "$BINDIR/pg_ctl" -D "${pid%/postmaster.pid}" stop -m immediate >/dev/null 2>&1 || true
    done
    rm -rf "$work"
}
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
start() { # name port [more server options]
    as_pg "$BINDIR/initdb" -D "$work/$1" -U postgres --auth=trust --locale=C -E UTF8 --no-sync >/dev/null
    as_pg "$BINDIR/pg_ctl" -D "$work/$1" -w -l "$work/$1.log" -o "-p $2 -c listen_addresses=127.0.0.1 -c unix_socket_directories=$work -c wal_level=logical -c max_wal_size=4GB ${3:-}" start >/dev/null
}
q() { "$PSQL" -qXtA "$1" -c "$2"; }
# The server options for capture path $1 on major $2: with `native`, the
# extension is installed first (release build) and preloaded.
preload_for() {
    [[ $1 == native ]] || return 0
    local pgc
    pgc=$(scripts/pg-env --pg-config "$2")
    (cd extension && CARGO_TARGET_DIR=${TRELLARA_EXT_TARGET_DIR:-/var/cache/trellara/target-ext} \
        cargo pgrx install --release --pg-config "$pgc" --no-default-features --features "pg$2" >/dev/null)
    # Builds that restrict output plugins (Debian's 15.20, 18.6) must
    # list it too.
    if "$BINDIR/postgres" --describe-config 2>/dev/null | grep -q '^output_plugin_libraries'; then
        echo "-c shared_preload_libraries=trellara -c output_plugin_libraries=pgoutput,trellara"
    else
        echo "-c shared_preload_libraries=trellara"
    fi
}
