# ---- communication environment: NERSC Perlmutter (A100, HPE Slingshot-11) ----------------
# Sources: HPE's Slingshot NCCL application note (github.com/HewlettPackard/shs-ccl-docs:
# nccl/nccl_tuning_guide.md, ccl_env.sh) and NERSC's NCCL/PyTorch pages. NERSC's nccl and
# pytorch modules already set most of these; they are repeated so the job says what it uses.
export NCCL_NET_GDR_LEVEL=PHB               # GPUDirect RDMA between a GPU and a NIC under the same host bridge (HPE: needed for RDMA)
export NCCL_CROSS_NIC=1                     # rings/trees may use different NICs on different nodes (HPE: better on large systems)
export NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3   # NCCL bootstrap/socket traffic on the Slingshot interfaces, not the management NIC
export FI_MR_CACHE_MONITOR=userfaultfd      # libfabric memory-registration cache monitor HPE recommends for NCCL
export FI_CXI_DISABLE_HOST_REGISTER=1       # HPE: avoids CXI-provider host-registration calls that can deadlock with CUDA
export FI_CXI_DEFAULT_CQ_SIZE=131072        # larger completion queues (HPE: increase, especially for large jobs)
export FI_CXI_DEFAULT_TX_SIZE=2048          # HPE: for large jobs that depend on unexpected rendezvous messages
export FI_CXI_RX_MATCH_MODE=hybrid          # fall back to software tag matching when NIC matching resources run out
export MPICH_GPU_SUPPORT_ENABLED=0          # axo4d does not use GPU-aware MPI (mixing it with NCCL can deadlock)
# Multi-node only: fail at start-up instead of silently falling back to TCP sockets when the
# aws-ofi-nccl plugin is missing (HPE advises against NCCL_NET on single-node runs).
if [ "${NNODES}" -gt 1 ]; then export NCCL_NET="AWS Libfabric"; fi
# Optional, HPE's setting for NCCL-heavy jobs at scale (needs `#SBATCH --network=disable_rdzv_get`):
# export FI_CXI_RDZV_PROTO=alt_read FI_CXI_RDZV_EAGER_SIZE=0 FI_CXI_RDZV_GET_MIN=0
# Debugging: export NCCL_DEBUG=INFO  (look for "Using network AWS Libfabric" on every rank)
axo4d_net_plugin nccl                     # more than one node: stop with one line if the plugin is missing
