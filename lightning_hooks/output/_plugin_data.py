"""Data only the Layers tab reads, written as summaries of the tab's own plugin so that the stock tabs stay lean.

TensorBoard's Text tab lists every summary whose ``SummaryMetadata.plugin_data.plugin_name`` is
``"text"``; a summary that names the Layers tab's plugin instead is listed by no stock tab, and
the tab reads it through the data provider with ``plugin_name=PLUGIN_NAME``. Each entry is one
UTF-8 string (JSON) in a scalar string tensor, with ``data_class`` TENSOR so that TensorBoard's
data providers (the Python multiplexer and the Rust data server) serve it.

No torch here: the TensorBoard plugin imports this module.
"""

from __future__ import annotations

from tensorboard.compat.proto.summary_pb2 import DATA_CLASS_TENSOR, Summary, SummaryMetadata
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.compat.proto.types_pb2 import DT_STRING

#: The Layers tab's plugin name: its routes live under ``/data/plugin/<PLUGIN_NAME>/``.
PLUGIN_NAME = "lightning_hooks_layers"
#: The version of the entries' layout, in ``plugin_data.content``.
CONTENT_VERSION = b"1"
#: GradientAnomalyStopping's flight record (JSON object, see ``callbacks/_flight_recorder.record_json``).
FLIGHT_RECORD_TAG = "anomalies/flight_record_data"
#: ActivationMonitor's forward order (JSON list of module names), once per fit.
FORWARD_ORDER_TAG = "layers/forward_order"
#: ActivationMonitor's watched embeddings (JSON object: each module's name, its weight's row), once per fit, with the
#: forward order: the judge lets their outputs' drift as far as their weights moved in as learning.
LOOKUPS_TAG = "layers/lookups"


def plugin_data_summary(tag: str, text: str) -> Summary:
    """A ``Summary`` holding ``text`` under ``tag`` for the Layers tab alone.

    Args:
        tag: The entry's tag, e.g. :data:`FLIGHT_RECORD_TAG`.
        text: The entry (JSON).

    Example::

        summary = plugin_data_summary(FORWARD_ORDER_TAG, '["net.0", "net.1"]')
        summary.value[0].metadata.plugin_data.plugin_name  # 'lightning_hooks_layers'
    """
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME,
                                                                      content=CONTENT_VERSION),
                               data_class=DATA_CLASS_TENSOR)
    tensor = TensorProto(dtype=DT_STRING, tensor_shape=TensorShapeProto(), string_val=[text.encode("utf-8")])
    return Summary(value=[Summary.Value(tag=tag, metadata=metadata, tensor=tensor)])
