#!/bin/sh
# Who holds the GPUs, and is their memory free (reconciler/plan/facts/gpu.py: GpuRead runs
# this, parse_gpu reads it).
#
# stdin, named parameters (one a line, then an empty line): token; prefix (the device nodes'
# path prefix, /dev/nvidia); since (absent: no health read).
#
# Every process with a PREFIX* node (/dev/nvidia*) open, from /proc (no fuser): its pid,
# comm, cgroup and nodes; and where nvidia-smi exists, each GPU's memory and the compute
# processes with theirs. With since (host epoch seconds, 0: this boot) the GPUs' health too,
# without a CUDA context (reconciler/plan/gpuhealth.py reads it): the sections of
# `nvidia-smi -q` that say it (HEALTH_SECTIONS, and any line saying a GPU is lost), the kernel
# log's entries since then whose message opens with the driver's Xid report (`journalctl -k -o
# json`: the kernel's own messages, as journald read them from /dev/kmsg, one entry a line with
# its message a field apart, so a quoted report or an embedded newline cannot pass for one;
# xids below; reconciler/plan/xid.py reads each again), and DCGM's health watches where dcgmi is
# installed.
# Each record is a line "TOKEN KIND ...", the last "TOKEN END".
# Constants (the sender's, plan/facts/gpu.py): GPU_FIELDS, OLD_GPU_FIELDS (nvidia-smi before
# compute_cap was a field, drivers older than 510, refuses the whole query: then these, and the
# compute capability is unknown), APP_FIELDS, SMI_FORMAT, HEALTH_SECTIONS, XID_LINES, XID_MATCH,
# XID_FIELDS, XID_GREP.
T='' PREFIX=/dev/nvidia SINCE=-
params T=token PREFIX=prefix SINCE=since
nl='
'
enc() {  # file -> e: @ and its one line when that is printable ASCII without spaces, else the
         # file in base64 (no process for the usual comm and cgroup v2); 1 when it cannot be read
  e='' ok='' l='' m=''
  { ok=1; IFS= read -r l; r=$?; IFS= read -r m; s=$?; } 2>/dev/null < "$1"
  [ -n "$ok" ] || return 1
  if [ "$r$s" = 01 ] && [ -z "$m" ]; then
    case "$l" in ''|*[!!-~]*) ;; *) e=@$l; return 0 ;; esac
  fi
  e=$(base64 -w0 < "$1" 2>/dev/null)
  return 0
}
xids() {  # the kernel log's entries since $s whose message opens with an Xid report, as JSON lines:
          # journalctl matches the message field itself (-g: only those entries are formatted);
          # one without -g (before 237, or built without PCRE2) says so, and then every entry
          # is formatted and grep keeps them (rc 1 and nothing said: nothing matched)
  if out=$(journalctl -k -q --no-pager -o json --output-fields="$XID_FIELDS" ${s:+--since "$s"} \
             -g "$XID_MATCH" 2>&1) || [ -z "$out" ]; then
    printf '%s\n' "$out"
  else
    journalctl -k -q --no-pager -o json ${s:+--since "$s"} 2>/dev/null | grep -E "$XID_GREP"
  fi
}
printf '%s BEGIN\n' "$T"
# One ls over every process's fd directory (no process per fd): "/proc/PID/fd:" headers, then
# "... N -> /dev/nvidia0" lines. awk keeps, per PID, the distinct /dev/nvidia* targets. Where
# no such device node exists and there is no nvidia-smi, nothing can hold one: no scan.
smi=; ! command -v nvidia-smi >/dev/null 2>&1 || smi=1
set -- "$PREFIX"*
if [ -e "$1" ] || [ -L "$1" ] || [ -n "$smi" ]; then
# shellcheck disable=SC2012 # one ls for every fd of every process, read only for its link targets
ls -l /proc/[0-9]*/fd 2>/dev/null | awk -v P=" -> $PREFIX" '
  /^\/proc\/[0-9]+\/fd:$/ { split($0, a, "/"); pid = a[3]; next }
  index($0, P) {
    dev = substr($0, index($0, P) + 4); k = pid " " dev
    if (!(k in seen)) { seen[k] = 1; devs[pid] = devs[pid] " " dev }
  }
  END { for (p in devs) print p devs[p] }' | while read -r pid devs; do
  enc "/proc/$pid/comm" || continue
  comm=$e
  enc "/proc/$pid/cgroup"
  printf '%s H %s %s %s %s\n' "$T" "$pid" "${comm:--}" "${e:--}" "$devs"
