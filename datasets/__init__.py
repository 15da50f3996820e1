"""Data: the bundled digits and (later) the HDF5 format, converters and loader."""
