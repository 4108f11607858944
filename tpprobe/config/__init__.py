"""Config: the option fields (fields), every TPPROBE_* knob (knobs), the fault names, and the probe's
options (options: ProbeOptions, the built-in model's defaults)."""