done
fi
if [ -n "$smi" ]; then
  printf '%s SMI 1\n' "$T"
  set -f      # nvidia-smi's lines, one by one (IFS: newlines only; empty lines say nothing)
  out=$(nvidia-smi --query-gpu="$GPU_FIELDS" --format="$SMI_FORMAT" 2>&1); rc=$?
  [ "$rc" = 0 ] || { out=$(nvidia-smi --query-gpu="$OLD_GPU_FIELDS" --format="$SMI_FORMAT" 2>&1); rc=$?; }
  IFS=$nl; for l in $out; do printf '%s G %s\n' "$T" "$l"; done; unset IFS
  printf '%s GRC %s\n' "$T" "$rc"
  out=$(nvidia-smi --query-compute-apps="$APP_FIELDS" --format="$SMI_FORMAT" 2>&1); rc=$?
  IFS=$nl; for l in $out; do printf '%s A %s\n' "$T" "$l"; done; unset IFS
  printf '%s ARC %s\n' "$T" "$rc"
  # The cgroup of every compute process too: a server's GPU workers may hold no /dev/nvidia*
  # fd we can see, and only their cgroup ties them to a service. Each PID once.
  seen=' '
  IFS=$nl
  for l in $out; do
    unset IFS
    # shellcheck disable=SC2086 # split on purpose: the first field, without the blanks around it
    set -- ${l%%,*}
    IFS=$nl
    [ $# -eq 1 ] || continue
    p=$1
    case "$p" in *[!0-9]*) continue ;; esac
    case "$seen" in *" $p "*) continue ;; esac
    seen="$seen$p "
    enc "/proc/$p/cgroup"
    printf '%s C %s %s\n' "$T" "$p" "${e:--}"
  done
  unset IFS
  if [ "$SINCE" != - ]; then
    printf '%s NOW %s\n' "$T" "$(date +%s)"
    # The health sections of each GPU (by indentation: the first level under "GPU <bus id>"),
    # and any unindented line but the log's header (nvidia-smi's errors: "GPU is lost", ...).
    out=$(nvidia-smi -q 2>&1); rc=$?
    out=$(printf '%s\n' "$out" | awk -v S="$HEALTH_SECTIONS" '
      /^GPU / { print; l1 = -1; keep = 0; next }
      /^[^ ]/ { if ($0 !~ /^(=|Timestamp|Driver Version|CUDA Version|Attached GPUs)/) print; next }
      /[^ ]/ {
        n = match($0, /[^ ]/) - 1
        if (l1 < 0) l1 = n
        if (n <= l1) { k = substr($0, n + 1); sub(/ *:.*$/, "", k); sub(/ +$/, "", k); keep = index(S, "|" k "|") > 0 }
        if (keep) print
      }')
    IFS=$nl; for l in $out; do printf '%s Q %s\n' "$T" "$l"; done; unset IFS
    printf '%s QRC %s\n' "$T" "$rc"
    if command -v journalctl >/dev/null 2>&1; then
      s=; [ "$SINCE" = 0 ] || s=@$SINCE
      xids | tail -n "$XID_LINES" | while IFS= read -r l; do [ -z "$l" ] || printf '%s K %s\n' "$T" "$l"; done
      printf '%s KRC 0\n' "$T"
    else
      printf '%s KRC -\n' "$T"
    fi
    if command -v dcgmi >/dev/null 2>&1; then
      out=$(dcgmi health -c 2>&1); rc=$?
      IFS=$nl; for l in $out; do printf '%s D %s\n' "$T" "$l"; done; unset IFS
      printf '%s DRC %s\n' "$T" "$rc"
    fi
  fi
  set +f
else
  printf '%s SMI 0\n' "$T"
fi
printf '%s END\n' "$T"
