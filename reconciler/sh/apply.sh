#!/bin/sh
# reconciler: the executor's program (host/apply.py runs it, host/script.py writes its steps).
# Sent as one script on the stdin of `sh -s`: this file, its constants and named parameters
# (assignments the sender puts after it: T, the token of its records; RC_PAUSE_*, fault
# injection only), then the plan's steps, one call of a function below a line, with named
# arguments (NAME=value words). Each step reports itself: "$T step N" on stderr (what the step
# printed there follows), "$T ok N" / "$T fail N STATUS" for a systemctl step (soft: the script
# goes on), "$T fatal N STATUS" for a file step (the script stops there). The script ends with
# "$T now EPOCH" ... "$T S -", systemd's reading of the units it started, as it is, and "$T END".
# Constants (the sender's, from reconciler/plan/layout.py and host/): STATE, CREDSTORE, KEPT,
# REMOVED, TRANSIENT, WANTS, REARM_PATH, REARM_LINK, REARM_SCRIPT, LOCK_OWNER, WATCH_PROPS, TEMP, SWITCH,
# CONFIRM.
# shellcheck disable=SC2034  # the named arguments each function resets, some unused by it
set -u
umask 022
TMPS='' BATCH='' DEFERRED='' DEFERRED_STEP='' STEP='' N=0
nl='
'
mark() { STEP=$1; printf '%s step %s\n' "$T" "$1" >&2; }   # what follows on stderr is step $1's
# shellcheck disable=SC2086  # TMPS: a list of this script's own temp paths (no blanks), split on purpose
cleanup() { [ -z "$TMPS" ] || rm -f $TMPS 2>/dev/null; true; }
trap cleanup EXIT
# A dropped SSH connection (controller killed) ends the script through these, running cleanup:
# writes are atomic, so no file is ever half-written, and the next run re-plans from the host.
trap 'exit 129' HUP INT TERM PIPE
fatal() { printf '%s fatal %s %s\n' "$T" "$1" "$2"; exit 1; }
reported() {  # step status: a soft step's end (ok, or its failure; the script goes on)
  if [ "$2" = 0 ]; then printf '%s ok %s\n' "$T" "$1"; else printf '%s fail %s %s\n' "$T" "$1" "$2"; fi
}
pause() { [ -z "${1:-}" ] || sleep "$1"; }   # fault injection only (faults.py); no-op otherwise

# Named arguments: each NAME=value word sets $NAME, for the NAMEs the calling function lists
# (it sets each to its default first); any other name is refused. The value is assigned from
# the word, never parsed as shell.
args() {  # "NAME..." WORD...
  _names=" $1 "; shift
  for _w; do
    _k=${_w%%=*}
    case $_names in *" $_k "*) ;; *) printf 'unknown argument %s\n' "$_k" >&2; return 2 ;; esac
    eval "$_k=\${_w#*=}"
  done
}

