"""Other inference methods built on the CVI machinery: structured SVI (``structured``) and
its Pyro guide ``AutoStructuredCVI`` (``structured_guide``)."""
