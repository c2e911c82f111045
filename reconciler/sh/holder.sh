#!/bin/sh
# shellcheck source-path=SCRIPTDIR
# reconciler: the holder of a run's host lock (host/lock.py). Installed once per host by content
# (/var/lib/reconciler/bin/<sha>.sh) and started by each run that changes the host (launch.sh),
# over its own SSH connection, for the whole host run: it lives exactly as long as the
# controller's hold on the host. It takes `flock` on $LOCK (waiting at most `wait` seconds; else
# says BUSY and who holds it), counts itself in $COUNT and names itself in $OWNER before anything
# changes, says LOCKED, runs the run's first program (its observation under the lock) unless the
# count was still the one the run's look saw (`since`: it says `same`), then keeps the lock while
# the run talks to it: where bash exists, as the run's command loop (session.sh, sourced: one
# shell for the whole host run), else reading heartbeats with `timeout head` (two processes each).
#
# As it lets go (EOF, a signal, $IDLE seconds of silence) it empties the owner file and arms
# the dead-man's switch of every deploy on the host that got no verdict (plan/confirm.py): the
# controller went.
#
# stdin, named parameters (one a line, then an empty line):
#   token    the token of its records: "TOKEN LOCKED [bash] [same]", "TOKEN BUSY OWNER-LINE"
#   wait     seconds to wait for the lock
#   since    the lock's count as the run's look saw it (absent: it looked at none)
#   owner    who this run is (host name, PID, start time: no secrets)
#   session  the path of session.sh (installed beside it)
#   then     a program run once the lock is held (the observation, an in_session program: this
#            shell runs it in a subshell): it reads its own parameters
#            from the same stdin, which follow these (skipped when it does not run)
# Constants (the sender's, from reconciler/plan/layout.py): LOCK, COUNT, OWNER, CONFIRM, REARM, IDLE.
set -u
T='' wait_s=0 since='' me='' session='' then=''
params T=token wait_s=wait since me=owner session 'then'

let_go() {
  : > "$OWNER"
  p=
  for s in "$CONFIRM"/*.sh; do [ ! -f "$s" ] || p=1; done
  if [ -n "$p" ] && [ -f "$REARM" ]; then
    trap '' HUP TERM INT PIPE      # the systemd-run it starts is not cut short by the session's end
    /bin/sh "$REARM" 'armed as the controller went' </dev/null >/dev/null 2>&1
  fi
}

{ [ -d "${LOCK%/*}" ] || mkdir -p "${LOCK%/*}"; } && exec 9>>"$LOCK" || exit 1
if ! flock -w "$wait_s" 9; then
  who=
  { read -r who < "$OWNER"; } 2>/dev/null
  printf '%s BUSY %s\n' "$T" "$who"
  exit 0
fi
# counted before it changes anything: a look that saw this count and finds it unmoved stands
g=0
[ ! -f "$COUNT" ] || { read -r g < "$COUNT" || :; }
case $g in ''|*[!0-9]*) n=1 ;; *) n=$((g + 1)) ;; esac
{ echo "$n" > "$COUNT"; } 2>/dev/null || rm -f "$COUNT"
same=
[ -z "$since" ] || [ "$g" != "$since" ] || same=same
printf '%s\n' "$me" > "$OWNER"
shell=
[ -z "${BASH_VERSION:-}" ] || [ ! -f "$session" ] || shell=bash
printf '%s LOCKED %s %s\n' "$T" "$shell" "$same"
if [ -n "$then" ]; then
  if [ -z "$same" ]; then
    # it reads its own parameters, the lines after these. Read by this shell in a subshell, with
    # no sh of its own (a process fewer: `then` is a program bash runs as sh does, in_session)
    # shellcheck source=/dev/null  # the observation, installed by content
    (set +u; . "$then") 2>/dev/null
  else
    params      # not run: its parameters are read and skipped
  fi
fi
if [ -n "$shell" ]; then
  # shellcheck source=session.sh
  . "$session"
  exit 0
fi
trap 'let_go; exit 129' HUP TERM PIPE
while line=$(timeout "$IDLE" head -n 1) && [ -n "$line" ]; do :; done
let_go
