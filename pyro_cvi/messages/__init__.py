"""Messages: from ``q``'s moments to (ELBO term, natural-parameter target) per factor.

``gaussian`` (exact rows, quadrature and Bonnet/Price messages to Gaussian blocks),
``quadrature`` (Gauss-Hermite, App. B.1), ``softmax`` / ``softmax_sites`` (K-variate
log-sum-exp expectations), ``expectations`` (closed-form mean-field terms, eqs. 20, 89),
``montecarlo`` (implicit reparameterisation + Fisher solve, App. F), ``collapsed``
(summed-out discrete latents) and ``mean_field`` (Algorithm 2's assembly)."""
