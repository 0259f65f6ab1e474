# ---- communication environment: no site-specific settings known for this machine -------------
# Set what your site documents for NCCL/RCCL, for example:
# export NCCL_SOCKET_IFNAME=ib0             # interface for NCCL's bootstrap (ib0, eth0, hsn0, ...)
# export NCCL_IB_HCA=mlx5                   # InfiniBand adapters NCCL may use
# export NCCL_DEBUG=INFO                    # prints the transport NCCL picked (look for NET/IB or NET/OFI)
