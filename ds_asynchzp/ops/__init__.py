"""Fused data-movement and quantization ops for the engine's collectives, JIT-built from C++/CUDA.

* ``pack`` / ``unpack``: many (strided) tensors to one flat buffer and back, in one pass;
* ``unpack_gathered``: a parameter all-gather's receive buffer laid out in atom order, per parameter;
* ``bucket_add``: gradients copied or added into a reduce-scatter bucket, transposed, padded, scaled and cast
  in one pass;
* ``quantize`` / ``dequantize``: symmetric absmax int8 / int4 block quantization;
* ``dequantize_reduce``: the fp32 sum of k quantized chunks (an all-to-all reduction);
* the submodule ``zeropp``: DeepSpeed ZeRO++'s quantizer on CPU, the module stock ZeRO++ loads once
  ``install_cpu_zeropp_quantizer()`` (``ds_asynchzp.platform.deepspeed_internals``) has bound it.

The library is built on first use (``builder.py``); where it cannot be, the pure-torch reference ops in
``reference.py`` (the specification) run instead. ``status()`` says which, and why. docs/ops.md has the
layouts and the NaN/inf rules.
"""

from .api import (DEFAULT_BLOCK_SIZE, FLOAT_DTYPES, bucket_add, dequantize, dequantize_reduce, pack, quantize, quantized_sizes,
                  unpack, unpack_gathered)
from .builder import Status, status

__all__ = ["DEFAULT_BLOCK_SIZE", "FLOAT_DTYPES", "Status", "bucket_add", "dequantize", "dequantize_reduce", "pack", "quantize",
           "quantized_sizes", "status", "unpack", "unpack_gathered"]
