"""Model inspection: trace the model (``tracing``), probe its affine structure (``probes``),
decide every factor's role per latent (``analysis``, ``factor_roles``, ``conjugate_pairs``),
and check observations (``validation``). The output is an :class:`~.analysis.Analysis`."""
