#!/bin/sh
# What a model directory holds (reconciler/preflight/_hostcheck.py: ModelCheck runs this,
# parse_model_check reads it). POSIX sh, no python on the host.
#
# stdin, named parameters (one a line, then an empty line): token; path (repeated; one with `*`
# is a pattern: its last matching directory, as a Hugging Face cache's snapshots/*); space
# (repeated: the paths whose free space is read, those a fetch may fill; no df for the others).
#
# Per path: "P NAME", whether it is a directory (D), CONFIG_FILE line by line (F NAME L|P TEXT,
# then F NAME E: builtins only, no process for a file of a few KiB) and INDEX_FILE whole in one
# record (F NAME B BASE64, then F NAME E: one base64, which reads in blocks: sh's `read` takes a
# byte per system call, and a large model's index is megabytes), the size of every weight file
# (one stat for all) and, where asked (space), the free space of its file system (one df). A name of printable
# ASCII without spaces comes as it is (@name), any other in base64. Each record is a line
# "TOKEN KIND ...", the last "TOKEN END". Constants (the sender's): CONFIG_FILE, INDEX_FILE.
T='' paths='' spaces=''
nl='
'
params T=token paths+=path spaces+=space
# One file's size: stat, else wc (only when the one stat in weights() does not line up).
size() { stat -L -c %s -- "$1" 2>/dev/null || wc -c < "$1" 2>/dev/null | tr -d ' '; }
name() {  # a name as an S line carries it: @ and the name when printable ASCII without spaces, else base64
  # (the range !-~ holds those bytes in any locale; bash, which may run this, reads [:graph:] by its locale)
  case "$1" in ''|*[!!-~]*) n=$(printf '%s' "$1" | base64 -w0) ;; *) n=@$1 ;; esac
}
weights() {  # dir: one S line per weight file (its size, or - when unreadable), in glob order
  d=$1; set --; ex=
  for w in "$d"/*.safetensors "$d"/*/*.safetensors "$d"/*.bin "$d"/*.gguf; do
    if [ -e "$w" ]; then ex=${ex}1; elif [ -L "$w" ]; then ex=${ex}0; else continue; fi
    set -- "$@" "$w"
  done
  [ $# -gt 0 ] || return 0
  # One stat for every file that exists ("SIZE NAME" lines, a dangling link gives none). Each
  # line must be "SIZE $w" for the next existing file; when not (a name with a newline, a file
  # that went or came meanwhile) every file is sized on its own, as size() does.
  all=; case "$ex" in *1*) all=$(stat -L -c '%s %n' -- "$@" 2>/dev/null) ;; esac
  rest=$all; e=$ex; ok=1
  for w in "$@"; do
    case "$e" in 1*)
      case "$rest" in *"$nl"*) l=${rest%%"$nl"*}; rest=${rest#*"$nl"} ;; *) l=$rest; rest= ;; esac
      s=${l%% *}
      case "$s" in ''|*[!0-9]*) ok= ;; esac
      [ "$l" = "$s $w" ] || ok= ;;
    esac
    e=${e#?}
  done
  [ -z "$rest" ] || ok=
  rest=$all
  for w in "$@"; do
    if [ -z "$ok" ]; then
      s=$(size "$w") || s=-
      [ -n "$s" ] || s=-
    else
      case "$ex" in
        1*) case "$rest" in *"$nl"*) l=${rest%%"$nl"*}; rest=${rest#*"$nl"} ;; *) l=$rest; rest= ;; esac
            s=${l%% *} ;;
        *) s=- ;;
      esac
    fi
    ex=${ex#?}
    name "${w#"$d"/}"
    printf '%s S %s %s\n' "$T" "$s" "$n"
  done
}
free() {  # path: the free KiB of its file system (df's "Available"), or nothing
  a=$(df -Pk -- "$1" 2>/dev/null)
  # shellcheck disable=SC2086 # df's second line split into its fields on purpose (set -f: no glob)
  case "$a" in
    *"$nl"*) a=${a#*"$nl"}; a=${a%%"$nl"*}; set -f; set -- $a; set +f; a=$4 ;;
    *) a= ;;
  esac
}
emit() {  # name file: each line after "$T F name L ", a last line without its newline as P, then E
  l=
  while IFS= read -r l; do printf '%s F %s L %s\n' "$T" "$1" "$l"; done < "$2"
  [ -z "$l" ] || printf '%s F %s P %s\n' "$T" "$1" "$l"
  printf '%s F %s E\n' "$T" "$1"
}
whole() {  # name file: the file's bytes in one record, "$T F name B " and their base64, then E
  printf '%s F %s B ' "$T" "$1"
  base64 -w0 < "$2" 2>/dev/null
  printf '\n%s F %s E\n' "$T" "$1"
}
IFS=$nl; set -f
for p in $paths; do
  unset IFS; set +f
  name "$p"
  printf '%s P %s\n' "$T" "$n"
  d=$p
  case "$p" in *"*"*)   # a pattern (a Hugging Face cache's snapshots/*): its last directory
    for g in $p; do [ -d "$g" ] && d=$g; done ;;
  esac
  if [ -d "$d" ]; then
    printf '%s D 1\n' "$T"
    [ ! -f "$d/$CONFIG_FILE" ] || emit "$CONFIG_FILE" "$d/$CONFIG_FILE"
    [ ! -f "$d/$INDEX_FILE" ] || whole "$INDEX_FILE" "$d/$INDEX_FILE"
    weights "$d"
  else
    printf '%s D 0\n' "$T"
  fi
  case "$nl$spaces" in *"$nl$p$nl"*)
    q=$d        # the nearest existing directory (dirname's steps, by parameter expansion)
    while [ ! -d "$q" ] && [ "$q" != / ] && [ "$q" != . ]; do
      case "$q" in */*) q=${q%/*}; [ -n "$q" ] || q=/ ;; *) q=. ;; esac
    done
    free "$q"
    printf '%s A %s\n' "$T" "$a" ;;
  esac
  IFS=$nl; set -f
done
unset IFS; set +f
printf '%s END\n' "$T"
