"""Benchmarks of the pipeline's stages at the paper's shapes (each module's docstring gives its command)."""
