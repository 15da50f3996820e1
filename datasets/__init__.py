"""Data: the bundled digits, the HDF5 image format, its converters and the loader."""
