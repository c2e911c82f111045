#!/bin/sh
# systemd's own check of the units about to be written (reconciler/loop/checks.py:
# verify_command runs this, parse_verify reads it): `systemd-analyze verify` on a copy of each,
# under a throw-away name in a private directory, so no live drop-in of the real unit mixes in.
#
#   verify.sh TOKEN    < RANDOM TEMPNAME-WITH-DROPIN...
#                        SERVICE TEMPNAME UNIT_LINES ENV_LINES, then those lines...
#
# The texts come on stdin as counted lines (never on a command line) and the shell writes them
# byte for byte. Per service: systemd-analyze's output (O lines, or one B line in base64) and
# "TOKEN V SERVICE EXIT_STATUS"; "TOKEN V - -" where there is no systemd-analyze. The last
# line is "TOKEN END".
ENV_DROPIN=50-reconciler-env.conf

T=$1
nl='
'
command -v systemd-analyze >/dev/null 2>&1 || { printf '%s V - -\n' "$T"; printf '%s END\n' "$T"; exit 0; }
# stdin, first line: a random directory suffix, then the temp names that get a drop-in directory.
# One mkdir makes them all (mode 700; the name is on no command line before mkdir runs).
read -r r dropins || exit 1
dir=/tmp/reconciler-verify.$r
set -f
set -- "$dir"
for t in $dropins; do set -- "$@" "$dir/$t.service.d"; done
set +f
mkdir -m 700 -- "$@" || exit 1
trap 'rm -rf "$dir"' EXIT
put() {  # file count: copy count lines of stdin into file, the last without a newline (exact bytes)
  n=$2
  { IFS= read -r l; printf '%s' "$l"
    while [ "$n" -gt 1 ]; do IFS= read -r l; printf '\n%s' "$l"; n=$((n - 1)); done; } > "$1"
}
while read -r svc tmpname nunit nenv; do
  put "$dir/$tmpname.service" "$nunit"
  [ "$nenv" = - ] || put "$dir/$tmpname.service.d/$ENV_DROPIN" "$nenv"
  # Only this unit's own findings (--recursive-errors=no, systemd 250+: a fifth of the time, and
  # another unit's fault never blocks this one); an older systemd-analyze checks as it can.
  out=$(systemd-analyze verify --man=no --recursive-errors=no "$dir/$tmpname.service" 2>&1); rc=$?
  case "$out" in *recursive-errors*)
    out=$(systemd-analyze verify --man=no "$dir/$tmpname.service" 2>&1); rc=$? ;;
  esac
  # Printable ASCII comes line by line (O); anything else in one base64 payload (B).
  # shellcheck disable=SC2101 # [![:print:]"$nl"] is one bracket expression: neither printable nor a newline
  case "$out" in
    *[![:print:]"$nl"]*) printf '%s B %s %s\n' "$T" "$svc" "$(printf '%s' "$out" | base64 -w0)" ;;
    *) IFS=$nl; set -f
       for l in $out; do printf '%s O %s %s\n' "$T" "$svc" "$l"; done
       unset IFS; set +f ;;
  esac
  printf '%s V %s %s\n' "$T" "$svc" "$rc"
done
printf '%s END\n' "$T"
