#!/bin/sh
# Ask the installed engine about a unit's command line (reconciler/host/engine.py: EngineProbe
# runs this, read_answer reads it). The probe (reconciler/engines/probe.py and its adapters)
# runs with the unit's own interpreter, isolated (`python -I`: no PYTHON* variable, no user
# site, no current directory), under systemd-run with the unit's identity and sandbox and the
# probe's own (the properties come from preflight/_enginebox.py), an allowlisted environment,
# bounded memory, time, tasks and output, lowest CPU and I/O priority, no network, no hub
# downloads and (MODE hidden) no GPU visible, the host's GPU facts passed in instead.
#
# stdin: named parameters, NAME=value lines, one per line, ended by an empty line, then the
# service's environment as an env file (`env` lines of NAME="value", already allowlisted by the
# controller; never on a command line, where other users could read it), then the probe program
# (`probe` bytes), read only where the probe runs: in a batch this program goes last, so what
# it leaves unread is nobody's (sh's `read` takes a pipe a byte per read: 45 KiB of probe read so
# was 45,000 system calls on every host, engine or none). Parameters:
#   token     the token of its records            arg       one of the server's own arguments
#   env       how many lines the environment has            (repeated, in order)
#   interp    the unit's interpreter              probe     the probe program's length in bytes
#   probesum  the probe program's sha256 (the stamp's part of it)
#   user      the unit's User= (may be empty)     mem, secs MemoryMax=, RuntimeMaxSec=
#   mode      hidden | visible                    model     the model directory (its config.json)
#   cached    the stamp of a cached answer        stage     the engine's argument module, as a file
#   usersite  1 when the interpreter reads the user's site directory, else 0
#   pythonpath  one PYTHONPATH entry (repeated, in order)
#   envfile   one of the unit's EnvironmentFile=s (repeated; "-" prefix: it may be missing)
#   prop      one systemd-run property (repeated, in order)
#
# Where the interpreter would find the engine, in import order: PYTHONPATH, the user's site
# directory (when it reads it), its own site-packages, the system's site directories (no venv,
# or one with include-system-site-packages: venv.sh's SYSTEM_SITES, Debian's and Fedora's), each
# site directory followed by the directories its .pth files name. PYTHONPATH, the user site and what its .pth files name go to the probe as
# --path options (it puts them on sys.path itself); python adds the others.
#
# Output, each line "TOKEN KIND ...": N (the engine's argument stage is not installed there), or
# U UID GID MODE PATH_BASE64 (the check refuses: that path, or a directory above it, is writable
# by someone other than root or the unit's user), or S STAMP, then either C (the cached answer
# stands) or R EXIT_STATUS, O STDOUT_BASE64, E STDERR_TAIL_BASE64; the last line is "TOKEN END".
# Constants (the sender's: host/engine.py, preflight/_enginebox.py): SLICE_BYTES, ENV_FILE_BYTES,
# ENV_ALLOW, ENV_DENY.

set -f        # nothing the unit names is globbed; the globs below are turned on where meant
nl='
'
T='' args='' nenv=0 envtext=''
interp='' probe=0 probesum='' user='' mem='' secs='' mode='' model='' cached='' stage='' usersite=1 pypath='' files='' props=''
params T=token args+=arg nenv=env interp probe probesum user mem secs mode model cached stage usersite \
  pypath+=pythonpath files+=envfile props+=prop
