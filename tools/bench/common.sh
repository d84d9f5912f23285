# Sourced by the benchmarks (convert.sh, read.sh) from the repository root: where
# things are. Sets ROOT, CACHE (the first argument, default /tmp/smp-bench), BIN
# (SMP_BIN, default build/bin) and PY (SMP_PY, default the oracle venv under
# ~/.cache/smp, made by tools/bootstrap.sh when missing), and installs GNU time (for
# peak RSS) when it is missing.
ROOT=$PWD
CACHE=${1:-/tmp/smp-bench}
BIN=${SMP_BIN:-$ROOT/build/bin}
# the venv of today's pins (bootstrap.sh names it by their hash; an older one may lie beside it)
PY=${SMP_PY:-"$(tools/bootstrap.sh | tail -1)/bin/python"}
if [ ! -x /usr/bin/time ]; then
    echo "installing GNU time (for peak RSS)"; apt-get install -y time >/dev/null
fi

# A VM whose kernel runs a DAMON "pageout" scheme pages out memory idle for a while,
# the page cache of a checkpoint included: a "warm" command may then read from disk.
# Prints one line saying so (nothing elsewhere).
damon_note() {
    local k c s age aggr
    for k in /sys/kernel/mm/damon/admin/kdamonds/*; do
        [ "$(cat "$k/state" 2>/dev/null)" = on ] || continue
        for c in "$k"/contexts/*; do
            for s in "$c"/schemes/*; do
                [ "$(cat "$s/action" 2>/dev/null)" = pageout ] || continue
                age=$(cat "$s/access_pattern/age/min" 2>/dev/null || echo 0)
                aggr=$(cat "$c/monitoring_attrs/intervals/aggr_us" 2>/dev/null || echo 0)
                echo "note: DAMON pages out memory idle for $((age * aggr / 1000000)) s or more ($s): page caches left idle that long are read from disk again"
                return
            done
        done
    done
}
