"""Doors into harmony_fx from where people already train, each an optional extra.

``harmony_fx.integrations.huggingface`` (``pip install harmony_fx[hf]``): ``HarmonyTrainer``, a
``transformers.Trainer`` that trains through ``harmony_fx.Trainer``. ``harmony_fx.integrations.lightning``
(``pip install harmony_fx[lightning]``): a Lightning ``Strategy``. This package imports neither: each
module imports its framework, and ``import harmony_fx`` needs none of them.
"""
