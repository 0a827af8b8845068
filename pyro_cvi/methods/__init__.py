"""Other inference methods built on the CVI machinery: structured SVI (``structured``)."""
