"""Where figures go.

Logger sinks, TensorBoard wire format and checksums, listeners, health verdicts and pictures, saved
features. Imports ``core`` only; ``_health_verdicts`` imports no torch, so that the TensorBoard plugin
can read it.
"""
