"""The bottom layer: module selection, argument checks and private PyTorch/Lightning APIs.

``selection`` chooses modules, ``_validation`` checks constructor arguments, ``_torch_internals``
holds every private PyTorch, FSDP and Lightning API the package touches. Imports nothing else of the
package.
"""
