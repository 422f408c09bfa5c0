#!/bin/sh
# Open MPI's rsh agent for the emulated cluster (tools/cluster/launch.py points
# plm_rsh_agent here). Open MPI calls it as "rsh_agent.sh [options] HOST COMMAND...", like ssh:
# run COMMAND (a shell command line) on HOST, here inside HOST's network namespace, with its own
# UTS namespace whose host name is HOST's address. PSGD_CLUSTER_PREFIX names the namespaces.
while [ "${1#-}" != "$1" ]; do shift; done   # ssh-style options: none apply
host=$1
shift
last=${host##*.}
ns="${PSGD_CLUSTER_PREFIX:?PSGD_CLUSTER_PREFIX is not set}-h$((last - 1))"
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