# ---- writing files atomically ------------------------------------------------------------------
# A temp file beside $1 that no other run's script names ($$: this shell's PID, unique while it
# runs), in root's own directories, so nobody else can plant one there; never one left by a
# killed run of the same PID (it is created anew, so its mode is the umask's). Sets d and t.
tmp_beside() {
  d=${1%/*}; [ -d "$d" ] || mkdir -p "$d" || return 1
  N=$((N + 1)); t="$d/$TEMP.$$.$N"
  while [ -e "$t" ] || [ -L "$t" ]; do N=$((N + 1)); t="$d/$TEMP.$$.$N"; done
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

# ---- the steps: files (a failure stops the script) ---------------------------------------------
write_file() {  # step path mode text | base64: one file written atomically, by itself
  step='' path='' mode=0644 text='' base64=''
  args "step path mode text base64" "$@" || fatal "$STEP" 2
  settle
  mark "$step"
  if [ -n "$base64" ]; then atomic_write "$path" "$mode" "$base64"; else atomic_text "$path" "$mode" "$text"; fi \
    || fatal "$step" $?
}
# A batch: consecutive file steps staged (no process), then `commit`: one fsync of every temp (and
# of the directories of the batch before: it is on disk before any of these is renamed), a
# rename each, and the fsync of their directories left to the next batch or file step, or to
# the end (`settle`: every file step settles first; a systemctl step changes no file, so a
# restart between two batches costs no fsync of its own). Each file is still replaced atomically, and a batch is on disk before the
# next one's renames: the intents, a batch of their own, before any file they announce. Paths
# in a batch are plain (no blank: host/script.py sends any other by itself, `write`).
stage_file() {  # step path mode text
  step='' path='' mode=0644 text=''
  args "step path mode text" "$@" || fatal "$STEP" 2
  [ "$step" = "$STEP" ] || mark "$step"
  stage "$path" "$mode" "$text" || fatal "$step" $?
  BATCH="$BATCH$step $t $path$nl"
}
commit() {  # the staged files, renamed into place
  first=${BATCH%% *} temps='' dirs='' last=''
  IFS=$nl
  for b in $BATCH; do b=${b#* }; temps="$temps ${b%% *}"; done
  unset IFS
  [ "$STEP" = "$first" ] || mark "$first"
  # shellcheck disable=SC2086  # DEFERRED and temps: lists of plain paths, split on purpose
  sync $DEFERRED $temps || fatal "$first" $?
  DEFERRED=''
  pause "${RC_PAUSE_AFTER_TEMP:-}"
  IFS=$nl
  for b in $BATCH; do
    unset IFS
    s=${b%% *} b=${b#* }; tmp=${b%% *} path=${b#* }
    [ "$STEP" = "$s" ] || mark "$s"
    mv -f "$tmp" "$path" || fatal "$s" $?
    case " $dirs " in *" ${path%/*} "*) ;; *) dirs="$dirs ${path%/*}" ;; esac
    last=$s
    IFS=$nl
  done
  unset IFS
  BATCH='' TMPS='' DEFERRED=${dirs# } DEFERRED_STEP=$last
  pause "${RC_PAUSE_AFTER_RENAME:-}"
}
settle() {  # the last batch's directories, on disk (before a file step that is no batch, and at the end)
  # shellcheck disable=SC2086
  [ -z "$DEFERRED" ] || sync $DEFERRED || fatal "$DEFERRED_STEP" $?
  DEFERRED=''
}
drop_record() {  # step service: the record of a service no longer in the inventory, and its adopted originals
  step='' service=''
  args "step service" "$@" || fatal "$STEP" 2
  [ "$STEP" = "$step" ] || mark "$step"
  rm -rf "$STATE/services/$service.json" "$STATE/adopted/$service" || fatal "$step" $?
}
remove_stale() {  # step path: a temp file a killed run left, only if it was there before this run's
  # holder took the lock (its owner file's time): nothing of this run's own, nor of a switch
  # that holds the lock after it
  step='' path=''
  args "step path" "$@" || fatal "$STEP" 2
  settle
  mark "$step"
  # shellcheck disable=SC3013  # -nt: dash's and bash's test both have it
  { [ ! -e "$path" ] && [ ! -L "$path" ]; } || [ "$path" -nt "$LOCK_OWNER" ] || rm -f "$path" || fatal "$step" $?
}
remove() {  # step path [backup]: a file removed (a drop-in someone else wrote is kept at backup
  # first), and its .service.d directory when that is left empty
  step='' path='' backup=''
  args "step path backup" "$@" || fatal "$STEP" 2
  settle
  mark "$step"
  if [ -n "$backup" ]; then { mkdir -p "${backup%/*}" && cp -p "$path" "$backup"; } || fatal "$step" $?; fi
  rm -f "$path" || fatal "$step" $?
  case ${path%/*} in *.service.d) rmdir "${path%/*}" 2>/dev/null ;; esac
  true
}
copy_file() {  # step from to: a file copied atomically (an adopted unit's original kept, or put back)
  step='' from='' to=''
  args "step from to" "$@" || fatal "$STEP" 2
  settle
  mark "$step"
  atomic_copy "$from" "$to" || fatal "$step" $?
}
mask() {  # step path: a masked unit's link put back
  step='' path=''
  args "step path" "$@" || fatal "$STEP" 2
  settle
  mark "$step"
  ln -sfn /dev/null "$path" || fatal "$step" $?
}
reload() {  # step: systemd reads the unit files again
  step=''
  args "step" "$@" || fatal "$STEP" 2
  settle
  mark "$step"
  pause "${RC_PAUSE_BEFORE_RELOAD:-}"
  systemctl daemon-reload || fatal "$step" $?
}
refuse() {  # step message: a step that cannot be done (what it says goes with the failure)
  step='' message=''
  args "step message" "$@" || fatal "$STEP" 2
  mark "$step"
  printf '%s\n' "$message" >&2
  fatal "$step" 1
}

# ---- the steps: a service's secrets -------------------------------------------------------------
# Each age secret's value to a root-only file (0600 in a 0700 directory, written atomically: the
# value comes on the script's stdin, never on a command line), the environment file composed on
# the host from those files and the referenced ones, and nothing else left in its credstore.
# What was there is kept aside first for the deploy's dead-man's switch (confirm.sh puts it
# back); the verdict deletes it.
secrets_aside() {  # step service [remove]: what the service had, kept aside; remove: and gone
  step='' service='' remove=''
  args "step service remove" "$@" || fatal "$STEP" 2
  settle
  mark "$step"
  svc=$CREDSTORE/$service env=$CREDSTORE/$service.env
  { (umask 077; mkdir -p "$KEPT") && chmod 0700 "$CREDSTORE" "$KEPT" && rm -rf "${KEPT:?}/$service" "$KEPT/$service.env"; } \
    || fatal "$step" $?
  if [ -n "$remove" ]; then rm -rf "$svc" "$env" || fatal "$step" $?; return; fi
  { { [ ! -e "$svc" ] || cp -a "$svc" "$KEPT/$service"; } && { [ ! -e "$env" ] || cp -p "$env" "$KEPT/$service.env"; } \
    && (umask 077; mkdir -p "$svc") && chmod 0700 "$svc"; } || fatal "$step" $?
}
secret() {  # step service name base64: one value, root's alone
  step='' service='' name='' base64=''
  args "step service name base64" "$@" || fatal "$STEP" 2
  atomic_write "$CREDSTORE/$service/$name" 0600 "$base64" || fatal "$step" $?
}
secrets_env() {  # step service keep env: the rest of its credstore removed (keep: the names that
  # stay, a word each), and its environment file composed (env: NAME=PATH words), or removed
  step='' service='' keep='' env=''
  args "step service keep env" "$@" || fatal "$STEP" 2
  svc=$CREDSTORE/$service
  for f in "$svc"/* "$svc"/.[!.]*; do
    [ -e "$f" ] || continue
    case " $keep " in *" ${f##*/} "*) ;; *) rm -rf "$f" || fatal "$step" $? ;; esac
  done
  if [ -z "$env" ]; then rm -f "$CREDSTORE/$service.env" || fatal "$step" $?; return; fi
  tmp_beside "$CREDSTORE/$service.env" || fatal "$step" $?
  (umask 077; : > "$t") || fatal "$step" $?
  for e in $env; do env_line "${e%%=*}" "${e#*=}" >> "$t" || fatal "$step" $?; done
  { sync "$t" && mv -f "$t" "$CREDSTORE/$service.env" && sync "$CREDSTORE"; } || fatal "$step" $?
  TMPS=${TMPS%" $t"}
}
env_line() {  # NAME file: NAME="value" for an EnvironmentFile= (systemd's double-quote escapes)
  [ -f "$2" ] || { echo "$2 does not exist" >&2; return 1; }
  v=$(cat "$2") || return 1
  printf '%s="' "$1"; printf '%s' "$v" | sed 's/[\\"`$]/\\&/g'; printf '"\n'
}

