"""Offline tools that read other programs' files (SGLang's dumper, SpecForge) or compare runs."""
