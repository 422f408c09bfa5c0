#!/bin/sh
# "ssh" for horovodrun on the emulated cluster (tools/cluster/horovodrun.py puts it first on
# PATH under that name). horovodrun runs "ssh -o A -o B HOST [-p P] [-i F] [-o C] COMMAND" to check
# that hosts answer and to start remote ranks; this runs COMMAND (one shell command line, as ssh
# does) inside HOST's network namespace, with its own UTS namespace whose host name is HOST's
# address (tools/cluster/netns.py says why). PSGD_CLUSTER_PREFIX names the namespaces.
host=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-i|-l|-F) shift 2 ;;      # ssh options with an argument: none apply here
    -*) shift ;;
    *) if [ -z "$host" ]; then host=$1; shift; else break; fi ;;
  esac
done
[ -n "$host" ] || { echo "ssh (emulated cluster): no host given" >&2; exit 255; }
last=${host##*.}
ns="${PSGD_CLUSTER_PREFIX:?PSGD_CLUSTER_PREFIX is not set}-h$((last - 1))"
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