# ---- the steps: dead-man's switches (plan/confirm.py) -------------------------------------------
stop_if_armed() {  # service: queue the stop of a switch's timer and service only where one is
  # loaded (a holder armed it as its controller went, or it fired and waits for the lock): a
  # builtin test of their transient unit files, no systemctl otherwise
  n=$SWITCH-$1
  if [ -e "$TRANSIENT/$n.timer" ] || [ -e "$TRANSIENT/$n.service" ]; then
    systemctl stop --no-block "$n.timer" "$n.service" >/dev/null 2>&1 || :
  fi
}
arm_timer() {  # step service script unit: the timer itself is made only if the controller goes
  # (the lock holder's last act runs the re-arm script); here a timer an earlier controller's
  # holder left armed is stopped, and once per host the unit and script that arm pending switches
  # (at boot, and for the holder) are installed (script, unit: their texts). The unit only matters
  # at the next boot (no daemon-reload); the link first, the unit file last, so a cut-short
  # install is done again. Both files staged, one fsync of both, then one of their directories.
  # Installed already (every deploy but a host's first): no file written, so the last batch's
  # directories stay deferred (settle) to the next file step or the end, as across a restart.
  step='' service='' script='' unit=''
  args "step service script unit" "$@" || fatal "$STEP" 2
  mark "$step"
  if [ ! -f "$REARM_PATH" ]; then
    settle
    { { [ -d "${REARM_LINK%/*}" ] || mkdir -p "${REARM_LINK%/*}"; } && ln -sfn "$REARM_PATH" "$REARM_LINK" \
      && stage "$REARM_SCRIPT" 0644 "$script" && r1=$t && stage "$REARM_PATH" 0644 "$unit" && r2=$t \
      && sync "$r1" "$r2" && mv -f "$r1" "$REARM_SCRIPT" && mv -f "$r2" "$REARM_PATH" \
      && TMPS=${TMPS%" $r2"} && TMPS=${TMPS%" $r1"} && sync "${REARM_SCRIPT%/*}" "${REARM_PATH%/*}"; } \
      || fatal "$step" $?
  fi
  stop_if_armed "$service"
}
disarm() {  # step service [wait]: a switch disarmed: the timer (wait: stopped, and the stop waited
  # for, as the plan's own disarms do; else queued where one is loaded: a verdict's), a run it may
  # have started, its files (and an older reconciler's unit files) and the secrets kept aside
  step='' service='' wait=''
  args "step service wait" "$@" || fatal "$STEP" 2
  [ -z "$step" ] || { settle; mark "$step"; }
  n=$SWITCH-$service
  if [ -n "$wait" ]; then systemctl stop "$n.timer" "$n.service" >/dev/null 2>&1; else stop_if_armed "$service"; fi
  rm -rf "$CONFIRM/$service.sh" "$UNIT_DIR/$n.service" "$UNIT_DIR/$n.timer" "$WANTS/$n.timer" \
    "${KEPT:?}/$service" "$KEPT/$service.env"
  true
}

