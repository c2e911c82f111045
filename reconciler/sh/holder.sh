#!/bin/sh
# shellcheck source-path=SCRIPTDIR
# reconciler: the holder of a run's host lock (host/lock.py). Installed once per host by content
# (/var/lib/reconciler/bin/<sha>.sh) and started by each run that changes the host, over its own
# SSH connection, for the whole host run: it lives exactly as long as the controller's hold on
# the host. It takes `flock` on $LOCK (waiting at most $1 seconds; else says BUSY and who holds
# it), counts itself in $COUNT and names itself in $OWNER before anything changes, says
# LOCKED, runs the run's first command (its observation under the lock) unless the count was
# still the one the run's look saw ($2: it says `same`), then keeps the lock while the run
# talks to it: where bash exists, as the run's command loop (session.sh, sourced: one shell for
# the whole host run), else reading heartbeats with `timeout head` (two processes each).
#
# As it lets go (EOF, a signal, $IDLE seconds of silence) it empties the owner file and arms
# the dead-man's switch of every deploy on the host that got no verdict (plan/confirm.py): the
# controller went.
#
#   holder.sh WAIT SINCE OWNER SESSION [PROGRAM ARGS...]
#     WAIT     seconds to wait for the lock
#     SINCE    the lock's count as the run's look saw it ("" when it looked at none)
#     OWNER    who this run is (host name, PID, start time: no secrets)
#     SESSION  the path of session.sh (installed beside it)
#     PROGRAM  a program run once the lock is held (the observation), with its ARGS
set -u
D=/var/lib/reconciler
LOCK=$D/.lock
COUNT=$D/.lock.count
OWNER=$D/.lock.owner
CONFIRM=$D/confirm
REARM=$D/rearm-switches.sh
IDLE=30

wait_s=$1 since=$2 owner=$3 session=$4
shift 4

let_go() {
  : > "$OWNER"
  p=
  for s in "$CONFIRM"/*.sh; do [ ! -f "$s" ] || p=1; done
  if [ -n "$p" ] && [ -f "$REARM" ]; then
    trap '' HUP TERM INT PIPE      # the systemd-run it starts is not cut short by the session's end
    /bin/sh "$REARM" 'armed as the controller went' </dev/null >/dev/null 2>&1
  fi
}

{ [ -d "$D" ] || mkdir -p "$D"; } && exec 9>>"$LOCK" || exit 1
if ! flock -w "$wait_s" 9; then
  echo BUSY
  cat "$OWNER" 2>/dev/null
  exit 0
fi
# counted before it changes anything: a look that saw this count and finds it unmoved stands
g=0
[ ! -f "$COUNT" ] || { read -r g < "$COUNT" || :; }
case $g in ''|*[!0-9]*) n=1 ;; *) n=$((g + 1)) ;; esac
{ echo "$n" > "$COUNT"; } 2>/dev/null || rm -f "$COUNT"
same=
[ -z "$since" ] || [ "$g" != "$since" ] || same=same
printf '%s\n' "$owner" > "$OWNER"
shell=
[ -z "${BASH_VERSION:-}" ] || [ ! -f "$session" ] || shell=bash
echo LOCKED $shell $same
if [ -z "$same" ] && [ $# -gt 0 ]; then
  prog=$1
  shift
  (sh "$prog" "$@") </dev/null 2>/dev/null
fi
if [ -n "$shell" ]; then
  # shellcheck source=session.sh
  . "$session"
  exit 0
fi
trap 'let_go; exit 129' HUP TERM PIPE
while line=$(timeout "$IDLE" head -n 1) && [ -n "$line" ]; do :; done
let_go
