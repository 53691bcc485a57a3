"""Processes: the ``tritonserver`` (or PyTriton) process behind ``toktier serve``, and the nginx fleet."""
