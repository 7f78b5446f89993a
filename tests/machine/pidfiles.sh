# Daemons by their pid files, for tests/machine/slurm-up.sh and tests/machine/hosts-up.sh (sourced, not run).

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pidfile() {  # stop the daemon whose pid is in $1 (only that pid), wait up to 10 s
  local pid
  alive "$1" || { rm -f "$1"; return 0; }
  pid=$(cat "$1")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
  rm -f "$1"
}
