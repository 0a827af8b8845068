"""Scale-out: data-parallel steps (``distributed``) and streaming CVI (``streaming``)."""
