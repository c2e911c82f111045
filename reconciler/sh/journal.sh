#!/bin/sh
# A unit's journal since a moment, for the line that explains a failure
# (reconciler/plan/facts/journal.py: Journal runs this, parse_journal reads it): its last LINES
# entries as JSON (one a line: a message is a field, so no line of the service can pass for
# another entry), of those the newest BYTES bytes (a cut first entry is no JSON: skipped).
#
# stdin, named parameters (one a line, then an empty line): token; unit; since (epoch seconds).
# The answer: "TOKEN J -", journalctl's lines as they are, then "TOKEN END".
# Constants (the sender's): LINES, BYTES.
T='' unit='' since=0
params T=token unit since
case $since in ''|*[!0-9]*) since=0 ;; esac
printf '%s J -\n' "$T"
journalctl -u "$unit" --since "@$since" -o json --no-pager -n "$LINES" 2>/dev/null | tail -c "$BYTES"
printf '\n%s END\n' "$T"
