#!/bin/bash
# Rendered by `resilient deploy render` from topology.toml; edit freely (render again to start over).
#
# A Slurm prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/resilient.sh) that runs the node burn-in
# measurement (a matmul, a disk write with fsync, a local gloo all-reduce) before a job of run demo
# starts here; a node that cannot do them is drained with the reason, and the job goes elsewhere.  The
# agents (started with --burn-in) also judge each node's numbers against the fleet's before it trains.
set -uo pipefail
case "${SLURM_JOB_NAME:-}" in
    demo) ;;
    *) exit 0 ;;
esac
scratch=${RESILIENT_BURNIN_SCRATCH:-/tmp}/resilient-burnin-$SLURM_JOB_ID
mkdir -p "$scratch"
if ! report=$(python3 -m resilient.watchdog.burnin --scratch "$scratch" 2>&1); then
    rm -rf "$scratch"
    scontrol update NodeName="$SLURMD_NODENAME" State=DRAIN Reason="resilient burn-in failed: ${report:0:200}"
    exit 1
fi
rm -rf "$scratch"
exit 0
