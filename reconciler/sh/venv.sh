#!/bin/sh
# A fragment, not a program: what the programs that read a Python environment share
# (engine-probe.sh, versions.sh), put in front of their text as it is sent (HostProgram.fragments).

# The system's site directories (globs, one a line), listed in the order python's site module
# puts them on sys.path: Fedora's and RHEL's /usr/local (a `pip install` as root; lib64 for a
# wheel with compiled code), Debian's and Ubuntu's dist-packages, then the distribution's own
# site-packages (lib64 again). The interpreter's own, BIN/../lib and BIN/../lib64, each program
# looks at first. Only read, with shell builtins: nothing here runs an interpreter. The engine
# check's probe is the one program that does (engine-probe.sh): `python -I -B` under systemd-run,
# with the unit's identity and sandbox and the controller's allowlisted copy of the service's
# environment; a preview runs it only for a signed revision or with --engine-check.
# shellcheck disable=SC2034  # read by the programs this fragment goes in front of
SYSTEM_SITES='/usr/local/lib64/python3*/site-packages
/usr/local/lib/python3*/site-packages
/usr/local/lib/python3*/dist-packages
/usr/lib/python3*/dist-packages
/usr/lib64/python3*/site-packages
/usr/lib/python3*/site-packages'

# venv_system_site BIN: true where the interpreter in BIN sees the system's site-packages (and
# the user's): it is no venv (no pyvenv.cfg beside or above it), or a venv that includes them.
# Builtins only: no process.
venv_system_site() {
  for cfg in "$1/pyvenv.cfg" "$1/../pyvenv.cfg"; do
    [ -f "$cfg" ] || continue
    while IFS= read -r l || [ -n "$l" ]; do
      case $l in include-system-site-packages*=*[Tt]rue*) return 0 ;; esac
    done < "$cfg"
    return 1
  done
  return 0
}
