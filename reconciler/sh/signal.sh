#!/bin/sh
# Signals to stray GPU holders, and which of them are still alive (reconciler/host/gpu.py:
# kill_strays runs this, Signal reads it). Builtins only: no process per PID.
#
# stdin, named parameters (one a line, then an empty line): token; action (term: SIGTERM each
# holder whose name is still the one seen, since PIDs are reused; kill: SIGKILL each; alive:
# say which are alive, a zombie counting as gone: it released its devices); holder (repeated:
# "PID NAME", NAME the process's comm as it was seen; kill and alive read the PID only).
#
# Per PID: "TOKEN S PID" (signalled), "TOKEN F PID" (the signal could not be sent), or
# "TOKEN A PID" (alive). The last line is "TOKEN END".
T='' action='' holders=''
nl='
'
params T=token action holders+=holder
IFS=$nl
set -f
for h in $holders; do
  p=${h%% *} name=${h#* }
  case $p in ''|*[!0-9]*) continue ;; esac
  case $action in
    term)
      c=
      { IFS= read -r c < "/proc/$p/comm"; } 2>/dev/null
      if [ -z "$c" ] || [ "$c" != "$name" ]; then continue; fi
      if kill -TERM "$p" 2>/dev/null; then printf '%s S %s\n' "$T" "$p"; else printf '%s F %s\n' "$T" "$p"; fi ;;
    kill)
      if kill -KILL "$p" 2>/dev/null; then printf '%s S %s\n' "$T" "$p"; else printf '%s F %s\n' "$T" "$p"; fi ;;
    alive)
      st=
      { IFS= read -r st < "/proc/$p/stat"; } 2>/dev/null
      st=${st##*) }
      case $st in ''|Z*) ;; *) printf '%s A %s\n' "$T" "$p" ;; esac ;;
  esac
done
printf '%s END\n' "$T"
