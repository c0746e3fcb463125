"""The virtual-memory backends (vattn.vmem): the host backend, the CUDA backend on the fake
driver (both driver paths) and on a GPU."""
