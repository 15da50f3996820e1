"""mpitrain: a parameter-server-free, MPI data-parallel trainer for convolutional networks."""
__version__ = "0.1.0"
