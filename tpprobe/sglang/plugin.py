"""The old path of the SGLang plugin's entry point: `tpprobe.sglang.plugin:register` (a server config may
name it). The plugin is tpprobe.engines.sglang.plugin."""
from tpprobe.engines.sglang.plugin import register

__all__ = ["register"]
