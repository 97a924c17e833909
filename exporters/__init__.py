"""edgefl.exporters: ONNX and TFLite export of the global model (the export issue fills this in).

Installed as ``edgefl.exporters``; this folder sits at the repository's top level by design.
"""
