"""glm_pack.runtime: load a packed checkpoint and run absorbed MLA (aiter on gfx950, Triton, torch reference)."""
