# What the C entries take as it is ("canonical"), for the Python layer to ask.
#
# The rule itself is _is_canonical and _disjoint (_core.pyx), which the entries
# use; these wrappers let cposembed/_validation.py and _state.py ask the same
# question instead of writing it again in Python.


def is_canonical(obj, dtype, bint writable=False):
    """Whether the entries take ``obj`` as it is for ``dtype``: an exact ndarray
    of that dtype, native byte order, C-contiguous, aligned (and writable, with
    ``writable=True``). ``dtype`` is compared by type number, so a byte-swapped
    array is not canonical for it."""
    cdef cnp.dtype descr = dtype if isinstance(dtype, cnp.dtype) else cnp.dtype(dtype)
    cdef int typenum = descr.type_num
    if not _is_canonical(obj, typenum):
        return False
    return not writable or cnp.PyArray_ISWRITEABLE(<cnp.ndarray>obj)


def disjoint(a, b):
    """Whether two exact C-contiguous ndarrays occupy byte ranges that do not
    meet (what the entries require of an output and what the call reads; an
    empty array meets nothing). False for anything else: it may meet."""
    if not (cnp.PyArray_CheckExact(a) and cnp.PyArray_CheckExact(b)):
        return False
    if not (cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>a)
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>b)):
        return False
    return _disjoint(<cnp.ndarray>a, <cnp.ndarray>b)
