#!/bin/sh
# reconciler: arm every dead-man's switch still pending (their timers are transient), at boot
# (reconciler-rearm-switches.service) and when the controller went (the lock holder's last act,
# holder.sh). A switch whose script is still there got no verdict: its transient timer is made
# again, its window (the script's "# window=" line) counted from now. $1: why, for the description.
# Constants (the sender's, from reconciler/plan/layout.py): CONFIRM, LOCK, SWITCH.

why=${1:-armed again at boot}
for s in "$CONFIRM"/*.sh; do
  [ -f "$s" ] || continue
  n=${s##*/}
  n=${n%.sh}
  w=$(sed -n 's/^# window=\([0-9][0-9]*\)$/\1/p' "$s" | head -n 1)
  # The switch's service takes the host lock first, then runs the script if it is still there
  # (a verdict meanwhile removed it); the path is an argument, never parsed as shell again.
  # shellcheck disable=SC2016  # $1 is the inner sh's own: expanded there, not here
  systemd-run --quiet --collect --unit="$SWITCH-$n" \
    --description="reconciler: dead-man's switch of $n ($why)" --on-active="${w:-600}s" \
    --timer-property=AccuracySec=1s --timer-property=RemainAfterElapse=no -p Type=oneshot \
    /usr/bin/flock -w 600 "$LOCK" /bin/sh -c '[ ! -f "$1" ] || exec /bin/sh "$1"' reconciler-switch "$s"
done
true
