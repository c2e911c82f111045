#!/bin/sh
# reconciler: a deploy's dead-man's switch (plan/confirm.py writes it: this file after a header
# of its constants and named parameters, as /var/lib/reconciler/confirm/<service>.sh, 0600).
# It runs, with /bin/sh, when the controller did not confirm the deploy within its window (the
# transient timer the lock holder armed as the controller went, rearm.sh): it takes the host
# lock first (the timer's service does, flock), counts itself and says who holds it, as every
# holder does (host/lock.py); then it puts the previous, verified version back (unit, env,
# secrets), records the new one quarantined (NotConfirmed) and restarts the service, or, with
# no verified previous version, records that and stops it. Then it disarms itself.
#
# Parameters (assignments in its header): SERVICE; ACTION (restore | stop); UNIT, DROPIN, ENVFILE,
# SECRETS_DROPIN (the previous version's files, base64; "-": it had none), RESTORE_SECRETS (1: put
# back the secrets the deploy replaced), RECORD (the record it writes, base64). ACTION stop: no
# previous version, the service is stopped. Constants (the sender's, plan/layout.py): STATE, UNIT_DIR,
# ENV_DIR, ENV_DROPIN, SECRETS_DROPIN_NAME, CREDSTORE, KEPT, COUNT, OWNER, WANTS, TEMP, SWITCH,
# CONFIRM.
set -u
# A holder of the host lock: counted, and named, before it changes anything (host/lock.py). Where
# the count cannot be written (a full disk), the file goes: a look that saw a count never stands.
g=0
[ ! -f "$COUNT" ] || { read -r g < "$COUNT" || :; }
case $g in ''|*[!0-9]*) n=1 ;; *) n=$((g + 1)) ;; esac
{ echo "$n" > "$COUNT"; } 2>/dev/null || rm -f "$COUNT"
echo "the dead-man switch of $SERVICE ($SWITCH-$SERVICE.service)" > "$OWNER"

put() {  # path base64 [mode]: written atomically ("-": removed)
  if [ "$2" = - ]; then rm -f "$1"; return; fi
  d=${1%/*}; mkdir -p "$d"; t=$(mktemp "$d/$TEMP.XXXXXX")
  printf "%s" "$2" | base64 -d > "$t" && chmod "${3:-0644}" "$t" && sync "$t" && mv -f "$t" "$1"
}
svc_unit=$SERVICE.service
if [ "$ACTION" = restore ]; then
  put "$UNIT_DIR/$svc_unit" "$UNIT"
  put "$UNIT_DIR/$svc_unit.d/$ENV_DROPIN" "$DROPIN"
  put "$ENV_DIR/$SERVICE.env" "$ENVFILE" 0600
  put "$UNIT_DIR/$svc_unit.d/$SECRETS_DROPIN_NAME" "$SECRETS_DROPIN"
  if [ -n "$RESTORE_SECRETS" ]; then     # the secrets the deploy replaced, kept aside by it
    cur=$CREDSTORE/$SERVICE old=$KEPT/$SERVICE
    rm -rf "$cur" "$cur.env"
    [ ! -e "$old" ] || mv "$old" "$cur"
    [ ! -e "$old.env" ] || mv "$old.env" "$cur.env"
  fi
  put "$STATE/services/$SERVICE.json" "$RECORD"
  systemctl daemon-reload
  systemctl reset-failed "$svc_unit" 2>/dev/null
  systemctl restart "$svc_unit"
else
  put "$STATE/services/$SERVICE.json" "$RECORD"
  systemctl stop "$svc_unit"
fi
# Disarmed: its transient timer is gone once it fired; an older reconciler's files go with it.
n=$SWITCH-$SERVICE
rm -f "$CONFIRM/$SERVICE.sh" "$UNIT_DIR/$n.service" "$UNIT_DIR/$n.timer" "$WANTS/$n.timer"
rm -f "$OWNER"
