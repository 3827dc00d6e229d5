"""Everything an artifact carries as source, and the copier that puts it there.

``driver/`` (the driver: ``forward``, the checks a call runs, and its optional parts),
``kernel_loader`` (the stand-in for Inductor's kernel builders) and ``wrapper_imports`` (the
Python wrapper's lazy Inductor names) are real, tested modules of this package whose source is
copied into artifacts, so they import only torch and the standard library. ``source`` is the
copier.
"""
