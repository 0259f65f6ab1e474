# ---- communication environment: CSCS Alps (GH200, HPE Slingshot-11) --------------------------
# Source: CSCS documentation, "NCCL" (docs.cscs.ch/software/communication/nccl): the variables
# "should always be set" with uenv; the Container Engine's aws_ofi_nccl hook sets them itself.
export NCCL_NET="AWS Libfabric"             # use the aws-ofi-nccl plugin; fail at start-up instead of falling back to TCP
export NCCL_NET_GDR_LEVEL=PHB               # GPUDirect RDMA when GPU and NIC share a NUMA node
export NCCL_CROSS_NIC=1                     # rings/trees may use different NICs on different nodes
export NCCL_PROTO=^LL128                    # CSCS: LL128 (on by default since NCCL 2.27) performs worse on Slingshot
export FI_CXI_DEFAULT_CQ_SIZE=131072        # libfabric values CSCS found best on Alps across applications
export FI_CXI_DEFAULT_TX_SIZE=32768         # (CSCS list)
export FI_CXI_DISABLE_HOST_REGISTER=1       # avoids CXI-provider host-registration calls that can deadlock with CUDA
export FI_CXI_RX_MATCH_MODE=software        # (CSCS list) software tag matching
export FI_MR_CACHE_MONITOR=userfaultfd      # (CSCS list) memory-registration cache monitor that works with CUDA memory
export MPICH_GPU_SUPPORT_ENABLED=0          # CSCS: GPU-aware MPI together with NCCL can deadlock; may default to 1 on Alps
# CSCS workaround if NCCL hangs or hits watchdog timeouts (disables Slingshot eager messages):
# export FI_CXI_RDZV_GET_MIN=0 FI_CXI_RDZV_THRESHOLD=0 FI_CXI_RDZV_EAGER_SIZE=0
# Debugging: export NCCL_DEBUG=INFO  (look for "Using network AWS Libfabric")
axo4d_net_plugin nccl                     # more than one node: stop with one line if the plugin is missing
