#!/bin/sh
# reconciler: starts a run's lock holder (host/lock.py): the installed holder (holder.sh) in bash
# where the host has it (the holder then runs the run's command loop, session.sh, in its own
# shell), else in sh; or says "TOKEN MISSING" where the holder, its loop or the program it runs
# first is not installed yet (the run installs them and starts this again). Nothing but this
# text is on the command line: what follows comes on stdin.
#
# stdin, named parameters (one a line, then an empty line): token; need (repeated: the installed
# programs, by path); run (the holder's path). The holder's own parameters follow.
T='' need='' run=''
nl='
'
params T=token need+=need run
IFS=$nl
for p in $need; do
  [ -f "$p" ] || { printf '%s MISSING\n' "$T"; exit 0; }
done
if command -v bash >/dev/null 2>&1; then exec bash "$run"; fi
exec sh "$run"
