"""Scale-out: data-parallel steps (``distributed``), streaming CVI (``streaming``) and
checkpoints with exact resume (``checkpoint``)."""
