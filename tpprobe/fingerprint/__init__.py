"""Fingerprint: what a tensor's fingerprint is (definition), its torch reference and deferred reads
(reference), how two compare (levels), and the Triton kernels that compute it on a GPU."""
