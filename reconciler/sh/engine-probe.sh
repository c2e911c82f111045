#!/bin/sh
# Ask the installed engine about a unit's command line (reconciler/host/engine.py:
# engine_command builds this, read_answer reads it). The probe (reconciler/engines/*_probe.py)
# runs with the unit's own interpreter, as the unit's user, with its environment, under
# systemd-run: bounded memory and time, lowest CPU and I/O priority, no hub downloads, and
# (MODE hidden) no GPU visible, the host's GPU facts passed in instead.
#
#   engine-probe.sh TOKEN INTERP PROBE_BASE64 USER WORKDIR MEMORY_MAX SECONDS MODE MODEL CACHED \
#                   STAGE PYTHONPATH ENV_FILE_COUNT [ENV_FILE]... [ARG]...
#
# stdin: the service's environment as an env file (NAME="value" lines; never on a command line,
# where other users could read it). USER and WORKDIR: empty for the unit's default. MODE: hidden
# (CUDA_VISIBLE_DEVICES empty, facts from nvidia-smi) or visible (the engine sees the GPUs).
# MODEL: the model directory whose config.json is part of the stamp. CACHED: the stamp of a
# cached answer; when the host's stamp equals it, the probe does not run. STAGE: the engine's
# argument module as a file (sglang/srt/server_args.py); when no package directory the
# interpreter may read (its own, the system's, the user's, PYTHONPATH's) holds it or an editable
# install of the engine (a .pth naming it), no python is started for an answer that must be
# "not installed".
#
# Output, each line "TOKEN KIND ...": N (the engine's argument stage is not installed there), or
# S STAMP, then either C (the cached answer stands) or R EXIT_STATUS, O STDOUT_TAIL_BASE64,
# E STDERR_TAIL_BASE64; the last line is "TOKEN END".
SLICE_BYTES=4096

T=$1 interp=$2 probe=$3 user=$4 workdir=$5 mem=$6 secs=$7 mode=$8 model=$9
shift 9
cached=$1 stage=$2 pypath=$3 nfiles=$4
shift 4
files=
while [ "$nfiles" -gt 0 ]; do files="$files $1"; shift; nfiles=$((nfiles - 1)); done
bin=${interp%/*}

# Is the engine there at all? (The probe would only fail to import it: a python start saved.)
# Builtins only, so that "not installed" (every host whose servers are not SGLang or vLLM)
# costs no process: the user's home from /etc/passwd (getent only for a user it does not
# hold: LDAP, sssd), PYTHONPATH split by IFS, each .pth read by `read`.
home=/root
if [ -n "$user" ]; then
  home=
  while IFS=: read -r n _ _ _ _ h _; do [ "$n" = "$user" ] && { home=$h; break; }; done < /etc/passwd
  [ -n "$home" ] || home=$(getent passwd "$user" | cut -d: -f6)
fi
pkg=${stage%%/*}
found=
IFS=:
# shellcheck disable=SC2086 # globs (python3*) and the PYTHONPATH entries (split on :) on purpose
for d in "$bin"/../lib/python3*/site-packages /usr/local/lib/python3*/dist-packages \
         /usr/lib/python3/dist-packages "$home"/.local/lib/python3*/site-packages $pypath; do
  [ -e "$d/$stage" ] && { found=1; break; }
  for p in "$d"/*.pth; do
    [ -f "$p" ] || continue
    [ -r "$p" ] || continue
    while IFS= read -r l || [ -n "$l" ]; do
      case $l in *"$pkg"*) found=1; break 3 ;; esac
    done < "$p"
  done
done
unset IFS
if [ -z "$found" ]; then
  printf '%s N\n%s END\n' "$T" "$T"; exit 0
fi

# The stamp: the interpreter and its package directories (an upgrade changes them), the model's
# config.json, the GPUs' facts and the probe itself. Equal stamps, equal answers.
facts=
if [ "$mode" = hidden ] && command -v nvidia-smi >/dev/null 2>&1; then
  facts=$(nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader,nounits 2>/dev/null)
fi
# shellcheck disable=SC2086 # globs (python3*) on purpose
stamp=$(stat -L --printf '%Y.' "$interp" "$bin"/../lib/python3*/site-packages \
          "$model/config.json" 2>/dev/null; printf '%s|%s' "$facts" "$probe" | cksum)
stamp=$(printf '%s' "$stamp" | cksum | tr ' ' .)
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

dir=$(mktemp -d /run/reconciler-engine.XXXXXX) || { printf '%s R 70\n%s END\n' "$T" "$T"; exit 0; }
trap 'rm -rf "$dir"' EXIT
umask 077
cat > "$dir/env"
{
  [ "$mode" = hidden ] && echo 'CUDA_VISIBLE_DEVICES='
  echo 'HF_HUB_OFFLINE=1'
  echo 'TRANSFORMERS_OFFLINE=1'
  echo 'PYTHONUNBUFFERED=1'
  echo 'PYTHONDONTWRITEBYTECODE=1'
} >> "$dir/env"
printf '%s' "$probe" | base64 -d > "$dir/probe.py"
chmod 755 "$dir"; chmod 644 "$dir/probe.py"

# The command, built back to front in "$@" (the server's arguments are there already):
# systemd-run's options, --, the interpreter, the probe, its --facts, --, the server's arguments.
if [ -n "$fargs" ]; then set -- --facts "$fargs" -- "$@"; else set -- -- "$@"; fi
set -- -p "EnvironmentFile=$dir/env" -- "$interp" "$dir/probe.py" "$@"
rev=
for f in $files; do rev="$f $rev"; done
for f in $rev; do set -- -p "EnvironmentFile=$f" "$@"; done      # the unit's files, then ours
[ -n "$user" ] && set -- -p "User=$user" "$@"
[ -n "$workdir" ] && set -- -p "WorkingDirectory=-$workdir" "$@"
if command -v systemd-run >/dev/null 2>&1; then
  systemd-run --quiet --wait --pipe --collect --service-type=exec \
    -p "MemoryMax=$mem" -p "RuntimeMaxSec=$secs" -p Nice=19 -p IOSchedulingClass=idle \
    -p CPUSchedulingPolicy=batch "$@" </dev/null >"$dir/out" 2>"$dir/err"
  rc=$?
else
  echo "systemd-run not found" > "$dir/err"; rc=127
fi
printf '%s R %s\n' "$T" "$rc"
printf '%s O %s\n' "$T" "$(tail -c "$SLICE_BYTES" "$dir/out" | base64 -w0)"
printf '%s E %s\n' "$T" "$(tail -c "$SLICE_BYTES" "$dir/err" | base64 -w0)"
printf '%s END\n' "$T"
