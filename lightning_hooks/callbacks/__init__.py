"""The top layer: the Lightning callbacks and their private parts.

Hook lifecycle, gradient rows, update ratios, anomaly reports, rollback. Imports every layer below;
nothing imports it but the package root.
"""
