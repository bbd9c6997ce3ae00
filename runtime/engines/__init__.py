"""Adapters that let serving engines (vLLM, SGLang) load glm-pack overlays instead of rebuilding MLA weights."""