# The environment, read now, whatever the answer (the probe's bytes follow it)
case $nenv in ''|*[!0-9]*) nenv=0 ;; esac
while [ "$nenv" -gt 0 ] && IFS= read -r line; do envtext=$envtext$line$nl; nenv=$((nenv - 1)); done
IFS=$nl       # every list below is one item a line
set --        # the server's own arguments, in order (an empty one kept)
while [ -n "$args" ]; do set -- "$@" "${args%%"$nl"*}"; args=${args#*"$nl"}; done
bin=${interp%/*}
pkg=${stage%%/*}

# The unit's user: its uid, gid and home (from /etc/passwd with builtins; getent only for a user
# it does not hold: LDAP, sssd). None (root): /root. A dynamic user has none.
home=/root uid=0 gid=0
case $user in ''|root|0) ;; *)
  home='' uid='' gid=''
  while IFS=: read -r n _ u g _ h _; do
    if [ "$n" = "$user" ] || [ "$u" = "$user" ]; then home=$h uid=$u gid=$g; break; fi
  done < /etc/passwd
  if [ -z "$uid" ]; then
    e=$(getent passwd "$user" 2>/dev/null)
    [ -n "$e" ] && IFS=: read -r _ _ uid gid _ home _ <<EOF
$e
EOF
  fi ;;
esac

# A venv: only its own site-packages, unless it includes the system's (then the user's too).
syssite=1
venv_system_site "$bin" || syssite=0 usersite=0      # venv.sh

# Builtins only, so that "not installed" (every host whose servers are not SGLang or vLLM)
# costs no process.
dirs='' paths='' pths='' hook=''
site() {  # a site directory, then the directories its .pth files name; $2: for --path too
  # (called with globbing on: everything read from a file is quoted or a case word here)
  [ -d "$1" ] || return 0
  dirs=$dirs$1$nl
  [ -n "$2" ] && paths=$paths$1$nl
  for p in "$1"/*.pth; do
    [ -f "$p" ] || continue
    [ -r "$p" ] || continue
    pths=$pths$p$nl
    while IFS=' 	' read -r l || [ -n "$l" ]; do
      case $l in
        ''|'#'*) ;;
        'import '*|'import	'*) case $l in *"$pkg"*) hook=1 ;; esac ;;   # an editable install's finder
        /*) [ -d "$l" ] && { dirs=$dirs$l$nl; [ -n "$2" ] && paths=$paths$l$nl; } ;;
        *) [ -d "$1/$l" ] && { dirs=$dirs$1/$l$nl; [ -n "$2" ] && paths=$paths$1/$l$nl; } ;;
      esac
    done < "$p"
  done
}
for d in $pypath; do
  case $d in /*) [ -d "$d" ] && { dirs=$dirs$d$nl; paths=$paths$d$nl; } ;; esac
done
set +f
if [ "$usersite" = 1 ] && [ -n "$home" ]; then
  for d in "$home"/.local/lib/python3*/site-packages; do site "$d" 1; done
fi
for d in "$bin"/../lib/python3*/site-packages "$bin"/../lib64/python3*/site-packages; do site "$d" ""; done
if [ "$syssite" = 1 ]; then
  for d in $SYSTEM_SITES; do site "$d" ""; done      # venv.sh
fi
set -f
stagefile=
for d in $dirs; do
  [ -f "$d/$stage" ] && { stagefile=$d/$stage; break; }
done
if [ -z "$stagefile" ] && [ -z "$hook" ]; then
  printf '%s N\n%s END\n' "$T" "$T"; exit 0
fi

# Who may change what the probe would run: the interpreter (after symlinks), every directory on
# its path and the engine's stage file, and every directory above them. Each must be root's or
# the unit's user's, and writable by no one else (a root-owned sticky directory above, /tmp,
# lets no one else rename what is in it).
# shellcheck disable=SC2086 # the lists, one item a line, split on purpose
leaves=$(realpath -e -- "$interp" $dirs ${stagefile:+"$stagefile"} 2>/dev/null)
above=
for r in $leaves; do
  p=${r%/*}
  while [ -n "$p" ]; do above=$above$p$nl; p=${p%/*}; done
  above=$above/$nl
done
# shellcheck disable=SC2086
owners=$(stat -c '%u %g %a %n' -- $leaves $above 2>/dev/null)
for o in $owners; do
  IFS=' ' read -r u g m name <<EOF
$o
EOF
  bad=
  [ "$u" = 0 ] || { [ -n "$uid" ] && [ "$u" = "$uid" ]; } || bad=1
  [ $((0$m & 020)) = 0 ] || [ "$g" = 0 ] || { [ -n "$gid" ] && [ "$g" = "$gid" ]; } || bad=1
  if [ $((0$m & 02)) != 0 ]; then
    case "$nl$leaves$nl" in
      *"$nl$name$nl"*) bad=1 ;;
      *) [ "$u" = 0 ] && [ $((0$m & 01000)) != 0 ] || bad=1 ;;
    esac
  fi
  if [ -n "$bad" ]; then
    printf '%s U %s %s %s %s\n%s END\n' "$T" "$u" "$g" "$m" "$(printf '%s' "$name" | base64 -w0)" "$T"
    exit 0
  fi
done

# The stamp: every file and directory the answer depends on (the interpreter, each directory on
# its path, each .pth file, the stage file, the engine's dist-info, the model's config.json; by
# name, modification and change time, size and inode), the unit's env files (their contents,
# read here: they may hold secrets), the GPUs' facts, the mode and the probe itself.
# Equal stamps, equal answers.
facts=
if [ "$mode" = hidden ] && command -v nvidia-smi >/dev/null 2>&1; then
  facts=$(nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader,nounits 2>/dev/null)
fi
infos=
for d in $dirs; do
  set +f
  for i in "$d/$pkg"-*.dist-info/METADATA; do [ -f "$i" ] && infos=$infos$i$nl; done
  set -f
done
# shellcheck disable=SC2086
stamp=$({ stat -L -c '%n %.9Y %.9Z %s %i' -- $leaves $pths $infos "$model/config.json" 2>/dev/null
          printf '%s\n' "$facts" "$mode" "$probesum"
          for f in $files; do
            f=${f#-}; printf 'file %s\n' "$f"
            [ -f "$f" ] && head -c "$ENV_FILE_BYTES" -- "$f"
          done; } | sha256sum)
stamp=${stamp%% *}
printf '%s S %s\n' "$T" "$stamp"
if [ -n "$cached" ] && [ "$cached" = "$stamp" ]; then
  printf '%s C\n%s END\n' "$T" "$T"; exit 0
fi

# The facts as the probe's --facts JSON: count, the first GPU's name, capability and memory.
fargs=
if [ -n "$facts" ]; then
  n=$(printf '%s\n' "$facts" | grep -c .)
  first=$(printf '%s\n' "$facts" | head -n 1)
  name=$(printf '%s' "${first%%,*}" | tr -d '\042\134'); rest=${first#*,}
  cap=$(printf '%s' "${rest%%,*}" | tr -d ' '); mib=$(printf '%s' "${rest#*,}" | tr -d ' ')
  case "$cap" in *.*) ;; *) cap=; esac
  case "$mib" in ''|*[!0-9]*) mib=0 ;; esac
  if [ -n "$cap" ]; then
    fargs="{\"count\": $n, \"name\": \"$name\", \"capability\": [${cap%%.*}, ${cap#*.}], \"memory_mib\": $mib}"
  fi
fi

allowed() {  # whether a variable may reach the probe (the same lists as preflight/_enginebox.py)
  case $1 in ''|[0-9]*|*[!A-Za-z0-9_]*) return 1 ;; esac
  IFS=' '
  # shellcheck disable=SC2254 # the lists are patterns, matched as patterns on purpose
  for p in $ENV_DENY; do case $1 in $p) IFS=$nl; return 1 ;; esac; done
  # shellcheck disable=SC2254
  for p in $ENV_ALLOW; do case $1 in $p) IFS=$nl; return 0 ;; esac; done
  IFS=$nl
  return 1
}
whole() {  # whether systemd reads a value as one whole value: bare (no quote, no backslash),
           # '...' (no ' inside) or "..." (a backslash escapes the next character)
  v=$1
  case $v in
    \'*\') v=${v#?}; v=${v%?}; case $v in *\'*) return 1 ;; esac ;;
    \"*\")
      v=${v#?}; v=${v%?}
      while :; do
        case $v in
          *\\*) a=${v%%\\*}; case $a in *\"*) return 1 ;; esac
                v=${v#*\\}; [ -n "$v" ] || return 1; v=${v#?} ;;
          *\"*) return 1 ;;
          *) break ;;
        esac
      done ;;
    *[\"\'\\]*) return 1 ;;
  esac
  return 0
}
keep() {  # the lines of an env file that set an allowed variable to one whole value; a line
          # continued (a trailing backslash) and the lines that continue it are dropped
  cont=
  while IFS= read -r l || [ -n "$l" ]; do
    l=${l#"${l%%[![:space:]]*}"}; l=${l%"${l##*[![:space:]]}"}
    if [ -n "$cont" ]; then case $l in *\\) ;; *) cont= ;; esac; continue; fi
    case $l in *\\) cont=1; continue ;; ''|'#'*|';'*) continue ;; esac
    name=${l%%=*}
    [ "$name" != "$l" ] && allowed "$name" && whole "${l#*=}" && printf '%s\n' "$l"
  done
  return 0
}

dir=$(mktemp -d /run/reconciler-engine.XXXXXX) || { printf '%s R 70\n%s END\n' "$T" "$T"; exit 0; }
trap 'rm -rf "$dir"' EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM
umask 077
# The probe's own env file (root's, 0600; systemd reads it before the probe starts): the unit's
# files, filtered here line by line, then the service's environment, then the guards.
: > "$dir/env"
for f in $files; do
  f=${f#-}
  [ -f "$f" ] || continue
  [ -r "$f" ] || continue
  head -c "$ENV_FILE_BYTES" -- "$f" | keep >> "$dir/env"
done
printf '%s' "$envtext" >> "$dir/env"
# The probe's home is its private /tmp (the engine creates caches there: ~/.cache, ~/.triton),
# so the Hugging Face cache stays where the unit's user has it, unless the unit says where.
hf=
case $home in *[\"\\]*|'') ;; *) grep -q '^HF_HOME=' "$dir/env" || hf="HF_HOME=\"$home/.cache/huggingface\"" ;; esac
{
  [ -n "$hf" ] && echo "$hf"
  echo 'HOME=/tmp'
  [ "$mode" = hidden ] && echo 'CUDA_VISIBLE_DEVICES='
  echo 'HF_HUB_OFFLINE=1'
  echo 'TRANSFORMERS_OFFLINE=1'
} >> "$dir/env"
case $probe in ''|*[!0-9]*) probe=0 ;; esac
head -c "$probe" > "$dir/probe.py"      # the rest of stdin: the probe, and only it
chmod 755 "$dir"; chmod 644 "$dir/probe.py"

# The command, built back to front in "$@" (the server's arguments are there already):
# systemd-run's options, --, the interpreter, the probe, its --path and --facts, --, the
# server's arguments.
if [ -n "$fargs" ]; then set -- --facts "$fargs" -- "$@"; else set -- -- "$@"; fi
rev=
for d in $paths; do rev=$d$nl$rev; done
for d in $rev; do set -- --path "$d" "$@"; done
set -- -p "EnvironmentFile=$dir/env" -- "$interp" -I -B "$dir/probe.py" "$@"
rev=
for p in $props; do rev=$p$nl$rev; done
for p in $rev; do set -- -p "$p" "$@"; done
if command -v systemd-run >/dev/null 2>&1; then
  systemd-run --quiet --wait --pipe --collect --service-type=exec \
    -p "MemoryMax=$mem" -p "RuntimeMaxSec=$secs" -p Nice=19 -p IOSchedulingClass=idle \
    -p CPUSchedulingPolicy=batch "$@" </dev/null >"$dir/out" 2>"$dir/err"
  rc=$?
else
  echo "systemd-run not found" > "$dir/err"; rc=127
fi
tail_of() {  # a file's last SLICE_BYTES, from the start of a line (none is cut in two)
  if [ "$(wc -c < "$1")" -le "$SLICE_BYTES" ]; then cat -- "$1"
  else tail -c "$SLICE_BYTES" -- "$1" | { IFS= read -r _; cat; }; fi
}
printf '%s R %s\n' "$T" "$rc"
printf '%s O %s\n' "$T" "$(tail_of "$dir/out" | base64 -w0)"
printf '%s E %s\n' "$T" "$(tail_of "$dir/err" | base64 -w0)"
printf '%s END\n' "$T"
