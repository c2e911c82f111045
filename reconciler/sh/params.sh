#!/bin/sh
# A fragment, not a program: how every host program reads its named parameters (HostProgram.params,
# shell.param_lines), put in front of its text as it is sent (HostProgram.fragments).

# params SPEC...: NAME=value lines from stdin up to an empty line (or the end). Each SPEC names
# a parameter and where it goes: NAME (the variable NAME takes its value), VAR=NAME (VAR takes
# it) or VAR+=NAME (VAR gains it as a line: a parameter given once per item). A parameter no
# SPEC names is read and skipped. A value is assigned as it is, never read as shell: only the
# SPEC's own words (the program's) are ever evaluated. Builtins only: no process.
params() {
  _pn='
'
  while IFS= read -r _pl && [ -n "$_pl" ]; do
    case $_pl in *=*) ;; *) continue ;; esac
    _pk=${_pl%%=*}
    for _ps; do
      case $_ps in
        *+="$_pk") eval "${_ps%%+=*}=\$${_ps%%+=*}\${_pl#*=}\$_pn" ;;
        *="$_pk") eval "${_ps%%=*}=\${_pl#*=}" ;;
        "$_pk") eval "$_ps=\${_pl#*=}" ;;
        *) continue ;;
      esac
      break
    done
  done
}
