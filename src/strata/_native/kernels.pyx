# cython: language_level=3
def simd_level():
    return "scalar"
