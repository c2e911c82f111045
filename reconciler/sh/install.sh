#!/bin/sh
# reconciler: installs the lock holder's programs on a host, by content (host/lock.py: Install
# runs this where launch.sh said MISSING): each under BIN as its content's name (NAME.sh), root's
# alone, written atomically; the programs there that are no longer named (an older release's)
# are removed.
#
# stdin, named parameters (one a line, then an empty line): token; file (repeated: "NAME BASE64":
# the name it is installed as, and its text in base64, one line).
# The answer: "TOKEN I NAME" for each program installed, then "TOKEN END". A failure ends it
# before its END, with exit status 1 (a name that is not a content name is one).
# Constants (the sender's, plan/layout.py): BIN, TEMP.
T='' files=''
nl='
'
params T=token files+=file
umask 077
{ mkdir -p "$BIN" && chmod 0700 "$BIN"; } || exit 1
for f in "$BIN"/*.sh; do
  [ -e "$f" ] || continue
  case $nl$files in *"$nl${f##*/} "*) ;; *) rm -f "$f" ;; esac
done
set -f
IFS=$nl
for e in $files; do
  name=${e%% *} blob=${e#* }
  case ${name%.sh} in ''|*[!0-9a-f]*) exit 1 ;; esac
  [ "${name%.sh}" != "$name" ] || exit 1
  t=$(mktemp "$BIN/$TEMP.XXXXXX") || exit 1
  { printf '%s' "$blob" | base64 -d > "$t" && mv -f "$t" "$BIN/$name"; } || { rm -f "$t"; exit 1; }
  printf '%s I %s\n' "$T" "$name"
done
printf '%s END\n' "$T"
