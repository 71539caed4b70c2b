#!/bin/bash
# Rendered by `resilient deploy render` from topology.toml; edit freely (render again to start over).
#
# A Slurm prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/resilient.sh) that runs the node burn-in
# measurement (a matmul, a disk write with fsync, a local gloo all-reduce) before a job starts here.  A node
# that cannot do them fails the prolog: Slurm drains it (the reason is in slurmd's log) and requeues the job,
# held.  The agents (started with --burn-in) also judge each node's numbers against the fleet's.
set -uo pipefail
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin  # a prolog gets no search path
# Only jobs of the partition this run uses (a prolog is the whole cluster's, and gets no job name).
[ "${SLURM_JOB_PARTITION:-}" = debug ] || exit 0
scratch=${RESILIENT_BURNIN_SCRATCH:-/tmp}/resilient-burnin-$SLURM_JOB_ID
mkdir -p "$scratch"
if ! report=$(/usr/bin/python3 -m resilient.watchdog.burnin --scratch "$scratch" 2>&1); then
    rm -rf "$scratch"
    echo "resilient burn-in failed on $(hostname): ${report:0:400}" >&2
    exit 1
fi
rm -rf "$scratch"
exit 0
