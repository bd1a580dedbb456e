"""numba's cache of a compiled kernel is checked against every kernel file, not only its own."""

import hashlib
import os

import pytest

from offload.model import fused, kernel_stamp, kernels
from offload.runtime.runner import Runner

pytestmark = pytest.mark.skipif(kernels.numba is None, reason="needs numba")


def _stamp(func, path):
    from numba.core import caching
    return caching.InTreeCacheLocator(func, path).get_source_stamp()


def test_a_cached_layer_is_stamped_with_the_packed_kernels_it_compiles_in():
    """The fused layer's cache holds the int8 kernel compiled into it: its stamp must change when cpu_packed.py does,
    although the layer lives in fused.py (a `git pull` touching one file must not leave the old kernel running)."""
    here = os.path.dirname(kernels.__file__)
    digest = hashlib.sha256()
    for name in kernel_stamp.SOURCES:
        with open(os.path.join(here, name), "rb") as f:
            digest.update(f.read())
    own, everything = _stamp(fused._layer.py_func, fused.__file__)
    assert everything == digest.hexdigest() and "cpu_packed.py" in kernel_stamp.SOURCES
    compiled = {name for name in os.listdir(here) if name.endswith(".py")  # every file of compiled kernels
                and "from numba" in open(os.path.join(here, name), encoding="utf-8").read()}
    assert compiled == set(kernel_stamp.SOURCES), "kernel_stamp.SOURCES must name every file numba compiles code from"
    with open(fused.__file__, "rb") as f:
        assert own == hashlib.sha256(f.read()).digest()  # numba's own stamp of the file, kept beside


def test_functions_of_other_packages_keep_numbas_stamp():
    stamp = _stamp(test_functions_of_other_packages_keep_numbas_stamp, __file__)
    with open(__file__, "rb") as f:
        assert stamp == hashlib.sha256(f.read()).digest()


def test_layers_compiled_reads_numbas_cache_of_the_decoder_layer(tiny_llama):
    """`fused.layers_compiled` (a fresh install's first run holds RAM back for compiling: `plan.memory.run_capacities`)
    finds the decoder layer a run compiled and cached: for dense matrices, and for packed ones (int8 codes)."""
    with Runner(model=str(tiny_llama), device="cpu", dtype="float32") as r:
        r.generate([[1, 5, 9]], max_new_tokens=2, stop_on_eos=False)
    assert fused.layers_compiled() is True and fused.layers_compiled(False) is True
    int8 = {"quantization": "int8", "group_size": 8}
    with Runner(model=str(tiny_llama), device="cpu", dtype="float32", weights=int8) as r:
        r.generate([[1, 5, 9]], max_new_tokens=2, stop_on_eos=False)
    assert fused.layers_compiled(True) is True and fused.compile_reserve(True) == fused.compile_reserve(False) == 0
