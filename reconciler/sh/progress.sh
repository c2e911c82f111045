#!/bin/sh
# The new journal lines of services being started, for their load progress
# (reconciler/plan/facts/progress.py: JournalTail runs this, parse_tail reads it). It runs in the
# health watch's round trip, just before its `systemctl show`.
#
# stdin, named parameters (one a line, then an empty line): token; read (repeated: "INVOCATION
# CURSOR", CURSOR - where none was read yet).
#
# Per invocation of a service, its own processes' lines only (systemd's are not): "TOKEN U
# INVOCATION", then "TOKEN L TEXT" a line: the lines after CURSOR ("-": none read yet, so its
# last LINES lines), at most LINES of them, each cut to its last LINE_MAX bytes (a progress
# bar redrawn with carriage returns is one long line whose latest state is at its end), from
# the first whole word after the cut: the word the cut went through goes too, since its end
# could be the end of a secret that the controller's redaction would no longer see whole; at
# most MAX_BYTES in all (a line that this cuts at the front loses its token: it is no record).
# journalctl's own last line "-- cursor: C" says where the next read starts. The last line is
# "TOKEN END". Constants (the sender's): LINES, LINE_MAX, MAX_BYTES.
T='' reads=''
nl='
'
params T=token reads+=read
LC_ALL=C         # awk and tail count bytes
export LC_ALL
IFS=$nl
set -f
for r in $reads; do
  inv=${r%% *} cursor=${r#* }
  printf '%s U %s\n' "$T" "$inv"
  after=
  [ "$cursor" = - ] || after=--after-cursor=$cursor
  journalctl "_SYSTEMD_INVOCATION_ID=$inv" ${after:+"$after"} -n "$LINES" -o cat --show-cursor --no-pager \
      2>/dev/null \
    | awk -v t="$T" -v m="$LINE_MAX" '{
        if (length($0) > m) {
          cut = substr($0, length($0) - m, 1)
          $0 = substr($0, length($0) - m + 1)
          if (cut !~ /[ \t\r]/) { w = match($0, /[ \t\r]/); $0 = w ? substr($0, w + 1) : "" }
        }
        print t " L " $0 }' \
    | tail -c "$MAX_BYTES"
done
printf '%s END\n' "$T"
