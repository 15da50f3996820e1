# Declarations shared by the Cython kernels (included by _im2col.pyx and _pool.pyx).

# below this many bytes of work, starting the OpenMP team costs more than it saves
cdef enum:
    PARALLEL_MIN_BYTES = 1 << 18

ctypedef fused floating:
    float
    double


cdef inline Py_ssize_t _max(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return a if a > b else b


cdef inline Py_ssize_t _min(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return a if a < b else b
