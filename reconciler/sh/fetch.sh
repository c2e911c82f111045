#!/bin/sh
# reconciler: a model's own fetch command, run in the model's directory, made first
# (host/apply.py: fetch_model runs this; reconciler/plan/facts/fetch.py reads its answer).
#
# stdin, named parameters (one a line, then an empty line): token; path (the model's directory).
# Then the payload: the command itself (the service's model.fetch as the desired state gives it,
# any number of lines), run as it always was by the login shell of the SSH user ($SHELL, which
# sshd sets; sh where there is none), its stdin empty, what it prints on stderr.
# The answer: "TOKEN F STATUS" (the command's exit status; 1 where the directory could not be
# made or entered), then "TOKEN END".
T='' path='' command=''
nl='
'
params T=token path
while IFS= read -r l; do command=$command$l$nl; done
[ -z "$l" ] || command=$command$l
if mkdir -p -- "$path" && cd -- "$path"; then
  "${SHELL:-/bin/sh}" -c "$command" </dev/null >&2
  r=$?
else
  r=1
fi
printf '%s F %s\n' "$T" "$r"
printf '%s END\n' "$T"
