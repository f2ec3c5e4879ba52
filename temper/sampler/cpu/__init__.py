"""The sampler's CPU speed wing: fused/packed decoder twins, thread-sharded decode, helper
processes. Chosen once when an engine is built; the core decode loop in `temper.sampler` does
not know about them."""
