# shellcheck shell=bash
# reconciler: the command loop of a run's host lock holder (host/session.py), in bash: `read -t`
# and `read -N` cost no process per frame. Sourced by holder.sh once it holds the lock, in the
# same shell (fd 9 holds the lock; no command gets it: one that leaves a process behind does not
# keep the lock). Frames from the run on stdin:
#
#   R <token> <command bytes> <input bytes, or -> then the command, then its input
#   F ...                                         as R: a read this shell runs itself (here())
#   K                                             kill the running command (a time-out)
#   .                                             heartbeat
#   (empty line, EOF, or $IDLE s of silence)      kill any running command, let go
#
# A command's stdout and stderr go to the channel's own streams, each ended by its token's END
# record: "<token> END <exit status>" on stdout, "<token> END" on stderr, right after the
# command's last byte (no newline of its own in front: each record is one write, so one SSH
# packet, where bash's line-buffered printf wrote a newline in front as a write, and a packet,
# of its own). Every command's token begins with the holder's own ($T), which no command's
# output holds, so the ends are found by one text wherever they start.
# The command text and its input come on the channel, never on a command line, and no file
# holds them. Each runs in the background in a process group of its own (so a kill reaches all
# of it), while the loop goes on reading heartbeats. Once it reads frames it says "$T READY" on
# stderr (what the holder wrote there before is not a command's). A command is any shell text:
# `sh -c ...` as in a channel of its own, or a program's own text, which this bash runs itself
# (no sh of its own: host/session.py). Needs from holder.sh: T (its token), IDLE (seconds),
# let_go (what it runs as it ends). The warm daemon's standing session (no lock) is this loop
# with those three set in front of it, on a kept connection of its own (host/pool.py).
# shellcheck disable=SC2154  # T and IDLE are set by holder.sh, which sources this file

HERE_MAX=60000    # bytes of input given as a here-string: under a pipe's 64 KiB
exec 4>&2 2>/dev/null
printf '%s READY\n' "$T" >&4
set -m
shopt -s lastpipe
pid=
stop() {  # the last command's process group, TERM, while its leader is this shell's child and
  # has not begun to write its ends (no frame says a command's end was read: its leader names
  # itself "ended" first, so one that is still on its way out is told apart from one that runs;
  # the PID of one that was reaped may since be another process's; /proc: no process to ask)
  [ -n "$pid" ] || return 0
  ppid='' name=''
  while read -r k v; do
    case $k in Name:) name=$v ;; PPid:) ppid=$v; break ;; esac
  done < "/proc/$pid/status"
  [ "$ppid" != "$$" ] || [ "$name" = ended ] || kill -TERM -- "-$pid"
  pid=
}
trap 'stop; let_go' EXIT
begin() {  # token: in a command's group, before the command: its ends, written by the group's
  # EXIT trap (an `exit` in the command ends it too), the token written into the trap as it is
  # set (a command this shell runs itself may set any variable); the host's clock for the
  # command from bash's own printf (apply's @@now: no `date` process). The group's leader names
  # itself "ended" before its ends (stop: what it left running stays)
  # shellcheck disable=SC2064  # expanded now, on purpose
  trap "s=\$?; printf ended 2>/dev/null >/proc/self/comm; printf '%s END %s\n' $1 \$s; printf '%s END\n' $1 >&2" EXIT
  printf -v RECONCILER_NOW '%(%s)T' -1; export RECONCILER_NOW
}
here() {  # token input-size: an F frame's program (the standing session's reads: host/session.py)
  # run by this shell itself, in the foreground, with no process of its own: a daemon's round
  # costs the host its systemctl alone. Only for a program that sets every name it reads and
  # never exits, execs or sets a trap (frames.HostProgram.in_session). No K reaches it (nothing
  # reads frames meanwhile): a time-out leaves the session, as for any command.
  local -x RECONCILER_NOW
  printf -v RECONCILER_NOW '%(%s)T' -1
  in_here "$2"
  printf '%s END %s\n' "$1" "$?"     # here()'s own $1: what the program set was in_here's
  printf '%s END\n' "$1" >&4
}
in_here() {  # input-size: the program; the loop's names are local here (what it sets of them is
  # gone as it returns), and so are its positional parameters, its options (local -) and IFS
  local more=$1 cmd=$cmd inp=$inp tok='' line='' size='' kind='' pid=$pid IFS -
  set +m
  if [ "$more" = - ]; then
    eval "$cmd" 2>&4 4>&- 9>&- </dev/null
  else
    eval "$cmd" 2>&4 4>&- 9>&- <<< "${inp%$'\n'}"
  fi
}
while IFS= read -r -t "$IDLE" line && [ -n "$line" ]; do
  case $line in
  [RF]\ *)
    read -r kind tok size more <<< "$line"
    case $tok in ''|*[!0-9a-f:]*) break ;; esac
    cmd='' inp=''
    [ "$size" = 0 ] || LC_ALL=C read -r -N "$size" cmd || break
    case $more in -|0) ;; *) LC_ALL=C read -r -N "$more" inp || break ;; esac
    if [ "$kind" = F ] && { [ "$more" = - ] || [ "$more" -le "$HERE_MAX" ]; }; then
      here "$tok" "$more"
      continue
    fi
    if [ "$more" = - ]; then
      {
        begin "$tok"
        eval "$cmd" 4>&- 9>&-
      } </dev/null 2>&4 &
    elif [ "$more" -le "$HERE_MAX" ]; then
      # Input that fits a pipe: a here-string, which bash writes into a pipe itself (no process,
      # and no file), its final newline the input's own (one is added where it has none).
      {
        begin "$tok"
        eval "$cmd" 4>&- 9>&- <<< "${inp%$'\n'}"
      } </dev/null 2>&4 &
    else
      {   # more than a pipe holds: bash would put a here-string in a temp file; never a file
        begin "$tok"
        printf %s "$inp" | eval "$cmd" 4>&- 9>&-
      } </dev/null 2>&4 &
    fi
    # The loop keeps no job of its own: a command's group is known by its PID alone. A job
    # table kept for each command that ran grows for as long as the loop lives (the daemon's
    # standing session: a command a round), and so does the cost of every fork.
    pid=$!; disown -a ;;
  K) stop ;;
  esac
done
