"""The kernel core shared by every op: registry and plans, statement IR and its evaluator, CG tables,
custom-op helper, tuning values (`tuning`: every knob, passed as values), launch arithmetic (`launch`), NVRTC
compiler + disk cache (`compiler`), cubin loading and launch (`runtime`).

The one compile path of every kernel: `registry` -> `compiler` -> `runtime`. tensor_product/ and
symmetric_contraction/ supply problem -> schedule -> program; convolution/ runs the tensor product's over a
graph; the fixed sources (segment_sum, radial_table, noise) are `registry.SourceKernels`.
"""
