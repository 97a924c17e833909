"""edgefl.server: the server halves of the methods and (later) round orchestration.

Installed as ``edgefl.server``; this folder sits at the repository's top level by design.
"""
