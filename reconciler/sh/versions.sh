#!/bin/sh
# Which sglang or vllm a service's own interpreter has (reconciler/host/versions.py:
# probe_command runs this, parse_probe reads it).
#
#   versions.sh TOKEN [SERVICE EXECUTABLE MODULE PYTHONPATH CACHED_STAMP]...
#
# Per service: the stamp (modification times of the interpreter and its package directories)
# and, unless it is CACHED_STAMP, the version PROBE_PY reads with that interpreter and only the
# unit's PYTHONPATH: "TOKEN V SERVICE STAMP VERSION" ("=" for the cached one, "- -" when
# unknown). The last line is "TOKEN END".
#
# PROBE_PY: the version of the package named in argv[1], from its metadata (nothing imported);
# imported only when it has none.
PROBE_PY='import sys
try:
    from importlib.metadata import version
    print(version(sys.argv[1]))
except Exception:
    import importlib
    print(getattr(importlib.import_module(sys.argv[1]), "__version__", ""))
'

T=$1
shift
nl='
'
probe() {  # name executable module pythonpath cached-stamp
  exe=$2
  unknown() { printf '%s V %s - -\n' "$T" "$1"; }
  case "$exe" in /*) ;; *) exe=$(command -v "$exe" 2>/dev/null) || { unknown "$1"; return; } ;; esac
  py=$exe
  line=
  { IFS= read -r line < "$exe"; } 2>/dev/null     # the first line: a shebang names the interpreter
  case "$line" in '#!'*)
    line=${line#??}; line=${line#"${line%%[![:space:]]*}"}
    case "$line" in *python*) py=$line ;; esac ;;
  esac
  first=${py%% *}
  if [ "$first" = /usr/bin/env ]; then
    second=${py#* }; first=$(command -v "${second%% *}" 2>/dev/null) || first=/nonexistent
  fi
  case "$first" in */*) bin=${first%/*} ;; *) bin=. ;; esac
  pp=$4 ppdirs=       # PYTHONPATH with each ':' a space (then split like the rest)
  while :; do case "$pp" in *:*) ppdirs="$ppdirs${pp%%:*} "; pp=${pp#*:} ;; *) ppdirs=$ppdirs$pp; break ;; esac; done
  dirs="$first ${bin:-/}/../lib/python3*/site-packages /usr/local/lib/python3*/dist-packages"
  dirs="$dirs /usr/lib/python3/dist-packages $ppdirs"
  # shellcheck disable=SC2086 # a list of paths, split and globbed (python3*) on purpose
  stamp=$(stat -L --printf '%Y.' $dirs 2>/dev/null)
  [ -x "$first" ] || { unknown "$1"; return; }
  if [ "$stamp" = "$5" ]; then printf '%s V %s %s =\n' "$T" "$1" "$stamp"; return; fi
  # shellcheck disable=SC2086 # the interpreter with the shebang's arguments (python3 -s): split on purpose
  out=$(cd / && PYTHONPATH="$4" timeout 60 $py -c "$PROBE_PY" "$3" 2>/dev/null; printf x)
  out=${out%x}; out=${out%"$nl"}; v=${out##*"$nl"}     # the last line, as tail -n 1 gives it
  case "$v" in
    [0-9]*[!0-9A-Za-z.+!-]*|[!0-9]*|'') v=$(printf '%s' "$v" | base64 -w0) ;;
    *) v=@$v ;;          # a version as it is (the parser's own pattern): no base64 process
  esac
  printf '%s V %s %s %s\n' "$T" "$1" "$stamp" "$v"
}

while [ $# -ge 5 ]; do
  probe "$1" "$2" "$3" "$4" "$5"
  shift 5
done
printf '%s END\n' "$T"
