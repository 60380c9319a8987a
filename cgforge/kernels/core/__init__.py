"""The kernel core shared by every op: registry and plans, statement IR and its evaluator, CG tables,
custom-op helper, tuning values, NVRTC compiler + disk cache (`compiler`), launch (`runtime`).

Each op package (tensor_product, convolution, symmetric_contraction) supplies only
problem -> schedule -> program; this package turns a program into a launchable kernel.
"""
