# shellcheck shell=bash
# reconciler: the command loop of a run's host lock holder (host/session.py), in bash: `read -t`
# and `read -N` cost no process per frame. Sourced by holder.sh once it holds the lock, in the
# same shell (fd 9 holds the lock; no command gets it: one that leaves a process behind does not
# keep the lock). Frames from the run on stdin:
#
#   R <token> <command bytes> <input bytes, or -> then the command, then its input
#   D                                             the last command's end was read
#   K                                             kill the running command (a time-out)
#   .                                             heartbeat
#   (empty line, EOF, or $IDLE s of silence)      kill any running command, let go
#
# A command's stdout and stderr go to the channel's own streams, each ended by its token's END
# record on a line of its own: "<token> END <exit status>" on stdout, "<token> END" on stderr.
# Every command's token begins with the holder's own ($T), so the ends are found by one text.
# The command text and its input come on the channel, never on a command line, and no file
# holds them. Each runs in the background in a process group of its own (so a kill reaches all
# of it), while the loop goes on reading heartbeats. Once it reads frames it says "$T READY" on
# stderr (what the holder wrote there before is not a command's). Needs from holder.sh: T (its
# token), IDLE (seconds), let_go (what it runs as it ends).
# shellcheck disable=SC2154  # T and IDLE are set by holder.sh, which sources this file

HERE_MAX=60000    # bytes of input given as a here-string: under a pipe's 64 KiB
exec 4>&2 2>/dev/null
printf '%s READY\n' "$T" >&4
set -m
shopt -s lastpipe
pid=
stop() { [ -z "$pid" ] || kill -TERM -- "-$pid"; pid=; }
trap 'stop; let_go' EXIT
while IFS= read -r -t "$IDLE" line && [ -n "$line" ]; do
  case $line in
  R\ *)
    read -r _ tok size more <<< "$line"
    cmd='' inp=''
    [ "$size" = 0 ] || LC_ALL=C read -r -N "$size" cmd || break
    case $more in -|0) ;; *) LC_ALL=C read -r -N "$more" inp || break ;; esac
    # The group's EXIT trap writes the ends (an `exit` in the command ends it too); the host's
    # clock for the command from bash's own printf (apply's @@now: no `date` process).
    if [ "$more" = - ]; then
      {
        trap 'printf "\n%s END %s\n" "$tok" "$?"; printf "\n%s END\n" "$tok" >&2' EXIT
        printf -v RECONCILER_NOW '%(%s)T' -1; export RECONCILER_NOW
        eval "$cmd" 4>&- 9>&-
      } </dev/null 2>&4 &
    elif [ "$more" -le "$HERE_MAX" ]; then
      # Input that fits a pipe: a here-string, which bash writes into a pipe itself (no process,
      # and no file), its final newline the input's own (one is added where it has none).
      {
        trap 'printf "\n%s END %s\n" "$tok" "$?"; printf "\n%s END\n" "$tok" >&2' EXIT
        printf -v RECONCILER_NOW '%(%s)T' -1; export RECONCILER_NOW
        eval "$cmd" 4>&- 9>&- <<< "${inp%$'\n'}"
      } </dev/null 2>&4 &
    else
      {   # more than a pipe holds: bash would put a here-string in a temp file; never a file
        trap 'printf "\n%s END %s\n" "$tok" "$?"; printf "\n%s END\n" "$tok" >&2' EXIT
        printf -v RECONCILER_NOW '%(%s)T' -1; export RECONCILER_NOW
        printf %s "$inp" | eval "$cmd" 4>&- 9>&-
      } </dev/null 2>&4 &
    fi
    pid=$! ;;
  D) pid= ;;
  K) stop ;;
  esac
done
