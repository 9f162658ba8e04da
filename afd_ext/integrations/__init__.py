"""Integrations of ``afd_ext`` with model libraries.

* :mod:`afd_ext.integrations.transformers` splits a Hugging Face
  ``transformers`` decoder into its attention role (MLP proxies that go
  through a connector) and its FFN role (a serving loop over the MLPs).

Importing this package imports nothing heavy; import the submodule you need.
"""
