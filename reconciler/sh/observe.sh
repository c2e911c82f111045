#!/bin/sh
# What the planner reads from a host, in one round trip (reconciler/plan/facts/observe.py:
# Observe runs this, parse_observation reads it).
#
# For every SERVICE and every service in the inventory: the unit file, our env drop-in, the env
# file, the record, every drop-in systemd would apply, its recorded leave of rotation
# (ROTATION/NAME.left), and `systemctl show`; the host record
# (and the host's GPU fault, gpu-fault.json),
# the lock's count, stale temp files, and a keyed hash of each SECRET_FILE (never its content).
# Each record is a line "TOKEN KIND ...", the last "TOKEN END": TOKEN is random per run, so no
# file's content can forge a record. Builtins only per file: no process per file.
#
# stdin, named parameters (one a line, then an empty line): token, service (repeated), secret
# (repeated: a file whose keyed hash is asked for; none asked: nothing is written).
# Constants (the sender's, from reconciler/plan/layout.py): D, LOCK, COUNT, OWNER, CONFIRM,
# UNIT_DIR, ENV_DIR, ENV_DROPIN, DROPIN_DIRS, SHOW_PROPS, KEY, TEMP, ROTATION.
NL='
'
T='' services='' secrets=''
params T=token services+=service secrets+=secret
names=' '
for n in $services; do names="$names$n "; done      # service names: no blank, no glob character
# The lock's count: 0 where the lock was never taken, - where it cannot be trusted: a holder
# has the lock (its owner file says who), an armed dead-man's switch may fire at any moment, or
# the lock was taken but its count is gone (a holder could not write it).
g=-
if [ -f "$COUNT" ]; then read -r g < "$COUNT" || :; elif [ ! -e "$LOCK" ]; then g=0; fi
[ ! -s "$OWNER" ] || g=-
for f in "$CONFIRM"/*.sh; do [ ! -e "$f" ] || g=-; done
printf '%s G %s\n' "$T" "${g:--}"
for f in "$UNIT_DIR/$TEMP".* "$UNIT_DIR"/*.service.d/"$TEMP".* "$ENV_DIR/$TEMP".* \
         "$D/$TEMP".* "$D"/*/"$TEMP".* "$D"/credstore/*/"$TEMP".*; do
  [ -e "$f" ] || [ -L "$f" ] || continue
  printf '%s T %s\n' "$T" "$(printf '%s' "$f" | base64 -w0)"
done
if [ -n "$secrets" ]; then
  # files that hold secrets: a keyed hash of each, never the content
  if [ ! -s "$KEY" ]; then
    mkdir -p "$D" && chmod 0700 "$D" && (umask 077; head -c 32 /dev/urandom | base64 > "$KEY.tmp" && mv -f "$KEY.tmp" "$KEY")
  fi
  IFS=$NL; set -f
  for f in $secrets; do
    h=-; [ -f "$f" ] && h=$(cat "$KEY" "$f" | sha256sum | cut -c1-32)
    printf '%s K %s %s\n' "$T" "$(printf '%s' "$f" | base64 -w0)" "$h"
  done
  unset IFS; set +f
fi
emit() {  # kind name path: each line of the file after "$T kind name L ", a last line without its
  # newline as P, then F; or "-" when there is no such file. Builtins only: no process per file.
  if [ -f "$3" ]; then
    l=
    while IFS= read -r l; do printf '%s %s %s L %s\n' "$T" "$1" "$2" "$l"; done < "$3"
    [ -z "$l" ] || printf '%s %s %s P %s\n' "$T" "$1" "$2" "$l"
    printf '%s %s %s F\n' "$T" "$1" "$2"
  else printf '%s %s %s -\n' "$T" "$1" "$2"; fi
}

for f in "$D"/services/*.json; do
  [ -e "$f" ] || continue
  n=${f##*/}; n=${n%.json}
  case "$names" in *" $n "*) ;; *) names="$names$n ";; esac
done
emit H - "$D/host.json"
emit H gpu "$D/gpu-fault.json"
units=""
for n in $names; do
  u=$UNIT_DIR/$n.service
  emit R "$n" "$D/services/$n.json"
  emit U "$n" "$u"
  emit E "$n" "$u.d/$ENV_DROPIN"
  emit V "$n" "$ENV_DIR/$n.env"
  emit O "$n" "$ROTATION/$n.left"
  for d in $DROPIN_DIRS; do
    for f in "$d/$n.service.d/"*.conf; do
      [ -f "$f" ] || continue
      case "$f" in
        *"$NL"*) printf '%s D %s B %s\n' "$T" "$n" "$(printf '%s' "$f" | base64 -w0)" ;;
        *) printf '%s D %s N %s\n' "$T" "$n" "$f" ;;
      esac
      emit D "$n" "$f"
    done
  done
  units="$units $n.service"
done
if [ -n "$units" ]; then
  # last, and as it is (no base64 process): everything up to the END line is systemctl's
  printf '%s S -\n' "$T"
  # shellcheck disable=SC2086 # $units is a list of unit names, one argument each
  systemctl show -p "$SHOW_PROPS" $units
  echo
fi
printf '%s END\n' "$T"
