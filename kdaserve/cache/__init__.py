"""Per-request cache memory: paged MLA latent blocks and fixed KDA state slots."""
