"""The SGLang engine moved to tpprobe.engines.sglang; this package keeps the plugin's old entry point
(`tpprobe.sglang.plugin:register`) importable for server configs that name it."""
