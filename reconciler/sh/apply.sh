#!/bin/sh
# reconciler: the functions every apply script starts with (host/apply.py sends this, then the
# plan's steps, as one script on the stdin of `sh -s`). Each step reports itself: `step N` on
# stderr, `@@ok N` / `@@fail N STATUS BASE64` for a systemctl step (soft: the script goes on),
# `@@fatal N STATUS` for a file step (the script stops there).
# shellcheck disable=SC2034  # variables the plan's steps set for later steps (t, W1..Wn)
set -u
umask 022
TMPS=""
step() { printf '@@step %s\n' "$1" >&2; }
# shellcheck disable=SC2086  # TMPS: a list of this script's own temp paths (no blanks), split on purpose
cleanup() { [ -z "$TMPS" ] || rm -f $TMPS 2>/dev/null; true; }
trap cleanup EXIT
# A dropped SSH connection (controller killed) ends the script through these, running cleanup:
# writes are atomic, so no file is ever half-written, and the next run re-plans from the host.
trap 'exit 129' HUP INT TERM PIPE
fatal() { printf '@@fatal %s %s\n' "$1" "$2"; exit 1; }
pause() { [ -z "${1:-}" ] || sleep "$1"; }   # fault injection only (faults.py); no-op otherwise
N=0
# A temp file beside $1 that no other run's script names ($$: this shell's PID, unique while it
# runs), in root's own directories, so nobody else can plant one there; never one left by a
# killed run of the same PID (it is created anew, so its mode is the umask's). Sets d and t.
tmp_beside() {
  d=${1%/*}; [ -d "$d" ] || mkdir -p "$d" || return 1
  N=$((N + 1)); t="$d/.reconciler-tmp.$$.$N"
  while [ -e "$t" ] || [ -L "$t" ]; do N=$((N + 1)); t="$d/.reconciler-tmp.$$.$N"; done
  TMPS="$TMPS $t"
}
modes() {  # mode file: made with umask 022 (0644) or 077 (0600); any other mode takes a chmod
  case "$1" in 0644|0600) ;; *) chmod "$1" "$2" ;; esac
}
stage() {  # path mode content: a temp file beside path holding content (printf is a builtin: no
  # process, and the content stays on the script's stdin, off every command line); sets t.
  tmp_beside "$1" || return 1
  # Anything but 0644 is created owner-only first (a secret is never readable by others, not
  # for a moment).
  [ "$2" = 0644 ] || umask 077
  # dash's printf says only "I/O error" when a write fails: once more through cat for the reason
  # (No space left on device) in the step's error
  printf '%s' "$3" 2>/dev/null > "$t" || printf '%s' "$3" | cat > "$t"; r=$?
  umask 022; [ "$r" = 0 ] || return 1
  modes "$2" "$t"
}
put() {  # path: fsync the staged temp $t, rename it over path, fsync the directory
  sync "$t" || return 1
  pause "${RC_PAUSE_AFTER_TEMP:-}"
  mv -f "$t" "$1" && sync "$d" || return 1
  TMPS=${TMPS%" $t"}            # renamed: nothing left for the clean-up to remove
  pause "${RC_PAUSE_AFTER_RENAME:-}"
}
atomic_text() {  # path mode content
  stage "$1" "$2" "$3" && put "$1"
}
atomic_write() {  # path mode base64-content (bytes that are not text: a secret's value)
  tmp_beside "$1" || return 1
  [ "$2" = 0644 ] || umask 077
  base64 -d > "$t" <<EOF
$3
EOF
  r=$?; umask 022; [ "$r" = 0 ] || return 1
  modes "$2" "$t" || return 1
  put "$1"
}
atomic_copy() {  # source destination
  tmp_beside "$2" || return 1
  cp -p "$1" "$t" && sync "$t" && mv -f "$t" "$2" && sync "$d"
}
soft() {  # step-index command...: never stops the script; reports ok or the failure
  i=$1; shift
  if err=$("$@" 2>&1); then printf '@@ok %s\n' "$i"
  else printf '@@fail %s %s %s\n' "$i" "$?" "$(printf '%s' "$err" | tail -n 5 | base64 -w0)"; fi
}
env_line() {  # NAME file: NAME="value" for an EnvironmentFile= (systemd's double-quote escapes)
  [ -f "$2" ] || { echo "$2 does not exist" >&2; return 1; }
  v=$(cat "$2") || return 1
  printf '%s="' "$1"; printf '%s' "$v" | sed 's/[\\"`$]/\\&/g'; printf '"\n'
}
u_stop() { systemctl stop "$1" && { systemctl reset-failed "$1" 2>/dev/null; true; }; }
# A start or restart that waits for its job at most $1 seconds (the script's JOB_WAIT shared out):
# a job done by then (a Type=simple or exec start, a quick stop) leaves the watch's first reading
# settled, with no poll after it; a longer one (a slow stop, Type=notify's wait for READY=1) goes
# on in systemd, which does not cancel a job when its client goes, and the watch waits for it. A
# job that ran and failed is no step failure: the watch judges the unit (a crash, a refused
# start), as after a queued one. Without timeout(1), queued (--no-block).
job() {  # seconds systemctl-arguments... (its variables are jw, je, jr: sh has no locals)
  jw=$1; shift
  command -v timeout >/dev/null 2>&1 || { systemctl "$@" --no-block; return; }
  je=$(timeout "$jw" systemctl "$@" 2>&1) && return 0
  jr=$?
  [ "$jr" != 124 ] || return 0
  case "$je" in "Job for "*|"A dependency job for "*) return 0 ;; esac
  printf '%s\n' "$je" >&2; return "$jr"
}
u_start() { systemctl reset-failed "$2" 2>/dev/null; job "$1" start "$2"; }
