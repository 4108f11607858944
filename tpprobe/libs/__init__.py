"""The TP libraries users bring, on CPU: one module per library holds every workaround that library
needs to run without a GPU (megatron_cpu). torch's own DTensor TP and transformers' TP need none
(CPU gloo works as they are). Imported only by CPU tests and examples; tpprobe's pipeline never
imports a library itself."""
