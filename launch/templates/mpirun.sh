#!/bin/bash
{{header}}
# Launch without Slurm, with Open MPI's mpirun. Run this script on the first node of a
# hostfile that lists the job's nodes, one per line ("node01 slots={{gpus_per_node}}"):
#     HOSTFILE=/path/to/hostfile bash THIS_SCRIPT
# Ranks start through mpi4py (--launcher mpi), which must be built against this Open MPI.
# MPICH/Hydra equivalent of the mpirun line at the end:
#     mpiexec -n {{ntasks}} -ppn {{gpus_per_node}} -f "$HOSTFILE" -genvall python -m axo4d.train ...

{{preamble}}

{{python_env}}

{{job_vars}}
HOSTFILE="${HOSTFILE:-hostfile}"
if [ ! -f "${HOSTFILE}" ]; then
    echo "error: hostfile '${HOSTFILE}' not found: list the ${NNODES} nodes one per line and set HOSTFILE=..." >&2
    exit 2
fi
NHOSTS=$(grep -cEv '^[[:space:]]*(#|$)' "${HOSTFILE}" || true)
if [ "${NHOSTS}" -lt "${NNODES}" ]; then
    echo "error: hostfile '${HOSTFILE}' lists ${NHOSTS} nodes but this job needs ${NNODES}" >&2
    exit 2
fi
# Rank 0 runs on the first host (ranks fill the nodes in hostfile order).
export MASTER_ADDR="${MASTER_ADDR:-$(grep -Ev '^[[:space:]]*(#|$)' "${HOSTFILE}" | head -n 1 | awk '{print $1}')}"

{{env}}

{{run_dir}}
# Forward the environment set above to every rank (only variables that are set).
FORWARD=()
for v in PATH LD_LIBRARY_PATH PYTHONPATH PYTHONUNBUFFERED VIRTUAL_ENV MASTER_ADDR MASTER_PORT {{env_names}}; do
    if [ -n "${!v+x}" ]; then FORWARD+=(-x "$v"); fi
done
# --map-by ppr:G:node places G ranks on each node (one per GPU; axo4d picks cuda:<local rank>).
# --bind-to none leaves CPU placement to the OS; bind by NUMA domain if your nodes need it.
mpirun -np {{ntasks}} --hostfile "${HOSTFILE}" --map-by ppr:{{gpus_per_node}}:node --bind-to none "${FORWARD[@]}" \
    {{train_cmd}} &
{{job_end}}
