# ---- communication environment: OLCF Frontier (MI250X GCDs, RCCL, HPE Slingshot-11) -------
# Sources: OLCF "PyTorch on Frontier" (RCCL network plugin, RCCL environment variables,
# MIOpen cache) and HPE's github.com/HewlettPackard/shs-ccl-docs (rccl_tuning_guide.md).
# MIOpen keeps its kernel databases under $HOME by default; thousands of ranks on the shared
# filesystem give "disk I/O" errors (OLCF), so use node-local /tmp.
export MIOPEN_USER_DB_PATH="/tmp/miopen-${USER:-$(id -un)}-${SLURM_JOB_ID:-$$}"
export MIOPEN_CUSTOM_CACHE_DIR="${MIOPEN_USER_DB_PATH}"   # compiled-kernel cache next to the user DB
mkdir -p "${MIOPEN_USER_DB_PATH}"
# RCCL reaches Slingshot only through the libfabric plugin (aws-ofi-rccl / aws-ofi-nccl built for
# ROCm): `module load rccl-net-plugin` above, or your own build with
# `export NCCL_NET_PLUGIN=/path/to/lib/librccl-net.so`. Without it RCCL uses TCP sockets.
export NCCL_CROSS_NIC=1                     # OLCF/HPE: improves performance on large systems
export NCCL_NET_GDR_LEVEL=PHB               # GPUDirect RDMA between GCD and NIC (OLCF/HPE list)
export NCCL_SOCKET_IFNAME=hsn0              # bootstrap on the Slingshot interface; OLCF lists hsn0..hsn3 and suggests hsn0 alone if start-up hangs
export HSA_FORCE_FINE_GRAIN_PCIE=1          # fine-grained PCIe memory for GPU<->NIC transfers (OLCF/HPE list)
export FI_MR_CACHE_MONITOR=kdreg2           # Frontier's default monitor; OLCF: kdreg2 or userfaultfd are safe, memhooks can deadlock
export FI_CXI_DISABLE_HOST_REGISTER=1       # avoids CXI-provider host-registration calls that can deadlock
export FI_CXI_DEFAULT_CQ_SIZE=131072        # larger completion queues for large jobs
export FI_CXI_DEFAULT_TX_SIZE=2048          # for large jobs that depend on unexpected rendezvous messages
export FI_CXI_RX_MATCH_MODE=hybrid          # fall back to software tag matching when NIC resources run out
export FI_CXI_RDZV_PROTO=alt_read           # OLCF: better RCCL performance at scale; needs `#SBATCH --network=disable_rdzv_get`
export FI_CXI_RDZV_EAGER_SIZE=0             # no eager data before the receiver is ready (OLCF/HPE list)
export FI_CXI_RDZV_THRESHOLD=0              # (OLCF/HPE list, goes with alt_read)
export FI_CXI_RDZV_GET_MIN=0                # (OLCF/HPE list, goes with alt_read)
export FI_CXI_ATS=0                         # NIC uses its own address translation instead of PCIe ATS: from the aws-ofi-rccl README's run settings, not in OLCF's current list
export MPICH_GPU_SUPPORT_ENABLED=0          # axo4d does not use GPU-aware MPI
# Multi-node only (OLCF): make RCCL fail if the plugin does not initialise instead of using
# sockets; Frontier's network is not configured for single-node jobs, so never on one node.
if [ "${NNODES}" -gt 1 ]; then export NCCL_NET="OFI"; fi
# Debugging: export NCCL_DEBUG=INFO
axo4d_net_plugin rccl                     # more than one node: stop with one line if the plugin is missing
