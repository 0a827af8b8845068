"""Other inference methods built on the CVI machinery: structured SVI (``structured``) and
its Pyro guide ``AutoStructuredCVI`` (``structured_guide``); several starts scored by the bound
for multimodal posteriors (``restarts.best_of_starts``)."""
