"""memfit-profiler's plugin module, registered through the ``memfit`` entry-point group.

It implements no hooks yet; installing the package already makes it visible in ``memfit plugins``.
"""
