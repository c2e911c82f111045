#!/bin/sh
# A fragment, not a program: the function the programs that read a Python environment share
# (engine-probe.sh, versions.sh), put in front of their text as it is sent (HostProgram.fragments).

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