# ---- the steps: systemctl (a failure is reported, and the script goes on) ----------------------
# A start or restart waits for its job at most `wait` seconds (the script's JOB_WAIT shared
# out): a job done by then (a Type=simple or exec start, a quick stop) leaves the watch's first
# reading settled, with no poll after it; a longer one (a slow stop, Type=notify's wait for
# READY=1) goes on in systemd, which does not cancel a job when its client goes, and the watch
# waits for it. A job that ran and failed is no step failure: the watch judges the unit (a crash,
# a refused start), as after a queued one. Without timeout(1), queued (--no-block).
job() {  # seconds systemctl-arguments... (its variables are jw, je, jr: sh has no locals)
  jw=$1; shift
  command -v timeout >/dev/null 2>&1 || { systemctl "$@" --no-block; return; }
  je=$(timeout "$jw" systemctl "$@" 2>&1) && return 0
  jr=$?
  [ "$jr" != 124 ] || return 0
  case "$je" in "Job for "*|"A dependency job for "*) return 0 ;; esac
  printf '%s\n' "$je" >&2; return "$jr"
}
stop() {  # step unit
  step='' unit=''
  args "step unit" "$@" || fatal "$STEP" 2
  mark "$step"
  systemctl stop "$unit"; r=$?
  [ "$r" != 0 ] || systemctl reset-failed "$unit" 2>/dev/null
  reported "$step" "$r"
}
enable() {  # step unit [off]: enabled (off: disabled)
  step='' unit='' off=''
  args "step unit off" "$@" || fatal "$STEP" 2
  mark "$step"
  if [ -n "$off" ]; then systemctl disable --quiet --no-reload "$unit"; else systemctl enable --quiet --no-reload "$unit"; fi
  reported "$step" $?
}
start() {  # step unit wait [fresh] [restart]: started (fresh: never before, so no failed state to
  # clear), or restarted
  step='' unit='' wait=1 fresh='' restart=''
  args "step unit wait fresh restart" "$@" || fatal "$STEP" 2
  mark "$step"
  if [ -n "$restart" ]; then job "$wait" restart "$unit"
  else { [ -n "$fresh" ] || systemctl reset-failed "$unit" 2>/dev/null; } ; job "$wait" start "$unit"; fi
  reported "$step" $?
}
enable_now() {  # step start unit wait [fresh]: steps `step` (enable) and `start` of one service in
  # one systemctl. Where that fails (not its start job: job() judges that as the watch's), each
  # step runs by itself, as without the pairing, so the failure is reported by its own step.
  step='' start='' unit='' wait=1 fresh=''
  args "step start unit wait fresh" "$@" || fatal "$STEP" 2
  mark "$step"
  [ -n "$fresh" ] || systemctl reset-failed "$unit" 2>/dev/null
  if job "$wait" enable --now --quiet --no-reload "$unit" >/dev/null 2>&1; then
    reported "$step" 0; reported "$start" 0; return
  fi
  systemctl enable --quiet --no-reload "$unit"; reported "$step" $?
  s=$start; start step="$s" unit="$unit" wait="$wait" ${fresh:+fresh=1}
}

# ---- the beginning and the end -----------------------------------------------------------------
now() {  # the host's clock: the session's bash gives it (session.sh, no process), else `date`
  printf '%s now %s\n' "$T" "${RECONCILER_NOW:-$(date +%s)}"
}
finish() {  # units: the last directories on disk, then systemd's reading of the units the
  # script started (the health watch's first reading, in the same round trip; never fatal)
  units=''
  args "units" "$@" || fatal "$STEP" 2
  settle
  mark 'done'
  printf '%s S -\n' "$T"
  # shellcheck disable=SC2086  # units: unit names, a word each
  [ -z "$units" ] || systemctl show -p "$WATCH_PROPS" $units 2>/dev/null
  printf '\n%s END\n' "$T"
}
