#!/bin/sh
# systemd's own check of the units about to be written (reconciler/plan/facts/verify.py: Verify
# runs this, parse_verify reads it): `systemd-analyze verify` on a copy of each, under a
# throw-away name in a private directory, so no live drop-in of the real unit mixes in.
#
# stdin, named parameters (one a line, then an empty line): token; dir (a random suffix of the
# private directory); unit (repeated: "SERVICE TEMPNAME UNIT_LINES ENV_LINES", ENV_LINES - where
# there is no env drop-in). Then the payload: each unit's lines, then its drop-in's, in that
# order (never on a command line); the shell writes them byte for byte. Every line is read
# before this program ends (a batch's next program reads the lines after them).
#
# Per service: systemd-analyze's output (O lines, or one B line in base64) and "TOKEN V SERVICE
# EXIT_STATUS"; "TOKEN V - -" where there is no systemd-analyze. The last line is "TOKEN END".
# Constants (the sender's): ENV_DROPIN.
T='' r='' units=''
nl='
'
params T=token r=dir units+=unit
dir=/tmp/reconciler-verify.$r
# The private directory (mode 700) and, for each unit with an env drop-in, its drop-in directory:
# one mkdir for all of them (the name is on no command line before mkdir runs).
set -f
set -- "$dir"
IFS=$nl
for u in $units; do
  IFS=' ' read -r _ tmpname _ nenv <<EOF
$u
EOF
  [ "$nenv" = - ] || set -- "$@" "$dir/$tmpname.service.d"
done
unset IFS
set +f
have=1 ok=1
command -v systemd-analyze >/dev/null 2>&1 || have='' ok=''
if [ -n "$have" ]; then
  mkdir -m 700 -- "$@" || ok=
  [ -z "$ok" ] || trap 'rm -rf "$dir"' EXIT
fi
put() {  # file count: copy count lines of stdin into file, the last without a newline (exact bytes)
  n=$2
  { IFS= read -r l; printf '%s' "$l"
    while [ "$n" -gt 1 ]; do IFS= read -r l; printf '\n%s' "$l"; n=$((n - 1)); done; } > "$1"
}
skip() {  # count: read past count lines of stdin
  n=$1
  while [ "$n" -gt 0 ]; do IFS= read -r _; n=$((n - 1)); done
}
IFS=$nl
for u in $units; do
  unset IFS
  read -r svc tmpname nunit nenv <<EOF
$u
EOF
  if [ -z "$ok" ]; then
    skip "$nunit"; [ "$nenv" = - ] || skip "$nenv"; IFS=$nl; continue
  fi
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
  IFS=$nl
done
unset IFS
if [ -z "$have" ]; then printf '%s V - -\n' "$T"; elif [ -z "$ok" ]; then exit 1; fi
printf '%s END\n' "$T"
