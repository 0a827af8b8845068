"""Checkpoints with exact resume: the file format (``checkpoint_file``), putting a checked file
into the live run (``restore``) and the public ``save_checkpoint`` / ``load_checkpoint``
(``checkpoint``). The top layer beside ``methods``: it saves guides and optimizers."""
