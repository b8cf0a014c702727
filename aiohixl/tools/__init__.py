"""Tools around the library, not part of it: ``info`` and ``bench`` (the ``bench`` extra)."""
