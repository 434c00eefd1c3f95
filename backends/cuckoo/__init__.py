"""Sources of the cuckoo backend: cuckoo_table.h (core), ops.cc (TF kernels)."""
