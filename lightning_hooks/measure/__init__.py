"""Tensors to numbers on one rank.

Statistics kernels (C, tensor ops, accelerator), histograms, anomaly flags, where a non-finite value
first appeared, and local views of sharded tensors. Imports ``core``.
"""
