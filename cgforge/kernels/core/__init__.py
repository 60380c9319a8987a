"""The kernel core shared by every op: registry and plans, statement IR and its evaluator, CG tables, custom-op
helper, tuning values, launch arithmetic, NVRTC compiler and disk cache, cubin loading and launch. The one compile
path of every kernel: ``registry`` -> ``compiler`` -> ``runtime``.
"""
