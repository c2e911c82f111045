#!/bin/sh
# systemd's reading of some units, as it is (reconciler/plan/facts/show.py: UnitShow runs this,
# parse_show reads it): the health watch's tick. One `systemctl show`, which this shell becomes
# (exec: no process of its own), so its output runs to the end: the answer is the "TOKEN S -"
# line, then everything after it. Where a unit is not in it, systemd names no such unit.
#
# stdin, named parameters (one a line, then an empty line): token; unit (repeated); props (the
# properties, comma-separated).
T='' units='' props=''
nl='
'
params T=token units+=unit props
printf '%s S -\n' "$T"
IFS=$nl
set -f
# shellcheck disable=SC2086 # $units is a list of unit names, one a line: one argument each
exec systemctl show -p "$props" $units 2>/dev/null
