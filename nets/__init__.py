"""Layers and networks (NHWC). `build_model(name, ...)` is the entry point."""
