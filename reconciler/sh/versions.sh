#!/bin/sh
# Which sglang or vllm a service's own interpreter has (reconciler/plan/facts/versions.py:
# Versions runs this, parse_versions reads it). Read from the files, never asked of python:
# nothing of the unit (its interpreter, its search path, its environment) is run.
#
# stdin, named parameters (one a line, then an empty line): token; then per service, in this
# order: service, exe (the interpreter, or a console script whose shebang names it), module
# (sglang | vllm), pythonpath (the unit's PYTHONPATH), user (the unit's User=: its home holds the
# user's site directory; empty: root), usersite (1 when the interpreter reads that directory).
#
# Per service: "TOKEN V SERVICE @VERSION", or "TOKEN V SERVICE -" when it is unknown. The last
# line is "TOKEN END".
#
# The version is that of the package the interpreter would import: the first directory in its
# import order (PYTHONPATH; the user's site directory; its own site-packages; the system's site
# directories, venv.sh's SYSTEM_SITES, unless it is a venv without them; each site directory followed by the
# directories its .pth files name) that holds the package's metadata
# (MODULE-*.dist-info/METADATA: its Version: line) or the package itself (MODULE/__init__.py:
# its `__version__ = "..."` line, read as text). Builtins only: no process.

set -f          # nothing given is globbed; the globs below are turned on where meant

home_of() {  # a user's home (from /etc/passwd; empty when it has none there)
  h=/root
  case $1 in ''|root|0) ;; *)
    h=''
    while IFS=: read -r n _ u _ _ hh _; do
      if [ "$n" = "$1" ] || [ "$u" = "$1" ]; then h=$hh; break; fi
    done < /etc/passwd ;;
  esac
}

field() {  # the value of the first line of file $1 that starts with $2 ("Version:", "__version__")
  val=''
  while IFS= read -r l || [ -n "$l" ]; do
    case $l in
      "$2"*) val=${l#"$2"}; break ;;
      '') [ "$2" = Version: ] && break ;;      # the end of METADATA's header
    esac
  done < "$1"
  val=${val#"${val%%[!\"\' =:]*}"}; val=${val%"${val##*[!\"\' ]}"}
}

look() {  # $1: a directory; sets `ver` when it holds the package or its metadata (ver=- unknown)
  for i in "$1/$mod"-*.dist-info/METADATA; do
    [ -f "$i" ] || continue
    field "$i" Version:; ver=${val:--}; return
  done
  if [ -f "$1/$mod/__init__.py" ]; then
    field "$1/$mod/__init__.py" __version__; ver=${val:--}
  fi
}

site() {  # a site directory, then the directories its .pth files name
  [ -d "$1" ] || return 0
  look "$1"; [ -n "$ver" ] && return
  for p in "$1"/*.pth; do
    [ -f "$p" ] || continue
    [ -r "$p" ] || continue
    while IFS=' 	' read -r l || [ -n "$l" ]; do
      case $l in
        ''|'#'*|'import '*|'import	'*) ;;
        /*) [ -d "$l" ] && look "$l" ;;
        *) [ -d "$1/$l" ] && look "$1/$l" ;;
      esac
      [ -n "$ver" ] && return
    done < "$p"
  done
}

version_of() {  # service executable module pythonpath user usersite
  exe=$2 mod=$3 ver=''
  case "$exe" in /*) ;; *) exe=$(command -v "$exe" 2>/dev/null) || { printf '%s V %s -\n' "$T" "$1"; return; } ;; esac
  py=$exe
  line=''
  { IFS= read -r line < "$exe"; } 2>/dev/null     # the first line: a shebang names the interpreter
  case "$line" in '#!'*)
    line=${line#??}; line=${line#"${line%%[![:space:]]*}"}
    case "$line" in *python*) py=$line ;; esac ;;
  esac
  first=${py%% *}
  if [ "$first" = /usr/bin/env ]; then
    second=${py#* }; first=$(command -v "${second%% *}" 2>/dev/null) || first=/nonexistent
  fi
  [ -x "$first" ] || { printf '%s V %s -\n' "$T" "$1"; return; }
  bin=${first%/*}
  usersite=$6 syssite=1
  case ${py#"$first"} in *-s*|*-I*) usersite=0 ;; esac      # python3 -s in the shebang
  venv_system_site "$bin" || syssite=0 usersite=0      # venv.sh
  IFS=:
  for d in $4; do
    set +f
    case $d in /*) [ -d "$d" ] && look "$d" ;; esac
    set -f
    [ -n "$ver" ] && break
  done
  unset IFS
  set +f
  if [ -z "$ver" ] && [ "$usersite" = 1 ]; then
    home_of "$5"
    if [ -n "$h" ]; then
      for d in "$h"/.local/lib/python3*/site-packages; do site "$d"; [ -n "$ver" ] && break; done
    fi
  fi
  if [ -z "$ver" ]; then
    for d in "$bin"/../lib/python3*/site-packages "$bin"/../lib64/python3*/site-packages; do
      site "$d"; [ -n "$ver" ] && break
    done
  fi
  if [ -z "$ver" ] && [ "$syssite" = 1 ]; then
    for d in $SYSTEM_SITES; do site "$d"; [ -n "$ver" ] && break; done      # venv.sh
  fi
  set -f
  case $ver in
    ''|-|[!0-9]*|*[!0-9A-Za-z.+!-]*) printf '%s V %s -\n' "$T" "$1" ;;
    *) printf '%s V %s @%s\n' "$T" "$1" "$ver" ;;
  esac
}

T='' svc='' exe='' mod='' pypath='' usr='' site1=''
while IFS= read -r l && [ -n "$l" ]; do
  case $l in
    token=*) T=${l#token=} ;;
    service=*) svc=${l#service=} ;;
    exe=*) exe=${l#exe=} ;;
    module=*) mod=${l#module=} ;;
    pythonpath=*) pypath=${l#pythonpath=} ;;
    user=*) usr=${l#user=} ;;
    usersite=*) site1=${l#usersite=}; version_of "$svc" "$exe" "$mod" "$pypath" "$usr" "$site1" ;;
  esac
done
printf '%s END\n' "$T"
