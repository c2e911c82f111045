#!/bin/sh
# The host record (host.json) as it is (reconciler/plan/facts/host_record.py: HostRecordRead runs
# this, parse_host_record reads it): pull mode's choice of revision starts from the revision the
# host last applied. Each line of the file as "TOKEN H L TEXT", a last line without its newline
# as "TOKEN H P TEXT", then "TOKEN H F"; "TOKEN H -" when there is no record. Builtins only.
#
# stdin, named parameters (one a line, then an empty line): token.
# Constants (the sender's, from reconciler/plan/layout.py): HOST_RECORD.
T=''
params T=token
if [ -f "$HOST_RECORD" ]; then
  l=
  while IFS= read -r l; do printf '%s H L %s\n' "$T" "$l"; done < "$HOST_RECORD"
  [ -z "$l" ] || printf '%s H P %s\n' "$T" "$l"
  printf '%s H F\n' "$T"
else
  printf '%s H -\n' "$T"
fi
printf '%s END\n' "$T"
